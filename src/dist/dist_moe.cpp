#include "dist/dist_moe.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/checked.h"
#include "core/sized_struct.h"
#include "core/tensor.h"
#include "dist/dist_moe_rows.h"
#include "moe/args.h"
#include "moe/layer_calls.h"

using kt::DType;
using kt::fail;
using kt::View;
using kt::dist::agree;
using kt::dist::attempt;
using kt::dist::combine_rows;
using kt::dist::copy_row_in;
using kt::dist::copy_row_out;
using kt::dist::dispatch_messages;
using kt::dist::heads_of;
using kt::dist::inline_routes_bytes;
using kt::dist::kDispatchRows;
using kt::dist::kOutcomeBytes;
using kt::dist::Outcome;
using kt::dist::outcome_and_rows;
using kt::dist::raw_to_f32;
using kt::dist::route_bytes;
using kt::dist::rows_of_replies;
using kt::dist::RowsHead;
using kt::dist::token_order;

namespace {

// The local layer of handle h, kept for a call reported as the ABI call
// `where` (the handle is the host's too: kt_dist_moe_layer).
std::shared_ptr<kt_moe> local_layer(kt_moe* h, const char* where) {
  return kt::live(h, kt::HandleKind::kMoe, where, "moe");
}

// The local layer's forward, its failure reported as kt_moe_forward's.
void local_forward(kt_moe* h, const kt_arg* args, size_t n, kt_context** saved) {
  const char* w = "kt_moe_forward";
  kt::as_call(w, [&] { kt::forward_layer(*local_layer(h, w), args, n, saved, w); });
}

DLDataType dl_type(DType d) {
  switch (d) {
    case DType::kBF16: return DLDataType{kDLBfloat, 16, 1};
    case DType::kI32: return DLDataType{kDLInt, 32, 1};
    default: return DLDataType{kDLFloat, 32, 1};
  }
}

// A compact 2-D tensor over kt's own buffers, for the local layer's calls.
struct Dl {
  int64_t shape[2];
  DLTensor t{};
  Dl(const void* data, DType dtype, int64_t rows, int64_t cols) : shape{rows, cols} {
    t.data = const_cast<void*>(data);
    t.device = {kDLCPU, 0};
    t.ndim = 2;
    t.dtype = dl_type(dtype);
    t.shape = shape;
  }
  Dl(const Dl&) = delete;
  Dl& operator=(const Dl&) = delete;
};

// Buffers never hand out a null pointer (DLTensor data of empty tensors).
char* bytes_of(std::vector<char>& v, size_t n) {
  v.resize(std::max<size_t>(n, 1));
  return v.data();
}

size_t usize(int64_t v) { return static_cast<size_t>(v); }

std::string dtype_word(int32_t d) { return kt::dtype_name(static_cast<DType>(d)); }

// Refuses (on every rank: each sees every payload) a value that differs
// between ranks.
template <class Get>
void check_same(const std::vector<char>& payloads, size_t stride, int world, const char* where, kt_status status,
                const std::string& what, Get get, std::string (*show)(int64_t)) {
  const int64_t first = get(payloads.data());
  for (int r = 1; r < world; ++r) {
    const int64_t v = get(payloads.data() + usize(r) * stride);
    if (v != first)
      fail(status, std::string(where) + ": the ranks disagree on " + what + ": rank 0 has " + show(first) + ", rank " +
                       std::to_string(r) + " has " + show(v) + " (every rank must pass the same)");
  }
}

std::string show_int(int64_t v) { return std::to_string(v); }
std::string show_float_bits(int64_t v) {
  float f;
  const uint32_t bits = static_cast<uint32_t>(v);
  std::memcpy(&f, &bits, sizeof(f));
  return std::to_string(f);
}
std::string show_dtype(int64_t v) { return dtype_word(static_cast<int32_t>(v)); }
std::string show_hash(int64_t v) { return "map #" + std::to_string(static_cast<uint64_t>(v) % 100000); }

int64_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

}  // namespace

// ------------------------------------------------------------------ create

namespace {

// What every rank must agree on at creation, with the names that errors use.
constexpr int kConfigFields = 19;
const char* const kConfigNames[kConfigFields] = {
    "layer_options->num_experts (E)", "layer_options->top_k (k)", "layer_options->hidden (H)",
    "layer_options->intermediate (I)", "layer_options->max_tokens", "layer_options->activation",
    "layer_options->act_alpha", "layer_options->act_limit", "layer_options->has_bias", "layer_options->mode",
    "layer_options->weight_format (the weights' dtype)", "layer_options->lora_rank", "layer_options->lora_alpha",
    "layer_options->use_rslora", "layer_options->lora_targets", "options->mode", "options->owner_rank",
    "options->grad_average", "options->expert_ranks"};

struct Config {
  int64_t v[kConfigFields];
};

Config config_of(const kt_moe_options& o, const kt_dist_moe_options& d, const std::vector<int32_t>& map) {
  const bool lora = kt::enum_bits(o.mode) == KT_MODE_LORA;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a of the expert map
  for (int32_t r : map) hash = (hash ^ static_cast<uint32_t>(r)) * 1099511628211ull;
  return Config{{o.num_experts, o.top_k, o.hidden, o.intermediate, o.max_tokens, kt::enum_bits(o.activation),
                 float_bits(o.act_alpha), float_bits(o.act_limit), o.has_bias, kt::enum_bits(o.mode),
                 kt::enum_bits(o.weight_format), lora ? o.lora_rank : 0, lora ? float_bits(o.lora_alpha) : 0,
                 lora ? o.use_rslora : 0, lora ? int64_t{o.lora_targets} : 0, kt::enum_bits(d.mode),
                 d.owner_rank, kt::enum_bits(d.grad_average), static_cast<int64_t>(hash >> 1)}};
}

}  // namespace

