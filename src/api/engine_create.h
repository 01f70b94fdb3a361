// kt_engine_create on a given NUMA topology: the ABI call discovers the
// machine's; tests give simulated nodes here (the ABI cannot reach it).
#pragma once

#include "kt_c_api.h"
#include "runtime/numa.h"

namespace kt {
kt_status engine_create_on(const kt_engine_options* options, const Topology* topology, kt_engine** engine);
}  // namespace kt
