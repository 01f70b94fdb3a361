// The optimizer loops compiled for avx2 (flags in sources.cmake).
#include "kernels/update.h"

#include "kernels/update_kernels.inc"

namespace kt {
namespace optim {
namespace avx2 {
extern const UpdateKernels kKernels = make_update_kernels("avx2");
}  // namespace avx2
}  // namespace optim
}  // namespace kt