void kt_dist_moe::create(kt_engine* engine, const char* where) {
  const int W = comm->world, me = comm->rank;
  std::lock_guard<std::mutex> lock(comm->mutex);
  comm->check_usable(where);
  const std::string w(where);
  const kt_moe_options& o = layer_options;
  const Outcome mine = attempt([&] {
    const auto range = [&](int64_t v, int64_t lo, int64_t hi, const char* name) {
      KT_CHECK(v >= lo && v <= hi, KT_ERR_INVALID_ARGUMENT,
               w + ": layer_options->" + name + " = " + std::to_string(v) + " is outside [" +
                   std::to_string(lo) + ", " + std::to_string(hi) + "]");
    };
    range(o.num_experts, 1, 1 << 20, "num_experts");
    range(o.top_k, 1, o.num_experts, "top_k");
    range(o.hidden, 1, 1 << 20, "hidden");
    range(o.intermediate, 1, 1 << 20, "intermediate");
    range(o.max_tokens, 1, (int64_t{1} << 31) / o.top_k / 64 / W, "max_tokens (per rank)");
    kt::check_enum(options.mode, KT_DIST_OWNER, KT_DIST_EXPERT_PARALLEL, w + ": options->mode", "kt_dist_mode");
    kt::check_enum(options.grad_average, KT_DIST_GRAD_SUM, KT_DIST_GRAD_MEAN, w + ": options->grad_average",
                   "kt_dist_grad_average");
    if (owner_mode()) {
      KT_CHECK(options.owner_rank >= 0 && options.owner_rank < W, KT_ERR_INVALID_ARGUMENT,
               w + ": options->owner_rank = " + std::to_string(options.owner_rank) +
                   " is outside [0, " + std::to_string(W) + ")");
      KT_CHECK(options.expert_ranks == nullptr, KT_ERR_INVALID_ARGUMENT,
               w + ": options->expert_ranks is for KT_DIST_EXPERT_PARALLEL; owner mode keeps every "
                   "expert on the owner");
    } else {
      expert_rank.resize(usize(o.num_experts));
      for (int64_t e = 0; e < o.num_experts; ++e) {
        const int32_t r = options.expert_ranks ? options.expert_ranks[e] : static_cast<int32_t>(e * W / o.num_experts);
        KT_CHECK(r >= 0 && r < W, KT_ERR_INVALID_ARGUMENT,
                 w + ": options->expert_ranks[" + std::to_string(e) + "] = " + std::to_string(r) +
                     " is outside [0, " + std::to_string(W) + ")");
        expert_rank[usize(e)] = r;
      }
    }
    local_index.assign(usize(o.num_experts), -1);
    for (int64_t e = 0; e < o.num_experts; ++e) {
      if (owner_mode() ? me == options.owner_rank : expert_rank[usize(e)] == me) {
        local_index[usize(e)] = static_cast<int32_t>(local_experts.size());
        local_experts.push_back(e);
      }
    }
    if (!local_experts.empty())
      kt::live(engine, kt::HandleKind::kEngine, where,
               owner_mode() ? "engine (the owner rank computes the layer)"
                            : "engine (every expert-parallel rank holding experts computes them)");
  });
  const Config mine_config = config_of(o, options, expert_rank);
  const std::vector<char> all = agree(*comm, where, mine, &mine_config, sizeof(Config));
  for (int f = 0; f < kConfigFields; ++f) {
    std::string (*show)(int64_t) = show_int;
    if (f == 6 || f == 7 || f == 12) show = show_float_bits;
    if (f == kConfigFields - 1) show = show_hash;
    check_same(all, sizeof(Config), W, where, KT_ERR_INVALID_ARGUMENT, kConfigNames[f],
               [f](const char* p) {
                 Config c;
                 std::memcpy(&c, p, sizeof(c));
                 return c.v[f];
               },
               show);
  }

  // The local layer: the owner's whole layer for every rank's tokens, or an
  // expert rank's experts with one route per computed row.
  const Outcome made = attempt([&] {
    if (local_experts.empty()) return;
    kt_moe_options lo = o;
    if (owner_mode()) {
      lo.max_tokens = o.max_tokens * W;
    } else {
      lo.num_experts = static_cast<int64_t>(local_experts.size());
      lo.top_k = 1;
      lo.max_tokens = o.max_tokens * W * o.top_k;
    }
    const char* w = "kt_moe_create";
    kt::as_call(w, [&] {
      const std::shared_ptr<kt_moe> m =
          kt::create_layer(kt::live(engine, kt::HandleKind::kEngine, w, "engine"), lo, w);
      local = kt::handle_value<kt_moe>(m->handle());
    });
  });
  try {
    agree(*comm, where, made, nullptr, 0);
  } catch (...) {
    destroy_local();
    throw;
  }
}

kt_dist_moe::~kt_dist_moe() {
  end_contexts();
  destroy_local();
}

