#pragma once
// A strict reader of the Prometheus text exposition format (version 0.0.4) for the tests: every
// line a HELP, a TYPE or a sample `name{label="value",...} value`; every sample of a family
// that has HELP and TYPE lines before it (a histogram's `_bucket`, `_sum` and `_count` samples
// belong to the histogram's family). Throws std::runtime_error naming the line.
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace baton::test {

struct PromSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PromText {
  std::vector<PromSample> samples;
  std::map<std::string, std::string> types;  // family -> counter, gauge, ...
  std::map<std::string, std::string> help;

  /// The samples of `name` whose labels include `match`.
  std::vector<PromSample> find(const std::string& name, const std::map<std::string, std::string>& match = {}) const {
    std::vector<PromSample> out;
    for (const auto& s : samples) {
      if (s.name != name) continue;
      bool ok = true;
      for (const auto& [k, v] : match) {
        auto it = s.labels.find(k);
        ok = ok && it != s.labels.end() && it->second == v;
      }
      if (ok) out.push_back(s);
    }
    return out;
  }
};

inline bool prom_name_char(char c, bool first) {
  return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (!first && c >= '0' && c <= '9');
}

/// The family a sample belongs to: its own name, or for a histogram's `_bucket`, `_sum` and
/// `_count` samples (a summary's `_sum` and `_count`) the histogram's (the summary's).
inline std::string prom_family(const PromText& text, const std::string& sample) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string_view sv(suffix);
    if (sample.size() <= sv.size() || sample.compare(sample.size() - sv.size(), sv.size(), sv) != 0) continue;
    const std::string base = sample.substr(0, sample.size() - sv.size());
    const auto type = text.types.find(base);
    if (type == text.types.end()) continue;
    if (type->second == "histogram" || (type->second == "summary" && sv != "_bucket")) return base;
  }
  return sample;
}

inline PromText parse_prometheus(const std::string& text) {
  PromText out;
  std::size_t line_no = 0, pos = 0;
  auto fail = [&](const std::string& why, const std::string& line) {
    throw std::runtime_error("line " + std::to_string(line_no) + ": " + why + ": '" + line + "'");
  };
  auto read_name = [&](const std::string& line, std::size_t& i) {
    const std::size_t start = i;
    while (i < line.size() && prom_name_char(line[i], i == start)) ++i;
    if (i == start) fail("a metric or label name was expected", line);
    return line.substr(start, i - start);
  };
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) fail("the last line has no line feed", text.substr(pos));
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::size_t i = 1;
      while (i < line.size() && line[i] == ' ') ++i;
      const bool is_help = line.compare(i, 5, "HELP ") == 0, is_type = line.compare(i, 5, "TYPE ") == 0;
      if (!is_help && !is_type) continue;  // a comment
      i += 5;
      const std::string name = read_name(line, i);
      if (i >= line.size() || line[i] != ' ') fail("HELP / TYPE needs a name and a text", line);
      const std::string rest = line.substr(i + 1);
      if (is_type) {
        static const std::set<std::string> types = {"counter", "gauge", "histogram", "summary", "untyped"};
        if (!types.count(rest)) fail("unknown type", line);
        if (out.types.count(name)) fail("a second TYPE line for " + name, line);
        out.types[name] = rest;
      } else {
        out.help[name] = rest;
      }
      continue;
    }
    PromSample s;
    std::size_t i = 0;
    s.name = read_name(line, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const std::string key = read_name(line, i);
        if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') fail("label=\"value\" expected", line);
        i += 2;
        std::string value;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            if (i + 1 >= line.size()) fail("a dangling backslash", line);
            const char e = line[i + 1];
            if (e == 'n') value += '\n';
            else if (e == '\\' || e == '"') value += e;
            else fail("an unknown escape", line);
            i += 2;
          } else {
            value += line[i++];
          }
        }
        if (i >= line.size()) fail("an unterminated label value", line);
        ++i;  // the closing quote
        if (s.labels.count(key)) fail("label " + key + " twice", line);
        s.labels[key] = value;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) fail("an unterminated label set", line);
      ++i;  // }
    }
    if (i >= line.size() || line[i] != ' ') fail("a space before the value was expected", line);
    const std::string value_text = line.substr(i + 1, line.find(' ', i + 1) - (i + 1));
    if (value_text == "NaN") {
      s.value = NAN;
    } else if (value_text == "+Inf") {
      s.value = INFINITY;
    } else if (value_text == "-Inf") {
      s.value = -INFINITY;
    } else {
      char* stop = nullptr;
      s.value = std::strtod(value_text.c_str(), &stop);
      if (value_text.empty() || *stop != '\0') fail("not a number: " + value_text, line);
    }
    const std::string family = prom_family(out, s.name);
    if (!out.types.count(family) || !out.help.count(family)) fail("a sample before its family's HELP and TYPE", line);
    if (s.name == family + "_bucket" && !s.labels.count("le")) fail("a histogram bucket without its le label", line);
    out.samples.push_back(std::move(s));
  }
  return out;
}

}  // namespace baton::test
