#include "io/packed_cache.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/sized_struct.h"
#include "io/safetensors.h"
#include "io/writer.h"
#include "runtime/engine.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the packed cache is written as little-endian memory images"
#endif

namespace kt {
namespace io {

namespace {

constexpr char kMagic[8] = {'K', 'T', 'P', 'A', 'C', 'K', '\n', '\x1a'};

struct SectionEntry {
  uint32_t kind;
  uint32_t reserved;
  uint64_t offset;       // from the start of the file
  uint64_t bytes;
  uint64_t block_bytes;  // checksum block size (> 0)
  uint64_t checksum;     // hash64 of the blocks' hash64s
};

struct PackedHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t abi_version;
  uint32_t panel_layout;
  uint32_t panel_rows;
  uint32_t weight_format;
  uint32_t has_bias;
  int64_t experts, hidden, intermediate;
  uint64_t file_bytes;
  uint32_t num_sections;
  uint32_t reserved0;
  SectionEntry sections[kPackedSections];
  uint8_t reserved[232];
  uint64_t header_checksum;  // hash64 of every byte before it
};
static_assert(sizeof(PackedHeader) == kPackedHeaderBytes, "the packed cache header is 512 bytes");
static_assert(offsetof(PackedHeader, header_checksum) == kPackedHeaderBytes - 8, "checksum last");

constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull,
                   kP3 = 1609587929392839161ull, kP4 = 9650029242287828579ull, kP5 = 2870177450012600261ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * kP2, 31) * kP1; }
inline uint64_t merge64(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * kP1 + kP4; }

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// What one layer's cache holds, derived from its shape.
struct Plan {
  uint64_t bytes[kPackedSections];
  uint64_t block[kPackedSections];
  uint64_t offset[kPackedSections];
  uint64_t file_bytes;
};

Plan plan_for(const PackedShape& shape) {
  Plan p{};
  const uint64_t E = static_cast<uint64_t>(shape.experts);
  const uint64_t g = shape.gate_expert_bytes;
  const uint64_t d = shape.down_expert_bytes;
  p.bytes[0] = E * g, p.block[0] = g;
  p.bytes[1] = E * g, p.block[1] = g;
  p.bytes[2] = E * d, p.block[2] = d;
  p.bytes[3] = shape.has_bias ? E * static_cast<uint64_t>(2 * shape.intermediate + shape.hidden) * sizeof(float) : 0;
  p.block[3] = std::max<uint64_t>(p.bytes[3], 1);
  p.bytes[4] = E, p.block[4] = E;
  uint64_t at = round_up(kPackedHeaderBytes, kPackedSectionAlign);
  for (int s = 0; s < kPackedSections; ++s) {
    p.offset[s] = at;
    at = round_up(at + p.bytes[s], kPackedSectionAlign);
  }
  p.file_bytes = p.offset[kPackedSections - 1] + p.bytes[kPackedSections - 1];
  return p;
}

// Checksum of a section whose block i is at block_ptr(i) (nullptr = zeros),
// blocks hashed on the engine's threads (caller holds the compute lock).
template <class BlockPtr>
uint64_t section_checksum(kt_engine* engine, uint64_t bytes, uint64_t block, BlockPtr block_ptr) {
  const uint64_t n = (bytes + block - 1) / block;
  std::vector<uint64_t> hashes(static_cast<size_t>(n));
  std::vector<uint8_t> zeros;
  uint64_t zero_hash = 0;
  bool need_zero = false;
  for (uint64_t i = 0; i < n && !need_zero; ++i) need_zero = block_ptr(i) == nullptr;
  if (need_zero) {
    zeros.assign(static_cast<size_t>(block), 0);
    zero_hash = hash64(zeros.data(), zeros.size());
  }
  engine->pool->run(static_cast<int64_t>(n), [&](int64_t i, int) {
    const uint64_t len = std::min(block, bytes - static_cast<uint64_t>(i) * block);
    const uint8_t* p = block_ptr(static_cast<uint64_t>(i));
    hashes[static_cast<size_t>(i)] = p ? hash64(p, static_cast<size_t>(len)) : zero_hash;
  });
  return hash64(hashes.data(), hashes.size() * sizeof(uint64_t));
}

