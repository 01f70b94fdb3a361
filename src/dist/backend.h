// Backend strings of a communicator ("gloo", "nccl", "cuda:nccl,cpu:gloo"):
// which collective engine carries the tensors of each device, and which
// device the communicator prefers.
#pragma once

#include <string>

#include "kt_c_api.h"

namespace kt::dist {

struct Backends {
  kt_comm_backend cpu = KT_COMM_BACKEND_NONE;
  kt_comm_backend cuda = KT_COMM_BACKEND_NONE;
  // The combined string prefers CUDA: the device is CUDA when a CUDA
  // backend is named.
  DLDeviceType device() const { return cuda != KT_COMM_BACKEND_NONE ? kDLCUDA : kDLCPU; }
};

// Parses text; throws kt::Error (KT_ERR_INVALID_ARGUMENT) saying what is
// wrong, naming `what` ("kt_comm_create: options->backend").
Backends parse_backends(const char* text, const std::string& what);

const char* backend_name(kt_comm_backend b);

}  // namespace kt::dist
