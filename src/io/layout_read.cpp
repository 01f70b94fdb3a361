#include "io/layout.h"

#include "core/ckpt_names.h"
#include "core/tensor.h"
#include "io/elements.h"
#include "io/layout_parts.h"

// Reading a checkpoint's layer back into host tensors: stored values
// converted, quantized weights decoded.

namespace kt {
namespace io {

// Projection p of expert e of a quantized layer as a QuantSource.
QuantSource quant_source(const MoeLayer& L, int64_t e, int p) {
  QuantSource src;
  src.group = L.group;
  const int64_t out = p == kProjDown ? L.H : L.I, in = p == kProjDown ? L.I : L.H;
  const int64_t groups = ceil_div64(in, L.group);
  auto scales_from = [&](const TensorRef* t) {
    src.scales = t->data;
    src.scale_dtype = t->entry->dtype;
  };
  if (L.layout == KT_CKPT_LAYOUT_GPT_OSS) {
    // Blocks [E, rows, in/32, 16] and scales [E, rows, in/32]; gate and up
    // interleave in the rows of gate_up.
    const TensorRef* blocks = p == kProjDown ? L.down : L.gate_up;
    const TensorRef* scales = p == kProjDown ? L.down_scales : L.gate_up_scales;
    const int64_t rows = p == kProjDown ? L.H : 2 * L.I;
    src.code = QuantCode::kE2M1;
    src.bits = 4;
    src.code_row_bytes = in / 2;
    src.codes = blocks->data + e * rows * src.code_row_bytes;
    scales_from(scales);
    src.scale_row = in / 32;
    src.scales += e * rows * src.scale_row;
    src.row0 = p == kProjUp ? 1 : 0;
    src.row_step = p == kProjDown ? 1 : 2;
    src.name = blocks->entry->name.c_str();
    (void)out;
    return src;
  }
  const ProjTensors& pt = L.experts[static_cast<size_t>(e)][static_cast<size_t>(p)];
  src.codes = pt.weight->data;
  src.name = pt.weight->entry->name.c_str();
  scales_from(pt.scale);
  src.scale_row = groups;
  switch (L.format) {
    case KT_CKPT_FORMAT_FP8_BLOCK:
      src.code = QuantCode::kE4M3;
      src.bits = 8;
      src.code_row_bytes = in;
      src.scale_row_div = L.block_rows;
      break;
    case KT_CKPT_FORMAT_INT4_GROUP:
      src.code = QuantCode::kInt;
      src.bits = 4;
      src.code_row_bytes = pt.weight->entry->shape[1] * 4;
      if (pt.zero) {
        src.zeros = pt.zero->data;
        src.zero_row = groups;
      }
      break;
    default:  // MXFP4, per expert
      src.code = QuantCode::kE2M1;
      src.bits = 4;
      src.code_row_bytes = pt.weight->entry->shape[1];
      break;
  }
  return src;
}

SourceWalk source_walk(const MoeLayer& L, int proj, bool bias, int64_t e) {
  const bool fused = !(L.layout == KT_CKPT_LAYOUT_PER_EXPERT || L.layout == KT_CKPT_LAYOUT_MIXTRAL);
  const bool in_out = fused && L.layout != KT_CKPT_LAYOUT_FUSED;
  const bool interleaved = L.layout == KT_CKPT_LAYOUT_GPT_OSS;
  const int64_t out = proj == kProjDown ? L.H : L.I, in = proj == kProjDown ? L.I : L.H;
  SourceWalk w;
  if (!fused) {
    const ProjTensors& pt = L.experts[static_cast<size_t>(e)][static_cast<size_t>(proj)];
    w.src = bias ? pt.bias : pt.weight;
    w.so = bias ? 1 : in;
    w.si = 1;
  } else if (bias) {
    w.src = proj == kProjDown ? L.down_bias : L.gate_up_bias;
    const int64_t width = proj == kProjDown ? L.H : 2 * L.I;
    w.base = e * width;
    w.so = 1;
    if (proj == kProjUp) w.base += interleaved ? 1 : L.I;
    if (proj != kProjDown && interleaved) w.so = 2;
  } else {
    w.src = proj == kProjDown ? L.down : L.gate_up;
    const int64_t rows = proj == kProjDown ? out : 2 * L.I;  // logical out rows of the tensor
    w.base = e * rows * in;
    int64_t row0 = 0, row_step = 1;
    if (proj != kProjDown) {
      row0 = proj == kProjUp ? (interleaved ? 1 : L.I) : 0;
      row_step = interleaved ? 2 : 1;
    }
    if (in_out) {  // stored [in, rows]
      w.base += row0;
      w.so = row_step;
      w.si = rows;
    } else {       // stored [rows, in]
      w.base += row0 * in;
      w.so = row_step * in;
      w.si = 1;
    }
  }
  return w;
}

namespace {

// A tensor kt_ckpt_read_layer fills: its argument id, view, projection and
// whether it is the projection's biases.
struct ReadDest {
  int id;
  View v;
  int proj;
  bool bias;
};

const char* const kReadNames[] = {"KT_ARG_W_GATE", "KT_ARG_W_UP", "KT_ARG_W_DOWN",
                                  "KT_ARG_B_GATE", "KT_ARG_B_UP", "KT_ARG_B_DOWN"};

const char* read_name(const ReadDest& d) { return kReadNames[d.proj + (d.bias ? 3 : 0)]; }

// The arguments of a read, each checked (id, shape, dtype, writable, and
// disjoint from the others) before anything is written.
std::vector<ReadDest> read_destinations(const MoeLayer& L, const kt_arg* args, size_t num_args, const char* where) {
  std::vector<ReadDest> dests;
  const std::initializer_list<DType> kOut = {DType::kF32, DType::kBF16, DType::kF16};
  for (size_t i = 0; i < num_args; ++i) {
    const int id = args[i].id;
    int proj = -1;
    bool bias = false;
    switch (id) {
      case KT_ARG_W_GATE: proj = kProjGate; break;
      case KT_ARG_W_UP: proj = kProjUp; break;
      case KT_ARG_W_DOWN: proj = kProjDown; break;
      case KT_ARG_B_GATE: proj = kProjGate, bias = true; break;
      case KT_ARG_B_UP: proj = kProjUp, bias = true; break;
      case KT_ARG_B_DOWN: proj = kProjDown, bias = true; break;
      default:
        fail(KT_ERR_INVALID_ARGUMENT, std::string(where) + ": argument id " + std::to_string(id) +
                                          " is not W_GATE/W_UP/W_DOWN/B_GATE/B_UP/B_DOWN");
    }
    for (const ReadDest& d : dests)
      KT_CHECK(d.id != id, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": argument id " + std::to_string(id) + " given twice");
    KT_CHECK(!bias || L.has_bias, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": layer " + std::to_string(L.layer) + " has no biases");
    const int64_t out = proj == kProjDown ? L.H : L.I, in = proj == kProjDown ? L.I : L.H;
    const char* name = kReadNames[proj + (bias ? 3 : 0)];
    View v = bias ? check_tensor(args[i].tensor, {name, kOut, {L.E, out}}, where)
                  : check_tensor(args[i].tensor, {name, kOut, {L.E, out, in}}, where);
    dests.push_back(ReadDest{id, v, proj, bias});
  }
  for (size_t i = 0; i < dests.size(); ++i) {
    check_writable(dests[i].v, where, read_name(dests[i]));
    for (size_t j = 0; j < i; ++j) check_disjoint(dests[i].v, read_name(dests[i]), dests[j].v, read_name(dests[j]), where);
  }
  return dests;
}


// One destination, every expert: stored values converted to its dtype, or
// for a quantized layer's weights each code times its scale (exact in fp32)
// converted.
void read_into(const MoeLayer& L, const ReadDest& d) {
  const int64_t out = d.proj == kProjDown ? L.H : L.I, in = d.proj == kProjDown ? L.I : L.H;
  const kt_ckpt_dtype dst_dt = from_dtype(d.v.dtype);
  for (int64_t e = 0; e < L.E; ++e) {
    if (L.quantized() && !d.bias) {
      const QuantSource src = quant_source(L, e, d.proj);
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const float v = quant_source_value(src, o, i);
          convert_elements(reinterpret_cast<const uint8_t*>(&v), KT_CKPT_DTYPE_F32, d.v.at(e, o, i), dst_dt, 1);
        }
      continue;
    }
    const SourceWalk w = source_walk(L, d.proj, d.bias, e);
    const kt_ckpt_dtype src_dt = w.src->entry->dtype;
    const size_t ses = st_dtype_info(src_dt).size;
    for (int64_t o = 0; o < out; ++o) {
      if (d.bias) {
        convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so) * ses, src_dt, d.v.at(e, o), dst_dt, 1);
        continue;
      }
      if (w.si == 1 && d.v.strides[2] == 1) {
        convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so) * ses, src_dt, d.v.at(e, o, 0), dst_dt,
                         in);
      } else {
        for (int64_t i = 0; i < in; ++i)
          convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so + i * w.si) * ses, src_dt,
                           d.v.at(e, o, i), dst_dt, 1);
      }
    }
  }
}

}  // namespace

void read_layer(const MoeLayer& L, const kt_arg* args, size_t num_args, const char* where) {
  KT_CHECK(num_args == 0 || args != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": args is NULL");
  KT_CHECK(L.quantized() ? L.dequantizable() : L.loadable(), KT_ERR_UNSUPPORTED,
           std::string(where) + ": layer " + std::to_string(L.layer) + " stores " +
               format_name(L.format) +
               " weights; only bf16/fp16/fp32 layers and the quantized formats kt decodes can be "
               "read into tensors");
  for (const ReadDest& d : read_destinations(L, args, num_args, where)) {
    // Nothing to copy; also keeps a layer of 2^62 zero-byte experts from
    // looping over them.
    if (d.v.numel() == 0) continue;
    read_into(L, d);
  }
}

}  // namespace io
}  // namespace kt