// The control channel between the launchers of a multi-node job.
//
// Node 0's launcher listens on the master port; every other launcher connects to it. Before
// any rank starts, the launchers meet there (the rendezvous): node 0 checks that every node
// came once with the same job shape and hands out the port of the ranks' own store. While the
// ranks run, the channel carries heartbeats and what each launcher sees, so that a failure
// anywhere stops every node within a bounded time:
//
//   node K -> node 0   HELLO <version> <node_rank> <nnodes> <nproc>
//   node 0 -> node K   START <store_port> | ERROR <why>
//   both ways          PING                    (every heartbeat_timeout / 5)
//   node K -> node 0   FAILED <rank> <what>    (a rank of node K failed)
//   node K -> node 0   DONE                    (every rank of node K exited 0)
//   node 0 -> node K   STOP <why> | END        (the job failed / every node is done)
//
// A peer is lost when its connection closes (its launcher died: the kernel closes the socket)
// or when nothing arrived from it for heartbeat_timeout (its host or link is down).
#pragma once

#include <poll.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessera::launcher {

struct LinkConfig {
  int nnodes = 1;
  int node_rank = 0;
  int nproc = 1;
  std::string master_addr;
  int master_port = 0;
  double rdzv_timeout = 300;      // seconds the launchers wait for one another
  double heartbeat_timeout = 30;  // seconds of silence after which a peer is lost
};

// What the channel reports to the launcher's loop.
struct LinkEvent {
  enum Kind {
    RankFailed,  // (node 0) `node` reported that its rank `rank` failed: `text`
    NodeLost,    // (node 0: node `node`; others: node 0) the peer is gone: `text` says how
    Stop,        // (nodes > 0) node 0 stopped the job: `text`
    NodeDone,    // (node 0) every rank of `node` exited 0
    End,         // (nodes > 0) every node is done
  } kind;
  int node = -1;
  int rank = -1;
  std::string text;
};

class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Binds port 0 (on every interface, or on loopback only) and returns the port the kernel
// picked. Throws std::runtime_error.
int pick_free_port(bool any_interface);

class NodeLink {
 public:
  using Clock = std::chrono::steady_clock;

  explicit NodeLink(LinkConfig config);
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  // Blocks until every launcher has joined; returns the port of the ranks' store (on node 0's
  // host). Throws RendezvousError saying what went wrong; returns -1 when a byte arrives on
  // `interrupt_fd` (a signal) first.
  int rendezvous(int interrupt_fd);

  // The loop's poll set: append, poll, then hand the same entries back.
  void add_pollfds(std::vector<pollfd>& fds) const;
  void on_poll(const pollfd* fds, std::size_t count);
  // Heartbeats out, silence checks in; call every loop iteration.
  void tick();
  // Milliseconds until tick() has work (the next heartbeat or silence deadline).
  long ms_until_due() const;
  std::vector<LinkEvent> take_events();

  // Node K > 0: tell node 0. Node 0: stop every other node (except `except`).
  void report_failure(int rank, const std::string& what);
  void report_done();
  void stop_all(const std::string& why, int except = -1);
  void end_all();
  // Node 0: every node has reported DONE and none is lost.
  bool all_nodes_done() const;
  // The channel needs nothing more (node 0 sent END or STOP; a node got END or STOP, or lost
  // node 0).
  bool finished() const { return finished_; }
  // Best effort: pushes out what is queued (STOP, END, FAILED) for up to `limit`.
  void flush(std::chrono::milliseconds limit);

 private:
  struct Peer {
    int fd = -1;
    int node = -1;
    std::string in, out;
    Clock::time_point heard;
    bool done = false;
    bool lost = false;
  };

  // The rendezvous, step by step. Node 0: listen, admit every other node's launcher (false:
  // interrupted), then hand out the store's port.
  enum class Hello { Waiting, Joined, Dropped };
  void listen_on_master_port();
  bool admit_launchers(Clock::time_point until, int interrupt_fd);
  void accept_pending(std::vector<Peer>& pending);
  Hello read_hello(Peer& p, std::vector<bool>& joined);
  std::string hello_problem(int version, int node, int nnodes, int nproc,
                            const std::vector<bool>& joined) const;  // "" when it may join
  RendezvousError nodes_missing_error(const std::vector<bool>& joined) const;
  int start_job();
  // Node K > 0: connect to node 0 (retrying until the deadline; -1: interrupted), say HELLO
  // and wait for START.
  int connect_to_node0(Clock::time_point until, int interrupt_fd);
  int try_connect(Clock::time_point until, std::string& last_error) const;
  int await_start(int fd, Clock::time_point until, int interrupt_fd);
  std::string master_text() const;  // "addr:port"

  void send(Peer& p, const std::string& line);
  void lose(Peer& p, const std::string& why);
  void on_line(Peer& p, const std::string& line);
  bool read_lines(Peer& p);  // false: the connection is gone
  void write_some(Peer& p);

  LinkConfig cfg_;
  int listen_fd_ = -1;
  std::vector<Peer> peers_;  // node 0: one per other node; others: node 0
  std::vector<LinkEvent> events_;
  Clock::time_point next_ping_;
  bool finished_ = false;
};

}  // namespace tessera::launcher
