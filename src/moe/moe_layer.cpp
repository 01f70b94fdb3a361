#include "moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "moe/args.h"
#include "moe/blocking.h"

namespace kt {

void Routing::reserve(int64_t max_tokens, int64_t k, int64_t experts) {
  offsets.resize(static_cast<size_t>(experts + 1));
  active.reserve(static_cast<size_t>(experts));
  token.reserve(static_cast<size_t>(max_tokens * k));
  slot.reserve(static_cast<size_t>(max_tokens * k));
  weight.reserve(static_cast<size_t>(max_tokens * k));
}

MoeWorkspace::~MoeWorkspace() {
  for (kt_context* c : spare_contexts) delete c;
}

void MoeWorkspace::fit_threads(const WeightOperand& operand, int64_t kpad, int64_t wide, int64_t rank) {
  for (ThreadScratch& s : per_thread) {
    for (auto& p : s.panels) p.reserve(static_cast<size_t>(kBlockCols * kpad));
    for (auto& c : s.c) c.reserve(static_cast<size_t>(kRowChunk * kBlockCols));
    s.grad.reserve(static_cast<size_t>(std::max<int64_t>(kRowChunk, rank) * wide));
    s.rows.resize(static_cast<size_t>(kRowChunk));
    s.frows.resize(static_cast<size_t>(kRowChunk));
    operand.size_scratch(&s.operand, kpad, kRowChunk);
  }
}

// The panel shapes of a layer: a quantized base pads the A rows (and its
// panels) to kq.
struct LayerShapes {
  bool quantized;
  PanelShape gate, down;
  QuantShape gate_q, down_q;
  explicit LayerShapes(const kt_moe_options& o)
      : quantized(is_quantized(o.weight_format)), gate(PanelShape::of(o.intermediate, o.hidden)),
        down(PanelShape::of(o.hidden, o.intermediate)) {
    if (!quantized) return;
    gate_q = QuantShape::of(o.weight_format, o.intermediate, o.hidden);
    down_q = QuantShape::of(o.weight_format, o.hidden, o.intermediate);
    gate.kp = gate_q.kq;
    down.kp = down_q.kq;
  }
};

}  // namespace kt

using namespace kt;

kt_moe::kt_moe(kt_engine* eng, const kt_moe_options& o)
    : engine_(eng), opt_(o), kernels_(*eng->kernels), a_size_(eng->kernels->a_elem_size) {
  E_ = o.num_experts;
  top_k_ = o.top_k;
  H_ = o.hidden;
  I_ = o.intermediate;
  r_ = o.mode == KT_MODE_LORA ? o.lora_rank : 0;
  if (o.mode == KT_MODE_LORA)
    lora_scale_ = o.use_rslora ? o.lora_alpha / std::sqrt(static_cast<float>(r_))
                              : o.lora_alpha / static_cast<float>(r_);
  const LayerShapes shapes(o);
  quantized_ = shapes.quantized;
  gate_shape_ = shapes.gate;
  down_shape_ = shapes.down;
  gate_q_ = shapes.gate_q;
  down_q_ = shapes.down_q;
  if (quantized_) {
    q_[kGate].resize(static_cast<size_t>(E_ * gate_q_.expert_bytes));
    q_[kUp].resize(static_cast<size_t>(E_ * gate_q_.expert_bytes));
    q_[kDown].resize(static_cast<size_t>(E_ * down_q_.expert_bytes));
  } else {
    w_[kGate].resize(static_cast<size_t>(E_ * gate_shape_.elements()));
    w_[kUp].resize(static_cast<size_t>(E_ * gate_shape_.elements()));
    w_[kDown].resize(static_cast<size_t>(E_ * down_shape_.elements()));
  }
  for (int p = 0; p < 3; ++p) {
    place_weights(p, quantized_ ? static_cast<void*>(q_[p].data()) : static_cast<void*>(w_[p].data()));
    wp_[p] = w_[p].data();
    qp_[p] = q_[p].data();
    operand_[p] = WeightOperand(kernels_, p == kDown ? down_shape_ : gate_shape_, p == kDown ? down_q_ : gate_q_, quantized_,
                                o.compute == KT_COMPUTE_INT8);
  }
  bind_operands();
  if (o.has_bias) {
    b_[kGate].resize(static_cast<size_t>(E_ * I_));
    b_[kUp].resize(static_cast<size_t>(E_ * I_));
    b_[kDown].resize(static_cast<size_t>(E_ * H_));
  }
  loaded_.assign(static_cast<size_t>(E_), 0);
  skipped_.assign(static_cast<size_t>(E_), 0);
  for (int p = 0; p < 3; ++p) {
    if (!lora_on(p)) continue;
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    lora_[p].a.resize(static_cast<size_t>(E_ * r_ * in));
    lora_[p].sbt.resize(static_cast<size_t>(E_ * r_ * out));
  }
  bound_load_options_ = defaults_of<kt_load_options>(set_load_options_defaults);
  // Made by the engine's first layer; created under the engine's lifetime
  // lock, so no other creation races on it.
  if (!engine_->moe_workspace) engine_->moe_workspace = std::make_shared<MoeWorkspace>(engine_->pool->size());
  ws_ = engine_->moe_workspace;
  engine_->num_layers.fetch_add(1);
  counted_ = true;
}

