// Forward: route -> convert x once -> [LoRA A-projections of x] -> fused
// gate+up GEMM with bias, LoRA and activation in its epilogue -> [LoRA
// A-projection of a] -> down GEMM with bias, LoRA, routing weight and the
// combine in its epilogue (each work item owns a block of output columns for
// all tokens: no atomics, a fixed summation order). At decode on a quantized
// base whose gate/up items are whole experts, each item runs its expert's
// down right after (down_rows), and the combine follows (combine_rows).
// With the experts split over NUMA nodes, each node's workers take the items
// of the experts it owns (node_ranges, ThreadPool::run_grouped), and the
// down stage goes by expert too (forward_down_by_node): the same bits.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "moe/args.h"
#include "moe/blocking.h"
#include "moe/moe_layer.h"

using namespace kt;

namespace {

// Route columns the caller combines alone after the expert pass (8 routes
// of 2048: Qwen3-30B-A3B at T=1); past it the workers do, in column blocks.
constexpr int64_t kCallerCombine = 16384;

// One route's share of the combine: dst[j] += w * (c[j] + bias[j]) (or
// w * c[j]). Both down paths add with it, so their results are the same bits.
void add_route(float* dst, const float* c, const float* bias, float w, int64_t n) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) dst[j] += w * (c[j] + bias[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] += w * c[j];
  }
}

}  // namespace

kt_moe::ForwardCall kt_moe::check_forward(const kt_arg* args, size_t n, const char* where) const {
  ArgTable t(args, n, where, {KT_ARG_X, KT_ARG_IDS, KT_ARG_ROUTE_WEIGHTS, KT_ARG_Y});
  const int required[] = {KT_ARG_X, KT_ARG_IDS, KT_ARG_ROUTE_WEIGHTS, KT_ARG_Y};
  for (int id : required)
    KT_CHECK(t[id] != nullptr, KT_ERR_NULL_POINTER,
             std::string(where) + ": " + arg_name(id) + " is required");
  ForwardCall c;
  c.where = where;
  c.x = check_tensor(t[KT_ARG_X], {"KT_ARG_X", {DType::kBF16, DType::kF32}, {-1, H_}, true}, where);
  c.T = c.x.shape[0];
  KT_CHECK(c.T <= opt_.max_tokens, KT_ERR_TOO_MANY_TOKENS,
           std::string(where) + ": KT_ARG_X has " + std::to_string(c.T) +
               " tokens; the layer's max_tokens is " + std::to_string(opt_.max_tokens));
  c.ids = check_tensor(t[KT_ARG_IDS], {"KT_ARG_IDS", {DType::kI32, DType::kI64}, {c.T, top_k_}}, where);
  c.w = check_tensor(t[KT_ARG_ROUTE_WEIGHTS],
                     {"KT_ARG_ROUTE_WEIGHTS", {DType::kF32, DType::kBF16}, {c.T, top_k_}}, where);
  c.y = check_tensor(t[KT_ARG_Y], {"KT_ARG_Y", {c.x.dtype}, {c.T, H_}, true}, where);
  // Y is written while X, IDS and ROUTE_WEIGHTS are still read.
  check_writable(c.y, where, "KT_ARG_Y");
  check_disjoint(c.y, "KT_ARG_Y", c.x, "KT_ARG_X", where);
  check_disjoint(c.y, "KT_ARG_Y", c.ids, "KT_ARG_IDS", where);
  check_disjoint(c.y, "KT_ARG_Y", c.w, "KT_ARG_ROUTE_WEIGHTS", where);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < top_k_; ++j) {
      const int64_t e = c.ids.get_int(t, j);
      KT_CHECK(e >= -1 && e < E_, KT_ERR_EXPERT_ID,
               std::string(where) + ": KT_ARG_IDS[" + std::to_string(t) + "," + std::to_string(j) +
                   "] = " + std::to_string(e) + " is outside [-1, " + std::to_string(E_) + ")");
    }
  return c;
}

void kt_moe::check_ready_for_forward(const ForwardCall& c) const {
  const char* where = c.where;
  if (opt_.mode == KT_MODE_LORA)
    KT_CHECK(lora_ready_, KT_ERR_NOT_BOUND,
             std::string(where) +
                 ": LoRA mode: bind every targeted KT_ARG_LORA_A_* and KT_ARG_LORA_B_* first");
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < top_k_; ++j) {
      const int64_t e = c.ids.get_int(t, j);
      if (e < 0) continue;
      KT_CHECK(loaded_[static_cast<size_t>(e)] || skipped_[static_cast<size_t>(e)],
               KT_ERR_NOT_LOADED,
               std::string(where) + ": expert " + std::to_string(e) + " (KT_ARG_IDS[" +
                   std::to_string(t) + "," + std::to_string(j) +
                   "]) has no weights loaded and is not marked skipped");
    }
}