void kt_dist_moe::destroy_local() noexcept {
  if (!local) return;
  try {
    // Already ended when the host destroyed it (kt_dist_moe_layer gave it out).
    if (auto m = std::static_pointer_cast<kt_moe>(kt::remove_handle(kt::handle_id(local), kt::HandleKind::kMoe)))
      kt::destroy_layer(m);
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
  local = nullptr;
}

void kt_dist_moe::end_contexts() noexcept {
  std::lock_guard<std::mutex> lock(contexts_mutex);
  for (kt::HandleId id : contexts) kt::remove_handle(id, kt::HandleKind::kDistContext);
  contexts.clear();
}

// ----------------------------------------------------------------- forward

struct kt_dist_moe::Forward {
  View x, ids, w, y;
  int64_t T = 0;
};

kt_dist_context* kt_dist_moe::forward(const kt_arg* args, size_t n, bool save, const char* where) {
  std::lock_guard<std::mutex> lock(comm->mutex);
  comm->check_usable(where);
  const int64_t E = layer_options.num_experts, K = layer_options.top_k, H = layer_options.hidden;
  Forward f;
  const Outcome mine = attempt([&] {
    kt::ArgTable t(args, n, where, {KT_ARG_X, KT_ARG_IDS, KT_ARG_ROUTE_WEIGHTS, KT_ARG_Y});
    for (int id : {KT_ARG_X, KT_ARG_IDS, KT_ARG_ROUTE_WEIGHTS, KT_ARG_Y})
      KT_CHECK(t[id] != nullptr, KT_ERR_NULL_POINTER,
               std::string(where) + ": " + kt::arg_name(id) + " is required");
    f.x = kt::check_tensor(t[KT_ARG_X], {"KT_ARG_X", {DType::kBF16, DType::kF32}, {-1, H}, true}, where);
    f.T = f.x.shape[0];
    KT_CHECK(f.T <= layer_options.max_tokens, KT_ERR_TOO_MANY_TOKENS,
             std::string(where) + ": KT_ARG_X has " + std::to_string(f.T) +
                 " tokens; the layer's max_tokens per rank is " +
                 std::to_string(layer_options.max_tokens));
    f.ids = kt::check_tensor(t[KT_ARG_IDS], {"KT_ARG_IDS", {DType::kI32, DType::kI64}, {f.T, K}}, where);
    f.w = kt::check_tensor(t[KT_ARG_ROUTE_WEIGHTS], {"KT_ARG_ROUTE_WEIGHTS", {DType::kF32, DType::kBF16}, {f.T, K}},
                           where);
    f.y = kt::check_tensor(t[KT_ARG_Y], {"KT_ARG_Y", {f.x.dtype}, {f.T, H}, true}, where);
    kt::check_writable(f.y, where, "KT_ARG_Y");
    kt::check_disjoint(f.y, "KT_ARG_Y", f.x, "KT_ARG_X", where);
    kt::check_disjoint(f.y, "KT_ARG_Y", f.ids, "KT_ARG_IDS", where);
    kt::check_disjoint(f.y, "KT_ARG_Y", f.w, "KT_ARG_ROUTE_WEIGHTS", where);
    for (int64_t i = 0; i < f.T; ++i)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = f.ids.get_int(i, j);
        KT_CHECK(e >= -1 && e < E, KT_ERR_EXPERT_ID,
                 std::string(where) + ": KT_ARG_IDS[" + std::to_string(i) + "," +
                     std::to_string(j) + "] = " + std::to_string(e) + " is outside [-1, " +
                     std::to_string(E) + ")");
      }
  });
  auto ctx = std::make_shared<kt_dist_context>();
  ctx->layer = handle;
  ctx->seq = ++forwards;
  ctx->tokens = f.T;
  ctx->x_dtype = static_cast<int32_t>(f.x.dtype);
  try {
    if (owner_mode()) {
      forward_owner(f, mine, save ? ctx.get() : nullptr, where);
    } else {
      forward_experts(f, mine, save ? ctx.get() : nullptr, where);
    }
  } catch (...) {
    if (ctx->local) kt::release_layer_context(ctx->local);
    throw;
  }
  if (!save) return nullptr;
  std::lock_guard<std::mutex> l(contexts_mutex);
  ctx->handle = kt::add_handle(kt::HandleKind::kDistContext, ctx);
  contexts.insert(ctx->handle);
  return kt::handle_value<kt_dist_context>(ctx->handle);
}

namespace {

// Refuses (on every rank: each sees every rank's head) X's dtype where the
// ranks differ; heads holds every rank's, one after another.
void check_x_dtypes(const std::vector<char>& heads, int W, const char* where) {
  check_same(heads, sizeof(RowsHead), W, where, KT_ERR_DTYPE, "KT_ARG_X's dtype",
             [](const char* p) {
               RowsHead h;
               std::memcpy(&h, p, sizeof(h));
               return int64_t{h.dtype};
             },
             show_dtype);
}

}  // namespace

