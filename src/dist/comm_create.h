// Making a communicator (kt_comm_create): options checked, the CPU transport
// started and the ranks' setups agreed, then NCCL started (with an id rank 0
// made, where the host gave none).
#pragma once

#include <memory>

#include "dist/comm.h"
#include "kt_c_api.h"

namespace kt::dist {

// A started communicator of options o (read and defaulted by the caller);
// `where` names the ABI call in messages.
std::shared_ptr<kt_comm> create_comm(const kt_comm_options& o, const char* where);

}  // namespace kt::dist
