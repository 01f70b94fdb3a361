// A minimal streaming JSON writer: objects, arrays, strings, numbers, null.
#ifndef KT_BENCH_JSON_WRITER_H_
#define KT_BENCH_JSON_WRITER_H_

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace kt_bench {

class JsonWriter {
 public:
  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  JsonWriter& key(const std::string& k) {
    separate();
    out_ += quote(k) + ": ";
    after_key_ = true;
    return *this;
  }
  void value(const std::string& v) { scalar(quote(v)); }
  void value(const char* v) { scalar(quote(v)); }
  void value(bool v) { scalar(v ? "true" : "false"); }
  void value(int v) { scalar(std::to_string(v)); }
  void value(int64_t v) { scalar(std::to_string(v)); }
  // Non-finite numbers (a measurement that did not happen) become null.
  void value(double v) {
    if (!std::isfinite(v)) return null();
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%.6g", v);
    scalar(buffer);
  }
  void null() { scalar("null"); }
  const std::string& str() const { return out_; }

 private:
  static std::string quote(const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buffer[8];
        std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
        q += buffer;
      } else {
        q += c;
      }
    }
    return q + "\"";
  }
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (!first_.empty()) {
      if (!first_.back()) out_ += ", ";
      first_.back() = false;
    }
  }
  void scalar(const std::string& text) {
    separate();
    out_ += text;
  }
  void open(char c) {
    separate();
    out_ += c;
    first_.push_back(true);
  }
  void close(char c) {
    first_.pop_back();
    out_ += c;
  }
  std::string out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

}  // namespace kt_bench

#endif  // KT_BENCH_JSON_WRITER_H_
