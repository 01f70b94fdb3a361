#include "moe/layer_calls.h"

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/checked.h"
#include "core/error.h"
#include "formats/formats.h"
#include "optim/optimizer.h"

namespace kt {

namespace {

bool finite(float v) { return std::isfinite(v); }

// The formats KT_COMPUTE_INT8 takes, as its refusal names them: the integer
// ones, then those whose e2m1 codes it doubles.
std::string int8_compute_names() {
  std::string s;
  for (const WeightFormat& f : kWeightFormats)
    if (f.int8_compute && f.code == QuantCode::kInt) s += (s.empty() ? "" : ", ") + std::string(f.name);
  for (const WeightFormat& f : kWeightFormats)
    if (f.int8_compute && f.code == QuantCode::kE2M1) s += ", and " + std::string(f.name) + "'s e2m1 doubled";
  return s;
}

// A layer is allocated when it is created: refuse one whose memory cannot be
// counted in 64 bits or exceeds the machine's physical memory, before any
// allocation (an allocation that still fails is KT_ERR_OUT_OF_MEMORY).
void check_layer_fits(const kt_moe_options& o, const kt_engine& engine, const char* w) {
  const CheckedSize bytes = kt_moe::memory_bytes(
      o, engine.pool->size(), engine.kernels->a_elem_size, engine.kernels->gemm_reads_spaced_rows,
      engine.pool->groups() > 1);
  const std::string shape = "E=" + std::to_string(o.num_experts) + ", H=" + std::to_string(o.hidden) +
                            ", I=" + std::to_string(o.intermediate) +
                            ", max_tokens=" + std::to_string(o.max_tokens);
  KT_CHECK(!bytes.overflow(), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options (" + shape + ") describe a layer of more than 2^63 bytes");
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const CheckedSize physical = CheckedSize(pages) * page;
  KT_CHECK(physical.overflow() || bytes.value() <= physical.value(), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options (" + shape + ") describe a layer of " +
               std::to_string(bytes.value()) +
               " bytes (packed weights, biases, LoRA factors, workspaces), more than the " +
               std::to_string(physical.value()) + " bytes of this machine's physical memory");
}

}  // namespace

void validate_moe_options(const kt_moe_options& o, const char* w) {
  auto range = [&](int64_t v, int64_t lo, int64_t hi, const char* name) {
    KT_CHECK(v >= lo && v <= hi, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->" + name + " = " + std::to_string(v) + " is outside [" +
                 std::to_string(lo) + ", " + std::to_string(hi) + "]");
  };
  range(o.num_experts, 1, 1 << 20, "num_experts");
  range(o.top_k, 1, o.num_experts, "top_k");
  range(o.hidden, 1, 1 << 20, "hidden");
  range(o.intermediate, 1, 1 << 20, "intermediate");
  range(o.max_tokens, 1, (int64_t{1} << 31) / o.top_k / 64, "max_tokens");
  // Enum fields as integers first: a C host may store any int in them.
  check_enum(o.activation, KT_ACT_SILU, KT_ACT_SWIGLU_OAI, std::string(w) + ": options->activation",
             "kt_activation");
  check_enum(o.mode, KT_MODE_INFERENCE, KT_MODE_FULL, std::string(w) + ": options->mode", "kt_mode");
  const int64_t format = enum_bits(o.weight_format);
  KT_CHECK(weight_format_of(format) != nullptr, KT_ERR_UNSUPPORTED,
           std::string(w) + ": options->weight_format = " + std::to_string(format) +
               " is not a storage format of this kt (" + weight_format_names() + ")");
  KT_CHECK(!is_quantized(o.weight_format) || o.mode != KT_MODE_FULL, KT_ERR_MODE,
           std::string(w) + ": options->weight_format " + weight_format_name(o.weight_format) +
               " is a frozen quantized base: KT_MODE_FULL trains the base weights and needs "
               "KT_FORMAT_BF16 "
               "(train LoRA on the quantized base with KT_MODE_LORA)");
  check_enum(o.compute, KT_COMPUTE_BF16, KT_COMPUTE_INT8, std::string(w) + ": options->compute", "kt_compute");
  if (o.compute == KT_COMPUTE_INT8) {
    KT_CHECK(int8_compute_takes(o.weight_format), KT_ERR_UNSUPPORTED,
             std::string(w) + ": options->compute KT_COMPUTE_INT8 multiplies integer codes (" +
                 int8_compute_names() + "); options->weight_format is " + weight_format_name(o.weight_format));
    KT_CHECK(o.mode == KT_MODE_INFERENCE, KT_ERR_MODE,
             std::string(w) +
                 ": options->compute KT_COMPUTE_INT8 is for inference: options->mode must be "
                 "KT_MODE_INFERENCE (int8 activations have no backward)");
    KT_CHECK(o.hidden <= kInt8ComputeMaxK && o.intermediate <= kInt8ComputeMaxK,
             KT_ERR_UNSUPPORTED,
             std::string(w) +
                 ": options->compute KT_COMPUTE_INT8 takes hidden and intermediate up to " +
                 std::to_string(kInt8ComputeMaxK) + " (exact int32 sums); the layer has " +
                 std::to_string(o.hidden) + " and " + std::to_string(o.intermediate));
  }
  KT_CHECK(finite(o.act_alpha) && o.act_alpha > 0.f, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->act_alpha must be finite and > 0");
  KT_CHECK(finite(o.act_limit), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->act_limit must be finite (<= 0 for none)");
  range(o.has_bias, 0, 1, "has_bias");
  if (o.mode == KT_MODE_LORA) {
    range(o.lora_rank, 1, 1024, "lora_rank");
    KT_CHECK(finite(o.lora_alpha), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->lora_alpha must be finite");
    range(o.use_rslora, 0, 1, "use_rslora");
    KT_CHECK(o.lora_targets != 0 && (o.lora_targets & ~KT_PROJ_ALL) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->lora_targets must be a non-empty set of KT_PROJ_* bits");
  }
}

std::shared_ptr<kt_moe> create_layer(const std::shared_ptr<kt_engine>& eng, const kt_moe_options& o,
                                     const char* w) {
  validate_moe_options(o, w);
  check_layer_fits(o, *eng, w);
  std::shared_ptr<kt_moe> m;
  {
    std::lock_guard<std::mutex> lock(eng->lifetime_mutex);
    KT_CHECK(!eng->destroyed, KT_ERR_INVALID_HANDLE,
             std::string(w) + ": engine is being destroyed by another thread");
    m = std::make_shared<kt_moe>(eng.get(), o);
  }
  m->registered(add_handle(HandleKind::kMoe, m), eng);
  eng->log(1, "moe: E=" + std::to_string(o.num_experts) + " k=" + std::to_string(o.top_k) +
                  " H=" + std::to_string(o.hidden) + " I=" + std::to_string(o.intermediate) +
                  " mode=" + std::to_string(o.mode) + " kernels " + eng->kernels->gemm_name);
  return m;
}

void finish_job(kt_moe* m, kt_job* job) {
  std::shared_ptr<kt_job> mine;  // dropped after the lock
  std::lock_guard<std::mutex> lock(m->state_mutex());
  mine = m->jobs().remove(job);
}

void destroy_layer(const std::shared_ptr<kt_moe>& m) {
  // Jobs that never started are cancelled so they cannot touch the layer:
  // deferred ones, and on the job thread (a hook destroying its layer)
  // also the queued ones, which could never run before this returns.
  const bool on_job_thread = m->engine()->jobs.on_job_thread();
  std::vector<std::shared_ptr<kt_job>> pending;
  {
    std::lock_guard<std::mutex> lock(m->state_mutex());
    pending = m->jobs().close(on_job_thread);
  }
  for (auto& j : pending)
    if (j->cancel(KT_ERR_INVALID_HANDLE, "kt_job: its layer was destroyed before the job ran"))
      finish_job(m.get(), j.get());
  pending.clear();
  {
    std::unique_lock<std::mutex> lock(m->state_mutex());
    m->jobs().wait_all(lock);
  }
  {
    std::lock_guard<std::mutex> lock(m->engine()->compute_mutex);
    optim::detach_layer(m.get());
  }
  m->end_context_handles();
  {
    std::lock_guard<std::mutex> lock(m->engine()->lifetime_mutex);
    m->leave_engine();
  }
  // Freed here, or when another thread's call (or a job's hook) on the
  // layer returns; it keeps its engine alive until then.
}

void forward_layer(kt_moe& layer, const kt_arg* args, size_t num_args, kt_context** saved, const char* w) {
  std::lock_guard<std::mutex> lock(layer.engine()->compute_mutex);
  kt_moe::ForwardCall call = layer.check_forward(args, num_args, w);
  if (layer.engine()->verbosity >= 2)
    layer.engine()->log(2, "forward: T=" + std::to_string(call.T) + (saved ? " (saving a context)" : ""));
  // Held while it is filled: its handle exists (and could be released by
  // a host guessing it) before the call returns it.
  kt_context* ctx = saved ? layer.new_context(call, 1) : nullptr;
  try {
    layer.forward(call, ctx);
  } catch (...) {
    if (ctx) {
      layer.release_context(ctx->handle);
      layer.drop_hold(ctx);
    }
    throw;
  }
  if (ctx) {
    kt_context* handle;
    {
      std::lock_guard<std::mutex> l(layer.state_mutex());
      ctx->state = kt_context::kReady;
      handle = handle_value<kt_context>(ctx->handle);
    }
    layer.drop_hold(ctx);
    *saved = handle;
  }
}

GradHook backward_layer(kt_moe& layer, kt_context* ctx, const kt_backward_options* options, const kt_arg* args,
                        size_t num_args, const char* w) {
  std::lock_guard<std::mutex> lock(layer.engine()->compute_mutex);
  ContextHold held(&layer, ctx, w);
  kt_context* c = held.get();
  kt_moe::BackwardCall call = layer.check_backward(c, options, args, num_args, w);
  {
    std::lock_guard<std::mutex> l(layer.state_mutex());
    KT_CHECK(!c->backward_queued, KT_ERR_CONTEXT, std::string(w) + ": ctx already has a backward submitted");
  }
  if (layer.engine()->verbosity >= 2)
    layer.engine()->log(2, "backward: T=" + std::to_string(c->tokens) +
                             " grad_scale=" + std::to_string(call.opt.grad_scale) +
                             (call.opt.accumulate ? " accumulate" : " overwrite"));
  layer.backward(c, call);
  if (call.opt.param_grads && layer.options().mode != KT_MODE_INFERENCE) return layer.grad_hook();
  return GradHook{};
}

bool release_layer_context(const kt_context* ctx) {
  const HandleId id = handle_id(ctx);
  std::shared_ptr<kt_moe> layer;
  if (const HandleId owner = context_owner(id))
    layer = std::static_pointer_cast<kt_moe>(find_handle(owner, HandleKind::kMoe));
  return layer && layer->release_context(id);
}

}  // namespace kt
