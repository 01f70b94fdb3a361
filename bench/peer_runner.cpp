#include "peer_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "bench_common.h"
#include "torch_runner.h"

namespace kt_bench {

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

PeerProcess::PeerProcess(const std::string& python, const std::string& script, int threads,
                         const std::string& log_path, const std::vector<std::string>& script_args)
    : log_path_(log_path) {
  if (access(python.c_str(), X_OK) != 0) {
    reason_ = python + " not found";
    return;
  }
  if (access(script.c_str(), R_OK) != 0) {
    reason_ = "script " + script + " not found";
    return;
  }
  // A peer that dies mid-command must not take kt_bench with it.
  signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) {
    reason_ = "cannot create pipes";
    return;
  }
  const std::string threads_arg = std::to_string(threads);
  std::vector<char*> argv = {const_cast<char*>(python.c_str()), const_cast<char*>(script.c_str()),
                             const_cast<char*>("--threads"), const_cast<char*>(threads_arg.c_str())};
  for (const std::string& a : script_args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) dup2(log, 2);
    for (int fd = 3; fd < 1024; ++fd) close(fd);
    execv(python.c_str(), argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  if (pid_ < 0) {
    close(in[1]);
    close(out[0]);
    reason_ = "cannot fork";
    return;
  }
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  Fields hello;
  std::string error;
  if (!ask({}, &hello, &error)) {
    reason_ = python + " " + script + " did not start: " + error;
    return;
  }
  hello_ = hello;
}

PeerProcess::~PeerProcess() {
  if (pid_ <= 0) return;
  if (to_) {
    std::fputs("{\"cmd\": \"quit\"}\n", to_);
    std::fflush(to_);
    std::fclose(to_);
  }
  if (from_) std::fclose(from_);
  int status = 0;
  waitpid(pid_, &status, 0);
}

std::string PeerProcess::said(const std::string& key) const {
  const auto it = hello_.find(key);
  return it == hello_.end() ? std::string() : it->second;
}

std::string PeerProcess::last_log_line() const {
  std::ifstream log(log_path_);
  std::string line, last;
  while (std::getline(log, line))
    if (!line.empty()) last = line;
  return last;
}

bool PeerProcess::ask(const Fields& command, Fields* reply, std::string* error) {
  if (pid_ <= 0 || !to_ || !from_) {
    *error = reason_.empty() ? "the peer process is not running" : reason_;
    return false;
  }
  if (!command.empty()) {
    std::string line = "{";
    for (const auto& kv : command)
      line += (line.size() > 1 ? ", \"" : "\"") + json_escape(kv.first) + "\": \"" + json_escape(kv.second) + "\"";
    line += "}\n";
    if (std::fputs(line.c_str(), to_) < 0 || std::fflush(to_) != 0) {
      *error = "the peer process exited (" + last_log_line() + ")";
      return false;
    }
  }
  std::string line;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), from_)) {
    line += buffer;
    if (!line.empty() && line.back() == '\n') break;
  }
  reply->clear();
  if (line.empty() || !parse_flat_json_object(line, reply)) {
    *error = "the peer process exited or replied no JSON (its last words: " + last_log_line() + ")";
    to_ = nullptr;  // it is gone: no further command
    return false;
  }
  if (reply->count("error")) {
    *error = (*reply)["error"];
    return false;
  }
  return true;
}

double PeerProcess::seconds_of(const Fields& command, std::string* error) {
  Fields reply;
  if (!ask(command, &reply, error)) return -1;
  if (!reply.count("s")) {
    *error = reply.count("reason") ? reply["reason"] : "no time in the reply";
    return -1;
  }
  return std::atof(reply["s"].c_str());
}

bool write_layer_for_peer(const std::string& dir, const LayerWeights& layer, const std::vector<Workload>& work,
                          std::string* error) {
  const auto write = [&](const std::string& name, const void* data, size_t bytes) {
    std::ofstream f(dir + "/" + name, std::ios::binary);
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    if (!f) *error = "cannot write " + dir + "/" + name;
    return static_cast<bool>(f);
  };
  if (!write("gate.bf16", layer.gate.dl()->data, static_cast<size_t>(layer.gate.numel()) * 2) ||
      !write("up.bf16", layer.up.dl()->data, static_cast<size_t>(layer.up.numel()) * 2) ||
      !write("down.bf16", layer.down.dl()->data, static_cast<size_t>(layer.down.numel()) * 2))
    return false;
  for (const Workload& w : work) {
    const std::string t = std::to_string(w.tokens);
    std::ofstream ids(dir + "/ids_" + t + ".i32", std::ios::binary), rw(dir + "/rw_" + t + ".f32", std::ios::binary),
        x(dir + "/x_" + t + ".bf16", std::ios::binary);
    for (const Batch& b : w.batches) {
      ids.write(static_cast<const char*>(b.ids.dl()->data), static_cast<std::streamsize>(b.ids.numel() * 4));
      rw.write(static_cast<const char*>(b.route_weights.dl()->data),
               static_cast<std::streamsize>(b.route_weights.numel() * 4));
      x.write(static_cast<const char*>(b.x.dl()->data), static_cast<std::streamsize>(b.x.numel() * 2));
    }
    if (!ids || !rw || !x) {
      *error = "cannot write the batches of T=" + t + " to " + dir;
      return false;
    }
  }
  return true;
}

std::vector<double> reference_y(const LayerWeights& layer, const Batch& b, int64_t rows) {
  const int64_t H = layer.shape.hidden, I = layer.shape.intermediate, k = layer.shape.top_k;
  const uint16_t* x = static_cast<const uint16_t*>(b.x.dl()->data);
  const int32_t* ids = static_cast<const int32_t*>(b.ids.dl()->data);
  const float* rw = static_cast<const float*>(b.route_weights.dl()->data);
  const uint16_t* gate = layer.gate.u16();
  const uint16_t* up = layer.up.u16();
  const uint16_t* down = layer.down.u16();
  std::vector<double> y(static_cast<size_t>(rows * H), 0.0), xt(static_cast<size_t>(H)), h(static_cast<size_t>(I));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < H; ++c) xt[static_cast<size_t>(c)] = from_bf16(x[t * H + c]);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      if (e < 0) continue;
      for (int64_t i = 0; i < I; ++i) {
        const uint16_t* g = gate + (e * I + i) * H;
        const uint16_t* u = up + (e * I + i) * H;
        double sg = 0, su = 0;
        for (int64_t c = 0; c < H; ++c) {
          sg += from_bf16(g[c]) * xt[static_cast<size_t>(c)];
          su += from_bf16(u[c]) * xt[static_cast<size_t>(c)];
        }
        h[static_cast<size_t>(i)] = sg / (1 + std::exp(-sg)) * su;
      }
      const double weight = rw[t * k + j];
      for (int64_t c = 0; c < H; ++c) {
        const uint16_t* d = down + (e * H + c) * I;
        double s = 0;
        for (int64_t i = 0; i < I; ++i) s += from_bf16(d[i]) * h[static_cast<size_t>(i)];
        y[static_cast<size_t>(t * H + c)] += weight * s;
      }
    }
  }
  return y;
}

double rel_l2_to(const float* got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace kt_bench