void kt_moe::route(const ForwardCall& c, Routing* R) {
  R->reserve(std::max<int64_t>(c.T, 1), top_k_, E_);
  R->tokens = c.T;
  std::fill(R->offsets.begin(), R->offsets.end(), 0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < top_k_; ++j) {
      const int64_t e = c.ids.get_int(t, j);
      if (e >= 0 && !skipped_[static_cast<size_t>(e)]) ++R->offsets[static_cast<size_t>(e) + 1];
    }
  R->active.clear();
  for (int64_t e = 0; e < E_; ++e) {
    if (R->offsets[static_cast<size_t>(e) + 1] > 0) R->active.push_back(static_cast<int32_t>(e));
    R->offsets[static_cast<size_t>(e) + 1] += R->offsets[static_cast<size_t>(e)];
  }
  R->routes = R->offsets[static_cast<size_t>(E_)];
  std::vector<int64_t>& fill = ws_->route_fill;
  fill.assign(R->offsets.begin(), R->offsets.end() - 1);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < top_k_; ++j) {
      const int64_t e = c.ids.get_int(t, j);
      if (e < 0 || skipped_[static_cast<size_t>(e)]) continue;
      const int64_t p = fill[static_cast<size_t>(e)]++;
      R->token[static_cast<size_t>(p)] = static_cast<int32_t>(t);
      R->slot[static_cast<size_t>(p)] = static_cast<int32_t>(t * top_k_ + j);
      R->weight[static_cast<size_t>(p)] = c.w.get(t, j);
    }
}

void kt_moe::chunk_items(const Routing& R) {
  ws_->items.clear();
  for (int32_t e : R.active) {
    const int64_t n = R.offsets[static_cast<size_t>(e) + 1] - R.offsets[static_cast<size_t>(e)];
    for (int64_t c = 0; c < ceil_div(n, kRowChunk); ++c) ws_->items.push_back((int64_t{e} << 32) | c);
  }
}

void kt_moe::block_items(const Routing& R, int64_t cols, int64_t width) {
  ws_->items.clear();
  for (int32_t e : R.active)
    for (int64_t b = 0; b < ceil_div(cols, width); ++b) ws_->items.push_back((int64_t{e} << 32) | b);
}

void kt_moe::pack_rows_a(const View& src, int64_t T, int64_t kp, void* dst, float* f32_copy) {
  const int64_t n = src.shape[1];
  engine_->pool->run(ceil_div(T, 16), [&](int64_t blk, int tid) {
    float* tmp = ws_->per_thread[static_cast<size_t>(tid)].grad.data();
    for (int64_t t = blk * 16; t < std::min(T, blk * 16 + 16); ++t) {
      const float* row;
      if (src.dtype == DType::kF32) {
        row = reinterpret_cast<const float*>(src.at(t, 0));
      } else {
        const bf16_t* b = reinterpret_cast<const bf16_t*>(src.at(t, 0));
        for (int64_t i = 0; i < n; ++i) tmp[i] = bf16_to_f32(b[i]);
        row = tmp;
      }
      if (f32_copy) std::memcpy(f32_copy + t * n, row, static_cast<size_t>(n) * sizeof(float));
      kernels_.pack_a_f32(row, n, kp, static_cast<char*>(dst) + t * kp * a_size_);
    }
  });
}

void kt_moe::quantize_rows(const void* src, DType dtype, int64_t n, int64_t k, int64_t ld,
                           const WeightOperand& w, Buffer<uint8_t>* dst) {
  const int64_t stride = w.int8_row_stride();
  dst->reserve(static_cast<size_t>(std::max<int64_t>(n * stride, 1)));
  uint8_t* out = dst->data();
  engine_->pool->run(ceil_div(n, 16), [&](int64_t blk, int tid) {
    float* tmp = ws_->per_thread[static_cast<size_t>(tid)].grad.data();
    for (int64_t i = blk * 16; i < std::min(n, blk * 16 + 16); ++i) {
      const float* row;
      if (dtype == DType::kF32) {
        row = static_cast<const float*>(src) + i * ld;
      } else {
        const bf16_t* b = static_cast<const bf16_t*>(src) + i * ld;
        for (int64_t j = 0; j < k; ++j) tmp[j] = bf16_to_f32(b[j]);
        row = tmp;
      }
      w.quantize_row(row, k, out + i * stride);
    }
  });
}

