// tessera-run: starts N local copies of a program with torchrun-style
// rendezvous variables, prefixes their output with the rank, and tears the
// whole job down as soon as one rank fails. With --nnodes > 1, one launcher per
// host forms one job; the launchers watch one another (node_link.h), so a
// failure on any host stops every host.
//
//   tessera-run -n N [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
//               [--no-prefix] [--timeout SECONDS] prog args...

#include <CLI/CLI.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "node_link.h"

namespace {

using tessera::launcher::LinkConfig;
using tessera::launcher::LinkEvent;
using tessera::launcher::NodeLink;
using tessera::launcher::RendezvousError;

using Clock = std::chrono::steady_clock;

constexpr auto kKillGrace = std::chrono::seconds(5);     // SIGTERM -> SIGKILL
constexpr auto kAbandonGrace = std::chrono::seconds(2);  // SIGKILL -> stop waiting for pipes
constexpr std::size_t kMaxLine = 1 << 20;                // longer "lines" are split

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

void write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // e.g. EPIPE: the reader went away; keep draining the ranks
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

std::string g_me = "tessera-run";  // "tessera-run[node K]" in a multi-node job

void message(const std::string& text) {
  const std::string line = g_me + ": " + text + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

// One child output stream (stdout or stderr) routed through a pipe.
struct Stream {
  int fd = -1;      // read end, -1 once closed
  int out_fd = -1;  // where prefixed lines go
  std::string prefix;
  std::string buf;

  void emit(std::string_view line) const {
    std::string out;
    out.reserve(prefix.size() + line.size() + 1);
    out += prefix;
    out += line;
    out += '\n';
    write_all(out_fd, out.data(), out.size());
  }

  void emit_complete_lines() {
    std::size_t start = 0;
    for (;;) {
      const auto nl = buf.find('\n', start);
      if (nl == std::string::npos) break;
      emit(std::string_view(buf).substr(start, nl - start));
      start = nl + 1;
    }
    buf.erase(0, start);
    while (buf.size() >= kMaxLine) {
      emit(std::string_view(buf).substr(0, kMaxLine));
      buf.erase(0, kMaxLine);
    }
  }

  void close_stream() {
    if (fd < 0) return;
    if (!buf.empty()) {
      emit(buf);
      buf.clear();
    }
    ::close(fd);
    fd = -1;
  }

  // Reads what is available (bounded, so that one chatty rank cannot starve
  // the others); closes the stream at end of file.
  void on_readable() {
    char chunk[65536];
    for (int round = 0; round < 4;) {
      const ssize_t n = ::read(fd, chunk, sizeof chunk);
      if (n > 0) {
        buf.append(chunk, static_cast<std::size_t>(n));
        emit_complete_lines();
        if (static_cast<std::size_t>(n) < sizeof chunk) return;
        ++round;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      close_stream();  // EOF or a hard error
      return;
    }
  }
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;  // also the process group id
  bool exited = false;
  int status = 0;
  Stream out, err;
};

struct Options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  bool no_prefix = false;
  double timeout = 0;
  double rdzv_timeout = 300;
  double heartbeat_timeout = 30;
  std::string ifname;
  std::optional<double> collective_timeout;
  std::vector<std::string> command;

  int world_size() const { return nnodes * nproc; }
  int global_rank(int local) const { return node_rank * nproc + local; }
};

std::string describe(int status) {
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "exit code " + std::to_string(WEXITSTATUS(status));
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

void make_pipe(int fds[2]) {
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

[[noreturn]] void exec_child(const Options& opt, int rank, int port, int out_fd, int err_fd,
                             pid_t launcher) {
  // Signals are blocked here (see Launcher::spawn) until the handlers are reset.
  ::setpgid(0, 0);
#ifdef __linux__
  // A launcher killed outright (SIGKILL) cannot stop its ranks: the kernel does it instead.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // it died before the line above
#else
  (void)launcher;
#endif
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  if (out_fd >= 0) ::dup2(out_fd, STDOUT_FILENO);
  if (err_fd >= 0) ::dup2(err_fd, STDERR_FILENO);
  // Only rank 0 may read a non-terminal stdin; a terminal cannot be read from a
  // background process group, so everybody else gets /dev/null.
  if (rank != 0 || ::isatty(STDIN_FILENO)) {
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) {
      ::dup2(null_fd, STDIN_FILENO);
      if (null_fd != STDIN_FILENO) ::close(null_fd);
    }
  }

  const auto set = [](const char* name, const std::string& value) {
    ::setenv(name, value.c_str(), 1);
  };
  set("RANK", std::to_string(opt.global_rank(rank)));
  set("WORLD_SIZE", std::to_string(opt.world_size()));
  set("LOCAL_RANK", std::to_string(rank));
  set("LOCAL_WORLD_SIZE", std::to_string(opt.nproc));
  set("GROUP_RANK", std::to_string(opt.node_rank));
  set("MASTER_ADDR", opt.master_addr);
  set("MASTER_PORT", std::to_string(port));
  set("TESSERA_LAUNCHER", "1");
  // A rank's stdout is our pipe, which the C library buffers fully: what a rank printed just
  // before it crashed would be lost. Tessera makes it line-buffered when loaded (unless the
  // user set this to 0).
  ::setenv("TESSERA_LINE_BUFFERED", "1", /*overwrite=*/0);
  // Several ranks on one host: one compute thread each unless the user chose (torchrun's
  // rule). at::set_num_threads does not reach every BLAS: Debian 13's LibTorch calls
  // OpenBLAS's pthread build, whose own pool of a thread per core per rank made a 2-rank
  // Llama step 5x slower on 2 cores; OpenBLAS reads OMP_NUM_THREADS.
  if (opt.nproc > 1) ::setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
  if (!opt.ifname.empty()) set("GLOO_SOCKET_IFNAME", opt.ifname);
  if (opt.collective_timeout) {
    std::ostringstream secs;
    secs << *opt.collective_timeout;
    set("TESSERA_TIMEOUT", secs.str());
  }

  std::vector<char*> argv;
  for (const auto& a : opt.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const std::string msg =
      "tessera-run: cannot execute '" + opt.command[0] + "': " + std::strerror(errno) + "\n";
  write_all(STDERR_FILENO, msg.data(), msg.size());
  ::_exit(127);
}

// Pids of this process's live children (used to find orphaned descendants,
// which are re-parented to us because we are a child subreaper).
std::vector<pid_t> current_children() {
  std::vector<pid_t> pids;
#ifdef __linux__
  const std::string path = "/proc/self/task/" + std::to_string(::getpid()) + "/children";
  std::ifstream in(path);
  pid_t pid;
  while (in >> pid) pids.push_back(pid);
#endif
  return pids;
}

class Launcher {
 public:
  explicit Launcher(Options opt) : opt_(std::move(opt)) {}

  int run() {
    install_signal_handlers();
#ifdef __linux__
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
    int port = 0;
    if (opt_.nnodes > 1) {
      LinkConfig cfg;
      cfg.nnodes = opt_.nnodes;
      cfg.node_rank = opt_.node_rank;
      cfg.nproc = opt_.nproc;
      cfg.master_addr = opt_.master_addr;
      cfg.master_port = opt_.master_port.value_or(29500);
      cfg.rdzv_timeout = opt_.rdzv_timeout;
      cfg.heartbeat_timeout = opt_.heartbeat_timeout;
      link_ = std::make_unique<NodeLink>(cfg);
      try {
        port = link_->rendezvous(g_signal_pipe[0]);
      } catch (const RendezvousError& e) {
        message(e.what());
        return 1;
      }
      if (port < 0) {
        unsigned char sig = SIGINT;
        [[maybe_unused]] ssize_t n = ::read(g_signal_pipe[0], &sig, 1);
        message("interrupted (signal " + std::to_string(sig) + ") during the rendezvous");
        return 128 + sig;
      }
    } else {
      port = opt_.master_port ? *opt_.master_port
                              : tessera::launcher::pick_free_port(/*any_interface=*/false);
    }
    ranks_.resize(static_cast<std::size_t>(opt_.nproc));
    for (int r = 0; r < opt_.nproc; ++r) {
      if (!spawn(r, port)) {
        begin_stop(SIGTERM);
        spawn_failed_ = true;
        break;
      }
    }
    if (opt_.timeout > 0) {
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(opt_.timeout));
    }
    loop();
    cleanup();
    if (link_) link_->flush(std::chrono::seconds(2));
    const bool failed_job = failed_rank_ >= 0 || remote_failure_ || timed_out_ ||
                            interrupt_signal_ != 0 || spawn_failed_;
    if (failed_job && kill_at_ && last_exit_) {
      // How long the stop took: from the first stop signal to the last rank's exit.
      const auto began = *kill_at_ - kKillGrace;
      const double secs =
          std::chrono::duration<double>(std::max(*last_exit_, began) - began).count();
      std::ostringstream text;
      text.precision(2);
      text << std::fixed << "all " << opt_.nproc << " local ranks stopped " << secs
           << " s after the stop began";
      message(text.str());
    }
    if (interrupt_signal_ != 0) return 128 + interrupt_signal_;
    if (timed_out_) return 124;
    if (spawn_failed_) return 1;
    if (failed_rank_ >= 0) {
      const int status = ranks_[static_cast<std::size_t>(failed_rank_)].status;
      return (WIFEXITED(status) && WEXITSTATUS(status) != 0) ? WEXITSTATUS(status) : 1;
    }
    if (remote_failure_) return 1;
    return 0;
  }

 private:
  static void install_signal_handlers() {
    make_pipe(g_signal_pipe);
    set_nonblocking(g_signal_pipe[0]);
    set_nonblocking(g_signal_pipe[1]);
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
  }

  bool spawn(int r, int port) {
    Rank& rk = ranks_[static_cast<std::size_t>(r)];
    rk.rank = r;
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (!opt_.no_prefix && (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)) {
      message("cannot create pipes for rank " + std::to_string(r) + ": " + std::strerror(errno));
      for (int fd : {out[0], out[1]}) {
        if (fd >= 0) ::close(fd);
      }
      rk.exited = true;
      return false;
    }
    // Keep signals blocked across fork() so that none reaches our handlers in
    // the child before it has restored the default dispositions.
    sigset_t all, saved;
    sigfillset(&all);
    ::sigprocmask(SIG_BLOCK, &all, &saved);
    const pid_t pid = ::fork();
    if (pid != 0) ::sigprocmask(SIG_SETMASK, &saved, nullptr);
    if (pid < 0) {
      message("cannot start rank " + std::to_string(r) + ": " + std::strerror(errno));
      for (int fd : {out[0], out[1], err[0], err[1]}) {
        if (fd >= 0) ::close(fd);
      }
      rk.exited = true;
      return false;
    }
    if (pid == 0) exec_child(opt_, r, port, out[1], err[1], launcher_pid_);
    ::setpgid(pid, pid);  // also done by the child; whichever runs first wins
    rk.pid = pid;
    if (!opt_.no_prefix) {
      ::close(out[1]);
      ::close(err[1]);
      const std::string prefix = "[rank " + std::to_string(opt_.global_rank(r)) + "] ";
      rk.out = Stream{out[0], STDOUT_FILENO, prefix, {}};
      rk.err = Stream{err[0], STDERR_FILENO, prefix, {}};
      set_nonblocking(out[0]);
      set_nonblocking(err[0]);
    }
    return true;
  }

  void signal_all(int sig) {
    for (const Rank& rk : ranks_) {
      if (rk.pid > 0) ::kill(-rk.pid, sig);
    }
  }

  // Sends `sig` to every rank's process group and arms the SIGKILL escalation.
  void begin_stop(int sig) {
    signal_all(sig);
    if (!kill_at_) kill_at_ = Clock::now() + kKillGrace;
  }

  bool all_exited() const {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.exited; });
  }
  bool all_streams_closed() const {
    return std::all_of(ranks_.begin(), ranks_.end(),
                       [](const Rank& r) { return r.out.fd < 0 && r.err.fd < 0; });
  }
  bool stopping() const { return kill_at_.has_value(); }

  void handle_signals() {
    unsigned char sigs[64];
    for (;;) {
      const ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof sigs);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      for (ssize_t i = 0; i < n; ++i) {
        const int sig = sigs[i];
        if (sig == SIGCHLD) continue;  // reaping happens every iteration
        if (interrupt_signal_ == 0) {
          interrupt_signal_ = sig;
          begin_stop(sig);
          stop_other_nodes(-1, "the launcher of node " + std::to_string(opt_.node_rank) +
                                   " got signal " + std::to_string(sig));
        } else {
          signal_all(SIGKILL);  // asked twice: stop waiting
        }
      }
    }
  }

