// Tests of WorkQueue (src/common/work_queue.h): closures run in post order on the queue's one
// thread, Stop() runs what is queued and then refuses, and closures may post or stop from
// inside. Every wait has a deadline.
#include "common/work_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace gradlink {
namespace {

using namespace std::chrono_literals;

TEST(WorkQueueTest, RunsInPostOrderOnItsOwnThread) {
  std::vector<int> ran;
  std::vector<std::thread::id> threads;
  {
    WorkQueue q;
    for (int i = 0; i < 1000; ++i) {
      ASSERT_TRUE(q.Post([&, i] {
        ran.push_back(i);  // only the queue's thread touches these until Stop() joins it
        threads.push_back(std::this_thread::get_id());
      }));
    }
    q.Stop();
  }
  ASSERT_EQ(ran.size(), 1000u);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(ran[i], i);
  for (std::thread::id t : threads) EXPECT_EQ(t, threads[0]);
  EXPECT_NE(threads[0], std::this_thread::get_id());
}

// Stop() runs everything queued before it, even behind a slow closure, then joins; a Post()
// after it is refused and its closure never runs.
TEST(WorkQueueTest, StopRunsWhatIsQueuedThenRefuses) {
  WorkQueue q;
  std::atomic<int> ran{0};
  ASSERT_TRUE(q.Post([&] {
    std::this_thread::sleep_for(100ms);
    ran++;
  }));
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(q.Post([&] { ran++; }));
  q.Stop();
  EXPECT_EQ(ran.load(), 101);
  EXPECT_FALSE(q.Post([&] { ran++; }));
  q.Stop();  // idempotent
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(ran.load(), 101);
}

// Posting from several threads at once: every closure runs exactly once, each thread's in its
// post order.
TEST(WorkQueueTest, ConcurrentPostersEachKeepTheirOrder) {
  constexpr int kThreads = 4, kPer = 500;
  std::vector<std::vector<int>> seen(kThreads);
  {
    WorkQueue q;
    std::vector<std::thread> posters;
    for (int t = 0; t < kThreads; ++t) {
      posters.emplace_back([&, t] {
        for (int i = 0; i < kPer; ++i) EXPECT_TRUE(q.Post([&, t, i] { seen[t].push_back(i); }));
      });
    }
    for (auto& p : posters) p.join();
  }  // the destructor stops: everything posted has run
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), size_t{kPer}) << "poster " << t;
    for (int i = 0; i < kPer; ++i) EXPECT_EQ(seen[t][i], i);
  }
}

// A closure can post the next one (no lock is held while it runs) and can stop the queue from
// its own thread without deadlocking on a join of itself.
TEST(WorkQueueTest, ClosuresMayPostAndStop) {
  WorkQueue q;
  std::mutex mu;
  std::condition_variable cv;
  int chain = 0;
  bool refused_after_stop = false;
  std::function<void()> step = [&] {
    std::lock_guard<std::mutex> lock(mu);
    if (++chain < 10) {
      EXPECT_TRUE(q.Post(step));
      return;
    }
    q.Stop();  // on the queue's own thread
    refused_after_stop = !q.Post([] {});
    cv.notify_all();
  };
  ASSERT_TRUE(q.Post(step));
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 5s, [&] { return chain == 10; }));
    EXPECT_TRUE(refused_after_stop);
  }
  q.Stop();  // joins the thread that already stopped
}

}  // namespace
}  // namespace gradlink
