// The packed cache: one layer's packed weights (the kernels' panel layout),
// fp32 biases and loaded flags in one file that is memory-mapped back, so a
// large model reloads without repacking.
//
// File layout (little-endian):
//   [0, 512)   PackedHeader: magic, versions, panel layout id, shape, the
//              section table (offset, bytes, checksum each), header checksum
//   sections   gate panels [E][panels], up panels, down panels (bf16, or
//              a quantized layer's codes and scales as the layer holds
//              them, never re-quantized: one block per expert as
//              formats/packed_quant.h lays it out),
//              biases (fp32 gate [E,I], up [E,I], down [E,H]; empty without
//              biases), loaded flags [E] (0/1); each starts at a multiple of
//              4096 so panels keep the kernels' 64-byte alignment in the map.
// Checksums are hash64 over 8 MiB blocks, combined (hash64 of the blocks'
// hashes), so they are computed and verified on the engine's threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/packed_quant.h"
#include "kernels/kernels.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// Bumped on any change of the file layout below.
constexpr uint32_t kPackedFormatVersion = 1;
// The header names the panel layout its weight sections hold: the id of
// the layer's format in formats/formats.inc (kt::panel_layout_of). bf16:
// kernels/kernels.h's panels (16 rows, K pairs innermost, K padded to even),
// which every ISA's kernels read. Quantized formats (formats/packed_quant.h):
// 16-row panels of codes as the checkpoint or kt's quantizer gave them, then
// the scales (and the zero bytes of the _ZP formats); K padded to 32, or to
// the group for wider groups. A new layout gets a new id, and caches of the
// old one are refused instead of being misread.
static_assert(kPanelRows == 16, "the panel layout changed: give it a new panel layout id (formats.inc)");
static_assert(kQuantKAlign == 32, "the quantized layout changed: give it a new panel layout id (formats.inc)");

constexpr size_t kPackedHeaderBytes = 512;
constexpr uint64_t kPackedSectionAlign = 4096;

enum PackedSection : uint32_t {
  kSectionGate = 1,
  kSectionUp = 2,
  kSectionDown = 3,
  kSectionBias = 4,
  kSectionLoaded = 5,
};
constexpr int kPackedSections = 5;

// 64-bit hash of bytes (the xxHash64 algorithm), seed 0.
uint64_t hash64(const void* data, size_t n, uint64_t seed = 0);

// One layer as its cache stores it. The layer describes itself
// (moe/packed_layer.cpp), so the file format needs nothing of kt_moe.
struct PackedShape {
  kt_weight_format format = KT_FORMAT_BF16;
  int64_t experts = 0, hidden = 0, intermediate = 0;
  bool has_bias = false;
  // Stored bytes of one expert's gate (and up) weights and of its down weights.
  uint64_t gate_expert_bytes = 0, down_expert_bytes = 0;
};

// The layer's memory a save reads: stored weights [E][expert bytes] of gate,
// up and down; fp32 biases gate [E,I], up [E,I], down [E,H] (read only with
// has_bias); loaded flags [E] (0/1).
struct PackedSource {
  const uint8_t* weights[3] = {nullptr, nullptr, nullptr};
  const float* biases[3] = {nullptr, nullptr, nullptr};
  const std::vector<uint8_t>* loaded = nullptr;
};

// Writes the layer to path atomically, its checksums computed on engine's
// threads: the caller holds the engine's compute lock.
void save_packed(kt_engine* engine, const PackedShape& shape, const PackedSource& source,
                 const std::string& path, const char* where);

// Reads path's header and loaded flags into *info (kt_packed_read_info).
void read_info(const std::string& path, kt_packed_info* info, const char* where);

// A cache mapped and checked against a layer's shape and format (header,
// section sizes); its section checksums are checked by verify_packed.
struct PackedMapping {
  std::shared_ptr<const void> memory;  // the file's bytes; keeps the map alive
  std::string what;                    // "<where>: <path>", for messages
  const uint8_t* weights[3] = {nullptr, nullptr, nullptr};  // laid out as PackedSource's
  const float* biases[3] = {nullptr, nullptr, nullptr};     // null without biases
  const uint8_t* loaded = nullptr;
  uint64_t offset[kPackedSections] = {}, bytes[kPackedSections] = {};
  uint64_t block_bytes[kPackedSections] = {}, checksum[kPackedSections] = {};
};

// Maps path and checks it against shape; KT_ERR_IO, _SHAPE or
// _INVALID_ARGUMENT naming the file when it does not fit.
PackedMapping map_packed(const PackedShape& shape, const std::string& path, const char* where);

// Checks every section's checksum on engine's threads (the caller holds the
// engine's compute lock); KT_ERR_IO naming the section when one differs.
void verify_packed(const PackedMapping& mapping, kt_engine* engine);

}  // namespace io
}  // namespace kt