  void reap() {
    std::vector<int> newly_failed;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) break;
      for (Rank& rk : ranks_) {
        if (rk.pid == pid && !rk.exited) {
          rk.exited = true;
          rk.status = status;
          last_exit_ = Clock::now();
          if (failed(status)) newly_failed.push_back(rk.rank);
        }
      }
      // Any other pid is an orphaned descendant re-parented to us.
    }
    if (!newly_failed.empty() && failed_rank_ < 0 && !stopping()) {
      failed_rank_ = *std::min_element(newly_failed.begin(), newly_failed.end());
      // Show what the failed rank wrote last before the failure notice.
      Rank& bad = ranks_[static_cast<std::size_t>(failed_rank_)];
      for (Stream* s : {&bad.out, &bad.err}) {
        if (s->fd >= 0) s->on_readable();
      }
      const int global = opt_.global_rank(failed_rank_);
      const std::string what = describe(ranks_[static_cast<std::size_t>(failed_rank_)].status);
      message("rank " + std::to_string(global) + " failed (" + what +
              "); stopping the other ranks" +
              (link_ ? std::string(" on every node") : std::string()));
      begin_stop(SIGTERM);
      stop_other_nodes(global, "rank " + std::to_string(global) + " on node " +
                                   std::to_string(opt_.node_rank) + " failed (" + what + ")");
    }
    if (all_exited() && !stopping()) {
      begin_stop(SIGTERM);  // stray descendants only
      // Every local rank exited 0: this node is done; node 0 ends the job once all are.
      if (link_ && failed_rank_ < 0 && !remote_failure_) link_->report_done();
    }
  }

  // Node 0 stops every other node; another node tells node 0, which does.
  void stop_other_nodes(int rank, const std::string& why) {
    if (!link_) return;
    if (opt_.node_rank == 0)
      link_->stop_all(why);
    else
      link_->report_failure(rank, why);
  }

  void on_link_events() {
    if (!link_) return;
    for (const LinkEvent& e : link_->take_events()) {
      switch (e.kind) {
        case LinkEvent::RankFailed: {
          const std::string why = e.text;  // names the rank and its node
          if (!stopping()) message(why + "; stopping the job");
          remote_failure_ = true;
          begin_stop(SIGTERM);
          link_->stop_all(why, e.node);
          break;
        }
        case LinkEvent::NodeLost: {
          const std::string who = e.node == 0 ? "node 0 (the launcher at " + opt_.master_addr + ")"
                                              : "node " + std::to_string(e.node);
          const std::string why = "lost " + who + ": " + e.text;
          if (!stopping()) message(why + "; stopping the job");
          remote_failure_ = true;
          begin_stop(SIGTERM);
          link_->stop_all(why, e.node);
          break;
        }
        case LinkEvent::Stop:
          if (!stopping()) message("node 0 stopped the job: " + e.text);
          remote_failure_ = true;
          begin_stop(SIGTERM);
          break;
        case LinkEvent::NodeDone:
        case LinkEvent::End: break;
      }
    }
    // Node 0 ends the job once its ranks and every other node are done.
    if (opt_.node_rank == 0 && !link_->finished() && all_exited() && failed_rank_ < 0 &&
        !remote_failure_ && interrupt_signal_ == 0 && !timed_out_ && link_->all_nodes_done())
      link_->end_all();
  }

  // The job may need the link after the local ranks are gone: to learn whether it ended well.
  bool link_settled() const { return !link_ || link_->finished(); }

  void check_deadlines() {
    const auto now = Clock::now();
    if (deadline_ && !stopping() && now >= *deadline_) {
      std::string running;
      for (const Rank& rk : ranks_) {
        if (!rk.exited) running += (running.empty() ? "" : ", ") + std::to_string(rk.rank);
      }
      std::ostringstream secs;
      secs << opt_.timeout;
      message("timeout of " + secs.str() + " s expired; ranks still running: " + running +
              "; killing them");
      timed_out_ = true;
      begin_stop(SIGTERM);
      stop_other_nodes(-1, "the --timeout of node " + std::to_string(opt_.node_rank) + " expired");
    }
    if (kill_at_ && !killed_ && now >= *kill_at_) {
      signal_all(SIGKILL);
      killed_ = true;
      abandon_at_ = now + kAbandonGrace;
    }
    if (abandon_at_ && now >= *abandon_at_) {
      // Something outside the process groups still holds a pipe open.
      for (Rank& rk : ranks_) {
        rk.out.close_stream();
        rk.err.close_stream();
      }
    }
  }

  int poll_timeout_ms() const {
    std::optional<Clock::time_point> next;
    const auto consider = [&](const std::optional<Clock::time_point>& t) {
      if (t && (!next || *t < *next)) next = t;
    };
    if (!stopping()) consider(deadline_);
    if (!killed_) consider(kill_at_);
    consider(abandon_at_);
    long ms = link_ ? std::min<long>(1000, link_->ms_until_due()) : 1000;  // also a safety net
    if (next) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now()).count();
      ms = std::clamp<long>(left + 1, 0, ms);
    }
    return static_cast<int>(ms);
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    for (;;) {
      reap();
      check_deadlines();
      if (link_) link_->tick();
      on_link_events();
      if (all_exited() && all_streams_closed() && link_settled()) return;

      fds.clear();
      streams.clear();
      fds.push_back({g_signal_pipe[0], POLLIN, 0});
      streams.push_back(nullptr);
      const std::size_t link_first = fds.size();
      if (link_) {
        link_->add_pollfds(fds);
        streams.resize(fds.size(), nullptr);
      }
      const std::size_t link_end = fds.size();
      for (Rank& rk : ranks_) {
        for (Stream* s : {&rk.out, &rk.err}) {
          if (s->fd >= 0) {
            fds.push_back({s->fd, POLLIN, 0});
            streams.push_back(s);
          }
        }
      }
      const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms());
      if (n < 0 && errno != EINTR) {
        message(std::string("poll failed: ") + std::strerror(errno));
        begin_stop(SIGKILL);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (n <= 0) continue;
      if (fds[0].revents != 0) handle_signals();
      if (link_) link_->on_poll(fds.data() + link_first, link_end - link_first);
      for (std::size_t i = link_end; i < fds.size(); ++i) {
        if (fds[i].revents != 0) streams[i]->on_readable();
      }
    }
  }

  // Makes sure nothing started by this job survives it, and reaps everything.
  void cleanup() {
    signal_all(SIGKILL);
    const auto until = Clock::now() + std::chrono::seconds(2);
    for (;;) {
      for (pid_t pid : current_children()) ::kill(pid, SIGKILL);
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) continue;
      if (pid < 0 && errno == EINTR) continue;
      if (pid < 0) break;  // ECHILD: nothing left
      if (Clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  Options opt_;
  pid_t launcher_pid_ = ::getpid();
  std::unique_ptr<NodeLink> link_;  // multi-node jobs only
  bool remote_failure_ = false;     // another node failed or was lost
  std::vector<Rank> ranks_;
  std::optional<Clock::time_point> deadline_;    // --timeout
  std::optional<Clock::time_point> last_exit_;   // when a rank last exited
  std::optional<Clock::time_point> kill_at_;     // SIGKILL escalation, set once stopping
  std::optional<Clock::time_point> abandon_at_;  // give up on pipes held by strangers
  bool killed_ = false;
  bool timed_out_ = false;
  bool spawn_failed_ = false;
  int failed_rank_ = -1;
  int interrupt_signal_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tessera-run -n N [OPTIONS] prog [args...]\n"
      "Starts N local ranks of a program with torchrun-style rendezvous variables.\n"
      "Many hosts: run one launcher per host with --nnodes M --node-rank K and node 0's\n"
      "--master-addr / --master-port; ranks are numbered K*N + local rank.",
      "tessera-run"};
  app.prefix_command();
  app.footer(
      "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT and TESSERA_LAUNCHER=1; with N > 1, OMP_NUM_THREADS=1 unless it is set (one\n"
      "compute thread per rank, OpenBLAS's included). Everything from the program name on is\n"
      "passed to the program unparsed. In a multi-node job the launchers meet on --master-port\n"
      "of node 0 and the ranks' store gets a port node 0 picks; a failed rank, a lost launcher\n"
      "or a silent host (--heartbeat-timeout) stops every node.\n"
      "Exit status: 0 on success, the failed rank's exit code (or 1, also when another node\n"
      "failed), 124 on timeout.");

  Options opt;
  app.add_option("-n,--nproc,--nproc-per-node", opt.nproc, "number of ranks to start")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", opt.nnodes, "number of hosts (one launcher each)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app.add_option("--node-rank", opt.node_rank, "this host's index in [0, nnodes)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr", opt.master_addr,
                 "node 0's address as the other hosts reach it (MASTER_ADDR of the ranks)")
      ->capture_default_str();
  app.add_option("--master-port", opt.master_port,
                 "one node: MASTER_PORT given to the ranks (default: a free port); several: the "
                 "port node 0's launcher listens on (default 29500)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--rdzv-timeout", opt.rdzv_timeout,
                 "seconds the launchers wait for one another at the start")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--heartbeat-timeout", opt.heartbeat_timeout,
                 "seconds without news from another node's launcher before the job stops")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ifname", opt.ifname,
                 "network interface(s) the ranks' Gloo connections use (GLOO_SOCKET_IFNAME; "
                 "default: loopback on one node, else the interface that routes to the master)");
  app.add_option("--collective-timeout", opt.collective_timeout,
                 "seconds a collective waits for a peer before it fails (TESSERA_TIMEOUT; "
                 "default: the program's, 3 minutes unless it sets another)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-prefix", opt.no_prefix, "let the ranks write to the terminal directly");
  app.add_option("--timeout", opt.timeout, "kill the job after this many seconds (0: never)")
      ->check(CLI::NonNegativeNumber);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  opt.command = app.remaining();
  if (!opt.command.empty() && opt.command.front() == "--") opt.command.erase(opt.command.begin());
  if (opt.command.empty()) {
    std::fprintf(stderr, "tessera-run: missing the program to run\n%s", app.help().c_str());
    return 2;
  }
  if (opt.command.front().size() > 1 && opt.command.front()[0] == '-' &&
      app.remaining().front() != "--") {
    std::fprintf(
        stderr,
        "tessera-run: unknown option '%s' (use '--' before a program whose name starts with '-')\n",
        opt.command.front().c_str());
    return 2;
  }

  if (opt.node_rank >= opt.nnodes) {
    std::fprintf(stderr, "tessera-run: --node-rank %d is out of range for --nnodes %d\n",
                 opt.node_rank, opt.nnodes);
    return 2;
  }
  if (opt.nnodes > 1) g_me = "tessera-run[node " + std::to_string(opt.node_rank) + "]";

  try {
    return Launcher(std::move(opt)).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera-run: %s\n", e.what());
    return 1;
  }
}
