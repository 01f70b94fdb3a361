// Multi-process tests of src/dist: a test starts N copies of its own program
// as ranks (`<program> --rank <scenario> <rank> <world> <dir>`), each of
// which runs one scenario against a Gloo communicator on loopback (its file
// store in <dir>) and exits 0 when every check held. The test waits for all
// of them with a deadline, kills what is left when it passes, and reports
// each rank's exit and output.
#pragma once

#include <string>
#include <vector>

namespace kt_dist_test {

struct RankResult {
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal ended it
  bool killed_at_deadline = false;
  std::string output;  // its stdout and stderr
};

// Runs world ranks of scenario; returns when all ended (at most deadline_s).
std::vector<RankResult> run_ranks(const std::string& scenario, int world, double deadline_s);

// The entry of a rank (main calls it for --rank). Returns the exit code.
int rank_main(const std::string& scenario, int rank, int world, const std::string& dir);

}  // namespace kt_dist_test
