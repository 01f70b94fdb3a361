#include "moe/ckpt_load.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "core/buffer.h"
#include "core/ckpt_names.h"
#include "core/sized_struct.h"
#include "io/elements.h"
#include "io/layout_parts.h"
#include "moe/args.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"

// Loading a checkpoint's layer into a kt_moe: per-expert and fused tensors
// as stored (zero-copy where aligned), quantized layers in their own format
// or dequantized.

namespace kt {
namespace io {

namespace {

// A DLTensor over mapped (or copied) bytes with its own shape storage.
struct Tensor3 {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
  void set(const void* data, kt_ckpt_dtype dt, int ndim, const int64_t* s, const int64_t* st) {
    t.data = const_cast<void*>(data);
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = ndim;
    t.dtype = dl_dtype(dt);
    for (int i = 0; i < ndim; ++i) {
      shape[i] = s[i];
      strides[i] = st[i];
    }
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = 0;
  }
};

bool aligned_for(const void* p, kt_ckpt_dtype dt) {
  return reinterpret_cast<uintptr_t>(p) % st_dtype_info(dt).size == 0;
}

// What of the layer a kt_moe holds (kt_ckpt_load_options): the checkpoint
// experts of its experts, in order, and a slice [i0, i1) of the
// intermediate dimension.
struct Share {
  std::vector<int64_t> experts;
  int64_t i0 = 0, i1 = 0;
  bool zero_down_bias = false;
  int64_t E() const { return static_cast<int64_t>(experts.size()); }
  int64_t I() const { return i1 - i0; }
  bool whole(const MoeLayer& L) const {
    if (E() != L.E || i0 != 0 || i1 != L.I || zero_down_bias) return false;
    for (int64_t e = 0; e < L.E; ++e)
      if (experts[static_cast<size_t>(e)] != e) return false;
    return true;
  }
  // The kt_moe experts [k, k + n) as a stacked map (index -> its expert).
  std::vector<int64_t> local_map(int64_t k, int64_t n) const {
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = k + i;
    return map;
  }
};

Share share_of(const MoeLayer& L, const kt_ckpt_load_options& o, const char* where) {
  const std::string at = std::string(where) + ": layer " + std::to_string(L.layer) + ": options->";
  Share s;
  KT_CHECK(o.zero_down_bias == 0 || o.zero_down_bias == 1, KT_ERR_INVALID_ARGUMENT,
           at + "zero_down_bias = " + std::to_string(o.zero_down_bias) + " is not 0 or 1");
  s.zero_down_bias = o.zero_down_bias == 1 && L.has_bias;
  if (o.experts == nullptr) {
    KT_CHECK(o.num_experts == 0, KT_ERR_INVALID_ARGUMENT,
             at + "num_experts = " + std::to_string(o.num_experts) + " without an experts list");
    s.experts.resize(static_cast<size_t>(L.E));
    for (int64_t e = 0; e < L.E; ++e) s.experts[static_cast<size_t>(e)] = e;
  } else {
    KT_CHECK(o.num_experts >= 1 && o.num_experts <= L.E, KT_ERR_INVALID_ARGUMENT,
             at + "num_experts = " + std::to_string(o.num_experts) + " is not in [1, " + std::to_string(L.E) +
                 "] (the layer's experts)");
    std::vector<uint8_t> seen(static_cast<size_t>(L.E), 0);
    for (int64_t i = 0; i < o.num_experts; ++i) {
      const int64_t e = o.experts[i];
      KT_CHECK(e >= 0 && e < L.E, KT_ERR_INVALID_ARGUMENT,
               at + "experts[" + std::to_string(i) + "] = " + std::to_string(e) + " is not an expert of the layer [0, " +
                   std::to_string(L.E) + ")");
      KT_CHECK(!seen[static_cast<size_t>(e)], KT_ERR_INVALID_ARGUMENT,
               at + "experts[" + std::to_string(i) + "] = " + std::to_string(e) + " is listed twice");
      seen[static_cast<size_t>(e)] = 1;
      s.experts.push_back(e);
    }
  }
  s.i0 = o.intermediate_begin;
  s.i1 = o.intermediate_end;
  if (s.i0 == 0 && s.i1 == 0) s.i1 = L.I;
  KT_CHECK(s.i0 >= 0 && s.i0 < s.i1 && s.i1 <= L.I, KT_ERR_INVALID_ARGUMENT,
           at + "intermediate_begin, _end = " + std::to_string(o.intermediate_begin) + ", " +
               std::to_string(o.intermediate_end) + " is not a slice of the intermediate dimension [0, " +
               std::to_string(L.I) + ") (0, 0 = all of it)");
  return s;
}

void check_moe_matches(const MoeLayer& L, const Share& share, const kt_moe* moe, const char* where) {
  KT_CHECK(moe != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": moe is NULL");
  KT_CHECK(L.loadable() || L.dequantizable(), KT_ERR_UNSUPPORTED,
           std::string(where) + ": layer " + std::to_string(L.layer) + " stores " +
               format_name(L.format) + " " + dtype_name(L.weight_dtype) +
               " weights" +
               (L.unsupported.empty() ? std::string("; this kt cannot read them")
                                      : ": " + L.unsupported));
  auto same = [&](const char* what, int64_t layer_v, int64_t moe_v) {
    KT_CHECK(layer_v == moe_v, KT_ERR_SHAPE,
             std::string(where) + ": layer " + std::to_string(L.layer) + " has " + what + " = " +
                 std::to_string(layer_v) + " but the kt_moe was created with " +
                 std::to_string(moe_v));
  };
  const bool sliced = share.E() != L.E || share.I() != L.I;
  same(sliced ? "num_experts (in the share loaded)" : "num_experts", share.E(), moe->num_experts());
  same("hidden", L.H, moe->hidden());
  same(sliced ? "intermediate (in the share loaded)" : "intermediate", share.I(), moe->intermediate());
  same("biases (1 = present)", L.has_bias ? 1 : 0, moe->options().has_bias ? 1 : 0);
}

// Calls moe->load for the stacked experts `map` (stacked index i holds
// logical expert map[i]) under the engine's compute lock.
void load_chunk(kt_moe* moe, const kt_load_options& lo, std::vector<kt_arg> args, std::vector<int64_t> map,
                const char* where) {
  const int64_t n = static_cast<int64_t>(map.size());
  Tensor3 mt;
  const int64_t one = 1;
  mt.set(map.data(), KT_CKPT_DTYPE_I64, 1, &n, &one);
  args.push_back(kt_arg{KT_ARG_EXPERT_MAP, &mt.t});
  std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
  moe->load(lo, args.data(), args.size(), -1, where);
}

// Experts in the order their gate tensors sit in the files: writers sort
// tensor names, so experts 1, 10, 100, ... follow each other at a constant
// stride, and one strided DLTensor (with an expert map) covers many.
std::vector<int64_t> file_order(const MoeLayer& L) {
  std::vector<int64_t> order(static_cast<size_t>(L.E));
  for (int64_t e = 0; e < L.E; ++e) order[static_cast<size_t>(e)] = e;
  auto gate_of = [&](int64_t e) { return L.experts[static_cast<size_t>(e)][kProjGate].weight; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const TensorRef *ga = gate_of(a), *gb = gate_of(b);
    if (ga->file != gb->file) return ga->file->path() < gb->file->path();
    return ga->data < gb->data;
  });
  return order;
}

// A run of experts, consecutive in file order, whose tensors sit at a
// constant byte stride per projection: one strided DLTensor covers them.
struct ExpertRun {
  std::vector<int64_t> map;  // the run's experts (stacked index -> expert)
  int64_t stride[3] = {0, 0, 0};
};

// The longest run (at most 32 experts) from order[k0].
ExpertRun grow_run(const MoeLayer& L, const std::vector<int64_t>& order, int64_t k0) {
  constexpr int64_t kMaxRun = 32;
  auto tensor_of = [&](int64_t k, int p) {
    return L.experts[static_cast<size_t>(order[static_cast<size_t>(k)])][static_cast<size_t>(p)].weight;
  };
  ExpertRun run;
  int64_t n = 1;
  bool all_aligned = true;
  for (int p = 0; p < 3; ++p) all_aligned = all_aligned && aligned_for(tensor_of(k0, p)->data, tensor_of(k0, p)->entry->dtype);
  while (all_aligned && k0 + n < L.E && n < kMaxRun) {
    bool fits = true;
    for (int p = 0; p < 3 && fits; ++p) {
      const TensorRef* first = tensor_of(k0, p);
      const TensorRef* next = tensor_of(k0 + n, p);
      const int64_t es = static_cast<int64_t>(st_dtype_info(first->entry->dtype).size);
      const int64_t d = next->data - first->data;
      if (next->file != first->file || next->entry->dtype != first->entry->dtype) {
        fits = false;
      } else if (n == 1) {
        if (d <= 0 || d % es != 0) fits = false;
        else run.stride[p] = d;
      } else if (d != run.stride[p] * n) {
        fits = false;
      }
    }
    if (!fits) break;
    ++n;
  }
  run.map.assign(order.begin() + k0, order.begin() + k0 + n);
  return run;
}

// The load arguments of a run: views of its weights (zero-copy when
// aligned, else copied) and its biases gathered as fp32. Not moved once
// filled: args point into it.
struct RunArgs {
  Tensor3 w[3], b[3];
  std::vector<kt::Buffer<char>> copies;
  std::vector<kt_arg> args;