void kt_moe::place_weights(int proj, void* data) {
  engine_->numa.place_experts(data, E_, stored_expert_bytes(proj), &weights_node_[proj]);
}

ItemRanges kt_moe::node_ranges() const {
  const ThreadPool& pool = *engine_->pool;
  const std::vector<int64_t>& items = ws_->items;
  std::vector<int64_t> bounds(static_cast<size_t>(pool.groups()) + 1, static_cast<int64_t>(items.size()));
  std::vector<int> threads(static_cast<size_t>(pool.groups()));
  bounds[0] = 0;
  for (int g = 0; g < pool.groups(); ++g) {
    threads[static_cast<size_t>(g)] = pool.workers_in(g);
    if (g == 0) continue;
    // Items are sorted by expert: the first of an expert node g owns.
    const int64_t first = engine_->numa.first_expert(g, E_) << 32;
    bounds[static_cast<size_t>(g)] = std::lower_bound(items.begin(), items.end(), first) - items.begin();
  }
  return ItemRanges(bounds, threads);
}

void kt_moe::fit_workspace() {
  const int64_t kpad = std::max(round_up(H_, kPanelRows), round_up(I_, kPanelRows));
  ws_->fit_threads(operand_[kGate], kpad, std::max(H_, I_), r_);
}

void kt_moe::leave_engine() {
  if (!counted_) return;
  counted_ = false;
  engine_->num_layers.fetch_sub(1);
}

CheckedSize kt_moe::weight_bytes(const kt_moe_options& o) {
  const LayerShapes sh(o);
  if (sh.quantized) return CheckedSize(o.num_experts) * (CheckedSize(sh.gate_q.expert_bytes) * 2 + sh.down_q.expert_bytes);
  return CheckedSize(o.num_experts) * (CheckedSize(sh.gate.elements()) * 2 + sh.down.elements()) *
         static_cast<int64_t>(sizeof(bf16_t));
}

CheckedSize kt_moe::memory_bytes(const kt_moe_options& o, int64_t threads, int64_t a,
                                 bool rows_by_route, bool dx_by_node) {
  const int64_t E = o.num_experts, K = o.top_k, H = o.hidden, I = o.intermediate, T = o.max_tokens;
  const int64_t r = o.mode == KT_MODE_LORA ? o.lora_rank : 0;
  const LayerShapes sh(o);
  const PanelShape gs = sh.gate, ds = sh.down;
  const int64_t f32 = sizeof(float), b16 = sizeof(bf16_t), idx = sizeof(int64_t);
  CheckedSize bytes = weight_bytes(o);
  if (o.has_bias) bytes += CheckedSize(E) * (CheckedSize(I) * 2 + H) * f32;
  int64_t targets = 0;
  for (int p = 0; p < 3; ++p) targets += o.mode == KT_MODE_LORA && ((o.lora_targets >> p) & 1u);
  bytes += CheckedSize(targets) * E * r * (CheckedSize(H) + I) * f32;
  const int64_t nb = std::max(ceil_div(I, kBlockCols), ceil_div(H, kBlockCols));
  bytes += CheckedSize(E) * std::max<int64_t>(nb, 3) * 2 * idx;
  const int64_t kpad = std::max(round_up(H, kPanelRows), round_up(I, kPanelRows)), wide = std::max(H, I);
  bytes += CheckedSize(threads) * (CheckedSize(2) * kBlockCols * kpad * b16 +
                                   CheckedSize(3) * kRowChunk * kBlockCols * f32 +
                                   CheckedSize(std::max<int64_t>(kRowChunk, r)) * wide * f32);
  if (sh.quantized) bytes += CheckedSize(threads) * WeightOperand::scratch_bytes(true, kpad, sh.gate_q.zero_points);
  const CheckedSize routes = CheckedSize(T) * K;
  const CheckedSize tokens_h = CheckedSize(T) * H;
  // forward: x in fp32 and A format, g and u, LoRA projections, a, a in A
  // format, the accumulator; backward: dy likewise, dg, du, a, both in A
  // format, routing-weight parts, the down delta, LoRA partials.
  bytes += tokens_h * f32 * 2 + CheckedSize(T) * gs.kp * a + routes * I * f32 * 3 +
           routes * r * f32 * 3 + routes * ds.kp * a;
  if (sh.quantized)  // the routes' down rows of the one-pass decode (T <= kRowChunk)
    bytes += CheckedSize(std::min(T, kRowChunk)) * K * round_up(H, kPanelRows) * f32;
  if (o.compute == KT_COMPUTE_INT8)  // int8 rows of x and of the routes' activations
    bytes += CheckedSize(T) * int8_row_bytes(sh.gate_q.kq, sh.gate_q.group) +
             routes * int8_row_bytes(sh.down_q.kq, sh.down_q.group);
  bytes += tokens_h * f32 + CheckedSize(T) * ds.padded_rows() * a + routes * I * f32 * 3 +
           routes * gs.padded_rows() * a * 2 + routes * ceil_div(I, kBlockCols) * f32 +
           routes * H * f32 + routes * r * f32 * 5;
  // x's rows in route order, and dy's (no backward with int8 compute), for
  // GEMMs that read only equally spaced rows in place.
  if (rows_by_route)
    bytes += o.compute == KT_COMPUTE_INT8 ? routes * int8_row_bytes(sh.gate_q.kq, sh.gate_q.group)
                                          : routes * gs.kp * a + routes * ds.padded_rows() * a;
  // Each route's dx row before the sum per token, when the experts are split
  // over NUMA nodes (backward_dx_by_node).
  if (dx_by_node) bytes += routes * round_up(H, kPanelRows) * f32;
  return bytes;
}