void kt_dist_moe::forward_owner(Forward& f, const Outcome& mine, kt_dist_context* ctx, const char* where) {
  const int W = comm->world, me = comm->rank, owner = options.owner_rank;
  const int64_t K = layer_options.top_k, H = layer_options.hidden;
  ++comm->message_calls;
  // A rank whose arguments failed sends its outcome and no rows.
  const int64_t T = mine.ok() ? f.T : 0;
  const RowsHead head{T, mine.ok() ? static_cast<int32_t>(f.x.dtype) : 0, 0};
  const auto row_bytes = [&](const RowsHead& h) {
    return H * static_cast<int64_t>(kt::dtype_size(static_cast<DType>(h.dtype))) + K * 8;
  };
  // The rows to the owner: T x rows, then T x k int32 ids, then T x k fp32
  // weights.
  const int64_t xrow = mine.ok() ? H * static_cast<int64_t>(kt::dtype_size(f.x.dtype)) : 0;
  char* out = bytes_of(send_, usize(T * row_bytes(head)));
  if (T > 0) {
    for (int64_t i = 0; i < T; ++i) copy_row_out(f.x, i, out + i * xrow);
    char* tail = out + T * xrow;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = static_cast<int32_t>(f.ids.get_int(i, j));
        const float wt = f.w.get(i, j);
        std::memcpy(tail + (i * K + j) * 4, &e, 4);
        std::memcpy(tail + T * K * 4 + (i * K + j) * 4, &wt, 4);
      }
  }
  const std::vector<std::vector<char>> msgs =
      kt::dist::to_owner(*comm, where, owner, mine, &head, sizeof(head), out, usize(T * row_bytes(head)),
                         [&](const char* h) {
                           RowsHead t;
                           std::memcpy(&t, h, sizeof(t));
                           return usize(t.rows * row_bytes(t));
                         });

  // The owner checks what every rank sent and computes every rank's rows as
  // one call, rank 0's first.
  kt::dist::Relay relay;
  std::vector<std::pair<const char*, size_t>> replies;
  std::vector<RowsHead> heads(usize(W));
  if (me == owner) {
    std::vector<char> all(usize(W) * sizeof(RowsHead));
    for (int r = 0; r < W; ++r) {
      std::memcpy(&heads[usize(r)], msgs[usize(r)].data() + kOutcomeBytes, sizeof(RowsHead));
      std::memcpy(all.data() + usize(r) * sizeof(RowsHead), &heads[usize(r)], sizeof(RowsHead));
    }
    relay = kt::dist::first_failure(msgs);
    if (relay.outcome.ok()) {
      relay.outcome = attempt([&] {
        check_x_dtypes(all, W, where);
      });
    }
    std::vector<int64_t> first(usize(W) + 1, 0);
    for (int r = 0; r < W; ++r) first[usize(r) + 1] = first[usize(r)] + heads[usize(r)].rows;
    const int64_t total = first[usize(W)];
    if (relay.outcome.ok()) {
      relay.outcome = attempt([&] {
        char* x = bytes_of(x_, usize(total * xrow));
        char* ids = bytes_of(ids_, usize(total * K * 4));
        char* wts = bytes_of(w_, usize(total * K * 4));
        for (int r = 0; r < W; ++r) {
          const int64_t n = heads[usize(r)].rows, t0 = first[usize(r)];
          const char* src = msgs[usize(r)].data() + kOutcomeBytes + sizeof(RowsHead);
          std::memcpy(x + t0 * xrow, src, usize(n * xrow));
          std::memcpy(ids + t0 * K * 4, src + n * xrow, usize(n * K * 4));
          std::memcpy(wts + t0 * K * 4, src + n * xrow + n * K * 4, usize(n * K * 4));
        }
        char* y = bytes_of(y_, usize(total * xrow));
        const DType xd = f.x.dtype;
        Dl X(x, xd, total, H), I(ids, DType::kI32, total, K), Wt(wts, DType::kF32, total, K), Y(y, xd, total, H);
        const kt_arg a[] = {{KT_ARG_X, &X.t}, {KT_ARG_IDS, &I.t}, {KT_ARG_ROUTE_WEIGHTS, &Wt.t}, {KT_ARG_Y, &Y.t}};
        local_forward(local, a, 4, ctx ? &ctx->local : nullptr);
      });
      if (!relay.outcome.ok()) relay.rank = owner;
    }
    // Sizes from each rank's own head: what that rank expects back.
    for (int r = 0; r < W; ++r)
      replies.emplace_back(relay.outcome.ok() ? y_.data() + first[usize(r)] * xrow : nullptr,
                           usize(heads[usize(r)].rows * H *
                                 static_cast<int64_t>(kt::dtype_size(static_cast<DType>(heads[usize(r)].dtype)))));
  }

  // Each rank's y back, behind the relayed outcome.
  char* back = bytes_of(recv_, usize(T * xrow));
  kt::dist::from_owner(*comm, where, owner, relay, replies, back, usize(T * xrow));
  for (int64_t i = 0; i < T; ++i) copy_row_in(f.y, i, back + i * xrow);
  if (ctx && me == owner) {
    ctx->rank_tokens.resize(usize(W));
    for (int r = 0; r < W; ++r) ctx->rank_tokens[usize(r)] = heads[usize(r)].rows;
  }
}

namespace {

// The routes each rank sent this one, after refusing X's dtype where the
// ranks differ.
std::vector<int64_t> routes_received(const std::vector<std::vector<char>>& in, const char* where) {
  const int W = static_cast<int>(in.size());
  const std::vector<char> heads = heads_of(in, sizeof(RowsHead));
  check_x_dtypes(heads, W, where);
  std::vector<int64_t> received(usize(W));
  for (int r = 0; r < W; ++r) {
    RowsHead h;
    std::memcpy(&h, heads.data() + usize(r) * sizeof(h), sizeof(h));
    received[usize(r)] = h.rows;
  }
  return received;
}

}  // namespace

// The routes this rank received (received[r] from rank r, in its message
// in[r]) through the local layer: one route per row, in fp32 (bf16 rows
// convert exactly), so each row's output in y_ is w * o unrounded.
void kt_dist_moe::forward_received(const std::vector<std::vector<char>>& in, const std::vector<int64_t>& received,
                                   DType xd, kt_dist_context* ctx, const char* where) {
  const int me = comm->rank;
  const int64_t H = layer_options.hidden, row = route_bytes(H, xd), xrow = row - 8;
  int64_t nrecv = 0;
  for (int64_t n : received) nrecv += n;
  KT_CHECK(local != nullptr || nrecv == 0, KT_ERR_INTERNAL,
           std::string(where) + ": routes arrived at a rank that holds no experts");
  if (!local) return;
  float* x = reinterpret_cast<float*>(bytes_of(x_, usize(nrecv * H * 4)));
  int32_t* ids = reinterpret_cast<int32_t*>(bytes_of(ids_, usize(nrecv * 4)));
  float* wts = reinterpret_cast<float*>(bytes_of(w_, usize(nrecv * 4)));
  int64_t p = 0;
  for (size_t r = 0; r < in.size(); ++r)
    for (int64_t q = 0; q < received[r]; ++q, ++p) {
      const char* src = in[r].data() + kDispatchRows + q * row;
      raw_to_f32(src, xd, H, x + p * H);
      int32_t e;
      std::memcpy(&e, src + xrow, 4);
      KT_CHECK(e >= 0 && e < layer_options.num_experts && local_index[usize(e)] >= 0, KT_ERR_INTERNAL,
               std::string(where) + ": a route to expert " + std::to_string(e) + " arrived at rank " +
                   std::to_string(me) + ", which does not hold it");
      ids[p] = local_index[usize(e)];
      std::memcpy(&wts[p], src + xrow + 4, 4);
    }
  float* y = reinterpret_cast<float*>(bytes_of(y_, usize(nrecv * H * 4)));
  Dl X(x, DType::kF32, nrecv, H), I(ids, DType::kI32, nrecv, 1), Wt(wts, DType::kF32, nrecv, 1),
      Y(y, DType::kF32, nrecv, H);
  const kt_arg a[] = {{KT_ARG_X, &X.t}, {KT_ARG_IDS, &I.t}, {KT_ARG_ROUTE_WEIGHTS, &Wt.t}, {KT_ARG_Y, &Y.t}};
  local_forward(local, a, 4, ctx ? &ctx->local : nullptr);
}

