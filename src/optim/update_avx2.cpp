// The optimizer loops compiled for avx2 (flags in CMakeLists.txt).
#include "optim/update.h"

#include "optim/update_kernels.inc"

namespace kt {
namespace optim {
namespace avx2 {
extern const UpdateKernels kKernels = {"avx2", all_finite, sum_squares, adamw, sgd, pack_panel};
}  // namespace avx2
}  // namespace optim
}  // namespace kt