kt_moe::~kt_moe() {
  for (auto& kv : contexts_) {
    remove_context_handle(kv.first);
    delete kv.second;
  }
  for (kt_context* c : retiring_) delete c;
  leave_engine();
}

// ------------------------------------------------------------------ loading

namespace {

const std::initializer_list<DType> kWeightDtypes = {DType::kBF16, DType::kF16, DType::kF32};
const std::initializer_list<DType> kParamDtypes = {DType::kF32, DType::kBF16};

struct WeightSet {
  View gate, up, down, gate_up, bg, bu, bd, bgu, map;
  bool has[9] = {};
};

enum WeightSlot { sGate, sUp, sDown, sGateUp, sBg, sBu, sBd, sBgu, sMap };

}  // namespace

static WeightSet parse_weights(const kt_moe& m, const kt_load_options& lo, const ArgTable& args,
                               int64_t single, const char* where) {
  WeightSet ws;
  const bool stacked = single < 0;
  int64_t P = m.num_experts();
  if (args[KT_ARG_EXPERT_MAP]) {
    KT_CHECK(stacked, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": KT_ARG_EXPERT_MAP is for stacked loads only");
    ws.map = check_tensor(args[KT_ARG_EXPERT_MAP], {"KT_ARG_EXPERT_MAP", {DType::kI32, DType::kI64}, {-1}},
                          where);
    ws.has[sMap] = true;
    P = ws.map.shape[0];
    std::vector<uint8_t> seen(static_cast<size_t>(m.num_experts()), 0);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t e = ws.map.get_int(p);
      KT_CHECK(e >= 0 && e < m.num_experts(), KT_ERR_EXPERT_ID,
               std::string(where) + ": KT_ARG_EXPERT_MAP[" + std::to_string(p) +
                   "] = " + std::to_string(e) + " is outside [0, " + std::to_string(m.num_experts()) + ")");
      KT_CHECK(
          !seen[static_cast<size_t>(e)], KT_ERR_EXPERT_ID,
          std::string(where) + ": KT_ARG_EXPERT_MAP names expert " + std::to_string(e) + " twice");
      seen[static_cast<size_t>(e)] = 1;
    }
  }
  const bool in_out = lo.orientation == KT_ORIENT_IN_OUT;
  // Expected logical (out x in) extents; the tensor is given transposed when in_out.
  auto weight = [&](int id, int64_t out, int64_t in, View* v, int slot) {
    if (!args[id]) return;
    const char* name = arg_name(id);
    int64_t d0 = in_out ? in : out, d1 = in_out ? out : in;
    if (stacked)
      *v = check_tensor(args[id], {name, kWeightDtypes, {P, d0, d1}}, where);
    else
      *v = check_tensor(args[id], {name, kWeightDtypes, {d0, d1}}, where);
    if (in_out) *v = v->transposed();
    ws.has[slot] = true;
  };
  auto bias = [&](int id, int64_t n, View* v, int slot) {
    if (!args[id]) return;
    KT_CHECK(m.options().has_bias, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + arg_name(id) + " given but the layer has no biases");
    if (stacked)
      *v = check_tensor(args[id], {arg_name(id), kWeightDtypes, {P, n}}, where);
    else
      *v = check_tensor(args[id], {arg_name(id), kWeightDtypes, {n}}, where);
    ws.has[slot] = true;
  };
  weight(KT_ARG_W_GATE, m.intermediate(), m.hidden(), &ws.gate, sGate);
  weight(KT_ARG_W_UP, m.intermediate(), m.hidden(), &ws.up, sUp);
  weight(KT_ARG_W_GATE_UP, 2 * m.intermediate(), m.hidden(), &ws.gate_up, sGateUp);
  weight(KT_ARG_W_DOWN, m.hidden(), m.intermediate(), &ws.down, sDown);
  bias(KT_ARG_B_GATE, m.intermediate(), &ws.bg, sBg);
  bias(KT_ARG_B_UP, m.intermediate(), &ws.bu, sBu);
  bias(KT_ARG_B_GATE_UP, 2 * m.intermediate(), &ws.bgu, sBgu);
  bias(KT_ARG_B_DOWN, m.hidden(), &ws.bd, sBd);
  const std::string w = where;
  KT_CHECK(!(ws.has[sGateUp] && (ws.has[sGate] || ws.has[sUp])), KT_ERR_INVALID_ARGUMENT,
           w + ": give KT_ARG_W_GATE_UP or KT_ARG_W_GATE + KT_ARG_W_UP, not both");
  KT_CHECK(ws.has[sGateUp] || (ws.has[sGate] && ws.has[sUp]), KT_ERR_NULL_POINTER,
           w + ": KT_ARG_W_GATE and KT_ARG_W_UP (or KT_ARG_W_GATE_UP) are required");
  KT_CHECK(ws.has[sDown], KT_ERR_NULL_POINTER, w + ": KT_ARG_W_DOWN is required");
  if (m.options().has_bias) {
    KT_CHECK(!(ws.has[sBgu] && (ws.has[sBg] || ws.has[sBu])), KT_ERR_INVALID_ARGUMENT,
             w + ": give KT_ARG_B_GATE_UP or KT_ARG_B_GATE + KT_ARG_B_UP, not both");
    KT_CHECK(ws.has[sBgu] || (ws.has[sBg] && ws.has[sBu]), KT_ERR_NULL_POINTER,
             w + ": the layer has biases: KT_ARG_B_GATE and KT_ARG_B_UP (or KT_ARG_B_GATE_UP) are "
                 "required");
    KT_CHECK(ws.has[sBd], KT_ERR_NULL_POINTER,
             w + ": the layer has biases: KT_ARG_B_DOWN is required");
  }
  return ws;
}

