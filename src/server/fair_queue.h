// FairQueue: the order in which a shared server serves the jobs that have work (the pool of
// issue 45: engine time, and later send queues, shared among tenants by weight).
//
//   FairQueue<Task> q(/*quantum=*/256 << 10);
//   q.SetWeight(job_a, 1.0);
//   q.SetWeight(job_b, 2.0);
//   q.Push(job_a, bytes, task);             // FIFO within a tenant
//   while (auto next = q.Pop()) Run(*next); // deficit round robin across tenants
//
// Deficit round robin (Shreedhar and Varghese, SIGCOMM '95): each tenant with work gets
// quantum x weight bytes of credit per turn and is served while its credit covers its next
// task's cost; a tenant whose queue empties leaves the round and forgets its credit (an idle
// tenant saves nothing up), so backlogged tenants share in proportion to their weights and a
// tenant alone gets everything. A task's cost may exceed a turn's credit: the credit then
// carries over turns until it is covered (large tasks are served, only less often). O(1) per
// Push and Pop.
//
// Not yet used: the pool wires it into the servers' engines (issue 45); tested on its own in
// tests/unit/server/fair_queue_test.cc.
//
// Threads: not thread-safe; the owner serializes (the engine's queue lock).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>

namespace gradlink::server {

template <typename Task>
class FairQueue {
 public:
  explicit FairQueue(uint64_t quantum_bytes) : quantum_(quantum_bytes ? quantum_bytes : 1) {}

  // A tenant's share relative to the others' (default 1); > 0.
  void SetWeight(uint32_t tenant, double weight) {
    tenants_[tenant].weight = weight > 0 ? weight : 1.0;
  }

  // `cost`: the bytes the task stands for (0 counts as 1: nothing is free).
  void Push(uint32_t tenant, uint64_t cost, Task task) {
    Tenant& t = tenants_[tenant];
    t.tasks.push_back({cost ? cost : 1, std::move(task)});
    ++size_;
    if (!t.active) {
      t.active = true;
      t.fresh_turn = true;
      round_.push_back(tenant);
    }
  }

  // The next task by deficit round robin; nullopt when empty. `*tenant` (when given) is set to
  // whose it is.
  std::optional<Task> Pop(uint32_t* tenant = nullptr) {
    while (!round_.empty()) {
      const uint32_t id = round_.front();
      Tenant& t = tenants_[id];
      if (t.fresh_turn) {
        // At least 1 a turn, however small the weight: every tenant with work progresses.
        const double credit = static_cast<double>(quantum_) * t.weight;
        t.deficit += credit < 1 ? 1 : static_cast<uint64_t>(credit);
        t.fresh_turn = false;
      }
      if (t.tasks.front().first <= t.deficit) {
        auto [cost, task] = std::move(t.tasks.front());
        t.tasks.pop_front();
        --size_;
        t.deficit -= cost;
        if (t.tasks.empty()) {  // leaves the round; an idle tenant saves no credit
          t.active = false;
          t.deficit = 0;
          round_.pop_front();
        }
        if (tenant != nullptr) *tenant = id;
        return std::move(task);
      }
      // Its turn's credit is spent: the next tenant's turn.
      round_.pop_front();
      round_.push_back(id);
      t.fresh_turn = true;
    }
    return std::nullopt;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  struct Tenant {
    std::deque<std::pair<uint64_t, Task>> tasks;
    double weight = 1.0;
    uint64_t deficit = 0;
    bool active = false;      // in round_
    bool fresh_turn = false;  // its next Pop starts a turn (adds its quantum)
  };

  const uint64_t quantum_;
  std::unordered_map<uint32_t, Tenant> tenants_;
  std::deque<uint32_t> round_;  // tenants with work, in turn order
  size_t size_ = 0;
};

}  // namespace gradlink::server
