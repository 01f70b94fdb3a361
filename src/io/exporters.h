// Checkpoints kt writes (full-expert checkpoints, PEFT adapters) and the
// adapter reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// Slice e of v ([E, rows, cols], or [E, n] for biases), row-major, into dst
// as dtype dt; the source dtype is copied bit for bit.
void write_expert_slice(const View& v, int64_t e, kt_ckpt_dtype dt, uint8_t* dst);
// The reverse: row-major elements of src_dt at src into slice e of v
// (converted to v's dtype; any strides).
void read_expert_slice(const uint8_t* src, kt_ckpt_dtype src_dt, const View& v, int64_t e);

void write_experts(const std::string& dir, const kt_ckpt_write_options& options,
                   const kt_ckpt_layer_args* layers, size_t num_layers, const char* where);

void write_adapter(const std::string& dir, const kt_ckpt_adapter_config& config,
                   const kt_ckpt_layer_args* layers, size_t num_layers, const char* where);

// Fills rank, alpha, use_rslora, targets, layout, dtype (base_model = NULL).
void read_adapter_config(const std::string& dir, kt_ckpt_adapter_config* config);

// The defaults of kt_ckpt_adapter_config_init (after its struct_size).
void set_adapter_config_defaults(kt_ckpt_adapter_config& c);

void read_adapter(const std::string& dir, int64_t layer, const kt_arg* args, size_t num_args,
                  const char* where);

}  // namespace io
}  // namespace kt