// A quantized base cannot hold inf or NaN (its scales would be): such a
// weight is refused before anything is stored.
static void check_finite_weights(kt_moe& m, const WeightSet& ws, int64_t single, const char* where) {
  const bool stacked = single < 0;
  const View* views[] = {&ws.gate, &ws.up, &ws.gate_up, &ws.down};
  const char* names[] = {"KT_ARG_W_GATE", "KT_ARG_W_UP", "KT_ARG_W_GATE_UP", "KT_ARG_W_DOWN"};
  const int slots[] = {sGate, sUp, sGateUp, sDown};
  for (int i = 0; i < 4; ++i) {
    if (!ws.has[slots[i]]) continue;
    const View& v = *views[i];
    const int64_t P = stacked ? v.shape[0] : 1;
    std::vector<int64_t> bad(static_cast<size_t>(P), -1);
    m.engine()->pool->run(P, [&](int64_t p, int) {
      const View x = stacked ? v.slice0(p) : v;
      for (int64_t r = 0; r < x.shape[0] && bad[static_cast<size_t>(p)] < 0; ++r)
        for (int64_t c = 0; c < x.shape[1]; ++c)
          if (!std::isfinite(load_as_f32(x.at(r, c), x.dtype))) {
            bad[static_cast<size_t>(p)] = r;
            break;
          }
    });
    for (int64_t p = 0; p < P; ++p)
      KT_CHECK(bad[static_cast<size_t>(p)] < 0, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": " + names[i] +
                   (stacked ? "[" + std::to_string(p) + "]" : std::string()) +
                   " holds inf or NaN (row " + std::to_string(bad[static_cast<size_t>(p)]) +
                   "): the layer's " + weight_format_name(m.options().weight_format) +
                   " base cannot store it");
  }
}

static void pack_weights(kt_moe& m, const WeightSet& ws, const kt_load_options& lo, int64_t single,
                         kt::Buffer<bf16_t>* w, kt::Buffer<uint8_t>* q, kt::Buffer<float>* b,
                         std::vector<uint8_t>& loaded) {
  const bool stacked = single < 0;
  const int64_t P = ws.has[sMap] ? ws.map.shape[0] : (stacked ? m.num_experts() : 1);
  const bool inter = lo.gate_up_order == KT_GATE_UP_INTERLEAVED;
  auto logical = [&](int64_t p) { return ws.has[sMap] ? ws.map.get_int(p) : (stacked ? p : single); };
  auto part = [&](const View& v, int64_t p) { return stacked ? v.slice0(p) : v; };
  auto bias_copy = [&](const View& v, int64_t p, int64_t start, int64_t step, int64_t n, float* dst) {
    // v is [P, n'] (stacked) or [n'].
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = start + i * step;
      dst[i] = stacked ? v.get(p, j) : load_as_f32(v.at(j), v.dtype);
    }
  };
  const PanelShape gs = m.panel_shape(kGate), ds = m.panel_shape(kDown);
  m.engine()->pool->run(P, [&](int64_t p, int) {
    const int64_t e = logical(p);
    // Rows [row0, row0 + n * step) of a source into projection proj's
    // storage of expert e.
    const auto store = [&](int proj, const View& src, int64_t row0, int64_t step) {
      if (m.quantized()) {
        const QuantShape& qs = proj == kDown ? m.quant_shape(kDown) : m.quant_shape(kGate);
        quantize_panels(src, row0, step, qs, q[proj].data() + e * qs.expert_bytes);
      } else {
        const PanelShape& ps = proj == kDown ? ds : gs;
        pack_bf16_panels(src, row0, step, ps, w[proj].data() + e * ps.elements());
      }
    };
    if (ws.has[sGateUp]) {
      const View gu = part(ws.gate_up, p);
      store(kGate, gu, 0, inter ? 2 : 1);
      store(kUp, gu, inter ? 1 : m.intermediate(), inter ? 2 : 1);
    } else {
      store(kGate, part(ws.gate, p), 0, 1);
      store(kUp, part(ws.up, p), 0, 1);
    }
    store(kDown, part(ws.down, p), 0, 1);
    if (m.options().has_bias) {
      float* bg = b[kGate].data() + e * m.intermediate();
      float* bu = b[kUp].data() + e * m.intermediate();
      if (ws.has[sBgu]) {
        bias_copy(ws.bgu, p, 0, inter ? 2 : 1, m.intermediate(), bg);
        bias_copy(ws.bgu, p, inter ? 1 : m.intermediate(), inter ? 2 : 1, m.intermediate(), bu);
      } else {
        bias_copy(ws.bg, p, 0, 1, m.intermediate(), bg);
        bias_copy(ws.bu, p, 0, 1, m.intermediate(), bu);
      }
      bias_copy(ws.bd, p, 0, 1, m.hidden(), b[kDown].data() + e * m.hidden());
    }
  });
  for (int64_t p = 0; p < P; ++p) loaded[static_cast<size_t>(logical(p))] = 1;
}

