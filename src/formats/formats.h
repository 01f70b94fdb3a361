// The weight formats as data (formats/formats.inc): one WeightFormat per
// kt_weight_format, and the lookups every other part uses instead of a
// switch over the enum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/checked.h"
#include "formats/panels.h"
#include "kt_c_api.h"

namespace kt {

struct WeightFormat {
  kt_weight_format format;
  const char* name;
  int bits;               // per stored code; 16: bf16 panels
  QuantCode code;
  int64_t group;          // K elements per scale; 0: one scale per row
  int scale_bytes;        // 2: bf16, 4: fp32; 0: none (bf16 panels)
  bool zero_points;       // a zero point per (row, group)
  bool quantized_at_load; // kt quantizes bf16/fp16/fp32 sources to it
  bool int8_compute;      // KT_COMPUTE_INT8 multiplies its codes
  uint32_t panel_layout;  // the packed cache's panel layout id
};

constexpr WeightFormat kWeightFormats[] = {
#define KT_WEIGHT_FORMAT(e, name, bits, code, group, scale, zp, load, int8, layout) \
  {e, name, bits, QuantCode::code, group, scale, zp, load, int8, layout},
#include "formats/formats.inc"
#undef KT_WEIGHT_FORMAT
};
constexpr int kNumWeightFormats = static_cast<int>(sizeof(kWeightFormats) / sizeof(kWeightFormats[0]));

// The table holds the enum's values in order, each once: a format's row is
// its value.
constexpr bool formats_in_enum_order() {
  for (int i = 0; i < kNumWeightFormats; ++i)
    if (static_cast<int>(kWeightFormats[i].format) != i) return false;
  return true;
}
static_assert(formats_in_enum_order(), "formats.inc lists kt_weight_format's values in order, from 0");

// The row of a format given as a number (a C host may store any int in the
// enum), or null when it is none of kt's.
inline const WeightFormat* weight_format_of(int64_t value) {
  return value >= 0 && value < kNumWeightFormats ? &kWeightFormats[value] : nullptr;
}
inline const WeightFormat* weight_format_of(kt_weight_format f) { return weight_format_of(enum_bits(f)); }

// "bf16", "int4_g32", ...; "unknown" for a value outside the enum.
inline const char* weight_format_name(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w ? w->name : "unknown";
}

// Every format's name, in enum order, ", " between ("bf16, int8_channel, ...").
inline std::string weight_format_names() {
  std::string s;
  for (const WeightFormat& w : kWeightFormats) s += (s.empty() ? "" : ", ") + std::string(w.name);
  return s;
}

// Predicates of a format inside the enum (false outside it).
inline bool is_quantized(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w && w->scale_bytes != 0;
}
inline bool kt_quantizes_to(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w && w->quantized_at_load;
}
inline bool has_zero_points(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w && w->zero_points;
}
inline bool int8_compute_takes(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w && w->int8_compute;
}

// The quantized format that holds codes of this kind and width with scales
// per group (0: per row), with zero points or without, as they are; null
// when none does.
inline const WeightFormat* weight_format_holding(QuantCode code, int bits, int64_t group, bool zero_points) {
  for (const WeightFormat& w : kWeightFormats)
    if (w.scale_bytes != 0 && w.code == code && w.bits == bits && w.group == group && w.zero_points == zero_points)
      return &w;
  return nullptr;
}

// The groups the formats of this code kind and width hold, as messages
// list them ("32 or 128").
inline std::string held_groups(QuantCode code, int bits) {
  std::vector<int64_t> groups;
  for (const WeightFormat& w : kWeightFormats)
    if (w.scale_bytes != 0 && w.code == code && w.bits == bits && w.group != 0 &&
        std::find(groups.begin(), groups.end(), w.group) == groups.end())
      groups.push_back(w.group);
  std::string s;
  for (size_t i = 0; i < groups.size(); ++i)
    s += (i == 0 ? "" : i + 1 == groups.size() ? " or " : ", ") + std::to_string(groups[i]);
  return s;
}

// The panel layout id of a format; 0 for a value outside the enum.
inline uint32_t panel_layout_of(kt_weight_format f) {
  const WeightFormat* w = weight_format_of(f);
  return w ? w->panel_layout : 0;
}

}  // namespace kt
