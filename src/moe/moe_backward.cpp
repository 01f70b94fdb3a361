// Backward of a saved forward: da' = Wd_eff^T dy with W^T panels made in cache
// (no second copy of the weights in memory), the routing-weight gradient from
// the same pass (<dy, o> = <Wd_eff^T dy, a> + <dy, bd>), the activation
// derivative, dx with column ownership (fixed summation order), then LoRA or
// full parameter gradients as per-expert reductions over rows.
#include <algorithm>
#include <cstring>

#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "moe/args.h"
#include "moe/blocking.h"
#include "moe/moe_layer.h"

using namespace kt;

kt_moe::BackwardCall kt_moe::check_backward(const kt_context* ctx, const kt_backward_options* o,
                                            const kt_arg* args, size_t n, const char* where,
                                            bool forward_may_pend) const {
  KT_CHECK(opt_.compute != KT_COMPUTE_INT8, KT_ERR_MODE,
           std::string(where) +
               ": the layer computes with int8 activations (KT_COMPUTE_INT8), which have no "
               "backward");
  BackwardCall c;
  c.where = where;
  c.opt = defaults_of<kt_backward_options>(set_backward_options_defaults);
  if (o) {
    // As every options struct: older callers (smaller struct_size) get the
    // defaults of what they do not know; newer callers' fields past ours
    // must be zero.
    KT_CHECK(o->struct_size >= offsetof(kt_backward_options, accumulate) &&
                 o->struct_size <= kMaxOptionsStructSize,
             KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": options->struct_size (" + std::to_string(o->struct_size) +
                 ") is not the size of a kt_backward_options; call kt_backward_options_init first");
    std::memcpy(&c.opt, o, std::min(o->struct_size, sizeof(c.opt)));
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(o);
    for (size_t i = sizeof(c.opt); i < o->struct_size; ++i)
      KT_CHECK(bytes[i] == 0, KT_ERR_UNSUPPORTED,
               std::string(where) + ": options sets fields this kt version does not know (byte " +
                   std::to_string(i) + " past the " + std::to_string(sizeof(c.opt)) + " it knows)");
    c.opt.struct_size = sizeof(c.opt);
  }
  check_backward_values(c.opt, where);
  KT_CHECK(ctx != nullptr, KT_ERR_CONTEXT,
           std::string(where) +
               ": ctx is NULL: backward needs the context of a forward run with saved != NULL");
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    KT_CHECK(forward_may_pend || ctx->state != kt_context::kPending, KT_ERR_CONTEXT,
             std::string(where) + ": ctx: its forward has not finished (wait for the forward job)");
    KT_CHECK(ctx->state != kt_context::kFailed, KT_ERR_CONTEXT,
             std::string(where) + ": ctx: its forward failed");
    KT_CHECK(ctx->state != kt_context::kSpent, KT_ERR_CONTEXT,
             std::string(where) + ": ctx is spent: a backward already consumed it");
  }
  ArgTable t(args, n, where, {KT_ARG_DY, KT_ARG_DX, KT_ARG_DROUTE_WEIGHTS});
  KT_CHECK(t[KT_ARG_DY] != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": KT_ARG_DY is required");
  const int64_t T = ctx->tokens;
  c.dy = check_tensor(t[KT_ARG_DY], {"KT_ARG_DY", {DType::kBF16, DType::kF32}, {T, H_}, true}, where);
  if (t[KT_ARG_DX]) {
    c.dx = check_tensor(t[KT_ARG_DX], {"KT_ARG_DX", {ctx->x_dtype}, {T, H_}, true}, where);
    c.has_dx = true;
  }
  if (t[KT_ARG_DROUTE_WEIGHTS]) {
    c.dw = check_tensor(t[KT_ARG_DROUTE_WEIGHTS],
                        {"KT_ARG_DROUTE_WEIGHTS", {DType::kF32, DType::kBF16}, {T, top_k_}}, where);
    c.has_dw = true;
  }
  // DX and DROUTE_WEIGHTS are written while DY is still read.
  if (c.has_dx) {
    check_writable(c.dx, where, "KT_ARG_DX");
    check_disjoint(c.dx, "KT_ARG_DX", c.dy, "KT_ARG_DY", where);
  }
  if (c.has_dw) {
    check_writable(c.dw, where, "KT_ARG_DROUTE_WEIGHTS");
    check_disjoint(c.dw, "KT_ARG_DROUTE_WEIGHTS", c.dy, "KT_ARG_DY", where);
    if (c.has_dx) check_disjoint(c.dw, "KT_ARG_DROUTE_WEIGHTS", c.dx, "KT_ARG_DX", where);
  }
  return c;
}

void kt_moe::check_backward_state(const BackwardCall& c) const {
  const char* where = c.where;
  if (c.opt.param_grads && opt_.mode == KT_MODE_LORA) {
    for (int p = 0; p < 3; ++p) {
      if (!lora_on(p)) continue;
      for (int id : {KT_ARG_GRAD_LORA_A_GATE + 2 * p, KT_ARG_GRAD_LORA_B_GATE + 2 * p})
        KT_CHECK(bound_[id].set, KT_ERR_NOT_BOUND,
                 std::string(where) + ": " + arg_name(id) +
                     " is not bound (kt_moe_bind), or pass param_grads = 0");
    }
  }
  if (c.opt.param_grads && opt_.mode == KT_MODE_FULL) {
    for (int p = 0; p < 3; ++p) {
      int ids[2] = {KT_ARG_GRAD_W_GATE + p, KT_ARG_GRAD_B_GATE + p};
      for (int k = 0; k < (opt_.has_bias ? 2 : 1); ++k)
        KT_CHECK(bound_[ids[k]].set, KT_ERR_NOT_BOUND,
                 std::string(where) + ": " + arg_name(ids[k]) +
                     " is not bound (kt_moe_bind), or pass param_grads = 0");
    }
  }
  // The gradient buffers this call writes must not share memory with its
  // other tensors.
  if (c.opt.param_grads && opt_.mode != KT_MODE_INFERENCE) {
    for (int id = KT_ARG_GRAD_LORA_A_GATE; id <= KT_ARG_GRAD_B_DOWN; ++id) {
      if (!bound_[id].set) continue;
      const View& g = bound_[id].view;
      check_disjoint(g, arg_name(id), c.dy, "KT_ARG_DY", where);
      if (c.has_dx) check_disjoint(c.dx, "KT_ARG_DX", g, arg_name(id), where);
      if (c.has_dw) check_disjoint(c.dw, "KT_ARG_DROUTE_WEIGHTS", g, arg_name(id), where);
    }
  }
}

