// gl_ucx_limits: probes the UCX this binary runs on (whichever libucp the loader finds) for the
// two limits of UCX 1.13 that shape gradlink's UCX lanes, with raw UCX calls and no gradlink
// code, so the answer is UCX's own. scripts/ucx_limits.sh prints its lines in the reproduction
// table of docs/operations.md ("UCX").
//
//   shm      which transports an endpoint between two processes of this host gets, with and
//            without UCP_ERR_HANDLING_MODE_PEER (the mode gradlink's lanes use: peer failures
//            are reported instead of hanging). Prints "shm peer-mode: <lanes>" and
//            "shm none-mode: <lanes>"; exit 0 when the peer mode has a shared-memory lane
//            (posix, sysv, xpmem or cma), 1 when not; the verdict in one line:
//            "shared memory: peer-mode yes|no, none-mode yes|no".
//   cancel   a rendezvous active-message receive (64 MiB) from a peer that stops progressing
//            after sending its header: ucp_request_cancel() on it, then 1 s of progress. Prints
//            "cancel: ended <status> after <ms> ms" or "cancel: still pending after 1000 ms";
//            exit 0 when the cancel ended it, 1 when not. Then, in a child process,
//            ucp_worker_destroy() with that receive still pending: "destroy: ok" or
//            "destroy: died on signal N".
//   wireup [N [US]]  peers that die while their connection is being set up (bug B6,
//            docs/operations.md "UCX"): a server process progresses one worker while N peer
//            processes (default 600, 16 at a time) each connect to it (peer error mode), send
//            it their address (the server connects back and sends one message, as a gradlink
//            server answers a worker) and SIGKILL themselves 0-US microseconds later (default
//            2000). Prints "wireup: server
//            survived N peers" (exit 0) or "wireup: server died on signal S after M peers"
//            (exit 1).
//
// Exit codes: 0 the limit is gone, 1 the limit holds, 2 usage or a UCX call failed.
#include <fcntl.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kAmId = 7;
constexpr size_t kRndvBytes = size_t{64} << 20;

[[noreturn]] void Die(const char* what, ucs_status_t s) {
  std::fprintf(stderr, "gl_ucx_limits: %s: %s\n", what, ucs_status_string(s));
  std::exit(2);
}

void Check(const char* what, ucs_status_t s) {
  if (s != UCS_OK) Die(what, s);
}

ucp_context_h MakeContext() {
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_AM;
  ucp_config_t* config = nullptr;
  Check("ucp_config_read", ucp_config_read(nullptr, nullptr, &config));
  ucp_context_h ctx = nullptr;
  Check("ucp_init", ucp_init(&p, config, &ctx));
  ucp_config_release(config);
  return ctx;
}

ucp_worker_h MakeWorker(ucp_context_h ctx) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h w = nullptr;
  Check("ucp_worker_create", ucp_worker_create(ctx, &wp, &w));
  return w;
}

std::vector<char> AddressOf(ucp_worker_h w) {
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  Check("ucp_worker_get_address", ucp_worker_get_address(w, &addr, &len));
  std::vector<char> out(reinterpret_cast<char*>(addr), reinterpret_cast<char*>(addr) + len);
  ucp_worker_release_address(w, addr);
  return out;
}

void IgnoreEpError(void*, ucp_ep_h, ucs_status_t) {}

ucp_ep_h Connect(ucp_worker_h w, const std::vector<char>& remote, bool peer_mode) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
  ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_mode) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = IgnoreEpError;
    ep.err_handler.arg = nullptr;
  }
  ucp_ep_h h = nullptr;
  Check("ucp_ep_create", ucp_ep_create(w, &ep, &h));
  return h;
}

