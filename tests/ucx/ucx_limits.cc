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
//
// Exit codes: 0 the limit is gone, 1 the limit holds, 2 usage or a UCX call failed.
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
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

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc == 2 ? argv[1] : "";
  if (what == "shm") return ProbeShm();
  if (what == "cancel") return ProbeCancel();
  std::fprintf(stderr, "usage: gl_ucx_limits shm|cancel\n");
  return 2;
}