void kt_moe::load(const kt_load_options& lo, const kt_arg* args, size_t n, int64_t single,
                  const char* where) {
  check_enum(lo.orientation, KT_ORIENT_OUT_IN, KT_ORIENT_IN_OUT, std::string(where) + ": options->orientation",
             "kt_weight_orientation");
  check_enum(lo.gate_up_order, KT_GATE_UP_CONCAT, KT_GATE_UP_INTERLEAVED,
             std::string(where) + ": options->gate_up_order", "kt_gate_up_order");
  if (single >= 0 || single < -1)
    KT_CHECK(single >= 0 && single < E_, KT_ERR_EXPERT_ID,
             std::string(where) + ": expert " + std::to_string(single) + " is outside [0, " +
                 std::to_string(E_) + ")");
  ArgTable table(args, n, where,
                 {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN, KT_ARG_W_GATE_UP, KT_ARG_B_GATE,
                  KT_ARG_B_UP, KT_ARG_B_DOWN, KT_ARG_B_GATE_UP, KT_ARG_EXPERT_MAP});
  KT_CHECK(!quantized_ || kt_quantizes_to(opt_.weight_format), KT_ERR_UNSUPPORTED,
           std::string(where) + ": the layer stores " + weight_format_name(opt_.weight_format) +
               ", which kt does not quantize to from bf16/fp16/fp32 weights: load it from a "
               "checkpoint stored in "
               "that format (kt_ckpt_load_layer), or create the layer as bf16, int8_channel, "
               "int4_g32 or int4_g128");
  WeightSet ws = parse_weights(*this, lo, table, single, where);
  if (quantized_) check_finite_weights(*this, ws, single, where);
  own_weights();
  pack_weights(*this, ws, lo, single, w_, q_, b_, loaded_);
}

void kt_moe::store_quantized(const std::vector<int64_t>& map,
                             const std::function<void(int64_t, int, uint8_t*)>& fill,
                             const std::vector<float>* biases) {
  const int64_t n = static_cast<int64_t>(map.size());
  engine_->pool->run(n, [&](int64_t i, int) {
    const int64_t e = map[static_cast<size_t>(i)];
    for (int p = 0; p < 3; ++p) fill(i, p, q_[p].data() + e * qshape(p).expert_bytes);
    if (opt_.has_bias && biases)
      for (int p = 0; p < 3; ++p) {
        const int64_t out = p == kDown ? H_ : I_;
        std::memcpy(b_[p].data() + e * out, biases[p].data() + i * out, static_cast<size_t>(out) * sizeof(float));
      }
  });
  for (int64_t e : map) loaded_[static_cast<size_t>(e)] = 1;
}

void kt_moe::own_weights() {
  if (!mapping_) return;
  // Allocate all three before changing anything, so running out of memory
  // leaves the mapped weights in use.
  kt::Buffer<bf16_t> owned[3];
  kt::Buffer<uint8_t> owned_q[3];
  for (int p = 0; p < 3; ++p) {
    const size_t bytes = static_cast<size_t>(E_ * stored_expert_bytes(p));
    if (quantized_)
      owned_q[p].resize(bytes);
    else
      owned[p].resize(bytes / sizeof(bf16_t));
    place_weights(p, quantized_ ? static_cast<void*>(owned_q[p].data()) : static_cast<void*>(owned[p].data()));
  }
  for (int p = 0; p < 3; ++p) {
    const int64_t per_expert = stored_expert_bytes(p);
    const uint8_t* src = stored_weights(p);
    uint8_t* dst = quantized_ ? owned_q[p].data() : reinterpret_cast<uint8_t*>(owned[p].data());
    engine_->pool->run(E_, [&](int64_t e, int) {
      std::memcpy(dst + e * per_expert, src + e * per_expert, static_cast<size_t>(per_expert));
    });
    if (quantized_) {
      q_[p] = std::move(owned_q[p]);
      qp_[p] = q_[p].data();
    } else {
      w_[p] = std::move(owned[p]);
      wp_[p] = w_[p].data();
    }
  }
  mapping_.reset();
  bind_operands();
}