// The transports of the endpoint's lanes, from ucp_ep_print_info ("lane[0]: 1:tcp/lo.0 ...").
std::string Lanes(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string out;
  for (const char* p = text; (p = std::strstr(p, "lane[")) != nullptr;) {
    const char* colon = std::strchr(p, ':');
    if (colon == nullptr) break;
    colon = std::strchr(colon + 1, ':');  // after "N:"
    if (colon == nullptr) break;
    const char* end = colon + 1;
    while (*end != '\0' && *end != ' ' && *end != '\n') ++end;
    if (!out.empty()) out += ",";
    out.append(colon + 1, end);
    p = end;
  }
  std::free(text);
  return out.empty() ? "(none)" : out;
}

bool HasShm(const std::string& lanes) {
  for (const char* t : {"posix/", "sysv/", "xpmem/", "cma/"}) {
    if (lanes.find(t) != std::string::npos) return true;
  }
  return false;
}

// Two processes: the child publishes its worker address through a pipe and keeps progressing;
// the parent connects in both modes and prints the lanes each gets.
int ProbeShm() {
  int to_parent[2];
  if (::pipe(to_parent) != 0) return 2;
  const pid_t child = ::fork();
  if (child == 0) {
    ucp_context_h ctx = MakeContext();
    ucp_worker_h w = MakeWorker(ctx);
    std::vector<char> a = AddressOf(w);
    uint64_t n = a.size();
    if (::write(to_parent[1], &n, sizeof(n)) != sizeof(n) ||
        ::write(to_parent[1], a.data(), a.size()) != static_cast<ssize_t>(a.size())) {
      _exit(2);
    }
    const auto end = Clock::now() + std::chrono::seconds(3);
    while (Clock::now() < end) ucp_worker_progress(w);
    _exit(0);
  }
  ::close(to_parent[1]);  // a child that dies early then ends the reads below (EOF)
  uint64_t n = 0;
  if (::read(to_parent[0], &n, sizeof(n)) != sizeof(n) || n > (1u << 20)) return 2;
  std::vector<char> remote(n);
  for (size_t got = 0; got < n;) {
    const ssize_t r = ::read(to_parent[0], remote.data() + got, n - got);
    if (r <= 0) return 2;
    got += static_cast<size_t>(r);
  }
  ucp_context_h ctx = MakeContext();
  ucp_worker_h w = MakeWorker(ctx);
  const std::string peer = Lanes(Connect(w, remote, true));
  const std::string none = Lanes(Connect(w, remote, false));
  std::printf("shm peer-mode: %s\nshm none-mode: %s\n", peer.c_str(), none.c_str());
  std::printf("shared memory: peer-mode %s, none-mode %s\n", HasShm(peer) ? "yes" : "no",
              HasShm(none) ? "yes" : "no");
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return HasShm(peer) ? 0 : 1;
}

struct Arrived {
  void* desc = nullptr;
  size_t length = 0;
  bool rndv = false;
};

ucs_status_t OnAm(void* arg, const void*, size_t, void* data, size_t length,
                  const ucp_am_recv_param_t* param) {
  auto* a = static_cast<Arrived*>(arg);
  a->desc = data;
  a->length = length;
  a->rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  return a->rndv ? UCS_INPROGRESS : UCS_OK;
}

struct RecvDone {
  bool done = false;
  ucs_status_t status = UCS_INPROGRESS;
};

void OnRecvData(void*, ucs_status_t status, size_t, void* user) {
  auto* d = static_cast<RecvDone*>(user);
  d->done = true;
  d->status = status;
}

void OnSend(void*, ucs_status_t, void*) {}