void kt_dist_moe::forward_experts(Forward& f, const Outcome& mine, kt_dist_context* ctx, const char* where) {
  const int W = comm->world;
  const int64_t K = layer_options.top_k, H = layer_options.hidden;
  kt::dist::Transport& t = comm->cpu_transport(where);
  ++comm->message_calls;

  // This rank's routes by destination, each in (token, slot) order.
  std::vector<std::vector<int64_t>> to(usize(W));
  std::vector<int64_t> route_row(usize(f.T * K), -1);
  if (mine.ok())
    for (int64_t i = 0; i < f.T; ++i)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = f.ids.get_int(i, j);
        if (e >= 0) to[usize(expert_rank[usize(e)])].push_back(i * K + j);
      }
  std::vector<int64_t> sent(usize(W));
  int64_t nsent = 0;
  for (int r = 0; r < W; ++r) {
    sent[usize(r)] = static_cast<int64_t>(to[usize(r)].size());
    for (int64_t s : to[usize(r)]) route_row[usize(s)] = nsent++;
  }

  // Dispatch: each rank's outcome, X's dtype and routes go to every rank in
  // one exchange; a failure anywhere is raised on every rank once all the
  // messages are in.
  const std::vector<std::vector<char>> in = kt::dist::exchange_messages(
      *comm, where, dispatch_messages(mine, f.x, f.ids, f.w, to, K), std::vector<bool>(usize(W), true),
      sizeof(RowsHead), inline_routes_bytes(K, H), [H](const char* p) {
        RowsHead h;
        std::memcpy(&h, p, sizeof(h));
        return usize(h.rows * route_bytes(H, static_cast<DType>(h.dtype)));
      });
  kt::dist::raise_first_failure(in, where);
  std::vector<int64_t> received = routes_received(in, where);
  const Outcome computed = attempt([&] { forward_received(in, received, f.x.dtype, ctx, where); });

  // Combine: each rank's outcome and its routes' weighted outputs go back.
  const int64_t yrow = H * 4;
  std::vector<int64_t> send_bytes(usize(W)), recv_bytes(usize(W));
  const std::vector<char> reply = outcome_and_rows(computed, received, sent, y_.data(), yrow, &send_bytes, &recv_bytes);
  char* back = bytes_of(recv_, usize(int64_t{kOutcomeBytes} * W + nsent * yrow));
  comm->run(where, [&] { t.alltoallv(reply.data(), send_bytes, back, recv_bytes); });
  // Outputs packed without the headers, in route_row order.
  const std::vector<char> rows = rows_of_replies(back, sent, yrow, where);
  std::vector<int64_t> begin, order;
  token_order(f.ids, f.T, K, &begin, &order);
  combine_rows(begin, order, route_row, rows.data(), yrow, H, f.y);
  if (ctx) {
    ctx->sent = std::move(sent);
    ctx->received = std::move(received);
    ctx->route_row = std::move(route_row);
    ctx->token_begin = std::move(begin);
    ctx->route_order = std::move(order);
  }
}

// ---------------------------------------------------------------- backward

struct kt_dist_moe::Backward {
  View dy, dx, dw;
  bool has_dx = false, has_dw = false;
  kt_backward_options opt;
};

namespace {

struct GradHead {
  uint64_t seq;
  int64_t tokens;
  int32_t x_dtype;  // of the forward: dx comes back in it
  int32_t dy_dtype;
  int32_t has_dx;
  int32_t has_dw;
  int32_t accumulate;
  int32_t param_grads;
  uint32_t grad_scale_bits;
};

GradHead grad_head_at(const char* p) {
  GradHead h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}

}  // namespace

void kt_dist_moe::backward(kt_dist_context* ctx, const kt_backward_options* options_in, const kt_arg* args,
                           size_t n, const char* where) {
  std::lock_guard<std::mutex> lock(comm->mutex);
  comm->check_usable(where);
  const int64_t K = layer_options.top_k, H = layer_options.hidden;
  Backward b;
  const Outcome mine = attempt([&] {
    b.opt = kt::read_sized(options_in, kt::set_backward_options_defaults, where, "options");
    kt::check_backward_values(b.opt, where);
    KT_CHECK(ctx != nullptr, KT_ERR_CONTEXT,
             std::string(where) +
                 ": ctx is not a live kt_dist_context (NULL, released, or never issued)");
    KT_CHECK(ctx->layer == handle, KT_ERR_CONTEXT,
             std::string(where) + ": ctx belongs to another kt_dist_moe");
    KT_CHECK(!ctx->spent, KT_ERR_CONTEXT,
             std::string(where) + ": ctx is spent: a backward already consumed it");
    kt::ArgTable t(args, n, where, {KT_ARG_DY, KT_ARG_DX, KT_ARG_DROUTE_WEIGHTS});
    KT_CHECK(t[KT_ARG_DY] != nullptr, KT_ERR_NULL_POINTER,
             std::string(where) + ": KT_ARG_DY is required");
    const int64_t T = ctx->tokens;
    b.dy = kt::check_tensor(t[KT_ARG_DY], {"KT_ARG_DY", {DType::kBF16, DType::kF32}, {T, H}, true}, where);
    if (t[KT_ARG_DX]) {
      b.dx = kt::check_tensor(t[KT_ARG_DX], {"KT_ARG_DX", {static_cast<DType>(ctx->x_dtype)}, {T, H}, true}, where);
      b.has_dx = true;
      kt::check_writable(b.dx, where, "KT_ARG_DX");
      kt::check_disjoint(b.dx, "KT_ARG_DX", b.dy, "KT_ARG_DY", where);
    }
    if (t[KT_ARG_DROUTE_WEIGHTS]) {
      b.dw = kt::check_tensor(t[KT_ARG_DROUTE_WEIGHTS],
                              {"KT_ARG_DROUTE_WEIGHTS", {DType::kF32, DType::kBF16}, {T, K}}, where);
      b.has_dw = true;
      kt::check_writable(b.dw, where, "KT_ARG_DROUTE_WEIGHTS");
      kt::check_disjoint(b.dw, "KT_ARG_DROUTE_WEIGHTS", b.dy, "KT_ARG_DY", where);
      if (b.has_dx) kt::check_disjoint(b.dw, "KT_ARG_DROUTE_WEIGHTS", b.dx, "KT_ARG_DX", where);
    }
  });
  if (owner_mode()) {
    backward_owner(b, mine, ctx, where);
  } else {
    backward_experts(b, mine, ctx, where);
  }
  ctx->spent = true;
}

