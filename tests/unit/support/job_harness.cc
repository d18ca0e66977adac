#include "unit/support/job_harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <thread>

#include "control/join.h"
#include "wire/frame.h"
#include "server/start_on.h"
#include "worker/worker_impl.h"

namespace gradlink::test {

using namespace std::chrono_literals;

Job::~Job() {
  for (auto& w : workers_) {
    if (w) w->Shutdown(In(5s)).IgnoreError();
  }
  workers_.clear();
  fakes_.clear();
  for (auto& s : servers_) {
    if (s) s->Stop();
  }
  servers_.clear();
  if (scheduler_) scheduler_->Stop();
}

void Job::Start(const JobConfig& config) {
  ASSERT_TRUE(config.server_weights.empty() || config.server_weights.size() == config.servers)
      << config.server_weights.size() << " server weights for " << config.servers << " servers";
  std::vector<size_t> start_order(config.servers);  // each server's index, once
  std::iota(start_order.begin(), start_order.end(), size_t{0});
  if (!config.server_start_order.empty()) {
    ASSERT_TRUE(std::is_permutation(config.server_start_order.begin(),
                                    config.server_start_order.end(), start_order.begin(),
                                    start_order.end()))
        << "server_start_order is not an order of the " << config.servers << " servers";
    start_order = config.server_start_order;
  }

  config_ = config;
  if (config.ucx) {
    Result<std::unique_ptr<transport::Fabric>> ucx = transport::CreateUcxFabric();
    ASSERT_TRUE(ucx.ok()) << ucx.status().ToString();
    fabric_ = std::move(*ucx);
  } else {
    fabric_ = transport::CreateInprocFabric();
  }
  SchedulerOptions so;
  so.port = 0;
  so.num_workers = config.workers;
  so.num_servers = config.servers;
  so.job = config.job;
  so.join_timeout = kConnectTimeout;
  so.server_failover = config.server_failover;
  so.memory_quota_bytes = config.job_memory_quota;
  Result<std::unique_ptr<Scheduler>> sched = Scheduler::Start(so);
  ASSERT_TRUE(sched.ok()) << sched.status().ToString();
  scheduler_ = std::move(sched).value();
  const std::string address = "127.0.0.1:" + std::to_string(scheduler_->port());

  const uint32_t all_servers = config.servers + config.standby_servers;
  servers_.resize(all_servers);
  workers_.resize(config.workers);
  fakes_.resize(config.workers);
  std::vector<Status> errors(all_servers + config.workers);
  std::vector<std::thread> threads;
  for (size_t i = config.servers; i < all_servers; ++i) start_order.push_back(i);
  for (size_t i : start_order) {
    threads.emplace_back([&, i] {
      ServerOptions o = ServerOptionsFor(address, i);
      o.standby = i >= config.servers;
      if (config.per_server) config.per_server(i, o);
      Result<std::unique_ptr<Server>> s = StartServerOn(o, fabric_);
      if (s.ok()) servers_[i] = std::move(s).value();
      else errors[i] = s.status();
    });
    if (config.server_start_gap.count() > 0) std::this_thread::sleep_for(config.server_start_gap);
  }
  for (uint32_t r = 0; r < config.workers; ++r) {
    const bool fake = std::find(config.fake_worker_ranks.begin(), config.fake_worker_ranks.end(),
                                r) != config.fake_worker_ranks.end();
    threads.emplace_back([&, r, fake] {
      if (fake) {
        wire::RegisterMsg reg;
        reg.role = wire::Role::kWorker;
        reg.requested_rank = static_cast<int32_t>(r);
        reg.host = "fake-worker-" + std::to_string(r);
        reg.push_address.assign(8, std::byte{0xEE});  // no lane: nothing will reach it
        reg.pull_address.assign(8, std::byte{0xEE});
        Result<Joined> j = JoinJob(address, wire::JobHash(config.job), reg, In(kConnectTimeout));
        if (j.ok()) fakes_[r] = std::move(j->channel);
        else errors[all_servers + r] = j.status();
        return;
      }
      WorkerOptions o;
      o.scheduler = address;
      o.job = config.job;
      o.rank = static_cast<int32_t>(r);
      o.partition_bytes = config.partition_bytes;
      o.max_bytes_in_flight = config.max_bytes_in_flight;
      o.max_bytes_ahead = config.max_bytes_ahead;
      o.fusion_buffer_bytes = config.fusion_buffer_bytes;
      o.fusion_threshold_bytes = config.fusion_threshold_bytes;
      o.operation_timeout = config.operation_timeout;
      o.connect_timeout = kConnectTimeout;
      o.host_name = "worker-host-" + std::to_string(r);
      o.local_arena_bytes = config.local_arena_bytes;
      o.local_chunk_bytes = config.local_chunk_bytes;
      if (config.local_arena_bytes > 0) o.host_name = "one-host/" + std::to_string(r);
      if (config.per_worker) config.per_worker(r, o);
      Result<std::unique_ptr<Worker>> w = ConnectWorkerOn(o, fabric_);
      if (w.ok()) workers_[r] = std::move(w).value();
      else errors[all_servers + r] = w.status();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : errors) ASSERT_TRUE(s.ok()) << s.ToString();
  for (uint32_t r = 0; r < config.workers; ++r) {
    if (!workers_[r]) continue;
    EXPECT_EQ(workers_[r]->rank(), r);
    EXPECT_EQ(workers_[r]->size(), config.workers);
    EXPECT_EQ(workers_[r]->num_servers(), config.servers);
  }
}

ServerOptions Job::ServerOptionsFor(const std::string& address, size_t i) const {
  ServerOptions o;
  o.scheduler = address;
  o.job = config_.job;
  o.connect_timeout = kConnectTimeout;
  o.host_name = "server-host-" + std::to_string(i);
  if (i < config_.server_weights.size()) o.weight = config_.server_weights[i];
  o.memory_budget_bytes = config_.server_memory_budget;
  if (i < config_.server_ids.size()) o.id = config_.server_ids[i];
  return o;
}

Result<size_t> Job::AddServer(const std::function<void(ServerOptions&)>& tweak) {
  const size_t i = servers_.size();
  ServerOptions o = ServerOptionsFor("127.0.0.1:" + std::to_string(scheduler_->port()), i);
  if (tweak) tweak(o);
  GL_ASSIGN_OR_RETURN(std::unique_ptr<Server> s, StartServerOn(o, fabric_));
  servers_.push_back(std::move(s));
  return i;
}

void Job::FinishCleanly() {
  for (auto& w : workers_) {
    if (w) {
      EXPECT_TRUE(w->Shutdown(In(5s)).ok());
    }
  }
  for (auto& s : servers_) {
    if (s) {
      Status st = s->Wait(In(5s));
      EXPECT_TRUE(st.ok()) << "server " << s->id() << ": " << st.ToString();
    }
  }
  Status st = scheduler_->Wait(In(5s));
  EXPECT_TRUE(st.ok()) << "scheduler: " << st.ToString();
  EXPECT_EQ(scheduler_->protocol_errors(), 0u);
  for (auto& s : servers_) {
    if (s) {
      EXPECT_EQ(s->stats().protocol_errors, 0u);
      EXPECT_EQ(s->stats().mismatches, 0u);
    }
  }
}

std::vector<std::byte>& Job::Buffer(size_t bytes) {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  return buffers_.emplace_back(bytes);
}

void OnEveryWorker(uint32_t workers, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < workers; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

TwoEnds WaitBoth(PushPullHandle& a, PushPullHandle& b, Clock::time_point deadline) {
  TwoEnds ends;
  Clock::time_point a_end, b_end;
  std::thread waiter([&] {
    ends.a = a.Wait(deadline);
    a_end = Clock::now();
  });
  ends.b = b.Wait(deadline);
  b_end = Clock::now();
  waiter.join();
  ends.apart = a_end > b_end ? a_end - b_end : b_end - a_end;
  return ends;
}

}  // namespace gradlink::test