void kt_moe::write_grad(const View& dst, int64_t e, int64_t row0, const float* src, int64_t rows,
                        int64_t cols, bool transpose_src, float scale, bool accumulate, int64_t ld) const {
  // src == nullptr writes zeros (experts no token reached, overwrite mode).
  const int last = dst.ndim - 1;
  const bool unit = dst.shape[last] <= 1 || dst.strides[last] == 1;
  const int64_t step = transpose_src ? rows : 1;
  if (ld == 0) ld = cols;
  // Zeros into a block whose rows are contiguous: one fill.
  if (!src && !accumulate && unit && (rows == 1 || dst.ndim != 3 || dst.strides[1] == cols)) {
    zero_bytes_streaming(dst.ndim == 3 ? dst.at(e, row0, 0) : dst.at(e, row0),
                         static_cast<size_t>(rows * cols) * dst.elem_size());
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = src ? (transpose_src ? src + i : src + i * ld) : nullptr;
    if (!unit) {  // any strides: element by element
      for (int64_t j = 0; j < cols; ++j) {
        const float v = s ? scale * s[j * step] : 0.f;
        char* p = dst.ndim == 3 ? dst.at(e, row0 + i, j) : dst.at(e, row0 + j);
        store_f32(p, dst.dtype, accumulate ? load_as_f32(p, dst.dtype) + v : v);
      }
      continue;
    }
    char* row = dst.ndim == 3 ? dst.at(e, row0 + i, 0) : dst.at(e, row0);
    if (dst.dtype == DType::kF32) {
      float* d = reinterpret_cast<float*>(row);
      if (!s) {
        if (!accumulate) std::memset(d, 0, static_cast<size_t>(cols) * sizeof(float));
      } else if (accumulate) {
        for (int64_t j = 0; j < cols; ++j) d[j] += scale * s[j * step];
      } else {
        for (int64_t j = 0; j < cols; ++j) d[j] = scale * s[j * step];
      }
    } else {
      bf16_t* d = reinterpret_cast<bf16_t*>(row);
      if (!s) {
        if (!accumulate) std::memset(d, 0, static_cast<size_t>(cols) * sizeof(bf16_t));
      } else {
        for (int64_t j = 0; j < cols; ++j)
          d[j] = f32_to_bf16(accumulate ? bf16_to_f32(d[j]) + scale * s[j * step] : scale * s[j * step]);
      }
    }
  }
}

// What the stages of one backward share.
struct kt_moe::BackwardPass {
  kt_context* ctx;
  const BackwardCall& c;
  const Routing& R;
  int64_t T = 0, routes = 0;
  int64_t Hp = 0, Ip = 0;   // K of the W_d^T and W_g^T / W_u^T panels (padded H, I)
  int64_t nIb = 0;          // blocks of I: parts of each route's routing-weight gradient
  bool need_act = false;    // the activation is recomputed for the parameter gradients
  bool dy_by_route = false; // dy's rows laid out in route order (ws_->dy_by_route)

  BackwardPass(kt_context* context, const BackwardCall& call) : ctx(context), c(call), R(context->routing) {}
};

// Stages in order: dy in A format -> [LoRA of down] -> da' per (expert, block
// of I) with dg, du and the routing-weight parts -> [LoRA of gate/up] -> dx
// per block of H -> routing-weight gradients -> parameter gradients.
void kt_moe::backward(kt_context* ctx, const BackwardCall& c) {
  check_backward_state(c);
  fit_workspace();
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    KT_CHECK(ctx->state != kt_context::kPending, KT_ERR_CONTEXT,
             "kt_moe_backward: ctx: its forward job never ran (its layer was destroyed first)");
    KT_CHECK(ctx->state != kt_context::kFailed, KT_ERR_CONTEXT,
             "kt_moe_backward: ctx: its forward failed");
    KT_CHECK(ctx->state != kt_context::kSpent, KT_ERR_CONTEXT,
             "kt_moe_backward: ctx is spent: a backward already consumed it");
  }
  StageClock clock(engine_);
  BackwardPass b(ctx, c);
  const bool full = opt_.mode == KT_MODE_FULL && c.opt.param_grads;
  const bool lora_grads = opt_.mode == KT_MODE_LORA && c.opt.param_grads;
  b.need_act = full || (lora_grads && lora_on(kDown));
  clock.enter(KT_STAGE_PACK_INPUT);
  backward_inputs(b);
  clock.enter(KT_STAGE_BWD_LORA);
  if (lora_on(kDown)) project_rows(b.R, lora_[kDown].sbt.data(), H_, true, ws_->dy_f32.data(), H_, ws_->lora_b_proj[kDown].data());
  clock.enter(KT_STAGE_BWD_DOWN);
  backward_down(b);
  clock.enter(KT_STAGE_BWD_LORA);
  for (int p = kGate; p <= kUp; ++p)
    if (lora_on(p))
      project_rows(b.R, lora_[p].sbt.data(), I_, false, p == kGate ? ws_->d_gate.data() : ws_->d_up.data(), I_, ws_->lora_b_proj[p].data());
  clock.enter(KT_STAGE_BWD_DX);
  if (c.has_dx) backward_dx(b);
  clock.enter(KT_STAGE_BWD_ROUTE);
  if (c.has_dw) routing_weight_gradients(b);
  if (lora_grads) {
    clock.enter(KT_STAGE_LORA_GRADS);
    lora_gradients(ctx, c);
  }
  if (full) {
    clock.enter(KT_STAGE_FULL_GRADS);
    full_gradients(ctx, c);
  }
  clock.stop();
  std::lock_guard<std::mutex> lock(state_mutex_);
  ctx->state = kt_context::kSpent;
}

