#include "node_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace tessera::launcher {

namespace {

constexpr int kProtocol = 1;
constexpr std::size_t kMaxLine = 64 * 1024;  // a peer sending more without a newline is broken

std::string errno_text(int e = errno) { return std::strerror(e); }

std::string seconds_text(double s) {
  std::ostringstream os;
  os << s << " s";
  return os.str();
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

long ms_left(NodeLink::Clock::time_point until) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(until - NodeLink::Clock::now());
  return std::max<long>(0, left.count());
}

NodeLink::Clock::duration seconds(double s) {
  return std::chrono::duration_cast<NodeLink::Clock::duration>(std::chrono::duration<double>(s));
}

// Writes a short line on a socket that may be non-blocking, waiting at most `limit_ms`.
void write_line_blocking(int fd, const std::string& line, int limit_ms) {
  std::size_t done = 0;
  const auto until = NodeLink::Clock::now() + std::chrono::milliseconds(limit_ms);
  while (done < line.size()) {
    const ssize_t n = ::send(fd, line.data() + done, line.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(ms_left(until))) <= 0) return;
      continue;
    }
    return;
  }
}

// Reads complete lines from a socket into `buf`; returns false at end of file or error.
bool read_into(int fd, std::string& buf) {
  char chunk[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n > 0) {
      buf.append(chunk, static_cast<std::size_t>(n));
      if (buf.size() > kMaxLine && buf.find('\n') == std::string::npos) return false;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    return false;
  }
}

bool pop_line(std::string& buf, std::string& line) {
  const auto nl = buf.find('\n');
  if (nl == std::string::npos) return false;
  line = buf.substr(0, nl);
  buf.erase(0, nl + 1);
  return true;
}

bool interrupted(int fd, short revents) { return fd >= 0 && (revents & POLLIN); }

}  // namespace

int pick_free_port(bool any_interface) {
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) throw std::runtime_error("socket: " + errno_text());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(any_interface ? INADDR_ANY : INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    ::close(s);
    throw std::runtime_error("cannot pick a free port: " + errno_text(e));
  }
  ::close(s);
  return ntohs(addr.sin_port);
}

NodeLink::NodeLink(LinkConfig config) : cfg_(std::move(config)) {}

NodeLink::~NodeLink() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (Peer& p : peers_)
    if (p.fd >= 0) ::close(p.fd);
}

int NodeLink::rendezvous(int interrupt_fd) {
  const auto until = Clock::now() + seconds(cfg_.rdzv_timeout);
  if (cfg_.node_rank == 0) {
    listen_on_master_port();
    if (!admit_launchers(until, interrupt_fd)) return -1;
    return start_job();
  }
  const int fd = connect_to_node0(until, interrupt_fd);
  if (fd < 0) return -1;
  return await_start(fd, until, interrupt_fd);
}

// ---- the rendezvous on node 0

void NodeLink::listen_on_master_port() {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw RendezvousError("socket: " + errno_text());
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(cfg_.master_port));
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 128) != 0)
    throw RendezvousError("node 0 cannot listen on port " + std::to_string(cfg_.master_port) +
                          ": " + errno_text() +
                          " (is another job using it? pick another "
                          "--master-port)");
  set_nonblocking(listen_fd_);
}

bool NodeLink::admit_launchers(Clock::time_point until, int interrupt_fd) {
  std::vector<Peer> pending;  // connected, HELLO not read yet
  std::vector<bool> joined(static_cast<std::size_t>(cfg_.nnodes), false);
  int n_joined = 0;
  while (n_joined < cfg_.nnodes - 1) {
    if (Clock::now() >= until) throw nodes_missing_error(joined);
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {interrupt_fd, POLLIN, 0}};
    for (const Peer& p : pending) fds.push_back({p.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<long>(ms_left(until), 1000))) <
            0 &&
        errno != EINTR)
      throw RendezvousError("poll: " + errno_text());
    if (interrupted(interrupt_fd, fds[1].revents)) return false;
    if (fds[0].revents & POLLIN) accept_pending(pending);
    // Every pending peer is read (non-blocking: nothing to read costs one EAGAIN), which
    // keeps no index between `fds` and `pending` while entries are erased below.
    for (std::size_t i = 0; i < pending.size();) {
      Peer& p = pending[i];
      switch (read_hello(p, joined)) {
        case Hello::Waiting: ++i; continue;
        case Hello::Joined:
          ++n_joined;
          peers_.push_back(std::move(p));
          break;
        case Hello::Dropped: ::close(p.fd); break;
      }
      pending.erase(pending.begin() + static_cast<long>(i));
    }
  }
  for (Peer& p : pending) ::close(p.fd);
  return true;
}

