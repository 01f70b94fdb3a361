// The ABI shims of src/io use the boundary guard of src/api.
#pragma once

#include "api/guard.h"

namespace kt {
namespace io {

using kt::guarded;

}  // namespace io
}  // namespace kt