// dy in fp32 and in A format (K' = padded H of the W_d^T panels), in route
// order where the GEMM reads only equally spaced rows in place (as x in the
// forward), and the intermediates' buffers.
void kt_moe::backward_inputs(BackwardPass& b) {
  b.T = b.R.tokens;
  b.routes = b.R.routes;
  b.Hp = down_shape_.padded_rows();
  b.Ip = gate_shape_.padded_rows();
  b.nIb = ceil_div(I_, kBlockCols);
  ws_->dy_f32.reserve(static_cast<size_t>(std::max<int64_t>(b.T * H_, 1)));
  ws_->dy_packed.reserve(static_cast<size_t>(std::max<int64_t>(b.T * b.Hp * a_size_, 1)));
  pack_rows_a(b.c.dy, b.T, b.Hp, ws_->dy_packed.data(), ws_->dy_f32.data());
  b.dy_by_route = kernels_.gemm_reads_spaced_rows;
  if (b.dy_by_route) rows_by_route(b.R, ws_->dy_packed.data(), b.Hp * a_size_, &ws_->dy_by_route);
  const size_t rI = static_cast<size_t>(std::max<int64_t>(b.routes * I_, 1));
  const size_t rR = static_cast<size_t>(std::max<int64_t>(b.routes * r_, 1));
  for (int p = 0; p < 3; ++p)
    if (lora_on(p)) ws_->lora_b_proj[p].reserve(rR);
  ws_->d_gate.reserve(rI);
  ws_->d_up.reserve(rI);
  if (b.need_act) ws_->act_f32.reserve(rI);
  ws_->d_gate_packed.reserve(static_cast<size_t>(std::max<int64_t>(b.routes * b.Ip * a_size_, 1)));
  ws_->d_up_packed.reserve(static_cast<size_t>(std::max<int64_t>(b.routes * b.Ip * a_size_, 1)));
  ws_->route_weight_parts.reserve(static_cast<size_t>(std::max<int64_t>(b.routes * b.nIb, 1)));
}

// da' = dy . Wd_eff per (expert, block of I), then dg, du and the parts of
// the routing-weight gradients. Experts read straight from W's panels take
// items of `wide` blocks while every worker keeps 4 items: each call then
// streams longer slices of the panels.
void kt_moe::backward_down(const BackwardPass& b) {
  const Routing& R = b.R;
  int64_t wide = 1;
  if (operand_[kDown].reads_w_straight(1)) {
    const int64_t want = 4 * static_cast<int64_t>(engine_->pool->size());
    const int64_t experts = static_cast<int64_t>(R.active.size());
    while (2 * wide * kBlockCols <= kMaxItemCols && experts * ceil_div(b.nIb, 2 * wide) >= want) wide *= 2;
  }
  ws_->items.clear();
  for (int32_t e : R.active) {
    const int64_t f = operand_[kDown].reads_w_straight(R.offsets[static_cast<size_t>(e) + 1] -
                                                       R.offsets[static_cast<size_t>(e)])
                          ? wide
                          : 1;
    for (int64_t ib = 0; ib < b.nIb; ib += f) ws_->items.push_back((int64_t{e} << 32) | ib);
  }
  // What an item reads first (its W^T panels' source, or its slices' heads).
  const auto down_source = [&](int64_t item) {
    const int64_t e = item >> 32, col0 = (item & 0xffffffff) * kBlockCols;
    return operand_[kDown].transposed_block(e, col0, std::min(kBlockCols, I_ - col0));
  };
  const ItemRanges ranges = node_ranges();
  engine_->pool->run_grouped(ranges.group_bounds.data(), [&](int64_t range, int tid) {
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it) {
      note_worker(ws_->items[static_cast<size_t>(it)] >> 32, tid);
      backward_down_item(b, ws_->per_thread[static_cast<size_t>(tid)], ws_->items[static_cast<size_t>(it)], wide,
                         it + 1 < ranges.end(range) ? down_source(ws_->items[static_cast<size_t>(it + 1)])
                                                    : PrefetchRegion{});
    }
  });
}

