// The environment onto options (include/gradlink/env.h, src/common/env.h): each variable sets its
// field, unset ones keep the defaults, malformed ones are refused naming the variable and change
// nothing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/env.h"
#include "gradlink/env.h"

namespace gradlink {
namespace {

// Sets a variable for the scope of one test and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(EnvTest, UnsetVariablesKeepTheDefaults) {
  for (const char* v : {"GRADLINK_SCHEDULER", "GRADLINK_JOB", "GRADLINK_PARTITION_BYTES",
                        "GRADLINK_SECRET", "GRADLINK_SECRET_FILE", "GRADLINK_TIMEOUT"}) {
    ::unsetenv(v);
  }
  WorkerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  const WorkerOptions d;
  EXPECT_EQ(o.job, d.job);
  EXPECT_EQ(o.partition_bytes, d.partition_bytes);
  EXPECT_EQ(o.operation_timeout, d.operation_timeout);
  EXPECT_FALSE(o.secret.has_value());
}

TEST(EnvTest, EachWorkerVariableSetsItsField) {
  ScopedEnv a("GRADLINK_SCHEDULER", "10.0.0.1:7000"), b("GRADLINK_JOB", "lm"),
      c("GRADLINK_RANK", "3"), d("GRADLINK_PARTITION_BYTES", "512K"),
      e("GRADLINK_MAX_BYTES_AHEAD", "1M"), f("GRADLINK_SINGLE_LANE", "yes"),
      g("GRADLINK_FUSION_BUFFER_BYTES", "0"), h("GRADLINK_LOCAL_ARENA_BYTES", "64M"),
      i("GRADLINK_TIMEOUT", "2.5"), j("GRADLINK_SECRET", "0123456789abcdef0123");
  WorkerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.scheduler, "10.0.0.1:7000");
  EXPECT_EQ(o.job, "lm");
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.partition_bytes, 512u << 10);
  EXPECT_EQ(o.max_bytes_ahead, 1u << 20);
  EXPECT_TRUE(o.single_lane);
  EXPECT_EQ(o.fusion_buffer_bytes, 0u);
  EXPECT_EQ(o.local_arena_bytes, 64u << 20);
  EXPECT_EQ(o.operation_timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(o.secret, std::optional<std::string>("0123456789abcdef0123"));
}

TEST(EnvTest, AMalformedValueIsRefusedNamingItAndChangesNothing) {
  ScopedEnv a("GRADLINK_JOB", "changed"), b("GRADLINK_PARTITION_BYTES", "4 MiB");
  WorkerOptions o;
  const Status s = ApplyEnvironment(&o);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("GRADLINK_PARTITION_BYTES='4 MiB'"), std::string::npos) << s.ToString();
  EXPECT_EQ(o.job, "default");  // nothing applied
}

TEST(EnvTest, ARankOutOfRangeIsRefusedNotTruncated) {
  ScopedEnv r("GRADLINK_RANK", "4294967296");  // 2^32: would wrap to 0 in an int32_t
  WorkerOptions o;
  const Status s = ApplyEnvironment(&o);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("GRADLINK_RANK=4294967296"), std::string::npos) << s.ToString();
  EXPECT_EQ(o.rank, -1);
}

TEST(EnvTest, ServerWeightMustBeANumberInRange) {
  for (const char* bad : {"", "abc", "0", "2e6", "inf"}) {
    ScopedEnv w("GRADLINK_SERVER_WEIGHT", bad);
    ServerOptions o;
    const Status s = ApplyEnvironment(&o);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message().find("GRADLINK_SERVER_WEIGHT"), std::string::npos) << s.ToString();
  }
  ScopedEnv w("GRADLINK_SERVER_WEIGHT", "0.5");
  ServerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.weight, 0.5);
}

// The servers take the same join deadline as the workers (a fault test gives both 5 s).
TEST(EnvTest, ServersTakeTheConnectTimeout) {
  ScopedEnv t("GRADLINK_CONNECT_TIMEOUT", "5");
  ServerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.connect_timeout, std::chrono::seconds(5));
  ScopedEnv bad("GRADLINK_CONNECT_TIMEOUT", "soon");
  EXPECT_EQ(ApplyEnvironment(&o).code(), Code::kInvalidArgument);
}

TEST(EnvTest, ServersTakeTheirIdMemoryBudgetAndHost) {
  ScopedEnv i("GRADLINK_SERVER_ID", "3"), m("GRADLINK_SERVER_MEMORY", "96M"),
      h("GRADLINK_HOST", "rack2-node7");
  ServerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.id, 3);
  EXPECT_EQ(o.memory_budget_bytes, uint64_t{96} << 20);
  EXPECT_EQ(o.host_name, "rack2-node7");
  WorkerOptions w;
  ASSERT_TRUE(ApplyEnvironment(&w).ok());
  EXPECT_EQ(w.host_name, "rack2-node7");
  for (const char* bad : {"-2", "4294967296", "one"}) {
    ScopedEnv b("GRADLINK_SERVER_ID", bad);
    ServerOptions x;
    const Status st = ApplyEnvironment(&x);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("GRADLINK_SERVER_ID"), std::string::npos) << st.ToString();
  }
  ScopedEnv b("GRADLINK_SERVER_MEMORY", "96 MiB");
  ServerOptions x;
  EXPECT_EQ(ApplyEnvironment(&x).code(), Code::kInvalidArgument);
}

