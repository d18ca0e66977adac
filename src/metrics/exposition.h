// Metrics in Prometheus' text exposition format (version 0.0.4): what a process serves on
// /metrics (metrics/http_server.h).
//
//   metrics::Families f;
//   metrics::Family& pushed = metrics::Add(f, "gradlink_pushed_bytes_total",
//                                          "Bytes this worker pushed to servers.", "counter");
//   pushed.samples.push_back({{{"job", "lm"}, {"role", "worker"}}, 1.5e9});
//   std::string text = metrics::Render(f);
//
// A family is a name, a HELP text, a TYPE (counter, gauge, histogram, untyped) and its samples;
// a histogram's samples come from AddHistogram (cumulative `le` buckets, _sum, _count). Render
// writes HELP and TYPE once per family, escapes label values and HELP texts as the format
// requires, and writes values as Prometheus reads them (+Inf, -Inf, NaN; integers exactly).
// Names and label names are checked (CheckName): a bad one is a programming error, reported by
// Render as a comment line and the family left out, never a broken scrape.
//
// Threads: plain values; callers build them per scrape.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gradlink::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

// `labels` with one more.
inline Labels With(Labels labels, std::string name, std::string value) {
  labels.emplace_back(std::move(name), std::move(value));
  return labels;
}

struct Sample {
  Labels labels;
  double value = 0;
  std::string suffix;  // appended to the family's name: "_bucket", "_sum", "_count" (histograms)
};

struct Family {
  std::string name;
  std::string help;
  std::string type;  // "counter", "gauge", "histogram" or "untyped"
  std::vector<Sample> samples;

  // Adds one sample (not a histogram's: AddHistogram).
  Family& Put(Labels labels, double value) {
    samples.push_back({std::move(labels), value, ""});
    return *this;
  }
};

// A process's families, in the order they are rendered. A deque: the reference Add returns
// stays valid while more families are added (a vector's would not).
using Families = std::deque<Family>;

// Appends a family and returns it (for its samples).
Family& Add(Families& families, std::string name, std::string help, std::string type);

// A family of one sample: the most common shape.
inline void AddCounter(Families& families, std::string name, std::string help,
                       const Labels& labels, double value) {
  Add(families, std::move(name), std::move(help), "counter").Put(labels, value);
}
inline void AddGauge(Families& families, std::string name, std::string help,
                     const Labels& labels, double value) {
  Add(families, std::move(name), std::move(help), "gauge").Put(labels, value);
}

// A histogram's samples for `labels`: `bounds` ascending (upper bounds; +Inf is added), `counts`
// one per bound plus one for +Inf (not cumulative: how many observations fell in each), and the
// sum of the observations.
void AddHistogram(Family& family, const Labels& labels, const std::vector<double>& bounds,
                  const std::vector<uint64_t>& counts, double sum);

// Whether `name` is a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), or, with `label`, a valid
// label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with "__").
bool CheckName(std::string_view name, bool label = false);

// The exposition text of `families`, in their order.
std::string Render(const Families& families);

// The content type Render's text is served with.
inline constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace gradlink::metrics