// One item: da' for a block of I (straight from W's panels: `wide` blocks)
// over all of the expert's rows, then per block of kBlockCols its dg, du and
// routing-weight parts; `next` is the source of the worker's next item,
// fetched while this one computes.
void kt_moe::backward_down_item(const BackwardPass& b, ThreadScratch& s, int64_t item, int64_t wide,
                                const PrefetchRegion& next) {
  const Routing& R = b.R;
  const int64_t e = item >> 32;
  const int64_t ib0 = item & 0xffffffff;
  const int64_t pend = R.offsets[static_cast<size_t>(e) + 1];
  const bool straight = operand_[kDown].reads_w_straight(pend - R.offsets[static_cast<size_t>(e)]);
  const int64_t ld = (straight ? wide : 1) * kBlockCols;  // cda's row stride: the item's columns
  const int64_t col0 = ib0 * kBlockCols;
  const int64_t ncols = std::min(ld, I_ - col0);
  const int np = static_cast<int>(ceil_div(ncols, kPanelRows));
  const ActParams act{opt_.activation, opt_.act_alpha, opt_.act_limit};
  if (!straight) operand_[kDown].transposed(s.operand, e, col0, ncols, s.panels[0].data());
  float* cda = s.c[0].data();
  for (int64_t p0 = R.offsets[static_cast<size_t>(e)]; p0 < pend; p0 += kRowChunk) {
    const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
    for (int i = 0; i < m; ++i)
      s.rows[static_cast<size_t>(i)] = b.dy_by_route
                                           ? ws_->dy_by_route.data() + (p0 + i) * b.Hp * a_size_
                                           : ws_->dy_packed.data() + R.token[static_cast<size_t>(p0 + i)] * b.Hp * a_size_;
    const PrefetchRegion& ahead = p0 + kRowChunk >= pend ? next : PrefetchRegion{};
    if (straight) {
      operand_[kDown].gemm_t(e, s.rows.data(), m, col0, ncols, cda, ld, false, ahead);
    } else {
      kernels_.gemm_bf16w(s.rows.data(), m, b.Hp, s.panels[0].data(), kPanelRows * b.Hp, np, cda, ld, false, ahead);
    }
    if (lora_on(kDown)) {
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = ws_->lora_b_proj[kDown].data() + (p0 + i) * r_;
      kernels_.sgemm_nn(m, static_cast<int>(ncols), static_cast<int>(r_), s.frows.data(),
                  lora_[kDown].a.data() + e * r_ * I_ + col0, I_, cda, ld, true);
    }
    for (int i = 0; i < m; ++i) {
      const int64_t p = p0 + i;
      const float w = R.weight[static_cast<size_t>(p)];
      // Per block of kBlockCols: the routing-weight parts go per block
      // whatever the item's width (the same sums in the same order).
      for (int64_t c = col0; c < col0 + ncols; c += kBlockCols) {
        const int64_t n = std::min(kBlockCols, I_ - c);
        const float* gp = b.ctx->g.data() + p * I_ + c;
        const float* up = b.ctx->u.data() + p * I_ + c;
        float* dgp = ws_->d_gate.data() + p * I_ + c;
        float* dup = ws_->d_up.data() + p * I_ + c;
        const float part = kernels_.act_backward(act, gp, up, cda + i * ld + (c - col0), w, dgp, dup,
                                                 b.need_act ? ws_->act_f32.data() + p * I_ + c : nullptr, n);
        ws_->route_weight_parts[static_cast<size_t>(p * b.nIb + c / kBlockCols)] = part;
        const int64_t kp = std::min(kBlockCols, b.Ip - c);
        kernels_.pack_a_f32(dgp, n, kp, ws_->d_gate_packed.data() + (p * b.Ip + c) * a_size_);
        kernels_.pack_a_f32(dup, n, kp, ws_->d_up_packed.data() + (p * b.Ip + c) * a_size_);
      }
    }
  }
}

bool kt_moe::reads_w_straight(const Routing& R, int64_t e) const {
  const int64_t routes = R.offsets[static_cast<size_t>(e) + 1] - R.offsets[static_cast<size_t>(e)];
  return operand_[kGate].reads_w_straight(routes) && operand_[kUp].reads_w_straight(routes);
}

// cx[m, sn] = dg . Wg + du . Wu over columns [c0, c0 + sn) of routes
// [p0, p0 + m) of expert e: from W's panels (straight), or from the W^T
// panels in s.panels[0] and [1]. next_gate, next_up: what comes after each.
void kt_moe::dx_product(const BackwardPass& b, ThreadScratch& s, bool straight, int64_t e, int64_t p0, int m,
                        int64_t c0, int64_t sn, float* cx, int64_t ldc, const PrefetchRegion& next_gate,
                        const PrefetchRegion& next_up) {
  const int64_t Ip = b.Ip;
  const int np = static_cast<int>(ceil_div(sn, kPanelRows));
  for (int q = 0; q < 2; ++q) {
    const Buffer<char>& d = q == 0 ? ws_->d_gate_packed : ws_->d_up_packed;
    for (int i = 0; i < m; ++i) s.rows[static_cast<size_t>(i)] = d.data() + (p0 + i) * Ip * a_size_;
    const PrefetchRegion& next = q == 0 ? next_gate : next_up;
    if (straight) {
      operand_[q == 0 ? kGate : kUp].gemm_t(e, s.rows.data(), m, c0, sn, cx, ldc, q == 1, next);
    } else {
      kernels_.gemm_bf16w(s.rows.data(), m, Ip, s.panels[static_cast<size_t>(q)].data(), kPanelRows * Ip, np, cx,
                          ldc, q == 1, next);
    }
  }
}

// dx = sum over routes of dg . Wg_eff + du . Wu_eff; items own a block of H
// columns for a range of tokens. Token ranges repeat the W^T panel building
// per range: worth it only when columns alone cannot feed the workers.
void kt_moe::backward_dx(const BackwardPass& b) {
  if (engine_->pool->groups() > 1) {
    backward_dx_by_node(b);
    return;
  }
  ws_->token_sum.reserve(static_cast<size_t>(std::max<int64_t>(b.T * H_, 1)));
  CombineSplit split = CombineSplit::plan(b.T, H_, engine_->pool->size());
  // Experts multiplied straight from W's panels (few rows) read each
  // panel's slice of the item's columns in one call: wider items at decode.
  if (operand_[kGate].reads_w_straight(1)) split.widen_for_straight(b.T, H_, engine_->pool->size());
  engine_->pool->run(split.items(),
                    [&](int64_t item, int tid) { dx_item(b, split, ws_->per_thread[static_cast<size_t>(tid)], item); });
}

