// metrics/exposition.h and metrics/http_server.h: the text format, and the server's bounds.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <pthread.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "metrics/exposition.h"
#include "metrics/histogram.h"
#include "metrics/process.h"
#include "metrics/http_server.h"

namespace gradlink::metrics {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

Families Sample() {
  Families f;
  Family& c = Add(f, "gradlink_pushed_bytes_total", "Bytes pushed.\nTo servers \\ all.", "counter");
  c.samples.push_back({{{"job", "a\"b\\c\nd"}, {"role", "worker"}}, 1234567890123.0, ""});
  Family& g = Add(f, "gradlink_in_flight_bytes", "Bytes in flight.", "gauge");
  g.samples.push_back({{}, 0.5, ""});
  g.samples.push_back({{{"x", "inf"}}, std::numeric_limits<double>::infinity(), ""});
  g.samples.push_back({{{"x", "nan"}}, std::nan(""), ""});
  Family& h = Add(f, "gradlink_round_seconds", "Round latency.", "histogram");
  AddHistogram(h, {{"job", "a"}}, {0.001, 0.01}, {2, 3, 1}, 0.042);
  return f;
}

TEST(ExpositionTest, WritesHelpTypeEscapesAndValuesAsPrometheusReadsThem) {
  const std::string text = Render(Sample());
  EXPECT_NE(text.find("# HELP gradlink_pushed_bytes_total Bytes pushed.\\nTo servers \\\\ all.\n"
                      "# TYPE gradlink_pushed_bytes_total counter\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("gradlink_pushed_bytes_total{job=\"a\\\"b\\\\c\\nd\",role=\"worker\"} "
                      "1234567890123\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("gradlink_in_flight_bytes 0.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("gradlink_in_flight_bytes{x=\"inf\"} +Inf\n"), std::string::npos);
  EXPECT_NE(text.find("gradlink_in_flight_bytes{x=\"nan\"} NaN\n"), std::string::npos);
  // Histogram buckets are cumulative, +Inf equals _count.
  EXPECT_NE(text.find("gradlink_round_seconds_bucket{job=\"a\",le=\"0.001\"} 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("gradlink_round_seconds_bucket{job=\"a\",le=\"0.01\"} 5\n"),
            std::string::npos);
  EXPECT_NE(text.find("gradlink_round_seconds_bucket{job=\"a\",le=\"+Inf\"} 6\n"),
            std::string::npos);
  EXPECT_NE(text.find("gradlink_round_seconds_count{job=\"a\"} 6\n"), std::string::npos);
  EXPECT_NE(text.find("gradlink_round_seconds_sum{job=\"a\"} 0.042"), std::string::npos);
}

TEST(ExpositionTest, ABadNameIsLeftOutNotABrokenScrape) {
  Families f;
  Add(f, "9starts_with_a_digit", "x", "counter").samples.push_back({{}, 1, ""});
  Add(f, "good", "x", "counter").samples.push_back({{{"__reserved", "v"}}, 1, ""});
  Add(f, "bad_type", "x", "summary-ish").samples.push_back({{}, 1, ""});
  Add(f, "fine_total", "x", "counter").samples.push_back({{{"le_ok", "v"}}, 2, ""});
  const std::string text = Render(f);
  EXPECT_NE(text.rfind("# gradlink: family '9starts_with_a_digit' left out", 0), std::string::npos)
      << text;
  EXPECT_EQ(text.find("\n9starts"), std::string::npos) << text;
  EXPECT_EQ(text.find("\ngood"), std::string::npos) << text;
  EXPECT_EQ(text.find("\nbad_type "), std::string::npos) << text;
  EXPECT_NE(text.find("fine_total{le_ok=\"v\"} 2\n"), std::string::npos) << text;
  EXPECT_TRUE(CheckName("a:b_c9"));
  EXPECT_FALSE(CheckName("a:b", /*label=*/true));
  EXPECT_FALSE(CheckName(""));
}

// Prometheus' own linter, where it is installed (Debian's prometheus package).
TEST(ExpositionTest, PromtoolChecksTheText) {
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool is not installed (apt-get install prometheus)";
  }
  char path[] = "/tmp/gl_metrics_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << Render(Sample());
  const std::string cmd = std::string("promtool check metrics < ") + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[256];
  while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int rc = pclose(p);
  unlink(path);
  EXPECT_EQ(rc, 0) << out;
}

// ---- The server ------------------------------------------------------------------------------

int Connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `request`, reads until the server closes (or `limit`): the response, or "" on timeout.
std::string Ask(uint16_t port, const std::string& request, milliseconds limit = milliseconds(3000)) {
  const int fd = Connect(port);
  if (fd < 0) return "connect failed";
  if (!request.empty()) send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  const auto end = SteadyClock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(end - SteadyClock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) break;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

std::unique_ptr<HttpServer> Serve(HttpConfig config = {}) {
  config.host = "127.0.0.1";
  auto s = HttpServer::Start(config, {{"/metrics", {std::string(kContentType), [] {
                                           return Render(Sample());
                                         }}}});
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(HttpServerTest, AnswersAGetOfMetricsAndRefusesTheRest) {
  auto s = Serve();
  ASSERT_NE(s, nullptr);
  ASSERT_NE(s->port(), 0);
  const std::string ok = Ask(s->port(), "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(ok.find("# TYPE gradlink_pushed_bytes_total counter"), std::string::npos);
  EXPECT_EQ(Ask(s->port(), "POST /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0), 0u);
  EXPECT_EQ(Ask(s->port(), "GET /secrets HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(Ask(s->port(), "garbage\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(Ask(s->port(), std::string(9000, 'a')).rfind("HTTP/1.1 400", 0), 0u);
  const HttpStats st = s->stats();
  EXPECT_EQ(st.requests, 1u);
  EXPECT_EQ(st.refused, 4u);
}

TEST(HttpServerTest, ARequestThatNeverCompletesIsClosedAtItsDeadline) {
  HttpConfig c;
  c.request_timeout = milliseconds(300);
  auto s = Serve(c);
  ASSERT_NE(s, nullptr);
  const auto t0 = SteadyClock::now();
  const std::string out = Ask(s->port(), "GET /metrics HTTP/1.1\r\n", milliseconds(3000));
  const auto took = SteadyClock::now() - t0;
  EXPECT_EQ(out, "");  // closed with no answer
  EXPECT_GE(took, milliseconds(250));
  EXPECT_LT(took, milliseconds(2000));
  EXPECT_EQ(s->stats().timed_out, 1u);
}

TEST(HttpServerTest, AThousandIdleConnectionsDoNotKeepAScrapeOut) {
  HttpConfig c;
  c.max_connections = 64;
  auto s = Serve(c);
  ASSERT_NE(s, nullptr);
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    const int fd = Connect(s->port());
    if (fd >= 0) idle.push_back(fd);
  }
  EXPECT_GE(idle.size(), 900u);
  const auto t0 = SteadyClock::now();
  const std::string ok = Ask(s->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK", 0), 0u) << ok.substr(0, 200);
  EXPECT_LT(SteadyClock::now() - t0, milliseconds(1500));
  EXPECT_GE(s->stats().evicted, idle.size() - 64);
  for (int fd : idle) close(fd);
}

TEST(HttpServerTest, APortTakenFailsAtStartNamingIt) {
  auto first = Serve();
  ASSERT_NE(first, nullptr);
  HttpConfig c;
  c.host = "127.0.0.1";
  c.port = first->port();
  auto second = HttpServer::Start(c, {});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(std::to_string(first->port())), std::string::npos)
      << second.status().ToString();
  EXPECT_NE(second.status().message().find("taken"), std::string::npos)
      << second.status().ToString();
}

// A family's reference stays good while more are added: the roles fill two families in one
// loop (summed and sent bytes by dtype). Over a vector the first one's samples went to freed
// memory and vanished from the scrape.
TEST(ExpositionTest, AFamilyTakesSamplesAfterOthersWereAdded) {
  Families f;
  Family& first = Add(f, "gradlink_first_bytes_total", "First.", "counter");
  for (int i = 0; i < 1000; ++i) {
    Add(f, "gradlink_other_" + std::to_string(i) + "_total", "Other.", "counter");
  }
  first.Put({{"dtype", "fp32"}}, 42);
  EXPECT_NE(Render(f).find("gradlink_first_bytes_total{dtype=\"fp32\"} 42"), std::string::npos);
}

TEST(HistogramTest, BucketsAreCumulativeAndTheSumIsKept) {
  Histogram h;
  for (double v : {30e-6, 50e-6, 0.002, 0.002, 5.0, 100.0}) h.Observe(v);
  EXPECT_EQ(h.count(), 6u);
  Families f;
  h.AddTo(Add(f, "gradlink_round_seconds", "Rounds.", "histogram"), {{"job", "a"}});
  const std::string text = Render(f);
  // 50 us is in its own bucket (le is inclusive); 100 s only in +Inf.
  EXPECT_NE(text.find("gradlink_round_seconds_bucket{job=\"a\",le=\"5e-05\"} 2"),
            std::string::npos) << text;
  EXPECT_NE(text.find("le=\"0.0025\"} 4"), std::string::npos) << text;
  EXPECT_NE(text.find("le=\"10\"} 5"), std::string::npos) << text;
  EXPECT_NE(text.find("le=\"60\"} 5"), std::string::npos) << text;
  EXPECT_NE(text.find("le=\"+Inf\"} 6"), std::string::npos) << text;
  EXPECT_NE(text.find("gradlink_round_seconds_count{job=\"a\"} 6"), std::string::npos) << text;
  EXPECT_NE(text.find("gradlink_round_seconds_sum{job=\"a\"} 105.00408"), std::string::npos)
      << text;
}

TEST(ProcessTest, ThreadsAreFoundByNameWithTheirCpu) {
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    pthread_setname_np(pthread_self(), "gl-test-busy");
    const auto end = SteadyClock::now() + milliseconds(300);
    volatile uint64_t x = 0;
    while (SteadyClock::now() < end) x = x + 1;
    while (!stop.load()) std::this_thread::sleep_for(milliseconds(1));
  });
  std::this_thread::sleep_for(milliseconds(400));
  const std::vector<ThreadCpu> found = ThreadsCpu("gl-test-");
  stop = true;
  busy.join();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].name, "gl-test-busy");
  EXPECT_GT(found[0].seconds, 0.1);  // it spun for 0.3 s
  EXPECT_GT(ProcessCpuSeconds(), found[0].seconds - 0.02);
  EXPECT_GT(ResidentBytes(), 1e6);
}

}  // namespace
}  // namespace gradlink::metrics
