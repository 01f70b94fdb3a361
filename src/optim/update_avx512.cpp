// The optimizer loops compiled for avx512 (flags in CMakeLists.txt).
#include "optim/update.h"

#include "optim/update_kernels.inc"

namespace kt {
namespace optim {
namespace avx512 {
extern const UpdateKernels kKernels = {"avx512", all_finite, sum_squares, adamw, sgd, pack_panel};
}  // namespace avx512
}  // namespace optim
}  // namespace kt