void kt_moe::dx_item(const BackwardPass& b, const CombineSplit& split, ThreadScratch& s, int64_t item) {
  const Routing& R = b.R;
  float* acc = ws_->token_sum.data();
  const int64_t col0 = (item % split.col_blocks) * split.cols;
  const int64_t ncols = std::min(split.cols, H_ - col0);
  const int64_t t0 = (item / split.col_blocks) * split.token_chunk;
  const int64_t t1 = std::min(b.T, t0 + split.token_chunk);
  clear_columns(acc, t0, t1, H_, col0, ncols);
  float* cx = s.c[0].data();
  // The gate (q = 0) or up (q = 1) source of the block after (e, sc0): the
  // next block of the expert, or the next expert's first.
  const auto next_source = [&](int q, size_t ai, int64_t sc0) {
    const int proj = q == 0 ? kGate : kUp;
    if (sc0 + kBlockCols < col0 + ncols)
      return operand_[proj].transposed_block(R.active[ai], sc0 + kBlockCols,
                                             std::min(kBlockCols, col0 + ncols - sc0 - kBlockCols));
    if (ai + 1 < R.active.size())
      return operand_[proj].transposed_block(R.active[ai + 1], col0, std::min(kBlockCols, ncols));
    return PrefetchRegion{};
  };
  for (size_t ai = 0; ai < R.active.size(); ++ai) {
    const int32_t e = R.active[ai];
    int64_t pbegin, pend;
    token_range(R.token.data(), R.offsets[static_cast<size_t>(e)], R.offsets[static_cast<size_t>(e) + 1], t0, t1,
                &pbegin, &pend);
    if (pbegin == pend) continue;
    // By the expert's routes, not the range's: a token's dx takes one path
    // however the tokens were split.
    const bool straight = reads_w_straight(R, e);
    // Blocks of kBlockCols columns: the expert's rows of dg and du stay in
    // cache across them. Straight from W's panels, one block of the item's
    // columns: each panel's slice then streams as one longer run.
    const int64_t bw = straight ? ncols : kBlockCols;
    for (int64_t sc0 = col0; sc0 < col0 + ncols; sc0 += bw) {
      const int64_t sn = std::min(bw, col0 + ncols - sc0);
      if (!straight) {
        operand_[kGate].transposed(s.operand, e, sc0, sn, s.panels[0].data());
        operand_[kUp].transposed(s.operand, e, sc0, sn, s.panels[1].data());
      }
      for (int64_t p0 = pbegin; p0 < pend; p0 += kRowChunk) {
        const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
        const bool last = p0 + kRowChunk >= pend;
        // next_source takes the last kBlockCols block of this call's.
        const int64_t tail = sc0 + bw - kBlockCols;
        dx_product(b, s, straight, e, p0, m, sc0, sn, cx, bw, last ? next_source(0, ai, tail) : PrefetchRegion{},
                   last ? next_source(1, ai, tail) : PrefetchRegion{});
        for (int q = kGate; q <= kUp; ++q) {
          if (!lora_on(q)) continue;
          for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = ws_->lora_b_proj[q].data() + (p0 + i) * r_;
          kernels_.sgemm_nn(m, static_cast<int>(sn), static_cast<int>(r_), s.frows.data(),
                      lora_[q].a.data() + e * r_ * H_ + sc0, H_, cx, bw, true);
        }
        for (int i = 0; i < m; ++i) {
          float* dst = acc + R.token[static_cast<size_t>(p0 + i)] * H_ + sc0;
          const float* ci = cx + i * bw;
          for (int64_t j = 0; j < sn; ++j) dst[j] += ci[j];
        }
      }
    }
  }
  store_columns(acc, t0, t1, H_, col0, ncols, b.c.dx);
}

// dx with the experts split over NUMA nodes: items of an expert and a block
// of H columns, each node's workers taking its experts', into each route's
// row of ws_->route_dx; then per token the routes' rows added in expert
// order, as dx_item adds them (the same bits).
void kt_moe::backward_dx_by_node(const BackwardPass& b) {
  const Routing& R = b.R;
  const int64_t ldx = round_up(H_, kPanelRows);
  ws_->route_dx.reserve(static_cast<size_t>(std::max<int64_t>(b.routes * ldx, 1)));
  block_items(R, H_, kBlockCols);
  const ItemRanges ranges = node_ranges();
  engine_->pool->run_grouped(ranges.group_bounds.data(), [&](int64_t range, int tid) {
    for (int64_t it = ranges.begin(range); it < ranges.end(range); ++it) {
      note_worker(ws_->items[static_cast<size_t>(it)] >> 32, tid);
      dx_block(b, ws_->per_thread[static_cast<size_t>(tid)], ws_->items[static_cast<size_t>(it)], ldx);
    }
  });
  ws_->token_sum.reserve(static_cast<size_t>(std::max<int64_t>(b.T * H_, 1)));
  float* acc = ws_->token_sum.data();
  const int64_t cols = round_up(ceil_div(H_, 4 * engine_->pool->size()), kPanelRows);
  engine_->pool->run(ceil_div(H_, cols), [&](int64_t blk, int) {
    const int64_t col0 = blk * cols, n = std::min(cols, H_ - col0);
    clear_columns(acc, 0, b.T, H_, col0, n);
    for (int32_t e : R.active)
      for (int64_t p = R.offsets[static_cast<size_t>(e)]; p < R.offsets[static_cast<size_t>(e) + 1]; ++p) {
        float* dst = acc + R.token[static_cast<size_t>(p)] * H_ + col0;
        const float* src = ws_->route_dx.data() + p * ldx + col0;
        for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
      }
    store_columns(acc, 0, b.T, H_, col0, n, b.c.dx);
  });
}