void kt_moe::rows_by_route(const Routing& R, const char* src, int64_t row_bytes,
                           Buffer<char>* dst) {
  dst->reserve(static_cast<size_t>(std::max<int64_t>(R.routes * row_bytes, 1)));
  char* out = dst->data();
  engine_->pool->run(ceil_div(R.routes, 64), [&](int64_t blk, int) {
    for (int64_t p = blk * 64; p < std::min(R.routes, blk * 64 + 64); ++p)
      std::memcpy(out + p * row_bytes, src + R.token[static_cast<size_t>(p)] * row_bytes,
                  static_cast<size_t>(row_bytes));
  });
}

void kt_moe::project_rows(const Routing& R, const float* mats, int64_t in, bool by_token,
                          const float* src, int64_t ld, float* out) {
  chunk_items(R);
  engine_->pool->run(static_cast<int64_t>(ws_->items.size()), [&](int64_t it, int tid) {
    const int64_t e = ws_->items[static_cast<size_t>(it)] >> 32;
    const int64_t c = ws_->items[static_cast<size_t>(it)] & 0xffffffff;
    const int64_t p0 = R.offsets[static_cast<size_t>(e)] + c * kRowChunk;
    const int64_t m = std::min(kRowChunk, R.offsets[static_cast<size_t>(e) + 1] - p0);
    auto& rows = ws_->per_thread[static_cast<size_t>(tid)].frows;
    for (int64_t i = 0; i < m; ++i)
      rows[static_cast<size_t>(i)] =
          by_token ? src + R.token[static_cast<size_t>(p0 + i)] * ld : src + (p0 + i) * ld;
    kernels_.sgemm_nt(static_cast<int>(m), static_cast<int>(r_), static_cast<int>(in), rows.data(),
                mats + e * r_ * in, in, out + p0 * r_, r_, false);
  });
}

// What the stages of one forward share: its routing, where x's rows are
// in A format (or as int8 rows), and the intermediates it keeps (saved in
// the context for a training forward, scratch otherwise).
struct kt_moe::ForwardPass {
  const ForwardCall& c;
  Routing& R;
  int64_t T = 0, routes = 0;
  bool int8 = false;        // the GEMMs read int8 rows of x and a
  int64_t xq_stride = 0;    // bytes between int8 rows of x
  int64_t aq_stride = 0;    // and of a
  bool x_by_route = false;  // x's rows laid out in route order (ws_->x_by_route)
  int64_t x_row_bytes = 0;
  float* xf = nullptr;      // x in fp32 (LoRA, the saved context), or null
  float* g = nullptr;       // gate and up before the activation (saved), or null
  float* u = nullptr;
  float* la[3] = {nullptr, nullptr, nullptr};  // LoRA A-projections
  int64_t max_rows = 0;     // the most routes of one expert
  int64_t W = 0;            // columns of I per gate/up item
  int64_t row_chunk = 0;    // rows per gate/up call (its C tile holds row_chunk x W)

  ForwardPass(const ForwardCall& call, Routing& routing) : c(call), R(routing) {}
  // The A row of x for route p (token t).
  const void* x_row(const kt_moe& m, int64_t p, int64_t t) const {
    if (x_by_route) return m.ws_->x_by_route.data() + p * x_row_bytes;
    if (int8) return m.ws_->x_int8.data() + t * xq_stride;
    return m.ws_->x_packed.data() + t * m.gate_shape_.kp * m.a_size_;
  }
};

// Stages in order, as the head comment of this file lists them.
void kt_moe::forward(const ForwardCall& c, kt_context* save) {
  check_ready_for_forward(c);
  fit_workspace();
  StageClock clock(engine_);
  clock.enter(KT_STAGE_ROUTE);
  ForwardPass f(c, save ? save->routing : ws_->routing);
  route(c, &f.R);
  f.T = c.T;
  f.routes = f.R.routes;
  clock.enter(KT_STAGE_PACK_INPUT);
  forward_inputs(f, save);
  clock.enter(KT_STAGE_LORA_A);
  for (int p = kGate; p <= kUp; ++p)
    if (lora_on(p)) project_rows(f.R, lora_[p].a.data(), H_, true, f.xf, H_, f.la[p]);
  // Whole experts as items at decode on compact operands: down follows in
  // the same pass.
  const bool whole_experts = plan_gate_up(f);
  clock.enter(whole_experts ? KT_STAGE_EXPERTS : KT_STAGE_GATE_UP);
  if (whole_experts) {
    forward_whole_experts(f);
    clock.enter(KT_STAGE_DOWN);
    combine_rows(c, f.R, round_up(H_, kPanelRows));
    return;
  }
  forward_gate_up(f);
  clock.enter(KT_STAGE_LORA_A);
  if (lora_on(kDown)) project_rows(f.R, lora_[kDown].a.data(), I_, false, ws_->act_f32.data(), I_, f.la[kDown]);
  clock.enter(KT_STAGE_DOWN);
  if (engine_->pool->groups() > 1)
    forward_down_by_node(f);
  else
    forward_down(f);
}