void kt_moe::adopt_packed(std::shared_ptr<const void> mapping, const uint8_t* const weights[3],
                          const float* const biases[3], const uint8_t* loaded) {
  if (opt_.mode == KT_MODE_FULL) {
    // Never mapped in full mode, so w_ is allocated: copy, keep no mapping.
    for (int p = 0; p < 3; ++p) {
      const uint8_t* src = weights[p];
      uint8_t* dst = reinterpret_cast<uint8_t*>(w_[p].data());
      const int64_t n = stored_expert_bytes(p);
      engine_->pool->run(E_, [&](int64_t e, int) {
        std::memcpy(dst + e * n, src + e * n, static_cast<size_t>(n));
      });
    }
  } else {
    // The owned copies are not read any more: give their memory back.
    for (int p = 0; p < 3; ++p) {
      if (quantized_) {
        qp_[p] = weights[p];
        q_[p].resize(0);
      } else {
        wp_[p] = reinterpret_cast<const bf16_t*>(weights[p]);
        w_[p].resize(0);
      }
    }
    mapping_ = std::move(mapping);
    for (int p = 0; p < 3; ++p) weights_node_[p].assign(static_cast<size_t>(E_), -1);
    bind_operands();
  }
  if (opt_.has_bias)
    for (int p = 0; p < 3; ++p)
      std::memcpy(b_[p].data(), biases[p], b_[p].size() * sizeof(float));
  std::memcpy(loaded_.data(), loaded, loaded_.size());
}

void kt_moe::set_skipped(const DLTensor* mask) {
  View v = check_tensor(mask, {"mask", {DType::kBool, DType::kU8, DType::kI8, DType::kI32, DType::kI64}, {E_}},
                        "kt_moe_set_skipped");
  for (int64_t e = 0; e < E_; ++e) skipped_[static_cast<size_t>(e)] = v.get_int(e) != 0;
}

int64_t kt_moe::num_loaded() const {
  int64_t n = 0;
  for (int64_t e = 0; e < E_; ++e) n += loaded_[static_cast<size_t>(e)] && !skipped_[static_cast<size_t>(e)];
  return n;
}

// ------------------------------------------------------------ parameters

void kt_moe::bind(const kt_arg* args, size_t n) {
  const char* where = "kt_moe_bind";
  KT_CHECK(n == 0 || args != nullptr, KT_ERR_NULL_POINTER, "kt_moe_bind: args is NULL");
  std::vector<std::pair<int, View>> accepted;
  for (size_t i = 0; i < n; ++i) {
    const int id = args[i].id;
    const char* name = arg_name(id);
    KT_CHECK(name != nullptr && id >= KT_ARG_W_GATE && id != KT_ARG_EXPERT_MAP,
             KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + id_string(id) + " cannot be bound");
    for (auto& a : accepted)
      KT_CHECK(a.first != id, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": " + name + " given twice");
    const bool lora_id = id >= KT_ARG_LORA_A_GATE && id <= KT_ARG_GRAD_LORA_B_DOWN;
    if (lora_id) {
      KT_CHECK(opt_.mode == KT_MODE_LORA, KT_ERR_MODE,
               std::string(where) + ": " + name + " needs a layer in KT_MODE_LORA");
      const int rel = (id >= KT_ARG_GRAD_LORA_A_GATE ? id - KT_ARG_GRAD_LORA_A_GATE : id - KT_ARG_LORA_A_GATE);
      const int p = rel / 2;
      const bool is_a = rel % 2 == 0;
      KT_CHECK(lora_on(p), KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": " + name +
                   ": that projection is not a LoRA target of this layer");
      const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
      View v = is_a ? check_tensor(args[i].tensor, {name, kParamDtypes, {E_, r_, in}}, where)
                    : check_tensor(args[i].tensor, {name, kParamDtypes, {E_, out, r_}}, where);
      accepted.emplace_back(id, v);
      continue;
    }
    KT_CHECK(opt_.mode == KT_MODE_FULL, KT_ERR_MODE,
             std::string(where) + ": " + name + " needs a layer in KT_MODE_FULL");
    KT_CHECK(id != KT_ARG_W_GATE_UP && id != KT_ARG_B_GATE_UP, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": bind gate and up separately (" + name + ")");
    const bool grad = id >= KT_ARG_GRAD_W_GATE;
    const bool is_bias = grad ? id >= KT_ARG_GRAD_B_GATE : id >= KT_ARG_B_GATE;
    if (is_bias)
      KT_CHECK(opt_.has_bias, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": " + name + " given but the layer has no biases");
    const int first = grad ? (is_bias ? KT_ARG_GRAD_B_GATE : KT_ARG_GRAD_W_GATE)
                           : (is_bias ? KT_ARG_B_GATE : KT_ARG_W_GATE);
    const int p = id - first;
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    const auto& dts = grad ? kParamDtypes : kWeightDtypes;
    View v = is_bias ? check_tensor(args[i].tensor, {name, dts, {E_, out}}, where)
                     : check_tensor(args[i].tensor, {name, dts, {E_, out, in}}, where);
    accepted.emplace_back(id, v);
  }
  check_bound_memory(accepted, where);
  for (auto& a : accepted) {
    bound_[a.first].set = true;
    bound_[a.first].view = a.second;
  }
  bool lora_bound = opt_.mode == KT_MODE_LORA;
  for (int p = 0; p < 3 && lora_bound; ++p)
    if (lora_on(p))
      lora_bound = bound_[KT_ARG_LORA_A_GATE + 2 * p].set && bound_[KT_ARG_LORA_B_GATE + 2 * p].set;
  if (lora_bound) snapshot_lora();
}