// One (expert, block of H columns) item of backward_dx_by_node: dg . Wg_eff
// + du . Wu_eff of the expert's routes for those columns, as dx_item
// computes them.
void kt_moe::dx_block(const BackwardPass& b, ThreadScratch& s, int64_t item, int64_t ldx) {
  const Routing& R = b.R;
  const int64_t e = item >> 32;
  const int64_t col0 = (item & 0xffffffff) * kBlockCols;
  const int64_t sn = std::min(kBlockCols, H_ - col0);
  const bool straight = reads_w_straight(R, e);
  if (!straight) {
    operand_[kGate].transposed(s.operand, e, col0, sn, s.panels[0].data());
    operand_[kUp].transposed(s.operand, e, col0, sn, s.panels[1].data());
  }
  float* cx = s.c[0].data();
  const int64_t pend = R.offsets[static_cast<size_t>(e) + 1];
  for (int64_t p0 = R.offsets[static_cast<size_t>(e)]; p0 < pend; p0 += kRowChunk) {
    const int m = static_cast<int>(std::min(kRowChunk, pend - p0));
    dx_product(b, s, straight, e, p0, m, col0, sn, cx, kBlockCols, PrefetchRegion{}, PrefetchRegion{});
    for (int q = kGate; q <= kUp; ++q) {
      if (!lora_on(q)) continue;
      for (int i = 0; i < m; ++i) s.frows[static_cast<size_t>(i)] = ws_->lora_b_proj[q].data() + (p0 + i) * r_;
      kernels_.sgemm_nn(m, static_cast<int>(sn), static_cast<int>(r_), s.frows.data(),
                  lora_[q].a.data() + e * r_ * H_ + col0, H_, cx, kBlockCols, true);
    }
    for (int i = 0; i < m; ++i)
      std::memcpy(ws_->route_dx.data() + (p0 + i) * ldx + col0, cx + i * kBlockCols,
                  static_cast<size_t>(sn) * sizeof(float));
  }
}

// Each route's routing-weight gradient: its parts over the blocks of I, plus
// dy . b_d with a down bias.
void kt_moe::routing_weight_gradients(const BackwardPass& b) {
  const Routing& R = b.R;
  const BackwardCall& c = b.c;
  for (int64_t t = 0; t < b.T; ++t)
    for (int64_t j = 0; j < top_k_; ++j) store_f32(c.dw.at(t, j), c.dw.dtype, 0.f);
  for (int32_t e : R.active) {
    for (int64_t p = R.offsets[static_cast<size_t>(e)]; p < R.offsets[static_cast<size_t>(e) + 1]; ++p) {
      float v = 0.f;
      for (int64_t ib = 0; ib < b.nIb; ++ib) v += ws_->route_weight_parts[static_cast<size_t>(p * b.nIb + ib)];
      if (opt_.has_bias) {
        const float* bd = b_[kDown].data() + e * H_;
        const float* dy = ws_->dy_f32.data() + R.token[static_cast<size_t>(p)] * H_;
        float bias = 0.f;
        for (int64_t h = 0; h < H_; ++h) bias += dy[h] * bd[h];
        v += bias;
      }
      const int64_t slot = R.slot[static_cast<size_t>(p)];
      store_f32(c.dw.at(slot / top_k_, slot % top_k_), c.dw.dtype, v);
    }
  }
}

void kt_moe::lora_gradients(kt_context* ctx, const BackwardCall& c) {
  const Routing& R = ctx->routing;
  const int64_t routes = R.routes;
  const bool accumulate = c.opt.accumulate == KT_GRAD_ACCUMULATE;
  // w * lora_b_proj[down] and w * la[down]: the down projection's delta is w * dy.
  if (lora_on(kDown)) {
    for (int k = 0; k < 2; ++k) ws_->weighted_down_lora[k].reserve(static_cast<size_t>(std::max<int64_t>(routes * r_, 1)));
    for (int64_t p = 0; p < routes; ++p) {
      const float w = R.weight[static_cast<size_t>(p)];
      for (int64_t q = 0; q < r_; ++q) {
        ws_->weighted_down_lora[0][static_cast<size_t>(p * r_ + q)] = w * ws_->lora_b_proj[kDown][static_cast<size_t>(p * r_ + q)];
        ws_->weighted_down_lora[1][static_cast<size_t>(p * r_ + q)] = w * ctx->la[kDown][static_cast<size_t>(p * r_ + q)];
      }
    }
  }
  ws_->items.clear();
  for (int64_t e = 0; e < E_; ++e) {
    if (skipped_[static_cast<size_t>(e)]) continue;
    const bool touched = R.offsets[static_cast<size_t>(e) + 1] > R.offsets[static_cast<size_t>(e)];
    if (!touched && accumulate) continue;
    for (int64_t p = 0; p < 3; ++p)
      if (lora_on(static_cast<int>(p)))
        for (int64_t which = 0; which < 2; ++which) ws_->items.push_back((e << 32) | (p << 1) | which);
  }
  engine_->pool->run(static_cast<int64_t>(ws_->items.size()), [&](int64_t it, int tid) {
    ThreadScratch& s = ws_->per_thread[static_cast<size_t>(tid)];
    const int64_t item = ws_->items[static_cast<size_t>(it)];
    const int64_t e = item >> 32;
    const int p = static_cast<int>((item >> 1) & 3);
    const bool is_b = item & 1;
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    const int64_t p0 = R.offsets[static_cast<size_t>(e)];
    const int n = static_cast<int>(R.offsets[static_cast<size_t>(e) + 1] - p0);
    std::vector<const float*>& rows = s.frows;
    if (rows.size() < static_cast<size_t>(n)) rows.resize(static_cast<size_t>(n));
    float* out_buf = s.grad.data();
    if (n == 0) {  // no token reached this expert: its gradient is zero
      if (is_b)
        write_grad(bound_[KT_ARG_GRAD_LORA_B_GATE + 2 * p].view, e, 0, nullptr, out, r_, false, 1.f, false);
      else
        write_grad(bound_[KT_ARG_GRAD_LORA_A_GATE + 2 * p].view, e, 0, nullptr, r_, in, false, 1.f, false);
      return;
    }
    if (!is_b) {
      // dA [r, in] = sum_rows (s B^T delta) (x) z
      const float* lbs = p == kDown ? ws_->weighted_down_lora[0].data() : ws_->lora_b_proj[p].data();
      for (int i = 0; i < n; ++i) {
        const int64_t pos = p0 + i;
        rows[static_cast<size_t>(i)] = p == kDown ? ws_->act_f32.data() + pos * I_
                                                  : ctx->xf.data() + R.token[static_cast<size_t>(pos)] * H_;
      }
      // fp32 rows overwritten unscaled: the GEMM writes them where they lie
      // (the same bits as through out_buf, without its second pass).
      const View& ga = bound_[KT_ARG_GRAD_LORA_A_GATE + 2 * p].view;
      const bool direct = !accumulate && c.opt.grad_scale == 1.f && ga.dtype == DType::kF32 &&
                          ga.strides[2] == 1 && ga.strides[1] >= in;
      kernels_.sgemm_tn(static_cast<int>(r_), static_cast<int>(in), n, lbs + p0 * r_, r_, rows.data(),
                  direct ? reinterpret_cast<float*>(ga.at(e, 0, 0)) : out_buf,
                  direct ? ga.strides[1] : in, false);
      if (!direct) write_grad(ga, e, 0, out_buf, r_, in, false, c.opt.grad_scale, accumulate);
    } else {
      // dB^T [r, out] = sum_rows (A z) (x) delta, times s
      const float* las = p == kDown ? ws_->weighted_down_lora[1].data() : ctx->la[p].data();
      for (int i = 0; i < n; ++i) {
        const int64_t pos = p0 + i;
        rows[static_cast<size_t>(i)] =
            p == kDown ? ws_->dy_f32.data() + R.token[static_cast<size_t>(pos)] * H_
                       : (p == kGate ? ws_->d_gate.data() : ws_->d_up.data()) + pos * I_;
      }
      kernels_.sgemm_tn(static_cast<int>(r_), static_cast<int>(out), n, las + p0 * r_, r_, rows.data(), out_buf, out, false);
      write_grad(bound_[KT_ARG_GRAD_LORA_B_GATE + 2 * p].view, e, 0, out_buf, out, r_, true,
                 lora_scale_ * c.opt.grad_scale, accumulate);
    }
  });
}

