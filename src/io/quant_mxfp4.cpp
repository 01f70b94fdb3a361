#include "io/layout_parts.h"

#include "core/ckpt_names.h"

// MXFP4 (KT_CKPT_FORMAT_MXFP4): e2m1 codes with an e8m0 scale per 32
// inputs, as gpt-oss stores them fused (_blocks and _scales) or a
// checkpoint per expert (weight and scale).

namespace kt {
namespace io {

const TensorRef* FusedParts::need(const char* suffix) const {
  const TensorRef* t = get(suffix);
  if (!t) io_fail("tensor '" + c.base + "." + suffix + "' is missing (layer " + std::to_string(layer) + ")");
  return t;
}

void FusedParts::bad(const TensorRef* t, const std::string& expected) const {
  io_fail(t->file->path() + ": tensor '" + t->entry->name + "': expected " + expected + ", got " +
          dtype_name(t->entry->dtype) + " " + shape_text(t->entry->shape));
}

void describe_mxfp4_blocks(const FusedParts& f, MoeLayer* m_out) {
  MoeLayer& m = *m_out;
  const TensorRef* gb = f.need("gate_up_proj_blocks");
  const TensorRef* db = f.need("down_proj_blocks");
  m.gate_up = gb;
  m.down = db;
  m.gate_up_scales = f.need("gate_up_proj_scales");
  m.down_scales = f.need("down_proj_scales");
  const auto& gs = gb->entry->shape;
  const auto& ds = db->entry->shape;
  if (gs.size() != 4 || gs[3] != 16 || gb->entry->dtype != KT_CKPT_DTYPE_U8) f.bad(gb, "U8 [E, 2I, H/32, 16]");
  if (ds.size() != 4 || ds[3] != 16 || db->entry->dtype != KT_CKPT_DTYPE_U8) f.bad(db, "U8 [E, H, I/32, 16]");
  m.layout = KT_CKPT_LAYOUT_GPT_OSS;
  m.format = KT_CKPT_FORMAT_MXFP4;
  m.weight_dtype = KT_CKPT_DTYPE_U8;
  m.E = gs[0];
  m.I = gs[1] / 2;
  m.H = scaled_extent(gs[2], 32, *gb);
  if (gs[1] % 2 != 0 || ds[0] != m.E || ds[1] != m.H || scaled_extent(ds[2], 32, *db) != m.I)
    f.bad(db, "U8 [" + std::to_string(m.E) + ", " + std::to_string(m.H) + ", " +
                std::to_string(m.I / 32) + ", 16] to match " + gb->entry->name);
  // e8m0 scales, one per 32 inputs: [E, out, in/32] beside the blocks.
  auto check_scales = [&](const TensorRef* sc, const TensorRef* blocks) {
    const auto& bs = blocks->entry->shape;
    const std::vector<int64_t> want{bs[0], bs[1], bs[2]};
    const kt_ckpt_dtype dt = sc->entry->dtype;
    if ((dt != KT_CKPT_DTYPE_U8 && dt != KT_CKPT_DTYPE_E8M0) || sc->entry->shape != want)
      f.bad(sc, "U8/E8M0 (e8m0 scales) " + shape_text(want) + " to match " + blocks->entry->name);
  };
  check_scales(m.gate_up_scales, gb);
  check_scales(m.down_scales, db);
}

void check_mxfp4_layer(const LayerCheck& k) {
  MoeLayer& m = k.m;
  k.method_must_be("mxfp4", "MXFP4 weights (e2m1 with e8m0 scales)");
  if (m.layout != KT_CKPT_LAYOUT_GPT_OSS)
    k.per_expert([&](const ProjTensors& pt, int64_t out, int64_t in) {
      check_scale_tensor(pt.scale, "e8m0 scales, one per 32 inputs", out, ceil_div64(in, 32),
                         {KT_CKPT_DTYPE_E8M0, KT_CKPT_DTYPE_U8}, "E8M0/U8", "");
    });
  m.group = 32;
  m.decodable = true;
  m.native_format = KT_FORMAT_MXFP4;
}

}  // namespace io
}  // namespace kt
