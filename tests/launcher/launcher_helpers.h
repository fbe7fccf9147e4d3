// Helpers for driving the tessera-run executable from tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef TESSERA_RUN_PATH
#error "TESSERA_RUN_PATH must name the tessera-run executable"
#endif

namespace tessera::testing_launcher {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A fresh directory under the system temp dir, removed on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "tessera-run-test-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

struct RunResult {
  int exit_code = -1;  // -1 when the launcher itself died by a signal
  int term_signal = 0;
  std::string out;
  std::string err;
  double seconds = 0;
  bool hung = false;  // had to be killed by the test
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

// tessera-run running in the background with its output captured in files.
class LauncherProcess {
 public:
  LauncherProcess(const std::vector<std::string>& args, const TempDir& dir)
      : out_path_(dir.path() / "launcher.out"), err_path_(dir.path() / "launcher.err") {
    std::vector<std::string> argv{TESSERA_RUN_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      const int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int in = ::open("/dev/null", O_RDONLY);
      if (out < 0 || err < 0 || in < 0) ::_exit(200);
      ::dup2(in, 0);
      ::dup2(out, 1);
      ::dup2(err, 2);
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      ::execv(cargv[0], cargv.data());
      ::_exit(201);
    }
  }
  ~LauncherProcess() {
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  LauncherProcess(const LauncherProcess&) = delete;
  LauncherProcess& operator=(const LauncherProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Waits for the launcher to exit, killing it after `limit`.
  RunResult wait(std::chrono::seconds limit = std::chrono::seconds(90)) {
    RunResult r;
    int status = 0;
    for (;;) {
      const pid_t p = ::waitpid(pid_, &status, WNOHANG);
      if (p == pid_) break;
      if (Clock::now() - start_ > limit) {
        r.hung = true;
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    reaped_ = true;
    r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) r.term_signal = WTERMSIG(status);
    r.out = slurp(out_path_);
    r.err = slurp(err_path_);
    return r;
  }

 private:
  fs::path out_path_, err_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  Clock::time_point start_;
};

inline RunResult run_launcher(const std::vector<std::string>& args, const TempDir& dir) {
  LauncherProcess p(args, dir);
  return p.wait();
}

// Pids stored by the ranks, one per file, in files whose names start with `prefix`.
inline std::vector<pid_t> read_pids(const fs::path& dir, const std::string& prefix) {
  std::vector<pid_t> pids;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
    std::istringstream in(slurp(entry.path()));
    pid_t pid = 0;
    if (in >> pid && pid > 0) pids.push_back(pid);
  }
  return pids;
}

inline std::size_t count_files(const fs::path& dir, const std::string& prefix) {
  std::size_t n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

inline bool wait_for_files(const fs::path& dir, const std::string& prefix, std::size_t count,
                           std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (count_files(dir, prefix) >= count) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// True while a process with this pid exists (zombies included).
inline bool process_exists(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

inline std::vector<pid_t> surviving(const std::vector<pid_t>& pids) {
  std::vector<pid_t> alive;
  for (pid_t p : pids) {
    if (process_exists(p)) alive.push_back(p);
  }
  return alive;
}

}  // namespace tessera::testing_launcher
