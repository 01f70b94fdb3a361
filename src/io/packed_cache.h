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
#include <string>

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

// Writes moe's packed layer to path atomically. Takes the engine's compute
// lock itself.
void save_packed(kt_moe* moe, const std::string& path, const char* where);

// Reads path's header and loaded flags into *info (kt_packed_read_info).
void read_info(const std::string& path, kt_packed_info* info, const char* where);

// Maps path, checks it in full against moe, and makes it moe's weights
// (copied in KT_MODE_FULL). Nothing changes in moe when it fails.
void load_packed(kt_moe* moe, const std::string& path, unsigned flags, const char* where);

}  // namespace io
}  // namespace kt