// x in A format (or int8 rows), in route order where the GEMMs read spaced
// rows in place, and the intermediates' buffers.
void kt_moe::forward_inputs(ForwardPass& f, kt_context* save) {
  const int64_t T = f.T, kpH = gate_shape_.kp, kpI = down_shape_.kp;
  if (save) {
    save->xf.reserve(static_cast<size_t>(std::max<int64_t>(T * H_, 1)));
    f.xf = save->xf.data();
  } else if (lora_on(kGate) || lora_on(kUp)) {
    ws_->x_f32.reserve(static_cast<size_t>(std::max<int64_t>(T * H_, 1)));
    f.xf = ws_->x_f32.data();
  }
  const WeightOperand &gate_w = operand_[kGate], &down_w = operand_[kDown];
  f.int8 = gate_w.int8_rows();
  f.xq_stride = f.int8 ? gate_w.int8_row_stride() : 0;
  f.aq_stride = f.int8 ? down_w.int8_row_stride() : 0;
  if (f.int8) {
    // Row t of x at t * strides[0] elements (the inner stride is 1: checked).
    quantize_rows(f.c.x.at(0, 0), f.c.x.dtype, T, H_, f.c.x.strides[0], gate_w, &ws_->x_int8);
  } else {
    ws_->x_packed.reserve(static_cast<size_t>(std::max<int64_t>(T * kpH * a_size_, 1)));
    pack_rows_a(f.c.x, T, kpH, ws_->x_packed.data(), f.xf);
  }
  // Where the GEMMs read only equally spaced rows in place (AMX tiles,
  // oneDNN), x's rows go once into route order: an expert's gate and up
  // calls (two per block of I) then read them where they lie instead of
  // each gathering them again.
  f.x_by_route = kernels_.gemm_reads_spaced_rows;
  f.x_row_bytes = f.int8 ? f.xq_stride : kpH * a_size_;
  if (f.x_by_route)
    rows_by_route(f.R, f.int8 ? reinterpret_cast<const char*>(ws_->x_int8.data()) : ws_->x_packed.data(), f.x_row_bytes, &ws_->x_by_route);

  const size_t rI = static_cast<size_t>(std::max<int64_t>(f.routes * I_, 1));
  const size_t rR = static_cast<size_t>(std::max<int64_t>(f.routes * r_, 1));
  if (save) {
    save->g.reserve(rI);
    save->u.reserve(rI);
    f.g = save->g.data();
    f.u = save->u.data();
  }
  for (int p = 0; p < 3; ++p) {
    if (!lora_on(p)) continue;
    Buffer<float>& b = save ? save->la[p] : ws_->lora_a_proj[p];
    b.reserve(rR);
    f.la[p] = b.data();
  }
  if (lora_on(kDown) || f.int8) ws_->act_f32.reserve(rI);
  if (!f.int8) ws_->act_packed.reserve(static_cast<size_t>(std::max<int64_t>(f.routes * kpI * a_size_, 1)));
}

// The gate/up items (expert, W columns of I) and their row chunks; true
// when they are whole experts at decode (down then follows each item).
bool kt_moe::plan_gate_up(ForwardPass& f) {
  const WeightOperand& gate_w = operand_[kGate];
  f.max_rows = 0;
  for (int32_t e : f.R.active)
    f.max_rows = std::max(f.max_rows, f.R.offsets[static_cast<size_t>(e) + 1] - f.R.offsets[static_cast<size_t>(e)]);
  // Items of W columns; their C tiles hold row_chunk rows of W (ldc W).
  // Compact operands only: a block of codes streams fewer bytes per call
  // than a bf16 block, so wider items pay there; over bf16 panels coarser
  // items end the workers less evenly (bench/README.md).
  f.W = gate_w.compact()
            ? gate_up_item_cols(static_cast<int64_t>(f.R.active.size()), f.max_rows, I_, engine_->pool->size())
            : kBlockCols;
  f.row_chunk = kRowChunk * kBlockCols / f.W;
  block_items(f.R, I_, f.W);
  return gate_w.compact() && f.T <= kRowChunk && f.W >= I_;
}

