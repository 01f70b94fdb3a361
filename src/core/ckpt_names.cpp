#include "core/ckpt_names.h"

#include <cstddef>
#include <cstdint>
#include <utility>

#include "core/checked.h"

namespace kt {
namespace io {

namespace {

template <class E, size_t N>
const char* name_in(const std::pair<E, const char*> (&names)[N], const E& value) {
  const int64_t v = enum_bits(value);  // any int a C host stored
  for (const auto& n : names)
    if (static_cast<int64_t>(n.first) == v) return n.second;
  return "unknown";
}

const std::pair<kt_ckpt_dtype, const char*> kDtypeNames[] = {
    {KT_CKPT_DTYPE_F32, "F32"},         {KT_CKPT_DTYPE_F16, "F16"},         {KT_CKPT_DTYPE_BF16, "BF16"},
    {KT_CKPT_DTYPE_F64, "F64"},         {KT_CKPT_DTYPE_F8_E4M3, "F8_E4M3"}, {KT_CKPT_DTYPE_F8_E5M2, "F8_E5M2"},
    {KT_CKPT_DTYPE_E8M0, "E8M0"},       {KT_CKPT_DTYPE_I8, "I8"},           {KT_CKPT_DTYPE_U8, "U8"},
    {KT_CKPT_DTYPE_I16, "I16"},         {KT_CKPT_DTYPE_U16, "U16"},         {KT_CKPT_DTYPE_I32, "I32"},
    {KT_CKPT_DTYPE_U32, "U32"},         {KT_CKPT_DTYPE_I64, "I64"},         {KT_CKPT_DTYPE_U64, "U64"},
    {KT_CKPT_DTYPE_BOOL, "BOOL"}};

const std::pair<kt_ckpt_layout, const char*> kLayoutNames[] = {
    {KT_CKPT_LAYOUT_NONE, "none"},   {KT_CKPT_LAYOUT_PER_EXPERT, "per_expert"},
    {KT_CKPT_LAYOUT_MIXTRAL, "mixtral"}, {KT_CKPT_LAYOUT_FUSED, "fused"},
    {KT_CKPT_LAYOUT_FUSED_IN_OUT, "fused_in_out"}, {KT_CKPT_LAYOUT_GPT_OSS, "gpt_oss"}};

const std::pair<kt_ckpt_format, const char*> kFormatNames[] = {
    {KT_CKPT_FORMAT_DENSE, "dense"}, {KT_CKPT_FORMAT_FP8_BLOCK, "fp8_block"},
    {KT_CKPT_FORMAT_INT4_GROUP, "int4_group"}, {KT_CKPT_FORMAT_MXFP4, "mxfp4"},
    {KT_CKPT_FORMAT_OTHER, "other"}};

}  // namespace

const char* dtype_name(kt_ckpt_dtype dtype) { return name_in(kDtypeNames, dtype); }
const char* layout_name(kt_ckpt_layout layout) { return name_in(kLayoutNames, layout); }
const char* format_name(kt_ckpt_format format) { return name_in(kFormatNames, format); }

}  // namespace io
}  // namespace kt