namespace {

// Refuses heads (every rank's, one after another) whose forward or options
// differ between ranks.
void check_grad_heads(const std::vector<char>& all, int W, const char* where) {
  check_same(all, sizeof(GradHead), W, where, KT_ERR_CONTEXT, "the forward whose context backward consumes (its number)",
             [](const char* p) { return static_cast<int64_t>(grad_head_at(p).seq); }, show_int);
  check_same(all, sizeof(GradHead), W, where, KT_ERR_DTYPE, "KT_ARG_DY's dtype",
             [](const char* p) { return int64_t{grad_head_at(p).dy_dtype}; }, show_dtype);
  check_same(all, sizeof(GradHead), W, where, KT_ERR_INVALID_ARGUMENT, "options->grad_scale",
             [](const char* p) { return int64_t{grad_head_at(p).grad_scale_bits}; }, show_float_bits);
  check_same(all, sizeof(GradHead), W, where, KT_ERR_INVALID_ARGUMENT, "options->accumulate",
             [](const char* p) { return int64_t{grad_head_at(p).accumulate}; }, show_int);
  check_same(all, sizeof(GradHead), W, where, KT_ERR_INVALID_ARGUMENT, "options->param_grads",
             [](const char* p) { return int64_t{grad_head_at(p).param_grads}; }, show_int);
}

GradHead grad_head_of(const kt_dist_context* ctx, const Outcome& mine, const View& dy, bool has_dx, bool has_dw,
                      const kt_backward_options& o) {
  GradHead h{};
  if (!mine.ok()) return h;
  h.seq = ctx->seq;
  h.tokens = ctx->tokens;
  h.x_dtype = ctx->x_dtype;
  h.dy_dtype = static_cast<int32_t>(dy.dtype);
  h.has_dx = has_dx;
  h.has_dw = has_dw;
  h.accumulate = static_cast<int32_t>(kt::enum_bits(o.accumulate));
  h.param_grads = o.param_grads;
  h.grad_scale_bits = static_cast<uint32_t>(float_bits(o.grad_scale));
  return h;
}

// What a rank's dy message to a rank carries ahead of its dy rows: the
// backward's head (which the ranks must agree on) and the number of rows.
struct DyHead {
  GradHead grad;
  int64_t rows;
};

DyHead dy_head_at(const std::vector<char>& message) {
  DyHead h;
  std::memcpy(&h, message.data() + kOutcomeBytes, sizeof(h));
  return h;
}

// Where the rows of a dy message begin, behind its outcome and head.
constexpr size_t kDyRows = kOutcomeBytes + sizeof(DyHead);

// This rank's dy message to each rank: its outcome and head, then the dy
// rows of its routes to that rank, in the forward's order (no rows after a
// failed outcome, when ctx may be no context).
std::vector<std::vector<char>> dy_messages(const Outcome& mine, const GradHead& head, const kt_dist_context* ctx,
                                           const View& dy, int W, int64_t K) {
  const int64_t dyrow = mine.ok() ? dy.shape[1] * static_cast<int64_t>(kt::dtype_size(dy.dtype)) : 0;
  std::vector<std::vector<char>> messages(usize(W));
  std::vector<char*> row_at;  // a route_row's place in the messages
  for (int r = 0; r < W; ++r) {
    const DyHead h{head, mine.ok() ? ctx->sent[usize(r)] : 0};
    messages[usize(r)] = kt::dist::outcome_message(mine, &h, sizeof(h), nullptr, usize(h.rows * dyrow));
    for (int64_t i = 0; i < h.rows; ++i) row_at.push_back(messages[usize(r)].data() + kDyRows + i * dyrow);
  }
  if (mine.ok())
    for (int64_t s = 0; s < ctx->tokens * K; ++s)
      if (ctx->route_row[usize(s)] >= 0) copy_row_out(dy, s / K, row_at[usize(ctx->route_row[usize(s)])]);
  return messages;
}

// Every rank's backward head (in its dy message to this rank), after
// refusing heads whose forward or options differ between ranks.
std::vector<GradHead> agreed_grad_heads(const std::vector<std::vector<char>>& in, const char* where) {
  const int W = static_cast<int>(in.size());
  const std::vector<char> all = heads_of(in, sizeof(GradHead));  // a DyHead begins with its GradHead
  check_grad_heads(all, W, where);
  std::vector<GradHead> heads(usize(W));
  for (int r = 0; r < W; ++r) heads[usize(r)] = grad_head_at(all.data() + usize(r) * sizeof(GradHead));
  return heads;
}

}  // namespace