RendezvousError NodeLink::nodes_missing_error(const std::vector<bool>& joined) const {
  std::string missing;
  for (int k = 1; k < cfg_.nnodes; ++k)
    if (!joined[static_cast<std::size_t>(k)])
      missing += (missing.empty() ? "" : ", ") + std::to_string(k);
  return RendezvousError("rendezvous timed out after " + seconds_text(cfg_.rdzv_timeout) +
                         ": node(s) " + missing + " of " + std::to_string(cfg_.nnodes) +
                         " did not join. Start tessera-run "
                         "on each with --nnodes " +
                         std::to_string(cfg_.nnodes) +
                         " --node-rank K "
                         "--master-addr " +
                         cfg_.master_addr + " --master-port " + std::to_string(cfg_.master_port) +
                         " (and check that this port is open to them)");
}

void NodeLink::accept_pending(std::vector<Peer>& pending) {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) break;
    set_nodelay(fd);
    Peer p;
    p.fd = fd;
    pending.push_back(std::move(p));
  }
}

NodeLink::Hello NodeLink::read_hello(Peer& p, std::vector<bool>& joined) {
  const bool alive = read_into(p.fd, p.in);
  std::string line;
  if (!pop_line(p.in, line)) return alive ? Hello::Waiting : Hello::Dropped;
  std::istringstream in(line);
  std::string word;
  int version = 0, node = -1, nnodes = 0, nproc = 0;
  if (!(in >> word >> version >> node >> nnodes >> nproc) || word != "HELLO")
    return Hello::Dropped;  // not a launcher (a stray client): ignore it
  const std::string why = hello_problem(version, node, nnodes, nproc, joined);
  if (!why.empty()) {
    write_line_blocking(p.fd, "ERROR " + one_line(why) + "\n", 1000);
    throw RendezvousError("a launcher could not join: " + why);
  }
  joined[static_cast<std::size_t>(node)] = true;
  p.node = node;
  p.heard = Clock::now();
  return Hello::Joined;
}

std::string NodeLink::hello_problem(int version, int node, int nnodes, int nproc,
                                    const std::vector<bool>& joined) const {
  if (version != kProtocol)
    return "protocol version " + std::to_string(version) + " (this launcher speaks " +
           std::to_string(kProtocol) + "): use the same tessera-run on every node";
  if (nnodes != cfg_.nnodes || nproc != cfg_.nproc)
    return "it was started with --nnodes " + std::to_string(nnodes) + " --nproc-per-node " +
           std::to_string(nproc) + ", node 0 with --nnodes " + std::to_string(cfg_.nnodes) +
           " --nproc-per-node " + std::to_string(cfg_.nproc);
  if (node < 1 || node >= cfg_.nnodes)
    return "--node-rank " + std::to_string(node) + " is out of range [1, " +
           std::to_string(cfg_.nnodes - 1) + "]";
  if (joined[static_cast<std::size_t>(node)])
    return "node " + std::to_string(node) +
           " joined twice (two launchers were given "
           "--node-rank " +
           std::to_string(node) + ")";
  return "";
}

int NodeLink::start_job() {
  ::close(listen_fd_);  // nobody else may join
  listen_fd_ = -1;
  int store_port = 0;
  try {
    store_port = pick_free_port(/*any_interface=*/true);  // rank 0 serves the store on it
  } catch (const std::runtime_error& e) {
    throw RendezvousError(std::string("the ranks' store: ") + e.what());
  }
  for (Peer& p : peers_) send(p, "START " + std::to_string(store_port));
  flush(std::chrono::milliseconds(2000));
  next_ping_ = Clock::now();
  return store_port;
}

// ---- the rendezvous on node K > 0

std::string NodeLink::master_text() const {
  return cfg_.master_addr + ":" + std::to_string(cfg_.master_port);
}

int NodeLink::connect_to_node0(Clock::time_point until, int interrupt_fd) {
  std::string last_error = "no attempt made";
  for (;;) {
    if (Clock::now() >= until)
      throw RendezvousError("cannot reach node 0's launcher at " + master_text() + " within " +
                            seconds_text(cfg_.rdzv_timeout) + " (last error: " + last_error +
                            "). Check that "
                            "tessera-run runs there with --node-rank 0 and --master-port " +
                            std::to_string(cfg_.master_port) + ", that " + cfg_.master_addr +
                            " is its address "
                            "as seen from this host, and that no firewall blocks the port");
    const int fd = try_connect(until, last_error);
    if (fd >= 0) {
      set_nodelay(fd);
      return fd;
    }
    pollfd p{interrupt_fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long>(ms_left(until), 250))) > 0 &&
        interrupted(interrupt_fd, p.revents))
      return -1;
  }
}

