// Distributed checkpoints (kt_dist_ckpt_save / kt_dist_ckpt_load): each rank
// writes the experts it holds (weights, LoRA factors, optimizer state, named
// by global expert id) into one staging directory that rank 0 publishes
// once every rank's file is complete; a load reads each rank's experts from
// whichever files hold them, so the world size and expert map may change.
#pragma once

#include <cstddef>

#include "kt_c_api.h"

struct kt_comm;

namespace kt::dist {

constexpr const char* kCheckpointManifest = "kt_dist_checkpoint.json";
constexpr int kCheckpointFormatVersion = 1;

void set_checkpoint_options_defaults(kt_dist_ckpt_options& o);

// options may be NULL. Both take comm's mutex and run its collectives; they throw kt::Error
// (the same on every rank) naming where.
void save_checkpoint(kt_comm& comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t n,
                     const kt_dist_ckpt_options* options, const char* where);
void load_checkpoint(kt_comm& comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t n,
                     const kt_dist_ckpt_options* options, const char* where);

}  // namespace kt::dist