// The gate (q = kGate) or up panels of a gate/up item's first block of I.
PrefetchRegion kt_moe::gate_up_block(const ForwardPass& f, int q, int64_t item) const {
  const int64_t e = item >> 32, col0 = (item & 0xffffffff) * f.W;
  return operand_[q].block(e, col0, std::min(kBlockCols, I_ - col0));
}

// One gate/up item: gate and up panels of W columns of I for all of the
// expert's rows, LoRA, bias and the activation in the epilogue; `next` is
// the block the worker takes next.
void kt_moe::gate_up_item(const ForwardPass& f, ThreadScratch& s, int64_t item, const PrefetchRegion& next) {
  const Routing& R = f.R;
  const int64_t e = item >> 32;
  const int64_t col0 = (item & 0xffffffff) * f.W;
  const int64_t ncols = std::min(f.W, I_ - col0);
  const int np = static_cast<int>(ceil_div(ncols, kPanelRows));
  const PrefetchRegion up = gate_up_block(f, kUp, item);
  float* cg = s.c[0].data();
  float* cu = s.c[1].data();
  const int64_t pend = R.offsets[static_cast<size_t>(e) + 1];
  for (int64_t p0 = R.offsets[static_cast<size_t>(e)]; p0 < pend; p0 += f.row_chunk) {
    const int m = static_cast<int>(std::min(f.row_chunk, pend - p0));
    for (int i = 0; i < m; ++i) s.rows[static_cast<size_t>(i)] = f.x_row(*this, p0 + i, R.token[static_cast<size_t>(p0 + i)]);
    const bool last = p0 + f.row_chunk >= pend;
    operand_[kGate].gemm(s.operand, e, col0 / kPanelRows, np, s.rows.data(), m, cg, f.W, up);
    operand_[kUp].gemm(s.operand, e, col0 / kPanelRows, np, s.rows.data(), m, cu, f.W,
                       last ? next : PrefetchRegion{});
    for (int q = kGate; q <= kUp; ++q) {
      if (!lora_on(q)) continue;
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = f.la[q] + (p0 + i) * r_;
      kernels_.sgemm_nn(m, static_cast<int>(ncols), static_cast<int>(r_), s.frows.data(),
                  lora_[q].sbt.data() + e * r_ * I_ + col0, I_, q == kGate ? cg : cu, f.W, true);
    }
    for (int i = 0; i < m; ++i) gate_up_row(f, s, e, p0 + i, col0, ncols, cg + i * f.W, cu + i * f.W);
  }
}

// The epilogue of route p's row of a gate/up item (columns [col0, col0 +
// ncols) of I): bias, the saved g and u, the activation, and a in A format.
void kt_moe::gate_up_row(const ForwardPass& f, ThreadScratch& s, int64_t e, int64_t p, int64_t col0,
                         int64_t ncols, float* gi, float* ui) {
  if (opt_.has_bias) {
    const float* bg = b_[kGate].data() + e * I_ + col0;
    const float* bu = b_[kUp].data() + e * I_ + col0;
    for (int64_t j = 0; j < ncols; ++j) {
      gi[j] += bg[j];
      ui[j] += bu[j];
    }
  }
  if (f.g) {
    std::memcpy(f.g + p * I_ + col0, gi, static_cast<size_t>(ncols) * sizeof(float));
    std::memcpy(f.u + p * I_ + col0, ui, static_cast<size_t>(ncols) * sizeof(float));
  }
  const ActParams act{opt_.activation, opt_.act_alpha, opt_.act_limit};
  float* ai = lora_on(kDown) || f.int8 ? ws_->act_f32.data() + p * I_ + col0 : s.c[2].data();
  kernels_.act_forward(act, gi, ui, ai, ncols);
  if (f.int8) return;  // quantized per row once every block of the row is in
  // The last block also zero-pads the row to kpI (a quantized base with
  // groups of 128 pads K past the next block).
  const int64_t kpI = down_shape_.kp;
  const int64_t pad_to = col0 + ncols == I_ ? kpI - col0 : ncols;
  kernels_.pack_a_f32(ai, ncols, pad_to, ws_->act_packed.data() + (p * kpI + col0) * a_size_);
}