// Backward writes the gradient buffers: each must address distinct elements
// and share no memory with another bound tensor (a gradient written into its
// own parameter, or two gradients into one buffer, would corrupt both).
// Parameters may share memory with each other: kt only reads them.
void kt_moe::check_bound_memory(const std::vector<std::pair<int, View>>& accepted, const char* where) const {
  auto is_grad = [](int id) { return id >= KT_ARG_GRAD_LORA_A_GATE; };
  // The bindings after this call: the accepted ones replace their ids.
  std::vector<std::pair<int, const View*>> all;
  for (const auto& a : accepted) all.emplace_back(a.first, &a.second);
  for (int id = 0; id < kMaxArgId; ++id) {
    if (!bound_[id].set) continue;
    bool replaced = false;
    for (const auto& a : accepted) replaced = replaced || a.first == id;
    if (!replaced) all.emplace_back(id, &bound_[id].view);
  }
  // Pairs among the previous bindings were checked when they were bound.
  for (size_t i = 0; i < accepted.size(); ++i) {
    const int id = accepted[i].first;
    if (is_grad(id)) check_writable(accepted[i].second, where, arg_name(id));
    for (size_t j = 0; j < all.size(); ++j) {
      const int other = all[j].first;
      if (other == id || (j < i) || !(is_grad(id) || is_grad(other))) continue;
      if (is_grad(id))
        check_disjoint(accepted[i].second, arg_name(id), *all[j].second, arg_name(other), where);
      else
        check_disjoint(*all[j].second, arg_name(other), accepted[i].second, arg_name(id), where);
    }
  }
}

void kt_moe::snapshot_lora() {
  for (int p = 0; p < 3; ++p) {
    if (!lora_on(p)) continue;
    const View& A = bound_[KT_ARG_LORA_A_GATE + 2 * p].view;
    const View& B = bound_[KT_ARG_LORA_B_GATE + 2 * p].view;
    const int64_t in = p == kDown ? I_ : H_, out = p == kDown ? H_ : I_;
    float* a = lora_[p].a.data();
    float* sbt = lora_[p].sbt.data();
    engine_->pool->run(E_, [&](int64_t e, int) {
      for (int64_t q = 0; q < r_; ++q)
        for (int64_t i = 0; i < in; ++i) a[(e * r_ + q) * in + i] = A.get(e, q, i);
      for (int64_t o = 0; o < out; ++o)
        for (int64_t q = 0; q < r_; ++q) sbt[(e * r_ + q) * out + o] = lora_scale_ * B.get(e, o, q);
    });
  }
  lora_ready_ = true;
}

void kt_moe::params_changed() {
  if (opt_.mode == KT_MODE_LORA) {
    for (int p = 0; p < 3; ++p)
      if (lora_on(p))
        KT_CHECK(bound_[KT_ARG_LORA_A_GATE + 2 * p].set && bound_[KT_ARG_LORA_B_GATE + 2 * p].set,
                 KT_ERR_NOT_BOUND, "kt_moe_params_changed: the LoRA factors are not all bound");
    snapshot_lora();
  } else if (opt_.mode == KT_MODE_FULL) {
    const int need[] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
    for (int id : need)
      KT_CHECK(bound_[id].set, KT_ERR_NOT_BOUND,
               std::string("kt_moe_params_changed: ") + arg_name(id) + " is not bound");
    WeightSet ws;
    ws.gate = bound_[KT_ARG_W_GATE].view;
    ws.up = bound_[KT_ARG_W_UP].view;
    ws.down = bound_[KT_ARG_W_DOWN].view;
    ws.has[sGate] = ws.has[sUp] = ws.has[sDown] = true;
    if (opt_.has_bias) {
      const int bneed[] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
      for (int id : bneed)
        KT_CHECK(bound_[id].set, KT_ERR_NOT_BOUND,
                 std::string("kt_moe_params_changed: ") + arg_name(id) + " is not bound");
      ws.bg = bound_[KT_ARG_B_GATE].view;
      ws.bu = bound_[KT_ARG_B_UP].view;
      ws.bd = bound_[KT_ARG_B_DOWN].view;
      ws.has[sBg] = ws.has[sBu] = ws.has[sBd] = true;
    }
    own_weights();
    pack_weights(*this, ws, bound_load_options_, -1, w_, q_, b_, loaded_);
  }
}

// ------------------------------------------------------------ contexts

kt_context* kt_moe::new_context(const ForwardCall& call, int holds) {
  KT_CHECK(
      opt_.compute != KT_COMPUTE_INT8, KT_ERR_MODE,
      std::string(call.where) +
          ": the layer computes with int8 activations (KT_COMPUTE_INT8), which have no backward: "
          "call it without a saved context");
  std::unique_ptr<kt_context> fresh;
  {
    std::lock_guard<std::mutex> lock(ws_->spare_mutex);
    if (!ws_->spare_contexts.empty()) {
      fresh.reset(ws_->spare_contexts.back());
      ws_->spare_contexts.pop_back();
    }
  }
  if (!fresh) fresh.reset(new kt_context);
  kt_context* c = fresh.get();
  c->state = kt_context::kPending;
  c->holds = holds;
  c->released = false;
  c->backward_queued = false;
  c->forward_job.reset();
  c->tokens = call.T;
  c->x_dtype = call.x.dtype;
  // A handle value never issued before: a released handle cannot name this
  // context even though its memory is reused.
  std::lock_guard<std::mutex> lock(state_mutex_);
  contexts_.reserve(contexts_.size() + 1);
  c->handle = add_context_handle(handle_);
  contexts_.emplace(c->handle, fresh.release());
  return c;
}

