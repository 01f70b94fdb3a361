// The optimizer loops compiled for avx512 (flags in sources.cmake).
#include "kernels/update.h"

#include "kernels/update_kernels.inc"

namespace kt {
namespace optim {
namespace avx512 {
extern const UpdateKernels kKernels = make_update_kernels("avx512");
}  // namespace avx512
}  // namespace optim
}  // namespace kt