std::string shape_string(int64_t E, int64_t H, int64_t I, bool bias) {
  return "E=" + std::to_string(E) + " H=" + std::to_string(H) + " I=" + std::to_string(I) +
         (bias ? " with biases" : " without biases");
}

}  // namespace

uint64_t hash64(const void* data, size_t n, uint64_t seed) {
  // Offsets, not pointer arithmetic: data may be NULL when n is 0 (an empty
  // section), and no pointer may step past the end of the bytes.
  static const uint8_t kNothing = 0;
  const uint8_t* p = n == 0 ? &kNothing : static_cast<const uint8_t*>(data);
  size_t i = 0;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    for (; n - i >= 32; i += 32) {
      v1 = round64(v1, read64(p + i));
      v2 = round64(v2, read64(p + i + 8));
      v3 = round64(v3, read64(p + i + 16));
      v4 = round64(v4, read64(p + i + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge64(h, v1);
    h = merge64(h, v2);
    h = merge64(h, v3);
    h = merge64(h, v4);
  } else {
    h = seed + kP5;
  }
  h += static_cast<uint64_t>(n);
  for (; n - i >= 8; i += 8) h = rotl(h ^ round64(0, read64(p + i)), 27) * kP1 + kP4;
  if (n - i >= 4) {
    h = rotl(h ^ (static_cast<uint64_t>(read32(p + i)) * kP1), 23) * kP2 + kP3;
    i += 4;
  }
  for (; i < n; ++i) h = rotl(h ^ (p[i] * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

void save_packed(kt_engine* engine, const PackedShape& shape, const PackedSource& source,
                 const std::string& path, const char* where) {
  const std::vector<uint8_t>& loaded = *source.loaded;
  KT_CHECK(
      std::count(loaded.begin(), loaded.end(), uint8_t{1}) > 0, KT_ERR_NOT_LOADED,
      std::string(where) + ": the layer has no expert loaded; there is nothing to save to " + path);
  const Plan plan = plan_for(shape);
  const uint64_t E = static_cast<uint64_t>(shape.experts);

  // Biases as stored: gate [E,I], up [E,I], down [E,H], contiguous.
  std::vector<float> biases;
  if (shape.has_bias) {
    const size_t ni = static_cast<size_t>(shape.experts * shape.intermediate), nh = static_cast<size_t>(shape.experts * shape.hidden);
    biases.resize(2 * ni + nh);
    std::memcpy(biases.data(), source.biases[0], ni * sizeof(float));
    std::memcpy(biases.data() + ni, source.biases[1], ni * sizeof(float));
    std::memcpy(biases.data() + 2 * ni, source.biases[2], nh * sizeof(float));
    // Experts never loaded hold no defined values: store zeros.
    for (uint64_t e = 0; e < E; ++e) {
      if (loaded[e]) continue;
      std::fill_n(biases.begin() + static_cast<std::ptrdiff_t>(e * shape.intermediate), shape.intermediate, 0.f);
      std::fill_n(biases.begin() + static_cast<std::ptrdiff_t>(ni + e * shape.intermediate), shape.intermediate, 0.f);
      std::fill_n(biases.begin() + static_cast<std::ptrdiff_t>(2 * ni + e * shape.hidden), shape.hidden, 0.f);
    }
  }

  PackedHeader h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.format_version = kPackedFormatVersion;
  h.abi_version = KT_ABI_VERSION;
  h.panel_layout = panel_layout_of(shape.format);
  h.panel_rows = kPanelRows;
  h.weight_format = static_cast<uint32_t>(shape.format);
  h.has_bias = shape.has_bias ? 1 : 0;
  h.experts = shape.experts, h.hidden = shape.hidden, h.intermediate = shape.intermediate;
  h.file_bytes = plan.file_bytes;
  h.num_sections = kPackedSections;
  // An expert's slot of a weight section: its panels, or zeros when never loaded.
  auto weight_block = [&](int proj) {
    return [&, proj](uint64_t e) -> const uint8_t* {
      if (!loaded[e]) return nullptr;
      return source.weights[proj] + e * plan.block[proj];
    };
  };
  for (int s = 0; s < kPackedSections; ++s) {
    SectionEntry& se = h.sections[s];
    se.kind = static_cast<uint32_t>(kSectionGate + s);
    se.offset = plan.offset[s];
    se.bytes = plan.bytes[s];
    se.block_bytes = plan.block[s];
    if (s < 3)
      se.checksum = section_checksum(engine, se.bytes, se.block_bytes, weight_block(s));
    else if (s == 3)
      se.checksum = section_checksum(engine, se.bytes, se.block_bytes, [&](uint64_t) {
        return reinterpret_cast<const uint8_t*>(biases.data());
      });
    else
      se.checksum = section_checksum(engine, se.bytes, se.block_bytes, [&](uint64_t) { return loaded.data(); });
  }
  h.header_checksum = hash64(&h, offsetof(PackedHeader, header_checksum));

  AtomicFile f(path);
  f.write(&h, sizeof(h));
  for (int s = 0; s < kPackedSections; ++s) {
    f.write_zeros(static_cast<size_t>(plan.offset[s] - f.bytes_written()));
    if (s < 3) {
      auto block = weight_block(s);
      for (uint64_t e = 0; e < E; ++e) {
        const uint8_t* p = block(e);
        if (p)
          f.write(p, static_cast<size_t>(plan.block[s]));
        else
          f.write_zeros(static_cast<size_t>(plan.block[s]));
      }
    } else if (s == 3) {
      f.write(biases.data(), static_cast<size_t>(plan.bytes[s]));
    } else {
      f.write(loaded.data(), loaded.size());
    }
  }
  KT_CHECK(f.bytes_written() == plan.file_bytes, KT_ERR_INTERNAL,
           std::string(where) + ": " + path + ": wrote " + std::to_string(f.bytes_written()) +
               " bytes, planned " + std::to_string(plan.file_bytes));
  f.commit();
}

namespace {

const char* const kSectionNames[kPackedSections] = {"gate", "up", "down", "bias", "loaded"};

// Checks what the header says on its own (w names the call and the file):
// magic, versions, checksum, format and its panel layout, file size,
// section table. The layer's shape and format are checked by the caller.
PackedHeader checked_header(const MappedFile& map, const std::string& w) {
  const uint64_t size = map.size();
  const uint8_t* base = map.data();
  KT_CHECK(size >= 16 && std::memcmp(base, kMagic, sizeof(kMagic)) == 0, KT_ERR_IO,
           w + ": not a kt packed cache (no KTPACK magic)");
  uint32_t version;
  std::memcpy(&version, base + 8, 4);
  KT_CHECK(version == kPackedFormatVersion, KT_ERR_IO,
           w + ": packed cache format version " + std::to_string(version) +
               "; this kt reads version " + std::to_string(kPackedFormatVersion) +
               " (rebuild it with kt-moe convert)");
  KT_CHECK(size >= kPackedHeaderBytes, KT_ERR_IO,
           w + ": truncated: " + std::to_string(size) + " bytes, shorter than the " +
               std::to_string(kPackedHeaderBytes) + "-byte header");
  PackedHeader h;
  std::memcpy(&h, base, sizeof(h));
  KT_CHECK(hash64(&h, offsetof(PackedHeader, header_checksum)) == h.header_checksum, KT_ERR_IO,
           w + ": header checksum mismatch (the file is corrupted)");
  KT_CHECK(h.abi_version == KT_ABI_VERSION, KT_ERR_IO,
           w + ": written by kt ABI " + std::to_string(h.abi_version) + "; this kt is ABI " +
               std::to_string(KT_ABI_VERSION) + " (rebuild it with kt-moe convert)");
  // Compared as numbers: a value outside the enum is never converted to it.
  KT_CHECK(weight_format_of(int64_t{h.weight_format}) != nullptr, KT_ERR_IO,
           w + ": holds weight format " + std::to_string(h.weight_format) + ", which this kt does not know");
  const kt_weight_format format = static_cast<kt_weight_format>(h.weight_format);
  KT_CHECK(h.panel_layout == panel_layout_of(format) &&
               h.panel_rows == static_cast<uint32_t>(kPanelRows),
           KT_ERR_IO,
           w + ": built for panel layout " + std::to_string(h.panel_layout) + " (" +
               std::to_string(h.panel_rows) + "-row panels); this kt packs " +
               weight_format_name(format) + " weights in layout " +
               std::to_string(panel_layout_of(format)) + " (" + std::to_string(kPanelRows) +
               "-row panels) (rebuild it with kt-moe convert)");
  KT_CHECK(h.experts >= 1 && h.hidden >= 1 && h.intermediate >= 1, KT_ERR_IO,
           w + ": the header holds no layer shape");
  KT_CHECK(h.file_bytes == size, KT_ERR_IO,
           w + ": truncated or extended: the header says " + std::to_string(h.file_bytes) +
               " bytes, the file has " + std::to_string(size));
  KT_CHECK(h.num_sections == kPackedSections, KT_ERR_IO,
           w + ": " + std::to_string(h.num_sections) + " sections, expected " +
               std::to_string(kPackedSections));
  for (int s = 0; s < kPackedSections; ++s) {
    const SectionEntry& se = h.sections[s];
    const std::string sec = w + ": section '" + kSectionNames[s] + "'";
    KT_CHECK(se.kind == static_cast<uint32_t>(kSectionGate + s), KT_ERR_IO,
             sec + " has kind " + std::to_string(se.kind));
    KT_CHECK(
        se.offset % 64 == 0 && se.offset >= kPackedHeaderBytes && se.offset <= size &&
            se.bytes <= size - se.offset,
        KT_ERR_IO,
        sec + " at offset " + std::to_string(se.offset) + " is misaligned or outside the file");
    KT_CHECK(se.block_bytes > 0, KT_ERR_IO, sec + " has a zero checksum block size");
    if (s > 0) {
      const SectionEntry& prev = h.sections[s - 1];
      KT_CHECK(se.offset >= prev.offset + prev.bytes, KT_ERR_IO,
               sec + " overlaps the section before it");
    }
  }
  // kt pads the header and each section to the next section with zeros,
  // less than kPackedSectionAlign bytes each, and no checksum covers them:
  // a changed byte there is found here.
  uint64_t pad_start = kPackedHeaderBytes;
  for (int s = 0; s < kPackedSections; ++s) {
    const SectionEntry& se = h.sections[s];
    const std::string before = " before section '" + std::string(kSectionNames[s]) + "'";
    KT_CHECK(se.offset - pad_start < kPackedSectionAlign, KT_ERR_IO,
             w + ": " + std::to_string(se.offset - pad_start) + " bytes of padding" + before + " (kt pads less than " +
                 std::to_string(kPackedSectionAlign) + ")");
    for (uint64_t at = pad_start; at < se.offset; ++at)
      if (base[at] != 0)
        fail(KT_ERR_IO, w + ": byte " + std::to_string(at) + " of the padding" + before +
                            " is not zero (the file is corrupted)");
    pad_start = se.offset + se.bytes;
  }
  KT_CHECK(h.sections[4].bytes == static_cast<uint64_t>(h.experts), KT_ERR_IO,
           w + ": section 'loaded' holds " + std::to_string(h.sections[4].bytes) + " flags for " +
               std::to_string(h.experts) + " experts");
  const uint8_t* loaded = base + h.sections[4].offset;
  for (int64_t e = 0; e < h.experts; ++e)
    if (loaded[e] > 1) fail(KT_ERR_IO, w + ": loaded flag of expert " + std::to_string(e) + " is not 0/1");
  return h;
}

}  // namespace

void read_info(const std::string& path, kt_packed_info* out, const char* where) {
  const MappedFile map(path);
  const PackedHeader h = checked_header(map, std::string(where) + ": " + path);
  kt_packed_info info{};
  info.struct_size = sizeof(info);
  info.num_experts = h.experts;
  info.hidden = h.hidden;
  info.intermediate = h.intermediate;
  info.has_bias = h.has_bias != 0;
  info.weight_format = static_cast<kt_weight_format>(h.weight_format);
  const uint8_t* loaded = map.data() + h.sections[4].offset;
  info.num_loaded = std::count(loaded, loaded + h.experts, uint8_t{1});
  info.weight_bytes = static_cast<int64_t>(h.sections[0].bytes + h.sections[1].bytes + h.sections[2].bytes);
  info.file_bytes = static_cast<int64_t>(h.file_bytes);
  info.format_version = static_cast<int>(h.format_version);
  write_sized(out, info, where, "info");
}

PackedMapping map_packed(const PackedShape& shape, const std::string& path, const char* where) {
  const std::string w = std::string(where) + ": " + path;
  auto map = std::make_shared<MappedFile>(path);
  const uint8_t* base = map->data();
  const PackedHeader h = checked_header(*map, w);
  const kt_weight_format format = shape.format;
  const kt_weight_format stored = static_cast<kt_weight_format>(h.weight_format);
  KT_CHECK(stored == format, KT_ERR_INVALID_ARGUMENT,
           w + ": the cache holds " + weight_format_name(stored) +
               " weights, the layer stores " + weight_format_name(format) +
               " (create the layer with weight_format " + weight_format_name(stored) +
               ", or convert the checkpoint again for " + weight_format_name(format) + ")");
  KT_CHECK(h.experts == shape.experts && h.hidden == shape.hidden && h.intermediate == shape.intermediate &&
               (h.has_bias != 0) == shape.has_bias,
           KT_ERR_SHAPE,
           w + ": the cache holds a layer of " +
               shape_string(h.experts, h.hidden, h.intermediate, h.has_bias != 0) +
               " but the kt_moe was created with " +
               shape_string(shape.experts, shape.hidden, shape.intermediate, shape.has_bias));
  const Plan plan = plan_for(shape);
  for (int s = 0; s < kPackedSections; ++s)
    KT_CHECK(h.sections[s].bytes == plan.bytes[s], KT_ERR_IO,
             w + ": section '" + kSectionNames[s] + "' holds " +
                 std::to_string(h.sections[s].bytes) + " bytes, the layer needs " +
                 std::to_string(plan.bytes[s]));

  PackedMapping m;
  m.what = w;
  for (int s = 0; s < kPackedSections; ++s) {
    const SectionEntry& se = h.sections[s];
    m.offset[s] = se.offset, m.bytes[s] = se.bytes, m.block_bytes[s] = se.block_bytes, m.checksum[s] = se.checksum;
  }
  for (int s = 0; s < 3; ++s) m.weights[s] = base + h.sections[s].offset;
  if (shape.has_bias) {
    const float* b = reinterpret_cast<const float*>(base + h.sections[3].offset);
    m.biases[0] = b;
    m.biases[1] = b + shape.experts * shape.intermediate;
    m.biases[2] = b + 2 * shape.experts * shape.intermediate;
  }
  m.loaded = base + h.sections[4].offset;
  m.memory = std::shared_ptr<const void>(map, base);
  return m;
}

void verify_packed(const PackedMapping& m, kt_engine* engine) {
  const uint8_t* base = static_cast<const uint8_t*>(m.memory.get());
  for (int s = 0; s < kPackedSections; ++s) {
    const uint8_t* sec = base + m.offset[s];
    const uint64_t block = m.block_bytes[s];
    const uint64_t got = section_checksum(engine, m.bytes[s], block, [&](uint64_t i) { return sec + i * block; });
    KT_CHECK(got == m.checksum[s], KT_ERR_IO,
             m.what + ": checksum mismatch in section '" + kSectionNames[s] + "' (the file is corrupted)");
  }
}

}  // namespace io
}  // namespace kt