int NodeLink::try_connect(Clock::time_point until, std::string& last_error) const {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(cfg_.master_addr.c_str(), std::to_string(cfg_.master_port).c_str(),
                                &hints, &found);
  if (gai != 0) {
    last_error = std::string("cannot resolve ") + cfg_.master_addr + ": " + ::gai_strerror(gai);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = found; ai && fd < 0; ai = ai->ai_next) {
    const int s = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) continue;
    int err = 0;
    if (::connect(s, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{s, POLLOUT, 0};
        const int r = ::poll(&p, 1, static_cast<int>(std::min<long>(ms_left(until), 2000)));
        socklen_t len = sizeof err;
        if (r <= 0)
          err = ETIMEDOUT;
        else if (::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
          err = errno;
      }
    }
    if (err == 0) {
      fd = s;
    } else {
      last_error = errno_text(err);
      ::close(s);
    }
  }
  ::freeaddrinfo(found);
  return fd;
}

int NodeLink::await_start(int fd, Clock::time_point until, int interrupt_fd) {
  Peer master;
  master.fd = fd;
  master.node = 0;
  write_line_blocking(fd,
                      "HELLO " + std::to_string(kProtocol) + " " + std::to_string(cfg_.node_rank) +
                          " " + std::to_string(cfg_.nnodes) + " " + std::to_string(cfg_.nproc) +
                          "\n",
                      static_cast<int>(std::max<long>(ms_left(until), 1000)));
  for (;;) {
    std::string line;
    if (pop_line(master.in, line)) {
      std::istringstream in(line);
      std::string word;
      in >> word;
      if (word == "START") {
        int port = 0;
        if (!(in >> port) || port < 1 || port > 65535)
          throw RendezvousError("node 0 sent a malformed answer: \"" + line + "\"");
        master.heard = Clock::now();
        peers_.push_back(std::move(master));
        next_ping_ = Clock::now();
        return port;
      }
      if (word == "ERROR") throw RendezvousError("node 0 refused this node:" + line.substr(5));
      continue;  // nothing else is sent before START
    }
    if (Clock::now() >= until)
      throw RendezvousError("node 0's launcher at " + master_text() +
                            " accepted this node but did not "
                            "start the job within " +
                            seconds_text(cfg_.rdzv_timeout) + ": some other node did not join");
    std::vector<pollfd> fds{{fd, POLLIN, 0}, {interrupt_fd, POLLIN, 0}};
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<long>(ms_left(until), 1000))) <
            0 &&
        errno != EINTR)
      throw RendezvousError("poll: " + errno_text());
    if (interrupted(interrupt_fd, fds[1].revents)) return -1;
    if (fds[0].revents != 0 && !read_into(fd, master.in) &&
        master.in.find('\n') == std::string::npos)
      throw RendezvousError("node 0's launcher at " + master_text() +
                            " closed the connection during "
                            "the rendezvous (it stopped: see its output)");
  }
}

void NodeLink::add_pollfds(std::vector<pollfd>& fds) const {
  for (const Peer& p : peers_) {
    short want = POLLIN;
    if (!p.out.empty()) want |= POLLOUT;
    fds.push_back({p.lost ? -1 : p.fd, want, 0});
  }
}

void NodeLink::on_poll(const pollfd* fds, std::size_t count) {
  for (std::size_t i = 0; i < count && i < peers_.size(); ++i) {
    Peer& p = peers_[i];
    if (p.lost || fds[i].revents == 0) continue;
    if (fds[i].revents & POLLOUT) write_some(p);
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
      if (!read_lines(p)) {
        lose(p,
             "its launcher closed the connection (the launcher was killed or its host "
             "rebooted)");
      }
    }
  }
}

bool NodeLink::read_lines(Peer& p) {
  const bool alive = read_into(p.fd, p.in);
  std::string line;
  bool any = false;
  while (!p.lost && pop_line(p.in, line)) {
    any = true;
    on_line(p, line);
  }
  if (any || alive) p.heard = Clock::now();
  return alive;
}