// Each expert's down right after its gate/up (whose last up call fetches the
// down's first panels): no stage boundary between them, so no hand-off and
// no wait for the slowest worker between the stages. The combine follows.
void kt_moe::forward_whole_experts(const ForwardPass& f) {
  const int64_t ldy = round_up(H_, kPanelRows);
  ws_->route_down_out.reserve(static_cast<size_t>(std::max<int64_t>(f.routes * ldy, 1)));
  if (f.int8) ws_->act_int8.reserve(static_cast<size_t>(std::max<int64_t>(f.routes * f.aq_stride, 1)));
  const ItemRanges ranges = node_ranges();
  engine_->pool->run_grouped(ranges.group_bounds.data(), [&](int64_t range, int tid) {
    ThreadScratch& s = ws_->per_thread[static_cast<size_t>(tid)];
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it) {
      const int64_t item = ws_->items[static_cast<size_t>(it)];
      note_worker(item >> 32, tid);
      gate_up_item(f, s, item, operand_[kDown].block(item >> 32, 0, std::min(kBlockCols, H_)));
      down_rows(s, f.R, item >> 32, f.la[kDown], ldy,
                it + 1 < ranges.end(range) ? gate_up_block(f, kGate, ws_->items[static_cast<size_t>(it + 1)])
                                           : PrefetchRegion{});
    }
  });
}

// The gate/up stage over its items; with int8 rows, each route's activation
// then as an int8 row, now that it is whole.
void kt_moe::forward_gate_up(const ForwardPass& f) {
  const ItemRanges ranges = node_ranges();
  engine_->pool->run_grouped(ranges.group_bounds.data(), [&](int64_t range, int tid) {
    // While the up panels run, the next item's gate panels come in.
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it) {
      note_worker(ws_->items[static_cast<size_t>(it)] >> 32, tid);
      gate_up_item(f, ws_->per_thread[static_cast<size_t>(tid)], ws_->items[static_cast<size_t>(it)],
                   it + 1 < ranges.end(range) ? gate_up_block(f, kGate, ws_->items[static_cast<size_t>(it + 1)])
                                              : PrefetchRegion{});
    }
  });
  if (f.int8) quantize_rows(ws_->act_f32.data(), DType::kF32, f.routes, I_, I_, operand_[kDown], &ws_->act_int8);
}

// Down + bias + LoRA + routing weight + combine; items own a block of H
// columns for a range of tokens.
void kt_moe::forward_down(const ForwardPass& f) {
  ws_->token_sum.reserve(static_cast<size_t>(std::max<int64_t>(f.T * H_, 1)));
  CombineSplit split = CombineSplit::plan(f.T, H_, engine_->pool->size());
  if (operand_[kDown].compact()) split.widen_for_quantized_decode(f.T, H_, engine_->pool->size(), f.max_rows);
  // The first down panels of an item: the first active expert's, the
  // item's first block of columns.
  const auto first_block_of = [&](int64_t item) {
    if (f.R.active.empty()) return PrefetchRegion{};
    const int64_t col0 = (item % split.col_blocks) * split.cols;
    return operand_[kDown].block(f.R.active[0], col0, std::min({kBlockCols, split.cols, H_ - col0}));
  };
  const ItemRanges ranges(split.items(), engine_->pool->size());
  engine_->pool->run(ranges.count, [&](int64_t range, int tid) {
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it)
      down_item(f, split, ws_->per_thread[static_cast<size_t>(tid)], it,
                it + 1 < ranges.end(range) ? first_block_of(it + 1) : PrefetchRegion{});
  });
}