namespace {

// The local layer's backward over the rows it computed; parameter gradients
// follow the host's averaging convention.
void local_backward(const kt_dist_moe& d, kt_context* ctx, const kt_backward_options& given, const Dl& dy,
                    const Dl* dx, const Dl* dw) {
  kt_arg a[3] = {{KT_ARG_DY, &dy.t}};
  size_t n = 1;
  if (dx) a[n++] = kt_arg{KT_ARG_DX, &dx->t};
  if (dw) a[n++] = kt_arg{KT_ARG_DROUTE_WEIGHTS, &dw->t};
  kt_backward_options o = given;
  if (kt::enum_bits(d.options.grad_average) == KT_DIST_GRAD_MEAN) o.grad_scale /= static_cast<float>(d.comm->world);
  const char* w = "kt_moe_backward";
  kt::GradHook hook;
  kt::as_call(w, [&] { hook = kt::backward_layer(*local_layer(d.local, w), ctx, &o, a, n, w); });
  hook.call();
}

}  // namespace

void kt_dist_moe::backward_owner(Backward& b, const Outcome& mine, kt_dist_context* ctx, const char* where) {
  const int W = comm->world, me = comm->rank, owner = options.owner_rank;
  const int64_t K = layer_options.top_k, H = layer_options.hidden;
  ++comm->message_calls;
  // A rank whose arguments failed sends a zero head and no rows.
  const GradHead head = grad_head_of(ctx, mine, b.dy, b.has_dx, b.has_dw, b.opt);
  const auto dy_bytes = [&](const GradHead& h) {
    return h.tokens * H * static_cast<int64_t>(kt::dtype_size(static_cast<DType>(h.dy_dtype)));
  };
  const auto xrow_of = [&](const GradHead& h) {
    return H * static_cast<int64_t>(kt::dtype_size(static_cast<DType>(h.x_dtype)));
  };
  // What comes back to a rank, sized from its head alone: its dx rows, then
  // its routing-weight gradients, as it asked.
  const auto part_bytes = [&](const GradHead& h) {
    return (h.has_dx ? h.tokens * xrow_of(h) : 0) + (h.has_dw ? h.tokens * K * 4 : 0);
  };
  char* out = bytes_of(send_, usize(dy_bytes(head)));
  const int64_t dyrow = H * static_cast<int64_t>(kt::dtype_size(static_cast<DType>(head.dy_dtype)));
  for (int64_t i = 0; i < head.tokens; ++i) copy_row_out(b.dy, i, out + i * dyrow);
  const std::vector<std::vector<char>> msgs =
      kt::dist::to_owner(*comm, where, owner, mine, &head, sizeof(head), out, usize(dy_bytes(head)),
                         [&](const char* h) { return usize(dy_bytes(grad_head_at(h))); });

  // The owner's one backward over every rank's rows; parameter gradients
  // once, scaled by the host's convention.
  kt::dist::Relay relay;
  std::vector<std::pair<const char*, size_t>> replies;
  if (me == owner) {
    std::vector<char> all(usize(W) * sizeof(GradHead));
    std::vector<GradHead> heads(usize(W));
    for (int r = 0; r < W; ++r) {
      heads[usize(r)] = grad_head_at(msgs[usize(r)].data() + kOutcomeBytes);
      std::memcpy(all.data() + usize(r) * sizeof(GradHead), &heads[usize(r)], sizeof(GradHead));
    }
    relay = kt::dist::first_failure(msgs);
    if (relay.outcome.ok()) relay.outcome = attempt([&] { check_grad_heads(all, W, where); });
    bool any_dx = false, any_dw = false;
    std::vector<int64_t> first(usize(W) + 1, 0);
    for (int r = 0; r < W; ++r) {
      any_dx = any_dx || heads[usize(r)].has_dx;
      any_dw = any_dw || heads[usize(r)].has_dw;
      first[usize(r) + 1] = first[usize(r)] + heads[usize(r)].tokens;
    }
    const int64_t total = first[usize(W)];
    const int64_t xrow = xrow_of(head);
    if (relay.outcome.ok()) {
      relay.outcome = attempt([&] {
        const DType dyd = b.dy.dtype, xd = static_cast<DType>(ctx->x_dtype);
        char* dy = bytes_of(recv_, usize(total * dyrow));
        for (int r = 0; r < W; ++r)
          std::memcpy(dy + first[usize(r)] * dyrow, msgs[usize(r)].data() + kOutcomeBytes + sizeof(GradHead),
                      usize(heads[usize(r)].tokens * dyrow));
        char* dx = bytes_of(dx_, usize(any_dx ? total * xrow : 0));
        float* dw = reinterpret_cast<float*>(bytes_of(dw_, usize(any_dw ? total * K * 4 : 0)));
        Dl DY(dy, dyd, total, H), DX(dx, xd, total, H), DW(dw, DType::kF32, total, K);
        local_backward(*this, ctx->local, b.opt, DY, any_dx ? &DX : nullptr, any_dw ? &DW : nullptr);
      });
      if (!relay.outcome.ok()) relay.rank = owner;
    }
    // Each rank's part, packed behind one another in send_.
    int64_t sum = 0;
    for (int r = 0; r < W; ++r) sum += part_bytes(heads[usize(r)]);
    char* s = bytes_of(send_, usize(sum));
    for (int r = 0; r < W; ++r) {
      const GradHead& h = heads[usize(r)];
      char* p = s;
      if (relay.outcome.ok() && h.has_dx) std::memcpy(p, dx_.data() + first[usize(r)] * xrow, usize(h.tokens * xrow));
      if (h.has_dx) p += h.tokens * xrow;
      if (relay.outcome.ok() && h.has_dw) std::memcpy(p, dw_.data() + first[usize(r)] * K * 4, usize(h.tokens * K * 4));
      replies.emplace_back(s, usize(part_bytes(h)));
      s += part_bytes(h);
    }
  }

  char* back = bytes_of(recv_, usize(part_bytes(head)));
  kt::dist::from_owner(*comm, where, owner, relay, replies, back, usize(part_bytes(head)));
  const char* p = back;
  if (b.has_dx) {
    const int64_t xrow = xrow_of(head);
    for (int64_t i = 0; i < head.tokens; ++i) copy_row_in(b.dx, i, p + i * xrow);
    p += head.tokens * xrow;
  }
  if (b.has_dw)
    for (int64_t i = 0; i < head.tokens; ++i)
      for (int64_t j = 0; j < K; ++j) {
        float v;
        std::memcpy(&v, p + (i * K + j) * 4, 4);
        kt::store_f32(b.dw.at(i, j), b.dw.dtype, v);
      }
}