void kt_moe::full_gradients(kt_context* ctx, const BackwardCall& c) {
  const Routing& R = ctx->routing;
  const int64_t routes = R.routes;
  const bool accumulate = c.opt.accumulate == KT_GRAD_ACCUMULATE;
  ws_->down_delta.reserve(static_cast<size_t>(std::max<int64_t>(routes * H_, 1)));
  for (int64_t p = 0; p < routes; ++p) {
    const float w = R.weight[static_cast<size_t>(p)];
    const float* dy = ws_->dy_f32.data() + R.token[static_cast<size_t>(p)] * H_;
    float* d = ws_->down_delta.data() + p * H_;
    for (int64_t h = 0; h < H_; ++h) d[h] = w * dy[h];
  }
  if (kernels_.gemm_zip_bf16) {
    full_gradients_zipped(ctx, c);
    return;
  }
  ws_->items.clear();
  for (int64_t e = 0; e < E_; ++e) {
    if (skipped_[static_cast<size_t>(e)]) continue;
    const bool touched = R.offsets[static_cast<size_t>(e) + 1] > R.offsets[static_cast<size_t>(e)];
    if (!touched && accumulate) continue;
    for (int64_t p = 0; p < 3; ++p) {
      const int64_t out = p == kDown ? H_ : I_;
      for (int64_t ob = 0; ob < ceil_div(out, kRowChunk); ++ob) ws_->items.push_back((e << 32) | (ob << 2) | p);
    }
  }
  engine_->pool->run(static_cast<int64_t>(ws_->items.size()), [&](int64_t it, int tid) {
    ThreadScratch& s = ws_->per_thread[static_cast<size_t>(tid)];
    const int64_t item = ws_->items[static_cast<size_t>(it)];
    const int64_t e = item >> 32;
    const int p = static_cast<int>(item & 3);
    const int64_t o0 = ((item & 0xffffffff) >> 2) * kRowChunk;
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    const int64_t ob = std::min(kRowChunk, out - o0);
    const int64_t p0 = R.offsets[static_cast<size_t>(e)];
    const int n = static_cast<int>(R.offsets[static_cast<size_t>(e) + 1] - p0);
    std::vector<const float*>& rows = s.frows;
    if (rows.size() < static_cast<size_t>(n)) rows.resize(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      const int64_t pos = p0 + i;
      rows[static_cast<size_t>(i)] = p == kDown ? ws_->act_f32.data() + pos * I_
                                                : ctx->xf.data() + R.token[static_cast<size_t>(pos)] * H_;
    }
    const float* delta = p == kDown ? ws_->down_delta.data() : (p == kGate ? ws_->d_gate.data() : ws_->d_up.data());
    float* out_buf = s.grad.data();
    if (n == 0) {  // no token reached this expert: its gradient is zero
      write_grad(bound_[KT_ARG_GRAD_W_GATE + p].view, e, o0, nullptr, ob, in, false, 1.f, false);
      if (opt_.has_bias) write_grad(bound_[KT_ARG_GRAD_B_GATE + p].view, e, o0, nullptr, 1, ob, false, 1.f, false);
      return;
    }
    kernels_.sgemm_tn(static_cast<int>(ob), static_cast<int>(in), n, delta + p0 * out + o0, out, rows.data(),
                out_buf, in, false);
    write_grad(bound_[KT_ARG_GRAD_W_GATE + p].view, e, o0, out_buf, ob, in, false, c.opt.grad_scale,
               accumulate);
    if (opt_.has_bias) {
      for (int64_t o = 0; o < ob; ++o) {
        float sum = 0.f;
        for (int i = 0; i < n; ++i) sum += delta[(p0 + i) * out + o0 + o];
        out_buf[o] = sum;
      }
      write_grad(bound_[KT_ARG_GRAD_B_GATE + p].view, e, o0, out_buf, 1, ob, false, c.opt.grad_scale,
                 accumulate);
    }
  });
}

