#include "unit/support/rounds.h"

#include <algorithm>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "unit/support/reference.h"
#include "wire/frame.h"

namespace gradlink::test {

void RunRounds(Job& job, const std::vector<TensorSpec>& specs, uint64_t rounds,
               std::function<std::vector<size_t>(uint32_t)> order,
               std::chrono::microseconds issue_gap) {
  const uint32_t workers = job.config().workers;
  OnEveryWorker(workers, [&](uint32_t rank) {
    Worker& w = job.worker(rank);
    std::vector<size_t> idx(specs.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    if (order) idx = order(rank);
    std::vector<TensorHandle> handles(specs.size());
    std::vector<std::vector<std::byte>*> bufs(specs.size());
    for (size_t i : idx) {
      Result<TensorHandle> t = w.Declare(specs[i].name, specs[i].dtype, specs[i].count);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(t->key(), wire::TensorKey(job.config().job, specs[i].name));
      handles[i] = *t;
      bufs[i] = &job.Buffer(specs[i].count * DataTypeSize(specs[i].dtype));
    }
    std::mt19937 gap_rng(rank + 1);
    for (uint64_t round = 0; round < rounds; ++round) {
      std::vector<PushPullHandle> ops(specs.size());
      for (size_t i : idx) {
        if (issue_gap.count() > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(gap_rng() % issue_gap.count()));
        }
        FillTensor(specs[i].dtype, i, rank, round, *bufs[i]);
        ops[i] = w.PushPull(handles[i], *bufs[i], {specs[i].average, specs[i].priority});
      }
      const auto deadline = In(kOpTimeout);
      for (size_t i : idx) {
        Status s = ops[i].Wait(deadline);
        ASSERT_TRUE(s.ok()) << "rank " << rank << " '" << specs[i].name << "' round " << round
                            << ": " << s.ToString();
        EXPECT_TRUE(ops[i].Poll());
        EXPECT_TRUE(CheckTensor(specs[i].dtype, i, workers, round, specs[i].average, *bufs[i]))
            << "rank " << rank << " '" << specs[i].name << "'";
      }
    }
  });
}

// Partition rounds the servers must have completed for `rounds` steps over `specs`.
uint64_t ExpectedPartitionRounds(const std::vector<TensorSpec>& specs, uint64_t partition_bytes,
                                 uint64_t rounds) {
  uint64_t n = 0;
  for (const TensorSpec& t : specs) {
    const uint64_t per_part = std::max<uint64_t>(1, partition_bytes / DataTypeSize(t.dtype));
    n += (t.count + per_part - 1) / per_part;
  }
  return n * rounds;
}

uint64_t ServerRounds(Job& job) {
  uint64_t n = 0;
  for (uint32_t s = 0; s < job.config().servers; ++s) n += job.server(s).stats().rounds_completed;
  return n;
}

std::vector<TensorSpec> LayerSpecs() {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 12; ++i) {
    specs.push_back({"layer" + std::to_string(i), kAllTypes[i % 6], uint64_t(100 + 300 * i)});
  }
  return specs;
}

std::vector<size_t> OrderOfRank(size_t n, uint32_t rank) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  if (rank == 1) std::reverse(idx.begin(), idx.end());
  if (rank == 2) std::shuffle(idx.begin(), idx.end(), std::mt19937(99));
  return idx;
}

// 200 small tensors of every dtype.
std::vector<TensorSpec> ManyKeySpecs() {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 200; ++i) {
    specs.push_back({"k" + std::to_string(i), kAllTypes[i % 6], uint64_t(1 + (i * 37) % 150)});
  }
  return specs;
}

}  // namespace gradlink::test
