// metrics/exposition.h: Prometheus' text format.
#include "metrics/exposition.h"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <limits>

namespace gradlink::metrics {
namespace {

// HELP texts escape backslash and newline; label values also the double quote.
void Escape(std::string& out, std::string_view s, bool quote) {
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

void Value(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    out += std::to_string(static_cast<int64_t>(v));  // integers exactly, as counters mostly are
  } else {
    // The shortest form that reads back as the same double (0.1, not 0.10000000000000001).
    char buf[32];
    for (int digits = 6; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
    out += buf;
  }
}

}  // namespace

Family& Add(Families& families, std::string name, std::string help, std::string type) {
  families.push_back({std::move(name), std::move(help), std::move(type), {}});
  return families.back();
}

void AddHistogram(Family& family, const Labels& labels, const std::vector<double>& bounds,
                  const std::vector<uint64_t>& counts, double sum) {
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    total += i < counts.size() ? counts[i] : 0;
    Labels l = labels;
    std::string le;
    if (i < bounds.size()) {
      Value(le, bounds[i]);
    } else {
      le = "+Inf";
    }
    l.emplace_back("le", le);
    family.samples.push_back({std::move(l), static_cast<double>(total), "_bucket"});
  }
  family.samples.push_back({labels, sum, "_sum"});
  family.samples.push_back({labels, static_cast<double>(total), "_count"});
}

bool CheckName(std::string_view name, bool label) {
  if (name.empty()) return false;
  if (label && name.size() >= 2 && name[0] == '_' && name[1] == '_') return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (!label && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string Render(const Families& families) {
  std::string out;
  for (const Family& f : families) {
    bool ok = CheckName(f.name) && (f.type == "counter" || f.type == "gauge" ||
                                    f.type == "histogram" || f.type == "untyped");
    for (const Sample& s : f.samples) {
      for (const auto& [k, v] : s.labels) ok = ok && CheckName(k, true);
    }
    if (!ok) {
      out += "# gradlink: family '";
      Escape(out, f.name, false);
      out += "' left out: an invalid name, label name or type\n";
      continue;
    }
    out += "# HELP " + f.name + " ";
    Escape(out, f.help, false);
    out += "\n# TYPE " + f.name + " " + f.type + "\n";
    for (const Sample& s : f.samples) {
      out += f.name;
      out += s.suffix;
      if (!s.labels.empty()) {
        out += '{';
        for (size_t i = 0; i < s.labels.size(); ++i) {
          if (i) out += ',';
          out += s.labels[i].first + "=\"";
          Escape(out, s.labels[i].second, true);
          out += '"';
        }
        out += '}';
      }
      out += ' ';
      Value(out, s.value);
      out += '\n';
    }
  }
  return out;
}

}  // namespace gradlink::metrics
