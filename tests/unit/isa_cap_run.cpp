// Linked into every program that also runs as isa_cap.<cap>.<program>
// (tests/CMakeLists.txt, which sets KT_TEST_ISA_CAP_RUN there): a cap at or
// above the best level this CPU runs dispatches exactly as the program's
// uncapped run did, so that run is not repeated: it says so and exits with
// 77, which ctest shows as skipped.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kt_c_api.h"

namespace {

constexpr int kSkipped = 77;  // the isa_cap tests' SKIP_RETURN_CODE

class CapAtOrAboveTheCpu : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* cap = std::getenv("KT_MAX_ISA");
    if (std::getenv("KT_TEST_ISA_CAP_RUN") == nullptr || cap == nullptr) return;
    const kt_isa best = kt_cpu_isa();
    for (int level = KT_ISA_REF; level <= KT_ISA_AMX; ++level) {
      if (std::string(kt_isa_name(static_cast<kt_isa>(level))) != cap) continue;
      if (level >= best) {
        std::fprintf(stderr, "KT_MAX_ISA=%s is at or above this CPU's best level (%s): the program's uncapped run "
                     "already ran these tests with the same kernels\n", cap, kt_isa_name(best));
        std::exit(kSkipped);
      }
      return;
    }
  }
};

const ::testing::Environment* const kCapRun = ::testing::AddGlobalTestEnvironment(new CapAtOrAboveTheCpu);

}  // namespace