TEST(EnvTest, ServersTakeTheirEnginesAndCpus) {
  {
    ServerOptions o;
    ASSERT_TRUE(ApplyEnvironment(&o).ok());
    EXPECT_EQ(o.engine_threads, 0u);  // chosen by the server
    EXPECT_EQ(o.cpus, "");            // not pinned
  }
  ScopedEnv e("GRADLINK_SERVER_ENGINES", "6"), c("GRADLINK_SERVER_CPUS", "0-3,8");
  ServerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.engine_threads, 6u);
  EXPECT_EQ(o.cpus, "0-3,8");  // parsed and checked by the server, against its CPUs
  for (const char* bad : {"-1", "1025", "many"}) {
    ScopedEnv b("GRADLINK_SERVER_ENGINES", bad);
    ServerOptions x;
    const Status st = ApplyEnvironment(&x);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("GRADLINK_SERVER_ENGINES"), std::string::npos) << st.ToString();
  }
}

TEST(EnvTest, ASecretTooShortIsRefused) {
  ScopedEnv s("GRADLINK_SECRET", "short");
  SchedulerOptions o;
  const Status st = ApplyEnvironment(&o);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("GRADLINK_SECRET"), std::string::npos) << st.ToString();
  EXPECT_FALSE(o.secret.has_value());
}

TEST(EnvTest, ByteCountsRefuseOverflow) {
  ScopedEnv b("GRADLINK_X_BYTES", "99999999999999999999G");
  EXPECT_FALSE(env::Bytes("GRADLINK_X_BYTES").ok());
  ScopedEnv c("GRADLINK_Y_BYTES", "17179869184G");  // 2^34 GiB = 2^64 bytes
  EXPECT_FALSE(env::Bytes("GRADLINK_Y_BYTES").ok());
}

TEST(EnvTest, MetricsPortDefaultsAndValues) {
  EXPECT_EQ(SchedulerOptions{}.metrics_port, 0);  // on, a free port
  EXPECT_EQ(ServerOptions{}.metrics_port, 0);
  EXPECT_EQ(WorkerOptions{}.metrics_port, -1);  // off
  {
    ScopedEnv p("GRADLINK_METRICS_PORT", "9100");
    WorkerOptions w;
    ServerOptions s;
    SchedulerOptions c;
    ASSERT_TRUE(ApplyEnvironment(&w).ok() && ApplyEnvironment(&s).ok() &&
                ApplyEnvironment(&c).ok());
    EXPECT_EQ(w.metrics_port, 9100);
    EXPECT_EQ(s.metrics_port, 9100);
    EXPECT_EQ(c.metrics_port, 9100);
  }
  for (const char* off : {"off", "-1"}) {
    ScopedEnv p("GRADLINK_METRICS_PORT", off);
    ServerOptions s;
    ASSERT_TRUE(ApplyEnvironment(&s).ok());
    EXPECT_EQ(s.metrics_port, -1) << off;
  }
  for (const char* bad : {"65536", "-2", "http", "80x"}) {
    ScopedEnv p("GRADLINK_METRICS_PORT", bad);
    ServerOptions s;
    const Status st = ApplyEnvironment(&s);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("GRADLINK_METRICS_PORT"), std::string::npos) << st.ToString();
    EXPECT_EQ(s.metrics_port, 0) << bad;  // unchanged
  }
}

TEST(EnvTest, TheJobsMemoryQuota) {
  EXPECT_EQ(SchedulerOptions{}.memory_quota_bytes, 0u);  // none
  ScopedEnv q("GRADLINK_JOB_MEMORY", "3G");
  SchedulerOptions o;
  ASSERT_TRUE(ApplyEnvironment(&o).ok());
  EXPECT_EQ(o.memory_quota_bytes, uint64_t{3} << 30);
  ScopedEnv bad("GRADLINK_JOB_MEMORY", "lots");
  SchedulerOptions b;
  const Status st = ApplyEnvironment(&b);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("GRADLINK_JOB_MEMORY"), std::string::npos) << st.ToString();
}

TEST(EnvTest, StallInspectorTakesGradlinksAndHorovodsNames) {
  EXPECT_EQ(SchedulerOptions{}.stall_check, std::chrono::seconds(60));  // Horovod's default
  EXPECT_EQ(SchedulerOptions{}.stall_shutdown, std::chrono::seconds(0));
  {
    ScopedEnv h("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
        s("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120");
    SchedulerOptions o;
    ServerOptions v;
    ASSERT_TRUE(ApplyEnvironment(&o).ok() && ApplyEnvironment(&v).ok());
    EXPECT_EQ(o.stall_check, std::chrono::seconds(30));
    EXPECT_EQ(v.stall_check, std::chrono::seconds(30));
    EXPECT_EQ(o.stall_shutdown, std::chrono::seconds(120));
    // gradlink's names win over Horovod's.
    ScopedEnv g("GRADLINK_STALL_CHECK_SECONDS", "2.5"), t("GRADLINK_STALL_SHUTDOWN_SECONDS", "9");
    SchedulerOptions p;
    ASSERT_TRUE(ApplyEnvironment(&p).ok());
    EXPECT_EQ(p.stall_check, std::chrono::milliseconds(2500));
    EXPECT_EQ(p.stall_shutdown, std::chrono::seconds(9));
  }
  {
    ScopedEnv d("HOROVOD_STALL_CHECK_DISABLE", "1");
    SchedulerOptions o;
    ASSERT_TRUE(ApplyEnvironment(&o).ok());
    EXPECT_EQ(o.stall_check.count(), 0);
  }
  ScopedEnv bad("GRADLINK_STALL_CHECK_SECONDS", "soon");
  SchedulerOptions o;
  const Status st = ApplyEnvironment(&o);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("GRADLINK_STALL_CHECK_SECONDS"), std::string::npos);
}

}  // namespace
}  // namespace gradlink