// One down item: its columns for its tokens, every active expert in order,
// in blocks of call_cols per expert so that the expert's rows of a stay in
// cache across the blocks; `after` is the first block of the item the
// worker takes next.
void kt_moe::down_item(const ForwardPass& f, const CombineSplit& split, ThreadScratch& s, int64_t item,
                       const PrefetchRegion& after) {
  const Routing& R = f.R;
  const WeightOperand& down_w = operand_[kDown];
  const int64_t call_cols = split.call_cols, kpI = down_shape_.kp;
  const int64_t col0 = (item % split.col_blocks) * split.cols;
  const int64_t ncols = std::min(split.cols, H_ - col0);
  const int64_t t0 = (item / split.col_blocks) * split.token_chunk;
  const int64_t t1 = std::min(f.T, t0 + split.token_chunk);
  float* acc = ws_->token_sum.data();
  clear_columns(acc, t0, t1, H_, col0, ncols);
  float* co = s.c[0].data();
  // The down panels of expert e for the columns [sc0, sc0 + call_cols).
  const auto block_of_down = [&](int64_t e, int64_t sc0) {
    return down_w.block(e, sc0, std::min(call_cols, col0 + ncols - sc0));
  };
  for (size_t ai = 0; ai < R.active.size(); ++ai) {
    const int32_t e = R.active[ai];
    int64_t pbegin, pend;
    token_range(R.token.data(), R.offsets[static_cast<size_t>(e)], R.offsets[static_cast<size_t>(e) + 1], t0, t1,
                &pbegin, &pend);
    for (int64_t sc0 = col0; sc0 < col0 + ncols; sc0 += call_cols) {
      const int64_t sn = std::min(call_cols, col0 + ncols - sc0);
      const int np = static_cast<int>(ceil_div(sn, kPanelRows));
      // The next panels (next block, the next expert's first, or past the
      // last expert the worker's next item's first) come in while these run.
      const PrefetchRegion next = sc0 + call_cols < col0 + ncols ? block_of_down(e, sc0 + call_cols)
                                  : ai + 1 < R.active.size()     ? block_of_down(R.active[ai + 1], col0)
                                                                 : after;
      const float* bd = opt_.has_bias ? b_[kDown].data() + e * H_ + sc0 : nullptr;
      for (int64_t p0 = pbegin; p0 < pend; p0 += kRowChunk) {
        const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
        for (int i = 0; i < m; ++i)
          s.rows[static_cast<size_t>(i)] = f.int8 ? static_cast<const void*>(ws_->act_int8.data() + (p0 + i) * f.aq_stride)
                                                  : static_cast<const void*>(ws_->act_packed.data() + (p0 + i) * kpI * a_size_);
        down_w.gemm(s.operand, e, sc0 / kPanelRows, np, s.rows.data(), m, co, call_cols,
                    p0 + kRowChunk >= pend ? next : PrefetchRegion{});
        if (lora_on(kDown)) {
          for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = f.la[kDown] + (p0 + i) * r_;
          kernels_.sgemm_nn(m, static_cast<int>(sn), static_cast<int>(r_), s.frows.data(),
                      lora_[kDown].sbt.data() + e * r_ * H_ + sc0, H_, co, call_cols, true);
        }
        for (int i = 0; i < m; ++i)
          add_route(acc + R.token[static_cast<size_t>(p0 + i)] * H_ + sc0, co + i * call_cols, bd,
                    R.weight[static_cast<size_t>(p0 + i)], sn);
      }
    }
  }
  store_columns(acc, t0, t1, H_, col0, ncols, f.c.y);
}

// The down stage with the experts split over NUMA nodes: items of an expert
// and a block of H columns, each node's workers taking its experts', into
// the routes' rows of ws_->route_down_out; then y from those rows
// (combine_rows), which adds them as forward_down's column items do.
void kt_moe::forward_down_by_node(const ForwardPass& f) {
  const int64_t ldy = round_up(H_, kPanelRows);
  ws_->route_down_out.reserve(static_cast<size_t>(std::max<int64_t>(f.routes * ldy, 1)));
  const int64_t width =
      gate_up_item_cols(static_cast<int64_t>(f.R.active.size()), f.max_rows, H_, engine_->pool->size());
  block_items(f.R, H_, width);
  const ItemRanges ranges = node_ranges();
  const auto first_block_of = [&](int64_t item) {
    const int64_t col0 = (item & 0xffffffff) * width;
    return operand_[kDown].block(item >> 32, col0, std::min({kBlockCols, width, H_ - col0}));
  };
  engine_->pool->run_grouped(ranges.group_bounds.data(), [&](int64_t range, int tid) {
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it) {
      const int64_t item = ws_->items[static_cast<size_t>(it)];
      note_worker(item >> 32, tid);
      down_block(f, ws_->per_thread[static_cast<size_t>(tid)], item, width, ldy,
                 it + 1 < ranges.end(range) ? first_block_of(ws_->items[static_cast<size_t>(it + 1)])
                                            : PrefetchRegion{});
    }
  });
  combine_rows(f.c, f.R, ldy);
}

// One (expert, width columns of H) item of forward_down_by_node: the down
// GEMM and LoRA's B of the expert's routes for those columns, as down_item
// computes them.
void kt_moe::down_block(const ForwardPass& f, ThreadScratch& s, int64_t item, int64_t width, int64_t ldy,
                        const PrefetchRegion& next) {
  const Routing& R = f.R;
  const int64_t e = item >> 32;
  const int64_t col0 = (item & 0xffffffff) * width;
  const int64_t ncols = std::min(width, H_ - col0);
  const int np = static_cast<int>(ceil_div(ncols, kPanelRows));
  const int64_t kpI = down_shape_.kp;
  const int64_t pend = R.offsets[static_cast<size_t>(e) + 1];
  for (int64_t p0 = R.offsets[static_cast<size_t>(e)]; p0 < pend; p0 += kRowChunk) {
    const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
    for (int i = 0; i < m; ++i)
      s.rows[static_cast<size_t>(i)] = f.int8 ? static_cast<const void*>(ws_->act_int8.data() + (p0 + i) * f.aq_stride)
                                              : static_cast<const void*>(ws_->act_packed.data() + (p0 + i) * kpI * a_size_);
    float* yp = ws_->route_down_out.data() + p0 * ldy + col0;
    operand_[kDown].gemm(s.operand, e, col0 / kPanelRows, np, s.rows.data(), m, yp, ldy,
                         p0 + kRowChunk >= pend ? next : PrefetchRegion{});
    if (lora_on(kDown)) {
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = f.la[kDown] + (p0 + i) * r_;
      kernels_.sgemm_nn(m, static_cast<int>(ncols), static_cast<int>(r_), s.frows.data(),
                  lora_[kDown].sbt.data() + e * r_ * H_ + col0, H_, yp, ldy, true);
    }
  }
}

