#include "torch_runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace kt_bench {

namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void skip_space(const std::string& s, size_t& i) {
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
}

bool parse_string(const std::string& s, size_t& i, std::string* out) {
  if (i >= s.size() || s[i] != '"') return false;
  ++i;
  out->clear();
  while (i < s.size() && s[i] != '"') {
    char c = s[i++];
    if (c == '\\') {
      if (i >= s.size()) return false;
      const char e = s[i++];
      switch (e) {
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        case 'r': c = '\r'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'u':  // non-ASCII does not occur in the values read here
          if (i + 4 > s.size()) return false;
          i += 4;
          c = '?';
          break;
        default: c = e;
      }
    }
    *out += c;
  }
  if (i >= s.size()) return false;
  ++i;
  return true;
}

// Runs `command` and collects its JSON lines: the {"torch": version} header
// and one {"case", <index_key>, "ms" | "error"} per measurement.
void read_json_lines(const std::string& command, const std::string& python, const char* index_key, TorchRun* run) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) {
    run->reason = "cannot start " + python;
    return;
  }
  std::string line;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe)) {
    line += buffer;
    if (line.empty() || line.back() != '\n') continue;
    std::map<std::string, std::string> fields;
    if (parse_flat_json_object(line, &fields)) {
      if (fields.count("torch")) {
        run->version = fields["torch"];
        run->threads = std::atoi(fields["threads"].c_str());
      } else if (fields.count("case") && fields.count(index_key)) {
        const auto key = std::make_pair(fields["case"], static_cast<int64_t>(std::atoll(fields[index_key].c_str())));
        if (fields.count("ms")) run->seconds[key] = std::atof(fields["ms"].c_str()) / 1e3;
        else run->errors[key] = fields["error"];
      }
    }
    line.clear();
  }
  const int status = pclose(pipe);
  run->ran = !run->version.empty();
  if (status != 0) run->reason = "torch baseline exited with status " + std::to_string(status);
}

}  // namespace

bool parse_flat_json_object(const std::string& line, std::map<std::string, std::string>* out) {
  size_t i = 0;
  skip_space(line, i);
  if (i >= line.size() || line[i] != '{') return false;
  ++i;
  skip_space(line, i);
  if (i < line.size() && line[i] == '}') return true;
  while (i < line.size()) {
    std::string key, value;
    skip_space(line, i);
    if (!parse_string(line, i, &key)) return false;
    skip_space(line, i);
    if (i >= line.size() || line[i] != ':') return false;
    ++i;
    skip_space(line, i);
    if (i < line.size() && line[i] == '"') {
      if (!parse_string(line, i, &value)) return false;
    } else {
      const size_t start = i;
      while (i < line.size() && line[i] != ',' && line[i] != '}' && !std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      value = line.substr(start, i - start);
      if (value.empty()) return false;
    }
    (*out)[key] = value;
    skip_space(line, i);
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    return i < line.size() && line[i] == '}';
  }
  return false;
}

std::string torch_unavailable_reason(const std::string& python) {
  if (access(python.c_str(), X_OK) != 0) return python + " not found";
  const std::string command = shell_quote(python) + " -c 'import torch' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return "cannot start " + python;
  std::string output;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  const int status = pclose(pipe);
  if (status == 0) return "";
  // The last line of the traceback says what is missing.
  while (!output.empty() && output.back() == '\n') output.pop_back();
  const size_t nl = output.rfind('\n');
  return python + " cannot import torch: " + (nl == std::string::npos ? output : output.substr(nl + 1));
}

TorchRun run_torch_baseline(const std::string& python, const std::string& script, const LayerWeights& layer,
                            const std::vector<Workload>& workloads, const std::vector<Case>& cases, int threads,
                            int warmup, int reps) {
  TorchRun run;
  if (access(script.c_str(), R_OK) != 0) {
    run.reason = "script " + script + " not found";
    return run;
  }
  // The routing goes over as raw files: the same batches kt ran on.
  char dir_template[] = "/tmp/kt_bench_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (!dir) {
    run.reason = "cannot create a temporary directory";
    return run;
  }
  std::vector<std::string> files;
  std::string tokens;
  for (const Workload& w : workloads) {
    const std::string ids_path = std::string(dir) + "/ids_" + std::to_string(w.tokens) + ".i32";
    const std::string rw_path = std::string(dir) + "/rw_" + std::to_string(w.tokens) + ".f32";
    std::ofstream ids(ids_path, std::ios::binary), rw(rw_path, std::ios::binary);
    for (const Batch& b : w.batches) {
      ids.write(reinterpret_cast<const char*>(b.ids.i32()), static_cast<std::streamsize>(b.ids.numel() * 4));
      rw.write(reinterpret_cast<const char*>(b.route_weights.f32()), static_cast<std::streamsize>(b.route_weights.numel() * 4));
    }
    files.push_back(ids_path);
    files.push_back(rw_path);
    tokens += (tokens.empty() ? "" : ",") + std::to_string(w.tokens);
  }
  std::string case_list;
  for (Case c : cases) case_list += (case_list.empty() ? "" : ",") + std::string(case_key(c));
  std::ostringstream command;
  command << shell_quote(python) << ' ' << shell_quote(script) << " --hidden " << layer.shape.hidden
          << " --intermediate " << layer.shape.intermediate << " --experts " << layer.experts << " --top-k "
          << layer.shape.top_k << " --tokens " << tokens << " --cases " << case_list << " --batch-dir "
          << shell_quote(dir) << " --threads " << threads << " --warmup " << warmup << " --reps " << reps;
  read_json_lines(command.str(), python, "tokens", &run);
  for (const std::string& f : files) std::remove(f.c_str());
  rmdir(dir);
  return run;
}

TorchRun run_torch_optimizer_baseline(const std::string& python, const std::string& script, const ModelShape& shape,
                                      const std::vector<int64_t>& experts, int threads, int warmup, int reps) {
  TorchRun run;
  if (access(script.c_str(), R_OK) != 0) {
    run.reason = "script " + script + " not found";
    return run;
  }
  std::string list;
  for (int64_t e : experts) list += (list.empty() ? "" : ",") + std::to_string(e);
  std::ostringstream command;
  command << shell_quote(python) << ' ' << shell_quote(script) << " --hidden " << shape.hidden << " --intermediate "
          << shape.intermediate << " --experts " << list << " --threads " << threads << " --warmup " << warmup
          << " --reps " << reps;
  read_json_lines(command.str(), python, "experts", &run);
  return run;
}

}  // namespace kt_bench