  const void* place(const TensorRef* r) {
    if (aligned_for(r->data, r->entry->dtype)) return r->data;
    copies.emplace_back(static_cast<size_t>(r->entry->nbytes()));
    std::memcpy(copies.back().data(), r->data, static_cast<size_t>(r->entry->nbytes()));
    return copies.back().data();
  }
};

constexpr int kWeightArgs[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
constexpr int kBiasArgs[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};

void add_run_weights(const MoeLayer& L, const ExpertRun& run, RunArgs* a) {
  const int64_t n = static_cast<int64_t>(run.map.size());
  for (int p = 0; p < 3; ++p) {
    const ProjTensors& pt = L.experts[static_cast<size_t>(run.map[0])][static_cast<size_t>(p)];
    const int64_t out = proj_out(L, p), in = proj_in(L, p);
    const int64_t es = static_cast<int64_t>(st_dtype_info(pt.weight->entry->dtype).size);
    const int64_t shape[3] = {n, out, in};
    const int64_t strides[3] = {n > 1 ? run.stride[p] / es : out * in, in, 1};
    a->w[p].set(a->place(pt.weight), pt.weight->entry->dtype, 3, shape, strides);
    a->args.push_back(kt_arg{kWeightArgs[p], &a->w[p].t});
  }
}

// Biases are small: the run's are gathered into one contiguous fp32 block.
void add_run_biases(const MoeLayer& L, const ExpertRun& run, RunArgs* a) {
  const int64_t n = static_cast<int64_t>(run.map.size());
  for (int p = 0; p < 3; ++p) {
    const int64_t out = proj_out(L, p);
    a->copies.emplace_back(static_cast<size_t>(n * out) * sizeof(float));
    float* gathered = reinterpret_cast<float*>(a->copies.back().data());
    for (int64_t i = 0; i < n; ++i) {
      const TensorRef* br = L.experts[static_cast<size_t>(run.map[static_cast<size_t>(i)])][static_cast<size_t>(p)].bias;
      convert_elements(br->data, br->entry->dtype, gathered + i * out, KT_CKPT_DTYPE_F32, out);
    }
    const int64_t shape[2] = {n, out};
    const int64_t strides[2] = {out, 1};
    a->b[p].set(gathered, KT_CKPT_DTYPE_F32, 2, shape, strides);
    a->args.push_back(kt_arg{kBiasArgs[p], &a->b[p].t});
  }
}

// The run is packed: its source pages need not stay resident.
void release_run(const MoeLayer& L, const ExpertRun& run) {
  for (int64_t e : run.map)
    for (const ProjTensors& pt : L.experts[static_cast<size_t>(e)]) {
      release_mapped_pages(pt.weight->data, static_cast<size_t>(pt.weight->entry->nbytes()));
      if (pt.bias) release_mapped_pages(pt.bias->data, static_cast<size_t>(pt.bias->entry->nbytes()));
    }
}

void load_per_expert(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                     const char* where) {
  const kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  const std::vector<int64_t> order = file_order(L);
  int64_t done = 0;
  while (done < L.E) {
    ExpertRun run = grow_run(L, order, done);
    const int64_t n = static_cast<int64_t>(run.map.size());
    {
      RunArgs a;
      add_run_weights(L, run, &a);
      if (L.has_bias) add_run_biases(L, run, &a);
      load_chunk(moe, lo, a.args, run.map, where);
    }
    release_run(L, run);
    done += n;
    if (progress) progress(done, L.E, user);
  }
}

void load_fused(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                const char* where) {
  kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  const bool in_out = L.layout != KT_CKPT_LAYOUT_FUSED;
  lo.orientation = in_out ? KT_ORIENT_IN_OUT : KT_ORIENT_OUT_IN;
  lo.gate_up_order = L.layout == KT_CKPT_LAYOUT_GPT_OSS ? KT_GATE_UP_INTERLEAVED : KT_GATE_UP_CONCAT;
  const int64_t kChunk = 16;
  for (int64_t e0 = 0; e0 < L.E; e0 += kChunk) {
    const int64_t n = std::min(kChunk, L.E - e0);
    std::vector<kt::Buffer<char>> copies;
    std::vector<kt_arg> args;
    std::vector<std::pair<const uint8_t*, size_t>> consumed;
    Tensor3 t[4];
    auto stacked = [&](const TensorRef* r, int id, Tensor3* dst) {
      const auto& s = r->entry->shape;
      int64_t per = 1;
      for (size_t i = 1; i < s.size(); ++i) per *= s[i];
      const size_t es = st_dtype_info(r->entry->dtype).size;
      const uint8_t* p = r->data + static_cast<size_t>(e0 * per) * es;
      consumed.emplace_back(p, static_cast<size_t>(n * per) * es);
      const void* data = p;
      if (!aligned_for(p, r->entry->dtype)) {
        copies.emplace_back(static_cast<size_t>(n * per) * es);
        std::memcpy(copies.back().data(), p, copies.back().size());
        data = copies.back().data();
      }
      int64_t shape[3] = {n, s.size() > 1 ? s[1] : 1, s.size() > 2 ? s[2] : 1};
      int64_t strides[3] = {per, s.size() > 2 ? s[2] : 1, 1};
      dst->set(data, r->entry->dtype, static_cast<int>(s.size()), shape, strides);
      args.push_back(kt_arg{id, &dst->t});
    };
    stacked(L.gate_up, KT_ARG_W_GATE_UP, &t[0]);
    stacked(L.down, KT_ARG_W_DOWN, &t[1]);
    if (L.has_bias) {
      stacked(L.gate_up_bias, KT_ARG_B_GATE_UP, &t[2]);
      stacked(L.down_bias, KT_ARG_B_DOWN, &t[3]);
    }
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = e0 + i;
    load_chunk(moe, lo, args, std::move(map), where);
    for (const auto& range : consumed) release_mapped_pages(range.first, range.second);
    if (progress) progress(e0 + n, L.E, user);
  }
}

// How a quantized layer is stored, for messages.
std::string stored_text(const MoeLayer& L) {
  switch (L.format) {
    case KT_CKPT_FORMAT_FP8_BLOCK:
      return "fp8 e4m3 with a scale per " + std::to_string(L.block_rows) + " x " + std::to_string(L.group) + " block";
    case KT_CKPT_FORMAT_INT4_GROUP:
      return std::string("compressed-tensors int4 in groups of ") + std::to_string(L.group) +
             (L.asymmetric ? ", asymmetric" : ", symmetric");
    case KT_CKPT_FORMAT_MXFP4: return "mxfp4 (e2m1 with e8m0 scales per 32)";
    default: return format_name(L.format);
  }
}

// Biases of expert e, projection p, as fp32 (out values).
void bias_rows(const MoeLayer& L, int64_t e, int p, float* dst) {
  const int64_t out = p == kProjDown ? L.H : L.I;
  if (L.layout == KT_CKPT_LAYOUT_PER_EXPERT || L.layout == KT_CKPT_LAYOUT_MIXTRAL) {
    const TensorRef* b = L.experts[static_cast<size_t>(e)][static_cast<size_t>(p)].bias;
    convert_elements(b->data, b->entry->dtype, dst, KT_CKPT_DTYPE_F32, out);
    return;
  }
  const TensorRef* b = p == kProjDown ? L.down_bias : L.gate_up_bias;
  const size_t es = st_dtype_info(b->entry->dtype).size;
  if (p == kProjDown) {
    convert_elements(b->data + static_cast<size_t>(e * L.H) * es, b->entry->dtype, dst, KT_CKPT_DTYPE_F32, out);
    return;
  }
  const bool inter = L.layout == KT_CKPT_LAYOUT_GPT_OSS;
  for (int64_t o = 0; o < out; ++o) {
    const int64_t j = inter ? 2 * o + (p == kProjUp) : o + (p == kProjUp ? L.I : 0);
    convert_elements(b->data + static_cast<size_t>(e * 2 * L.I + j) * es, b->entry->dtype, dst + o, KT_CKPT_DTYPE_F32, 1);
  }
}

// Expert g's biases of projection p over the share's outputs (gate and up:
// the slice; down: every output, or zeros), as fp32.
void share_bias_rows(const MoeLayer& L, const Share& share, int64_t g, int p, float* dst) {
  if (p == kProjDown) {
    if (share.zero_down_bias) std::fill(dst, dst + L.H, 0.f);
    else bias_rows(L, g, p, dst);
    return;
  }
  std::vector<float> all(static_cast<size_t>(L.I));
  bias_rows(L, g, p, all.data());
  std::copy(all.begin() + share.i0, all.begin() + share.i1, dst);
}

// A share of a dense layer (any layout): each of its experts goes as
// strided views of the mapped projections, cut to the slice (copied to fp32
// where the mapping is not aligned for the dtype), so only the share's
// bytes are read.
void load_dense_share(const MoeLayer& L, const Share& share, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                      const char* where) {
  const kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  for (int64_t k = 0; k < share.E(); ++k) {
    const int64_t g = share.experts[static_cast<size_t>(k)];
    RunArgs a;
    std::vector<std::pair<const uint8_t*, size_t>> consumed;
    for (int p = 0; p < 3; ++p) {
      SourceWalk w = source_walk(L, p, false, g);
      const bool down = p == kProjDown;
      const int64_t out = down ? L.H : share.I(), in = down ? share.I() : L.H;
      w.base += share.i0 * (down ? w.si : w.so);
      const kt_ckpt_dtype dt = w.src->entry->dtype;
      const size_t es = st_dtype_info(dt).size;
      const uint8_t* first = w.src->data + static_cast<size_t>(w.base) * es;
      consumed.emplace_back(first, static_cast<size_t>((out - 1) * w.so + (in - 1) * w.si + 1) * es);
      const int64_t shape[3] = {1, out, in};
      if (aligned_for(first, dt)) {
        const int64_t strides[3] = {out * in, w.so, w.si};
        a.w[p].set(first, dt, 3, shape, strides);
      } else {
        a.copies.emplace_back(static_cast<size_t>(out * in) * sizeof(float));
        float* dst = reinterpret_cast<float*>(a.copies.back().data());
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i)
            convert_elements(first + static_cast<size_t>(o * w.so + i * w.si) * es, dt, dst + o * in + i,
                             KT_CKPT_DTYPE_F32, 1);
        const int64_t strides[3] = {out * in, in, 1};
        a.w[p].set(dst, KT_CKPT_DTYPE_F32, 3, shape, strides);
      }
      a.args.push_back(kt_arg{kWeightArgs[p], &a.w[p].t});
      if (L.has_bias) {
        a.copies.emplace_back(static_cast<size_t>(out) * sizeof(float));
        float* b = reinterpret_cast<float*>(a.copies.back().data());
        share_bias_rows(L, share, g, p, b);
        const int64_t bshape[2] = {1, out};
        const int64_t bstrides[2] = {out, 1};
        a.b[p].set(b, KT_CKPT_DTYPE_F32, 2, bshape, bstrides);
        a.args.push_back(kt_arg{kBiasArgs[p], &a.b[p].t});
      }
    }
    load_chunk(moe, lo, a.args, share.local_map(k, 1), where);
    for (const auto& range : consumed) release_mapped_pages(range.first, range.second);
    if (progress) progress(k + 1, share.E(), user);
  }
}

constexpr int64_t kQuantLoadChunk = 16;

// Projection p of checkpoint expert g of a quantized layer, cut to the
// share's slice: gate and up rows start at i0, down columns at i0 (on whole
// groups, checked by check_native_slice).
QuantSource share_quant_source(const MoeLayer& L, const Share& share, int64_t g, int p) {
  QuantSource src = quant_source(L, g, p);
  if (share.i0 == 0) return src;
  if (p != kProjDown) {
    src.row0 += share.i0 * src.row_step;
    return src;
  }
  const int64_t groups = share.i0 / src.group;
  src.codes += share.i0 * src.bits / 8;
  src.scales += groups * static_cast<int64_t>(st_dtype_info(src.scale_dtype).size);
  if (src.zeros) src.zeros += groups * 4;
  return src;
}

// A slice of a quantized layer loads as stored only on whole scale groups:
// down's columns on groups, gate and up rows on scale blocks and zero-point
// words.
void check_native_slice(const MoeLayer& L, const Share& share, const char* where) {
  auto on = [&](int64_t step, int64_t v) { return v % step == 0 || v == L.I; };
  const int64_t rows = std::max<int64_t>(L.block_rows, L.asymmetric ? 8 : 1);
  const bool ok = on(L.group, share.i0) && on(L.group, share.i1) && on(rows, share.i0) && on(rows, share.i1);
  KT_CHECK(ok, KT_ERR_UNSUPPORTED,
           std::string(where) + ": layer " + std::to_string(L.layer) + ": the slice [" + std::to_string(share.i0) +
               ", " + std::to_string(share.i1) + ") of the intermediate dimension cuts " + stored_text(L) +
               " scale groups: as stored, its ends must be multiples of " + std::to_string(std::max(L.group, rows)) +
               " (or the end of the dimension); or load it dequantized (options->dequantize = 1, a bf16 kt_moe)");
}

// Checks every expert's codes and scales (under the compute lock, a chunk
// at a time, on the engine's threads) before anything is stored.
void check_quant_sources(const MoeLayer& L, const Share& share, kt_moe* moe, bool native, const char* where) {
  for (int64_t e0 = 0; e0 < share.E(); e0 += kQuantLoadChunk) {
    const int64_t n = std::min(kQuantLoadChunk, share.E() - e0);
    std::vector<SourceProblem> problems(static_cast<size_t>(n * 3));
    {
      std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
      moe->engine()->pool->run(n * 3, [&](int64_t i, int) {
        const int64_t g = share.experts[static_cast<size_t>(e0 + i / 3)];
        const int p = static_cast<int>(i % 3);
        const int64_t out = p == kProjDown ? L.H : share.I(), in = p == kProjDown ? share.I() : L.H;
        problems[static_cast<size_t>(i)] = check_quant_source(share_quant_source(L, share, g, p), out, in,
                                                              native ? &moe->quant_shape(p) : nullptr);
      });
    }
    for (const SourceProblem& problem : problems)
      if (problem.status != KT_OK)
        fail(problem.status, std::string(where) + ": layer " + std::to_string(L.layer) + ": tensor '" +
                                 problem.text + "; nothing was loaded");
  }
}

// The mapped source bytes (codes, scales, zero points, biases) of the
// share's experts [k0, k0 + n) of a quantized layer, each range to `use`.
void quant_source_ranges(const MoeLayer& L, const Share& share, int64_t k0, int64_t n,
                         void (*use)(const void*, size_t)) {
  for (int64_t k = k0; k < k0 + n; ++k) {
    const int64_t e = share.experts[static_cast<size_t>(k)];
    if (L.layout == KT_CKPT_LAYOUT_GPT_OSS) {
      for (const TensorRef* t : {L.gate_up, L.down, L.gate_up_scales, L.down_scales, L.gate_up_bias, L.down_bias})
        if (t) {  // expert e of a tensor stacked over E
          const size_t per = static_cast<size_t>(t->entry->nbytes() / L.E);
          use(t->data + static_cast<size_t>(e) * per, per);
        }
      continue;
    }
    for (const ProjTensors& pt : L.experts[static_cast<size_t>(e)])
      for (const TensorRef* t : {pt.weight, pt.scale, pt.zero, pt.bias})
        if (t) use(t->data, static_cast<size_t>(t->entry->nbytes()));
  }
}

void load_quantized_native(const MoeLayer& L, const Share& share, kt_moe* moe, kt_ckpt_progress_fn progress,
                           void* user, const char* where) {
  if (share.I() != L.I) check_native_slice(L, share, where);
  check_quant_sources(L, share, moe, true, where);
  // The disk reads the next chunk's sources while this one is packed: a
  // checkpoint of many small tensors (128 experts x 3 projections a layer)
  // faulted in a few pages at a time reads at half the disk's rate.
  const int64_t E = share.E();
  quant_source_ranges(L, share, 0, std::min(kQuantLoadChunk, E), prefetch_mapped_pages);
  for (int64_t e0 = 0; e0 < E; e0 += kQuantLoadChunk) {
    const int64_t n = std::min(kQuantLoadChunk, E - e0);
    if (e0 + n < E) quant_source_ranges(L, share, e0 + n, std::min(kQuantLoadChunk, E - e0 - n), prefetch_mapped_pages);
    std::vector<float> biases[3];
    if (L.has_bias)
      for (int p = 0; p < 3; ++p) {
        const int64_t out = p == kProjDown ? L.H : share.I();
        biases[p].resize(static_cast<size_t>(n * out));
        for (int64_t i = 0; i < n; ++i)
          share_bias_rows(L, share, share.experts[static_cast<size_t>(e0 + i)], p, biases[p].data() + i * out);
      }
    {
      std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
      moe->store_quantized(
          share.local_map(e0, n),
          [&](int64_t i, int p, uint8_t* dst) {
            pack_quant_source(share_quant_source(L, share, share.experts[static_cast<size_t>(e0 + i)], p),
                              moe->quant_shape(p), dst);
          },
          L.has_bias ? biases : nullptr);
    }
    // Packed: the sources need not stay resident.
    quant_source_ranges(L, share, e0, n, release_mapped_pages);
    if (progress) progress(e0 + n, E, user);
  }
}

// A quantized layer into a bf16 layer: each expert dequantized to fp32
// (exact) and loaded as any fp32 source is (rounded to bf16 once).
void load_dequantized(const MoeLayer& L, const Share& share, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                      const char* where) {
  check_quant_sources(L, share, moe, false, where);
  kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  static const int kW[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
  static const int kB[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
  constexpr int64_t kChunk = 4;
  const int64_t E = share.E();
  for (int64_t e0 = 0; e0 < E; e0 += kChunk) {
    const int64_t n = std::min(kChunk, E - e0);
    std::vector<kt::Buffer<float>> values(3), biases(3);
    Tensor3 w[3], b[3];
    std::vector<kt_arg> args;
    for (int p = 0; p < 3; ++p) {
      const bool down = p == kProjDown;
      const int64_t out = down ? L.H : share.I(), in = down ? share.I() : L.H;
      // The slice: gate and up rows, down columns, from i0.
      const int64_t r0 = down ? 0 : share.i0, c0 = down ? share.i0 : 0;
      values[static_cast<size_t>(p)].resize(static_cast<size_t>(n * out * in));
      float* dst = values[static_cast<size_t>(p)].data();
      {
        std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
        moe->engine()->pool->run(n * out, [&](int64_t row, int) {
          const QuantSource src = quant_source(L, share.experts[static_cast<size_t>(e0 + row / out)], p);
          const int64_t r = r0 + row % out;
          for (int64_t c = 0; c < in; ++c) dst[row * in + c] = quant_source_value(src, r, c0 + c);
        });
      }
      const int64_t shape[3] = {n, out, in};
      const int64_t strides[3] = {out * in, in, 1};
      w[p].set(dst, KT_CKPT_DTYPE_F32, 3, shape, strides);
      args.push_back(kt_arg{kW[p], &w[p].t});
      if (L.has_bias) {
        biases[static_cast<size_t>(p)].resize(static_cast<size_t>(n * out));
        for (int64_t i = 0; i < n; ++i)
          share_bias_rows(L, share, share.experts[static_cast<size_t>(e0 + i)], p,
                          biases[static_cast<size_t>(p)].data() + i * out);
        const int64_t bshape[2] = {n, out};
        const int64_t bstrides[2] = {out, 1};
        b[p].set(biases[static_cast<size_t>(p)].data(), KT_CKPT_DTYPE_F32, 2, bshape, bstrides);
        args.push_back(kt_arg{kB[p], &b[p].t});
      }
    }
    load_chunk(moe, lo, args, share.local_map(e0, n), where);
    if (progress) progress(e0 + n, E, user);
  }
}

// Which way a quantized layer goes into moe, or why it cannot.
void load_quantized(const MoeLayer& L, const Share& share, kt_moe* moe, const kt_ckpt_load_options& o,
                    kt_ckpt_progress_fn progress, void* user, const char* where) {
  const kt_weight_format have = moe->options().weight_format;
  const std::string head = std::string(where) + ": layer " + std::to_string(L.layer) + " stores " + stored_text(L) +
                           "; the kt_moe stores " + weight_format_name(have);
  if (have == L.native_format && L.loadable()) {
    load_quantized_native(L, share, moe, progress, user, where);
    return;
  }
  if (have == KT_FORMAT_BF16) {
    KT_CHECK(o.dequantize != 0, KT_ERR_UNSUPPORTED,
             head + ": create the kt_moe with weight_format " +
                 weight_format_name(L.native_format) +
                 (L.loadable() ? std::string(" (kt_ckpt_moe_options sets it)")
                               : " (which cannot hold it: " + L.unsupported + ")") +
                 ", or ask for a dequantized load (kt_ckpt_load_options.dequantize = 1)");
    load_dequantized(L, share, moe, progress, user, where);
    return;
  }
  fail(KT_ERR_UNSUPPORTED,
       head + (have == L.native_format ? ": " + L.unsupported
                                         : std::string(": a quantized checkpoint is never re-quantized; create the "
                                                       "kt_moe with weight_format ") +
                                               weight_format_name(L.native_format) +
                                               ", or bf16 with kt_ckpt_load_options.dequantize = 1"));
}

}  // namespace

void load_layer(const MoeLayer& layer, kt_moe* moe, const kt_ckpt_load_options& options,
                kt_ckpt_progress_fn progress, void* user, const char* where) {
  const Share share = share_of(layer, options, where);
  check_moe_matches(layer, share, moe, where);
  if (layer.quantized())
    load_quantized(layer, share, moe, options, progress, user, where);
  else if (!share.whole(layer))
    load_dense_share(layer, share, moe, progress, user, where);
  else if (layer.layout == KT_CKPT_LAYOUT_PER_EXPERT || layer.layout == KT_CKPT_LAYOUT_MIXTRAL)
    load_per_expert(layer, moe, progress, user, where);
  else
    load_fused(layer, moe, progress, user, where);
}

}  // namespace io
}  // namespace kt