kt_context* kt_moe::hold_context(const kt_context* ctx, const char* where) {
  KT_CHECK(ctx != nullptr, KT_ERR_CONTEXT,
           std::string(where) +
               ": ctx is NULL: backward needs the context of a forward run with saved != NULL");
  const HandleId id = handle_id(ctx);
  std::lock_guard<std::mutex> lock(state_mutex_);
  auto it = contexts_.find(id);
  if (it == contexts_.end()) {
    const HandleId owner = context_owner(id);
    KT_CHECK(owner == 0 || owner == handle_, KT_ERR_CONTEXT,
             std::string(where) +
                 ": ctx does not belong to this layer (it is a context of another kt_moe)");
    fail(KT_ERR_CONTEXT, std::string(where) +
                             ": ctx is not a live context: it was released (a released handle is never "
                             "valid again)");
  }
  ++it->second->holds;
  return it->second;
}

void kt_moe::drop_hold(kt_context* c) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (--c->holds > 0 || !c->released) return;
  retiring_.erase(c);
  recycle_context(c);
}

bool kt_moe::release_context(HandleId id) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  auto it = contexts_.find(id);
  if (it == contexts_.end()) return false;
  kt_context* c = it->second;
  contexts_.erase(it);
  remove_context_handle(id);
  c->handle = 0;
  if (c->holds > 0) {  // a job still uses it: freed when the last hold ends
    c->released = true;
    retiring_.insert(c);
  } else {
    recycle_context(c);
  }
  return true;
}

void kt_moe::end_context_handles() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  for (auto& kv : contexts_) {
    remove_context_handle(kv.first);
    kt_context* c = kv.second;
    c->handle = 0;
    c->released = true;
    retiring_.insert(c);  // freed by the last hold, or with the layer
  }
  contexts_.clear();
}

void kt_moe::recycle_context(kt_context* c) {
  c->forward_job.reset();
  // As many spares as a forward through every layer of the engine takes
  // (and a few for forwards in flight together): no more than a step's
  // forwards hold at their peak.
  const size_t keep = static_cast<size_t>(std::max(8, engine_->num_layers.load()));
  {
    std::lock_guard<std::mutex> lock(ws_->spare_mutex);
    if (ws_->spare_contexts.size() < keep) {
      ws_->spare_contexts.push_back(c);
      return;
    }
  }
  delete c;
}

// ------------------------------------------------------------ base weights

void kt_moe::bind_operands() {
  for (int p = 0; p < 3; ++p) operand_[p].set_weights(stored_weights(p));
}

void kt_moe::read_weights(const kt_arg* args, size_t n) const {
  const char* where = "kt_moe_read_weights";
  ArgTable t(args, n, where, {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN, KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN});
  const std::initializer_list<DType> kOut = {DType::kF32, DType::kBF16, DType::kF16};
  std::vector<std::pair<int, View>> out;
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == kDown ? I_ : H_, rows = p == kDown ? H_ : I_;
    if (t[KT_ARG_W_GATE + p])
      out.emplace_back(KT_ARG_W_GATE + p,
                       check_tensor(t[KT_ARG_W_GATE + p], {arg_name(KT_ARG_W_GATE + p), kOut, {E_, rows, in}},
                                    where));
    if (t[KT_ARG_B_GATE + p]) {
      KT_CHECK(opt_.has_bias, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": " + arg_name(KT_ARG_B_GATE + p) +
                   " given but the layer has no biases");
      out.emplace_back(KT_ARG_B_GATE + p,
                       check_tensor(t[KT_ARG_B_GATE + p], {arg_name(KT_ARG_B_GATE + p), kOut, {E_, rows}},
                                    where));
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    check_writable(out[i].second, where, arg_name(out[i].first));
    for (size_t j = 0; j < i; ++j)
      check_disjoint(out[i].second, arg_name(out[i].first), out[j].second, arg_name(out[j].first), where);
  }
  for (const auto& o : out) {
    const View& v = o.second;
    const bool bias = o.first >= KT_ARG_B_GATE;
    const int p = o.first - (bias ? KT_ARG_B_GATE : KT_ARG_W_GATE);
    const int64_t in = p == kDown ? I_ : H_, rows = p == kDown ? H_ : I_;
    const PanelShape& ps = p == kDown ? down_shape_ : gate_shape_;
    engine_->pool->run(E_, [&](int64_t e, int) {
      const bool live = loaded_[static_cast<size_t>(e)] != 0;
      if (bias) {
        for (int64_t r = 0; r < rows; ++r)
          store_f32(v.at(e, r), v.dtype, live ? b_[p][static_cast<size_t>(e * rows + r)] : 0.f);
        return;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < in; ++c) {
          float w = 0.f;
          if (live)
            w = quantized_ ? quant_get(qexpert(p, e), qshape(p), r, c)
                          : packed_get(wp_[p] + e * ps.elements(), ps, r, c);
          store_f32(v.at(e, r, c), v.dtype, w);
        }
    });
  }
}
