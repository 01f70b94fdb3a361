// The optimizer loops compiled for generic (flags in CMakeLists.txt).
#include "optim/update.h"

#include "optim/update_kernels.inc"

namespace kt {
namespace optim {
namespace generic {
extern const UpdateKernels kKernels = {"generic", all_finite, sum_squares, adamw, sgd, pack_panel};
}  // namespace generic
}  // namespace optim
}  // namespace kt
