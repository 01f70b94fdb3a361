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
// Names the panel layout the weight sections hold (kernels/kernels.h: bf16,
// 16-row panels, K pairs innermost, K padded to even). Every ISA's kernels
// read this one layout; a new layout gets a new id, and caches of the old
// one are refused instead of being misread.
constexpr uint32_t kPanelLayoutBf16R16K2 = 0x31363242u;  // "B216"
// The quantized formats' layouts (formats/packed_quant.h: 16-row panels of
// codes as the checkpoint or kt's quantizer gave them, then the scales; K
// padded to 32, or to 128 for 128-wide groups), one id per format:
// int8 codes with one bf16 scale per row; int4 codes with a bf16 scale per
// group of 32 or 128; fp8 e4m3 codes with the fp32 scale of their 128x128
// block per (row, 128 inputs); e2m1 codes with the e8m0 scale of their 32
// inputs as bf16 (exact: a power of two).
constexpr uint32_t kPanelLayoutInt8R16K32 = 0x36313851u;    // "Q816"
constexpr uint32_t kPanelLayoutInt4R16G32 = 0x36313451u;    // "Q416"
constexpr uint32_t kPanelLayoutInt4R16G128 = 0x36573451u;   // "Q4W6"
constexpr uint32_t kPanelLayoutFp8R16B128 = 0x36313846u;    // "F816"
constexpr uint32_t kPanelLayoutMxfp4R16G32 = 0x3631344Du;   // "M416"
// Asymmetric int4: the int4 panels and scales, then a zero byte (z + 8)
// per (row, group) laid out as the scales.
constexpr uint32_t kPanelLayoutInt4ZpR16G32 = 0x36315A51u;   // "QZ16"
constexpr uint32_t kPanelLayoutInt4ZpR16G128 = 0x36575A51u;  // "QZW6"
static_assert(kPanelRows == 16, "the panel layout changed: give it a new kPanelLayout id");
static_assert(kQuantKAlign == 32, "the quantized layout changed: give it a new kPanelLayout id");

// The panel layout id of a weight format; 0 for a value outside the enum.
uint32_t panel_layout_of(kt_weight_format format);

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