// The dy rows this rank received (in[r]'s, from each rank r) through the
// local layer's backward: per row its dx (fp32) into dx_ and its
// routing-weight gradient into dw_, as any rank asked for them.
void kt_dist_moe::backward_received(const std::vector<std::vector<char>>& in, kt_dist_context* ctx,
                                    const kt_backward_options& opt, DType dyd, bool any_dx, bool any_dw,
                                    const char* where) {
  if (!local) return;
  const int64_t H = layer_options.hidden, dyrow = H * static_cast<int64_t>(kt::dtype_size(dyd));
  int64_t nrecv = 0;
  for (int64_t n : ctx->received) nrecv += n;
  float* dy = reinterpret_cast<float*>(bytes_of(x_, usize(nrecv * H * 4)));
  int64_t p = 0;
  for (size_t r = 0; r < in.size(); ++r) {
    const int64_t n = dy_head_at(in[r]).rows;
    KT_CHECK(n == ctx->received[r], KT_ERR_INTERNAL,
             std::string(where) + ": rank " + std::to_string(r) + " sent " + std::to_string(n) +
                 " dy rows for the forward's " + std::to_string(ctx->received[r]) + " routes");
    for (int64_t q = 0; q < n; ++q, ++p) raw_to_f32(in[r].data() + kDyRows + q * dyrow, dyd, H, dy + p * H);
  }
  float* dx = reinterpret_cast<float*>(bytes_of(dx_, usize(any_dx ? nrecv * H * 4 : 0)));
  float* dw = reinterpret_cast<float*>(bytes_of(dw_, usize(any_dw ? nrecv * 4 : 0)));
  Dl DY(dy, DType::kF32, nrecv, H), DX(dx, DType::kF32, nrecv, H), DW(dw, DType::kF32, nrecv, 1);
  local_backward(*this, ctx->local, opt, DY, any_dx ? &DX : nullptr, any_dw ? &DW : nullptr);
}

void kt_dist_moe::backward_experts(Backward& b, const Outcome& mine, kt_dist_context* ctx, const char* where) {
  const int W = comm->world;
  const int64_t K = layer_options.top_k, H = layer_options.hidden;
  ++comm->message_calls;
  // Dispatch: each rank's outcome, head and dy rows (to its routes' ranks,
  // in the forward's order) go to every rank in one exchange; a failure or
  // a disagreement anywhere is raised on every rank once all are in.
  const GradHead head = grad_head_of(ctx, mine, b.dy, b.has_dx, b.has_dw, b.opt);
  const std::vector<std::vector<char>> in = kt::dist::exchange_messages(
      *comm, where, dy_messages(mine, head, ctx, b.dy, W, K), std::vector<bool>(usize(W), true), sizeof(DyHead),
      inline_routes_bytes(K, H), [H](const char* p) {
        DyHead h;
        std::memcpy(&h, p, sizeof(h));
        return usize(h.rows * H * static_cast<int64_t>(kt::dtype_size(static_cast<DType>(h.grad.dy_dtype))));
      });
  kt::dist::raise_first_failure(in, where);
  bool any_dx = false, any_dw = false;
  for (const GradHead& h : agreed_grad_heads(in, where)) {
    any_dx = any_dx || h.has_dx;
    any_dw = any_dw || h.has_dw;
  }
  kt::dist::Transport& t = comm->cpu_transport(where);
  const Outcome computed = attempt([&] { backward_received(in, ctx, b.opt, b.dy.dtype, any_dx, any_dw, where); });

  // Combine: per route its dx row and routing-weight gradient go back.
  int64_t nsent = 0, nrecv = 0;
  for (int r = 0; r < W; ++r) {
    nsent += ctx->sent[usize(r)];
    nrecv += ctx->received[usize(r)];
  }
  const int64_t back_row = (any_dx ? H * 4 : 0) + (any_dw ? 4 : 0);
  std::vector<char> computed_rows(usize(std::max<int64_t>(nrecv * back_row, 1)));
  if (computed.ok())
    for (int64_t i = 0; i < nrecv; ++i) {
      char* q = computed_rows.data() + i * back_row;
      if (any_dx) std::memcpy(q, dx_.data() + i * H * 4, usize(H * 4));
      if (any_dw) std::memcpy(q + (any_dx ? H * 4 : 0), dw_.data() + i * 4, 4);
    }
  std::vector<int64_t> send_bytes(usize(W)), recv_bytes(usize(W));
  const std::vector<char> reply = outcome_and_rows(computed, ctx->received, ctx->sent, computed_rows.data(), back_row,
                                                   &send_bytes, &recv_bytes);
  char* back = bytes_of(recv_, usize(int64_t{kOutcomeBytes} * W + nsent * back_row));
  comm->run(where, [&] { t.alltoallv(reply.data(), send_bytes, back, recv_bytes); });
  const std::vector<char> rows = rows_of_replies(back, ctx->sent, back_row, where);
  const int64_t slots = ctx->tokens * K;
  if (b.has_dx) combine_rows(ctx->token_begin, ctx->route_order, ctx->route_row, rows.data(), back_row, H, b.dx);
  if (b.has_dw)
    for (int64_t s = 0; s < slots; ++s) {
      float v = 0.f;
      const int64_t r = ctx->route_row[usize(s)];
      if (r >= 0) std::memcpy(&v, rows.data() + r * back_row + (any_dx ? H * 4 : 0), 4);
      kt::store_f32(b.dw.at(s / K, s % K), b.dw.dtype, v);
    }
}