// One process, two workers over the peer error mode (TCP loopback on 1.13): the sender sends
// 64 MiB and is then never progressed again (a hung peer); the receiver asks for the data,
// cancels at once and progresses alone.
int ProbeCancel() {
  ucp_context_h ctx = MakeContext();
  ucp_worker_h sender = MakeWorker(ctx), receiver = MakeWorker(ctx);
  Arrived arrived;
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.cb = OnAm;
  hp.arg = &arrived;
  Check("ucp_worker_set_am_recv_handler", ucp_worker_set_am_recv_handler(receiver, &hp));
  ucp_ep_h ep = Connect(sender, AddressOf(receiver), true);

  std::vector<char> payload(kRndvBytes, 'x'), target(kRndvBytes);
  ucp_request_param_t sp{};
  sp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
  sp.cb.send = OnSend;
  sp.flags = UCP_AM_SEND_FLAG_RNDV;
  ucs_status_ptr_t send = ucp_am_send_nbx(ep, kAmId, nullptr, 0, payload.data(),
                                          payload.size(), &sp);
  if (UCS_PTR_IS_ERR(send)) Die("ucp_am_send_nbx", UCS_PTR_STATUS(send));
  for (auto end = Clock::now() + std::chrono::seconds(10);
       arrived.desc == nullptr && Clock::now() < end;) {
    ucp_worker_progress(sender);
    ucp_worker_progress(receiver);
  }
  if (arrived.desc == nullptr || !arrived.rndv) {
    std::fprintf(stderr, "gl_ucx_limits: the 64 MiB message did not arrive as rendezvous\n");
    return 2;
  }
  RecvDone done;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = OnRecvData;
  rp.user_data = &done;
  ucs_status_ptr_t recv = ucp_am_recv_data_nbx(receiver, arrived.desc, target.data(),
                                               arrived.length, &rp);
  if (UCS_PTR_IS_ERR(recv)) Die("ucp_am_recv_data_nbx", UCS_PTR_STATUS(recv));
  if (recv == nullptr) {
    std::printf("cancel: the receive completed at once (nothing to cancel)\n");
    return 2;
  }
  const auto t0 = Clock::now();
  ucp_request_cancel(receiver, recv);
  const auto end = t0 + std::chrono::seconds(1);
  while (!done.done && Clock::now() < end) ucp_worker_progress(receiver);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  const int rc = done.done ? 0 : 1;
  if (done.done) {
    std::printf("cancel: ended %s after %lld ms\n", ucs_status_string(done.status),
                static_cast<long long>(ms));
  } else {
    std::printf("cancel: still pending after %lld ms\n", static_cast<long long>(ms));
  }
  std::fflush(stdout);
  if (!done.done) {
    // What gradlink's lane would do next when it stops: destroy the worker. In a child, so
    // that an abort there is observed, not suffered.
    const pid_t child = ::fork();
    if (child == 0) {
      ucp_worker_destroy(receiver);
      _exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    if (WIFSIGNALED(status)) {
      std::printf("destroy: died on signal %d\n", WTERMSIG(status));
    } else {
      std::printf("destroy: exit %d\n", WEXITSTATUS(status));
    }
  }
  std::fflush(stdout);
  _exit(rc);  // the workers hold the pending requests: no orderly teardown
}

// One peer: connects, sends one active message, progresses for `us` microseconds (its
// connection to the server being set up meanwhile), and dies as a crash does.
[[noreturn]] void DyingPeer(const std::vector<char>& server, int us) {
  ucp_context_h ctx = MakeContext();
  ucp_worker_h w = MakeWorker(ctx);
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
  hp.id = kAmId;
  hp.cb = [](void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
    return UCS_OK;  // the server's answer: nothing to do with it
  };
  Check("ucp_worker_set_am_recv_handler", ucp_worker_set_am_recv_handler(w, &hp));
  ucp_ep_h ep = Connect(w, server, /*peer_mode=*/true);
  // Its own address: the server connects back to it, as a gradlink server does to a worker.
  static std::vector<char> self;
  self = AddressOf(w);
  ucp_request_param_t param{};
  ucs_status_ptr_t req = ucp_am_send_nbx(ep, kAmId, nullptr, 0, self.data(), self.size(), &param);
  (void)req;  // never waited for: the process dies with it in flight
  const Clock::time_point until = Clock::now() + std::chrono::microseconds(us);
  while (Clock::now() < until) ucp_worker_progress(w);
  ::raise(SIGKILL);
  _exit(3);  // not reached
}

int ProbeWireup(int peers, int max_us) {
  int to_parent[2], stop[2];
  if (::pipe(to_parent) != 0 || ::pipe(stop) != 0) return 2;
  const pid_t server = ::fork();
  if (server == 0) {
    ::close(stop[1]);
    ucp_context_h ctx = MakeContext();
    ucp_worker_h w = MakeWorker(ctx);
    // Each peer's address: connected back to, and sent one message (never closed: the probe
    // is about surviving, not cleaning up).
    static std::vector<std::vector<char>> callers;
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
    hp.id = kAmId;
    hp.cb = [](void*, const void*, size_t, void* data, size_t length,
               const ucp_am_recv_param_t* param) {
      if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        const char* bytes = static_cast<const char*>(data);
        callers.emplace_back(bytes, bytes + length);
      }
      return UCS_OK;
    };
    Check("ucp_worker_set_am_recv_handler", ucp_worker_set_am_recv_handler(w, &hp));
    const std::vector<char> addr = AddressOf(w);
    const uint64_t len = addr.size();
    if (::write(to_parent[1], &len, sizeof(len)) != sizeof(len) ||
        ::write(to_parent[1], addr.data(), len) != static_cast<ssize_t>(len)) {
      _exit(2);
    }
    ::fcntl(stop[0], F_SETFL, O_NONBLOCK);
    static const char kBack[] = "back";
    for (char c;;) {
      for (int i = 0; i < 256; ++i) ucp_worker_progress(w);
      for (const std::vector<char>& caller : callers) {
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.address = reinterpret_cast<const ucp_address_t*>(caller.data());
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep.err_handler.cb = IgnoreEpError;
        ucp_ep_h back = nullptr;
        if (ucp_ep_create(w, &ep, &back) != UCS_OK) continue;  // dead already: refused
        ucp_request_param_t param{};
        ucs_status_ptr_t req = ucp_am_send_nbx(back, kAmId, nullptr, 0, kBack, sizeof(kBack), &param);
        if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
      }
      callers.clear();
      if (::read(stop[0], &c, 1) == 0) break;  // the parent closed it: done
    }
    _exit(0);  // alive: no orderly teardown needed
  }
  ::close(stop[0]);
  uint64_t len = 0;
  if (::read(to_parent[0], &len, sizeof(len)) != sizeof(len) || len == 0 || len > (1 << 20)) {
    return 2;
  }
  std::vector<char> addr(len);
  for (size_t got = 0; got < len;) {
    const ssize_t n = ::read(to_parent[0], addr.data() + got, len - got);
    if (n <= 0) return 2;
    got += static_cast<size_t>(n);
  }
  std::mt19937 rng(20261203);
  std::uniform_int_distribution<int> delay_us(0, max_us);
  int started = 0, running = 0, server_status = 0;
  bool server_died = false;
  while ((started < peers || running > 0) && !server_died) {
    while (started < peers && running < 16) {
      const int us = delay_us(rng);
      const pid_t peer = ::fork();
      if (peer == 0) DyingPeer(addr, us);
      ++started;
      ++running;
    }
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, 0);
    if (done == server) {
      server_died = true;
      server_status = status;
    } else if (done > 0) {
      --running;
    }
  }
  if (!server_died) {
    ::close(stop[1]);
    ::waitpid(server, &server_status, 0);
    server_died = !WIFEXITED(server_status) || WEXITSTATUS(server_status) != 0;
  }
  while (::waitpid(-1, nullptr, 0) > 0) {
  }
  if (server_died) {
    std::printf("wireup: server died on signal %d after %d peers\n",
                WIFSIGNALED(server_status) ? WTERMSIG(server_status) : 0, started);
    return 1;
  }
  std::printf("wireup: server survived %d peers\n", peers);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc >= 2 ? argv[1] : "";
  if (what == "shm" && argc == 2) return ProbeShm();
  if (what == "cancel" && argc == 2) return ProbeCancel();
  if (what == "wireup" && argc <= 4) {
    return ProbeWireup(argc >= 3 ? std::atoi(argv[2]) : 600, argc == 4 ? std::atoi(argv[3]) : 2000);
  }
  std::fprintf(stderr, "usage: gl_ucx_limits shm|cancel|wireup [peers [max_us]]\n");
  return 2;
}