void NodeLink::on_line(Peer& p, const std::string& line) {
  std::istringstream in(line);
  std::string word;
  in >> word;
  std::string rest;
  std::getline(in, rest);
  if (!rest.empty() && rest[0] == ' ') rest.erase(0, 1);
  if (word == "PING") return;
  if (cfg_.node_rank == 0) {
    if (word == "FAILED") {
      std::istringstream r(rest);
      int rank = -1;
      r >> rank;
      std::string what;
      std::getline(r, what);
      if (!what.empty() && what[0] == ' ') what.erase(0, 1);
      events_.push_back({LinkEvent::RankFailed, p.node, rank, what});
    } else if (word == "DONE") {
      p.done = true;
      events_.push_back({LinkEvent::NodeDone, p.node, -1, ""});
    }
    return;
  }
  if (finished_) return;
  if (word == "STOP") {
    finished_ = true;
    events_.push_back({LinkEvent::Stop, 0, -1, rest});
  } else if (word == "END") {
    finished_ = true;
    events_.push_back({LinkEvent::End, 0, -1, ""});
  }
}

void NodeLink::send(Peer& p, const std::string& line) {
  if (p.lost) return;
  p.out += one_line(line) + "\n";
  write_some(p);
}

void NodeLink::write_some(Peer& p) {
  while (!p.out.empty() && !p.lost) {
    const ssize_t n = ::send(p.fd, p.out.data(), p.out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      p.out.erase(0, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    lose(p, "sending to its launcher failed: " + errno_text());
    return;
  }
}

void NodeLink::lose(Peer& p, const std::string& why) {
  if (p.lost) return;
  p.lost = true;
  ::close(p.fd);
  p.fd = -1;
  p.out.clear();
  // A node that finished, or a job already decided, loses nothing by a closed connection.
  if (finished_ || p.done) return;
  events_.push_back({LinkEvent::NodeLost, p.node, -1, why});
  if (cfg_.node_rank != 0) finished_ = true;
}

void NodeLink::tick() {
  const auto now = Clock::now();
  const auto period = seconds(cfg_.heartbeat_timeout / 5);
  if (now >= next_ping_) {
    for (Peer& p : peers_)
      if (!p.lost) send(p, "PING");
    next_ping_ = now + period;
  }
  for (Peer& p : peers_) {
    if (p.lost || p.done) continue;
    if (now - p.heard > seconds(cfg_.heartbeat_timeout))
      lose(p, "nothing heard from its launcher for " + seconds_text(cfg_.heartbeat_timeout) +
                  " (its host or the network link to it is down)");
  }
}

long NodeLink::ms_until_due() const {
  if (peers_.empty()) return 1000;
  long ms = ms_left(next_ping_);
  for (const Peer& p : peers_)
    if (!p.lost && !p.done)
      ms = std::min(ms, ms_left(p.heard + seconds(cfg_.heartbeat_timeout)) + 1);
  return ms;
}

std::vector<LinkEvent> NodeLink::take_events() {
  std::vector<LinkEvent> out;
  out.swap(events_);
  return out;
}

void NodeLink::report_failure(int rank, const std::string& what) {
  if (cfg_.node_rank == 0 || finished_) return;
  for (Peer& p : peers_) send(p, "FAILED " + std::to_string(rank) + " " + what);
  finished_ = true;
}

void NodeLink::report_done() {
  if (cfg_.node_rank == 0) return;
  for (Peer& p : peers_) send(p, "DONE");
}

void NodeLink::stop_all(const std::string& why, int except) {
  if (cfg_.node_rank != 0 || finished_) return;
  for (Peer& p : peers_)
    if (p.node != except) send(p, "STOP " + why);
  finished_ = true;
}

void NodeLink::end_all() {
  if (cfg_.node_rank != 0 || finished_) return;
  for (Peer& p : peers_) send(p, "END");
  finished_ = true;
}

bool NodeLink::all_nodes_done() const {
  return std::all_of(peers_.begin(), peers_.end(), [](const Peer& p) { return p.done; });
}

void NodeLink::flush(std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Peer*> who;
    for (Peer& p : peers_) {
      if (!p.lost && !p.out.empty()) {
        fds.push_back({p.fd, POLLOUT, 0});
        who.push_back(&p);
      }
    }
    if (fds.empty() || Clock::now() >= until) return;
    if (::poll(fds.data(), fds.size(), static_cast<int>(ms_left(until))) <= 0) return;
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents != 0) write_some(*who[i]);
  }
}

}  // namespace tessera::launcher
