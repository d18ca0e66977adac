// The server's life: joining the job (lanes, membership, the connections to every worker),
// sizing and placing its threads, waiting for the job's end, and stopping.
// Threads: the caller's (Init, Wait, Stop); Finish from any.
#include "server/server_impl.h"

#include <algorithm>

#include "common/cpus.h"
#include "common/log.h"
#include "common/naming.h"
#include "gradlink/env.h"
#include "metrics/endpoint.h"
#include "metrics/process.h"
#include "server/start_on.h"

namespace gradlink {

ServerImpl::ServerImpl(const ServerOptions& o, std::shared_ptr<transport::Fabric> fabric)
    : opts_(o), job_hash_(wire::JobHash(o.job)), fabric_(std::move(fabric)) {}

Status ServerImpl::Init() {
  cpu_at_start_ = metrics::ProcessCpuSeconds();
  // The CPU list is checked before anything starts: a server that cannot run where it was
  // asked to says so at once, not after joining the job.
  if (!opts_.cpus.empty()) {
    GL_ASSIGN_OR_RETURN(thread_inputs_.pinned, ParseCpuList("server CPUs", opts_.cpus));
  }
  thread_inputs_.allowed = AllowedCpus();
  thread_inputs_.engines = opts_.engine_threads;
  thread_inputs_.lanes = opts_.single_lane ? 1 : 2;
  GL_RETURN_IF_ERROR(server::PlanThreads(thread_inputs_).status());
  if (!wire::IsValidServerWeight(opts_.weight)) {
    return InvalidArgument("server " + wire::ServerWeightError(opts_.weight));
  }
  const auto deadline = transport::Clock::now() + opts_.connect_timeout;
  GL_RETURN_IF_ERROR(lanes_.Open({"server", job_hash_, opts_.secret, opts_.single_lane,
                                  std::move(fabric_)},
                                 &push_receiver_, &pull_receiver_));

  // Metrics are served from before the join (the scheduler lists the port); a scrape sees the
  // process alone until the job is known (CollectMetrics).
  GL_ASSIGN_OR_RETURN(metrics_, metrics::Serve("0.0.0.0", opts_.metrics_port,
                                               [this] { return CollectMetrics(); }));

  wire::RegisterMsg reg;
  reg.role = wire::Role::kServer;
  reg.requested_rank = opts_.id < 0 ? -1 : opts_.id;
  reg.host = opts_.host_name.empty() ? LocalHostName() : opts_.host_name;
  reg.push_address = lanes_.push().address();
  reg.pull_address = lanes_.reply().address();
  reg.weight = opts_.weight;
  reg.memory_budget = opts_.memory_budget_bytes;
  reg.available_memory = AvailableMemory();
  reg.standby = opts_.standby;
  reg.metrics_port = metrics_ ? metrics_->port() : 0;
  membership_ = std::make_unique<Membership>(
      MembershipConfig{opts_.scheduler, job_hash_, opts_.secret,
                       opts_.scheduler_reconnect_timeout},
      "server");
  GL_ASSIGN_OR_RETURN(const wire::WelcomeMsg welcome, membership_->Join(reg, deadline));
  reg_ = reg;
  id_.store(welcome.your_id, std::memory_order_relaxed);
  const uint32_t num_workers = welcome.num_workers;
  hosts_ = topology::Of(welcome);
  worker_peers_.assign(num_workers, std::nullopt);
  {
    // Connecting to every worker takes a while with thousands of them: heartbeats go on
    // meanwhile, or the scheduler takes this server for a hung one (kSilenceLimit).
    HeartbeatPump pump(membership_->channel().get(), job_hash_, welcome.your_id);
    for (const wire::Member& m : welcome.members) {
      if (m.role != wire::Role::kWorker) continue;
      const std::string name = "worker " + std::to_string(m.id) + " (" + m.host + ")";
      // A worker that is already gone must not take the server down: the scheduler fails the
      // job if it is lost, and a reply to it fails on its own.
      auto peer = lanes_.reply().Connect(m.pull_address, name);
      if (peer.ok()) {
        worker_peers_[m.id] = *peer;
      } else {
        GL_LOG(kWarn) << "server " << id_ << ": cannot reach " << name << ": "
                      << peer.status().ToString();
      }
    }
  }  // the control thread heartbeats from here on
  GL_RETURN_IF_ERROR(StartEngines(welcome, reg.host));
  // Publishes the job to the lanes' threads, which started before it was known: until now
  // every push was refused (its sender >= 0 workers), and from now on the address book and
  // engines it needs are there (release; OnPushHeader's load acquires).
  num_workers_.store(num_workers, std::memory_order_release);
  membership_->Run(this, [this] {
    if (!thread_inputs_.pinned.empty()) PinThisThread(thread_inputs_.pinned).IgnoreError();
  });
  GL_LOG(kInfo) << "server " << id_ << " joined: " << num_workers_ << " workers; "
                << threads_.why;
  if (metrics_) {
    const auto channel = membership_->channel();
    metrics::LogServing("server " + std::to_string(id_),
                        channel ? transport::SocketHost(channel->fd(), false) : reg.host,
                        metrics_->port());
  }
  return Status::Ok();
}

Status ServerImpl::Wait(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(mu_);
  if (!cv_.WaitUntil(mu_, deadline, [this] {
        mu_.AssertHeld();  // the wait runs it under `lock`
        return finished_;
      })) {
    return Timeout("server " + std::to_string(id_) + " still serving");
  }
  return result_;
}

void ServerImpl::Stop() {
  if (stopped_.exchange(true)) return;
  // No scrape from here on: what stats() reads is being taken apart (and, after abandoned
  // receives, released).
  metrics_.reset();
  if (membership_) {
    membership_->StartLeaving();  // a lost scheduler from here on is not a failure
    membership_->CancelRejoin();
    membership_->Leave(finished() ? std::nullopt
                                  : std::optional(transport::Clock::now() + std::chrono::seconds(1)));
  }
  Finish(Aborted("server stopped"));
  if (lanes_.open()) LogSummary();
  for (auto& e : engines_) e->Stop();
  lanes_.Stop();
  // Pushes land in the staging buffers directly (PushReceiver::KeepsBuffersIfAbandoned): if
  // the lane gave up a receive it could not cancel (a hung worker), the fabric may still
  // write into one, so they are never freed.
  if (lanes_.open() && lanes_.push().stats().receives_abandoned != 0) {
    MutexLock lock(parts_mu_);
    GL_LOG(kWarn) << "server " << id_ << ": " << lanes_.push().stats().receives_abandoned
                  << " push receive(s) abandoned; leaking " << parts_.size()
                  << " partition(s) whose staging buffers they may still write";
    for (auto& [id, part] : parts_) (void)part.release();
  }
}

// Sizes the engines from the CPUs this server has (server/thread_plan.h), starts them, and
// names and pins every thread of the server's own (the lanes' progress threads through their
// Defer). `host`: this server's, to find the job's other processes on this machine.
Status ServerImpl::StartEngines(const wire::WelcomeMsg& book, std::string_view host) {
  for (const wire::Member& m : book.members) {
    if (MachineOf(m.host) != MachineOf(host)) continue;
    if (m.role == wire::Role::kWorker) ++thread_inputs_.workers_here;
    if (m.role == wire::Role::kServer && m.id != id_) ++thread_inputs_.servers_here;
  }
  GL_ASSIGN_OR_RETURN(threads_, server::PlanThreads(thread_inputs_));
  const auto place = [this](std::string name, std::optional<uint32_t> cpu) {
    // Named once placed: a thread that has its name has its CPU (the threads test relies on it).
    return [this, name = std::move(name), cpu] {
      if (cpu) {
        const uint32_t c[] = {*cpu};
        if (Status s = PinThisThread(c); !s.ok()) {
          GL_LOG(kWarn) << "server " << id_ << ": " << name << " stays unpinned: " << s.ToString();
        }
      }
      NameThisThread(name);
    };
  };
  const auto cpu_of = [](const std::vector<uint32_t>& cpus, size_t i) {
    return i < cpus.size() ? std::optional<uint32_t>(cpus[i]) : std::nullopt;
  };
  lanes_.push().Defer(place("gl-srv-push", cpu_of(threads_.lane_cpu, 0)));
  if (lanes_.pull()) lanes_.pull()->Defer(place("gl-srv-pull", cpu_of(threads_.lane_cpu, 1)));
  for (uint32_t i = 0; i < threads_.engines; ++i) {
    engines_.push_back(std::make_unique<WorkQueue>());
    // The first closure an engine runs: before any sum.
    engines_.back()->Post(place("gl-engine-" + std::to_string(i), cpu_of(threads_.engine_cpu, i)));
  }
  return Status::Ok();
}

bool ServerImpl::finished() {
  MutexLock lock(mu_);
  return finished_;
}

void ServerImpl::Finish(Status s) {
  MutexLock lock(mu_);
  if (finished_) return;
  finished_ = true;
  // Why the server ends, when it is not its own Stop().
  if (!s.ok() && s.code() != Code::kAborted) {
    GL_LOG(kWarn) << "server " << id_ << ": " << s.message();
  }
  result_ = std::move(s);
  cv_.NotifyAll();
}

Result<std::unique_ptr<Server>> StartServerOn(const ServerOptions& options,
                                              std::shared_ptr<transport::Fabric> fabric) {
  auto s = std::make_unique<ServerImpl>(options, std::move(fabric));
  GL_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<Server>(std::move(s));
}

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  return StartServerOn(options, nullptr);
}

}  // namespace gradlink