// One expert's down for its routes, all H columns in one call (its streams
// run through the expert's panels), into the routes' rows of ws_->route_down_out (ldy apart):
// with the LoRA A-projection of a before it (as project_rows computes it) and
// each row of a as int8 (KT_COMPUTE_INT8), and LoRA's B after. `next`: the
// panels the worker reads next.
void kt_moe::down_rows(ThreadScratch& s, const Routing& R, int64_t e, float* la_down, int64_t ldy,
                       const PrefetchRegion& next) {
  const WeightOperand& down_w = operand_[kDown];
  const bool int8 = down_w.int8_rows();
  const int64_t aq_stride = int8 ? down_w.int8_row_stride() : 0;
  const int64_t kpI = down_shape_.kp;
  const int np = static_cast<int>(ceil_div(H_, kPanelRows));
  const int64_t pend = R.offsets[static_cast<size_t>(e) + 1];
  for (int64_t p0 = R.offsets[static_cast<size_t>(e)]; p0 < pend; p0 += kRowChunk) {
    const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
    if (lora_on(kDown)) {
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = ws_->act_f32.data() + (p0 + i) * I_;
      kernels_.sgemm_nt(m, static_cast<int>(r_), static_cast<int>(I_), s.frows.data(),
                  lora_[kDown].a.data() + e * r_ * I_, I_, la_down + p0 * r_, r_, false);
    }
    for (int i = 0; i < m; ++i) {
      const int64_t p = p0 + i;
      if (int8) {
        down_w.quantize_row(ws_->act_f32.data() + p * I_, I_, ws_->act_int8.data() + p * aq_stride);
        s.rows[static_cast<size_t>(i)] = ws_->act_int8.data() + p * aq_stride;
      } else {
        s.rows[static_cast<size_t>(i)] = ws_->act_packed.data() + p * kpI * a_size_;
      }
    }
    float* yp = ws_->route_down_out.data() + p0 * ldy;
    down_w.gemm(s.operand, e, 0, np, s.rows.data(), m, yp, ldy,
                p0 + kRowChunk >= pend ? next : PrefetchRegion{});
    if (lora_on(kDown)) {
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = la_down + (p0 + i) * r_;
      kernels_.sgemm_nn(m, static_cast<int>(H_), static_cast<int>(r_), s.frows.data(),
                  lora_[kDown].sbt.data() + e * r_ * H_, H_, yp, ldy, true);
    }
  }
}

// y from the routes' down rows (ws_->route_down_out): per token, the routes added in expert
// order with bias and routing weight, as the column items of the down stage
// add them (the same bits). On the caller while it is small, else by the
// workers in blocks of columns.
void kt_moe::combine_rows(const ForwardCall& c, const Routing& R, int64_t ldy) {
  const int64_t T = c.T;
  ThreadPool& pool = *engine_->pool;
  ws_->token_sum.reserve(static_cast<size_t>(std::max<int64_t>(T * H_, 1)));
  float* acc = ws_->token_sum.data();
  const float* yr = ws_->route_down_out.data();
  const int64_t cols =
      R.routes * H_ <= kCallerCombine ? H_ : round_up(ceil_div(H_, 4 * pool.size()), kPanelRows);
  pool.run(ceil_div(H_, cols), [&](int64_t b, int) {
    const int64_t col0 = b * cols, n = std::min(cols, H_ - col0);
    clear_columns(acc, 0, T, H_, col0, n);
    for (int32_t e : R.active) {
      const float* bd = opt_.has_bias ? b_[kDown].data() + e * H_ + col0 : nullptr;
      for (int64_t p = R.offsets[static_cast<size_t>(e)]; p < R.offsets[static_cast<size_t>(e) + 1];
           ++p)
        add_route(acc + R.token[static_cast<size_t>(p)] * H_ + col0, yr + p * ldy + col0, bd,
                  R.weight[static_cast<size_t>(p)], n);
    }
    store_columns(acc, 0, T, H_, col0, n, c.y);
  });
}