// dW_p[e] = sum over the expert's routes of delta (x) z, on bf16 operands:
// both come zipped in route pairs (kernels.h), z once per item and chunk of
// routes, delta per block of output rows. Items are (expert, projection);
// each owns its gradient, so nothing is shared between workers.
void kt_moe::full_gradients_zipped(kt_context* ctx, const BackwardCall& c) {
  const Routing& R = ctx->routing;
  const bool accumulate = c.opt.accumulate == KT_GRAD_ACCUMULATE;
  constexpr int64_t kZipRoutes = 256;
  const int64_t wide = round_up(std::max(H_, I_), kPanelRows);
  for (auto& s : ws_->per_thread) {
    s.zip[0].reserve(static_cast<size_t>(kZipRoutes * wide));
    s.zip[1].reserve(static_cast<size_t>(kZipRoutes * wide));
    s.grad.reserve(static_cast<size_t>(kRowChunk * wide));
  }
  ws_->items.clear();
  for (int64_t e = 0; e < E_; ++e) {
    if (skipped_[static_cast<size_t>(e)]) continue;
    const bool touched = R.offsets[static_cast<size_t>(e) + 1] > R.offsets[static_cast<size_t>(e)];
    if (!touched && accumulate) continue;
    for (int64_t p = 0; p < 3; ++p) ws_->items.push_back((e << 2) | p);
  }
  engine_->pool->run(static_cast<int64_t>(ws_->items.size()), [&](int64_t it, int tid) {
    ThreadScratch& s = ws_->per_thread[static_cast<size_t>(tid)];
    const int64_t e = ws_->items[static_cast<size_t>(it)] >> 2;
    const int p = static_cast<int>(ws_->items[static_cast<size_t>(it)] & 3);
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    const int64_t inp = round_up(in, kPanelRows);
    const int64_t p0 = R.offsets[static_cast<size_t>(e)];
    const int64_t n = R.offsets[static_cast<size_t>(e) + 1] - p0;
    const View& gw = bound_[KT_ARG_GRAD_W_GATE + p].view;
    if (n == 0) {  // no token reached this expert: its gradient is zero
      write_grad(gw, e, 0, nullptr, out, in, false, 1.f, false);
      if (opt_.has_bias) write_grad(bound_[KT_ARG_GRAD_B_GATE + p].view, e, 0, nullptr, 1, out, false, 1.f, false);
      return;
    }
    const auto z_row = [&](int64_t i) {
      const int64_t pos = p0 + i;
      return p == kDown ? ws_->act_f32.data() + pos * I_ : ctx->xf.data() + R.token[static_cast<size_t>(pos)] * H_;
    };
    const float* delta = (p == kDown ? ws_->down_delta.data() : (p == kGate ? ws_->d_gate.data() : ws_->d_up.data())) + p0 * out;
    bf16_t* zz = s.zip[0].data();
    bf16_t* dz = s.zip[1].data();
    float* cbuf = s.grad.data();
    const auto zip_z = [&](int64_t r0, int64_t nr) {
      for (int64_t g = 0; 2 * g < nr; ++g) {
        bf16_t* dst = zz + g * 2 * inp;
        kernels_.zip_rows_bf16(z_row(r0 + 2 * g), 2 * g + 1 < nr ? z_row(r0 + 2 * g + 1) : nullptr, in, dst);
        std::memset(dst + 2 * in, 0, static_cast<size_t>(2 * (inp - in)) * sizeof(bf16_t));
      }
    };
    // fp32 gradients with whole panels per row are written by the kernel
    // itself, scaled, streamed past the caches; others go through cbuf.
    const bool direct = gw.dtype == DType::kF32 && gw.strides[2] == 1 && in % kPanelRows == 0;
    const int64_t chunks = ceil_div(n, kZipRoutes);
    if (chunks == 1) zip_z(0, n);
    for (int64_t o0 = 0; o0 < out; o0 += kRowChunk) {
      const int64_t ob = std::min(kRowChunk, out - o0);
      float* dst = direct ? reinterpret_cast<float*>(gw.at(e, o0, 0)) : cbuf;
      const int64_t ld = direct ? gw.strides[1] : inp;
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t r0 = ch * kZipRoutes, nr = std::min(kZipRoutes, n - r0);
        if (chunks > 1) zip_z(r0, nr);
        for (int64_t g = 0; 2 * g < nr; ++g) {
          const float* d0 = delta + (r0 + 2 * g) * out + o0;
          kernels_.zip_rows_bf16(d0, 2 * g + 1 < nr ? d0 + out : nullptr, ob, dz + g * 2 * ob);
        }
        kernels_.gemm_zip_bf16(dz, 2 * ob, static_cast<int>(ob), zz, 2 * inp, static_cast<int>(inp / kPanelRows),
                         ceil_div(nr, 2), dst, ld, ch > 0 || (direct && accumulate),
                         direct ? c.opt.grad_scale : 1.f, direct && chunks == 1);
      }
      if (!direct) write_grad(gw, e, o0, cbuf, ob, in, false, c.opt.grad_scale, accumulate, inp);
    }
    if (opt_.has_bias) {
      for (int64_t o = 0; o < out; ++o) cbuf[o] = 0.f;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t o = 0; o < out; ++o) cbuf[o] += delta[i * out + o];
      write_grad(bound_[KT_ARG_GRAD_B_GATE + p].view, e, 0, cbuf, 1, out, false, c.opt.grad_scale, accumulate);
    }
  });
}
