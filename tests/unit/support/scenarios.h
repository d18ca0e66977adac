// Scenarios that both paths run, through the servers (unit/worker/declare_test.cc,
// failure_test.cc) and through shared memory (unit/worker/local_path_test.cc): one body per
// behaviour, so that the two paths are held to the same assertions. Each fails the calling test
// through gtest; none hangs (every wait has a deadline).
#pragma once

#include <cstdint>
#include <string>

#include "unit/support/job_harness.h"

namespace gradlink::test {

// Rank 0 declares `name` as t0[n0], rank 1 as t1[n1]: both PushPulls fail with kMismatch naming
// the key, the name, both ranks and both declarations, within 5 s; later calls fail at once.
void ExpectMismatchOnBothRanks(Job& job, const std::string& name, DataType t0, uint64_t n0,
                               DataType t1, uint64_t n1);

// Rank 0's op times out while rank 1 has not pushed, and completes once it has.
void ExpectWaitTimesOutThenCompletes(const JobConfig& config);

// Rank 0 shuts down while its op waits for rank 1: the op fails with kAborted, and so does
// every later one.
void ExpectShutdownFailsOwnPendingOps(const JobConfig& config, uint64_t count);

// The scheduler stops while rank 0's op waits for rank 1: the op fails within seconds.
void ExpectSchedulerStopAbortsPendingOps(const JobConfig& config);

// A worker that leaves cleanly while another still waits on a round that needs its push: the
// other's op fails within seconds, naming it; its message contains `says` too.
void ExpectCleanGoodbyeFailsTheOthersPendingOp(const JobConfig& config,
                                               const std::string& says = "");

// One worker averages, the other sums: each partition's round fails with kMismatch on every
// rank, and the next call on the tensor works.
void AverageDisagreementThenAgreement(Job& job, const std::string& name, uint64_t count);

}  // namespace gradlink::test
