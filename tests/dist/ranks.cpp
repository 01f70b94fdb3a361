#include "ranks.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace kt_dist_test {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::vector<RankResult> run_ranks(const std::string& scenario, int world, double deadline_s) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_dist_XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  std::vector<RankResult> results(static_cast<size_t>(world));
  if (!mkdtemp(buf.data())) {
    for (auto& r : results) r.output = "mkdtemp failed";
    return results;
  }
  const std::string dir(buf.data());
  std::vector<pid_t> pids(static_cast<size_t>(world), -1);
  for (int r = 0; r < world; ++r) {
    const std::string log = dir + "/rank" + std::to_string(r) + ".log";
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      const std::string rank = std::to_string(r), w = std::to_string(world);
      execl("/proc/self/exe", "kt_test_dist", "--rank", scenario.c_str(), rank.c_str(), w.c_str(), dir.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_s);
  int left = world;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      pid_t& pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) != pid) continue;
      RankResult& res = results[static_cast<size_t>(r)];
      if (WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) res.signal = WTERMSIG(status);
      pid = -1;
      --left;
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      for (int r = 0; r < world; ++r) {
        pid_t& pid = pids[static_cast<size_t>(r)];
        if (pid <= 0) continue;
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        results[static_cast<size_t>(r)].killed_at_deadline = true;
        pid = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world; ++r)
    results[static_cast<size_t>(r)].output = read_file(dir + "/rank" + std::to_string(r) + ".log");
  const std::string rm = "rm -rf '" + dir + "'";
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir.c_str());
  return results;
}

}  // namespace kt_dist_test
