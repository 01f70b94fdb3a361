// The optimizer loops compiled for generic (flags in sources.cmake).
#include "kernels/update.h"

#include "kernels/update_kernels.inc"

namespace kt {
namespace optim {
namespace generic {
extern const UpdateKernels kKernels = make_update_kernels("generic");
}  // namespace generic
}  // namespace optim
}  // namespace kt
