// kt_moe: one MoE layer's routed experts — packed weights, LoRA snapshot,
// bound gradient buffers, saved contexts — and the forward and
// backward algorithms, written once over the kernel table.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/handles.h"
#include "core/buffer.h"
#include "core/checked.h"
#include "core/tensor.h"
#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kt_c_api.h"
#include "moe/args.h"
#include "moe/weight_operand.h"
#include "moe/workspace.h"
#include "runtime/engine.h"

namespace kt {
struct CombineSplit;  // moe/blocking.h
struct ItemRanges;    // moe/blocking.h

// Which workers ran each expert's weight GEMMs: bit tid of by_expert[e]
// (tid < 64). Tests of the NUMA split watch a layer through it.
struct ExpertWorkers {
  explicit ExpertWorkers(int64_t experts) : by_expert(static_cast<size_t>(experts)) {}
  std::vector<std::atomic<uint64_t>> by_expert;
};

// Trainable factors of one projection: A [E, r, in], and s*B^T [E, r, out].
struct LoraFactors {
  Buffer<float> a;
  Buffer<float> sbt;
};

enum Proj { kGate = 0, kUp = 1, kDown = 2 };

}  // namespace kt

// What a training forward saved for its backward. The host holds it by a
// handle (kt::HandleId); the layer owns it.
struct kt_context {
  kt::HandleId handle = 0;
  enum State { kPending, kReady, kSpent, kFailed } state = kPending;
  // Jobs and calls using it now: its submitted forward, a submitted or
  // running backward. A context released while held is freed when the last
  // hold ends.
  int holds = 0;
  bool released = false;
  bool backward_queued = false;
  // The submitted forward that fills it, until that job ends: a backward
  // job runs it first (or waits for it) when it has not run yet.
  std::shared_ptr<kt_job> forward_job;
  int64_t tokens = 0;  // T of the forward (known at submit time)
  kt::DType x_dtype = kt::DType::kF32;
  kt::Routing routing;
  kt::Buffer<float> xf;    // [T, H] fp32 input
  kt::Buffer<float> g, u;  // [routes, I] pre-activation
  kt::Buffer<float> la[3]; // [routes, r] LoRA A-projections (gate, up, down)
};

namespace kt {

// The gradient-ready hook of a layer, called once kt no longer holds the
// layer (it may call kt, even destroy the layer).
struct GradHook {
  kt_grad_ready_fn fn = nullptr;
  void* user = nullptr;
  HandleId layer = 0;
  void call() const {
    if (fn) fn(handle_value<kt_moe>(layer), user);
  }
};

// A layer's submitted jobs that have not ended, and whether its destruction
// began (then no new job is taken). Every method but wait_all is called
// under the layer's state lock; wait_all releases it while it waits.
class LayerJobs {
 public:
  // Refuses a new job once closed (KT_ERR_INVALID_HANDLE naming `where`).
  void add(const std::shared_ptr<kt_job>& job, const char* where);
  // Takes the job off the list and returns it, to be dropped after the lock.
  std::shared_ptr<kt_job> remove(kt_job* job);
  // Closes the list; returns the jobs that may still be cancelled: the
  // deferred ones, or with all_queued every one not ended.
  std::vector<std::shared_ptr<kt_job>> close(bool all_queued);
  bool closed() const { return closed_; }
  void wait_all(std::unique_lock<std::mutex>& lock);

 private:
  // Shared with the queue and the job's handle.
  std::unordered_map<kt_job*, std::shared_ptr<kt_job>> jobs_;
  std::condition_variable done_;
  bool closed_ = false;
};

}  // namespace kt

struct kt_moe {
  kt_moe(kt_engine* engine, const kt_moe_options& options);
  ~kt_moe();
  // The layer stops counting as one of its engine's (kt_moe_destroy); the
  // object may live on while a call or job still holds it. Runs once.
  void leave_engine();

  // Set once by create_layer, after construction: the host's handle of this
  // layer, and the engine kept alive while the layer lives.
  void registered(kt::HandleId handle, std::shared_ptr<kt_engine> engine) {
    handle_ = handle;
    engine_ref_ = std::move(engine);
  }
  kt::HandleId handle() const { return handle_; }
  kt_engine* engine() const { return engine_; }
  const kt_moe_options& options() const { return opt_; }
  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return top_k_; }
  int64_t hidden() const { return H_; }
  int64_t intermediate() const { return I_; }
  int64_t lora_rank() const { return r_; }  // 0 unless KT_MODE_LORA
  float lora_scale() const { return lora_scale_; }
  bool quantized() const { return quantized_; }
  // The packed panels of projection proj: [I,H] for gate and up, [H,I] for down.
  const kt::PanelShape& panel_shape(int proj) const { return proj == kt::kDown ? down_shape_ : gate_shape_; }

  // Bytes a layer with these (range-checked) options holds: packed weights,
  // biases, LoRA factors, per-thread scratch, and forward and backward
  // workspaces for max_tokens tokens (with rows_by_route, x's and dy's rows
  // in route order too; with dx_by_node, each route's dx row). Overflow is
  // reported, not wrapped.
  static kt::CheckedSize memory_bytes(const kt_moe_options& o, int64_t threads, int64_t a_elem_size,
                                      bool rows_by_route, bool dx_by_node);
  // Bytes of the stored base weights (scales and padding included).
  static kt::CheckedSize weight_bytes(const kt_moe_options& o);

  // The layer's base weights W (dequantized) and biases into host tensors
  // (kt_moe_read_weights); call under the compute lock.
  void read_weights(const kt_arg* args, size_t n) const;

  void load(const kt_load_options& lo, const kt_arg* args, size_t n, int64_t single_expert,
            const char* where);
  void set_skipped(const DLTensor* mask);
  void bind(const kt_arg* args, size_t n);
  void params_changed();
  int64_t num_loaded() const;

  // Checks arguments; returns the parsed call (throws kt::Error).
  // `where` names the ABI call in every message.
  struct ForwardCall {
    kt::View x, ids, w, y;
    int64_t T = 0;
    const char* where = "kt_moe_forward";
  };
  ForwardCall check_forward(const kt_arg* args, size_t n, const char* where) const;
  // Runs under the engine's compute lock; rechecks what depends on state.
  void forward(const ForwardCall& call, kt_context* save);
  void check_ready_for_forward(const ForwardCall& call) const;

  struct BackwardCall {
    kt::View dy, dx, dw;
    bool has_dx = false, has_dw = false;
    kt_backward_options opt;
    const char* where = "kt_moe_backward";
  };
  // ctx is held by the caller; with forward_may_pend a context whose
  // submitted forward has not ended yet is accepted (backward_submit).
  BackwardCall check_backward(const kt_context* ctx, const kt_backward_options* o,
                              const kt_arg* args, size_t n, const char* where,
                              bool forward_may_pend = false) const;
  // Checks that need the layer's current state (bound buffers, which the
  // outputs must not overlap); run under the engine's compute lock, also by
  // submitted jobs when they start.
  void check_backward_state(const BackwardCall& call) const;
  void backward(kt_context* ctx, const BackwardCall& call);

  // Packed weights as the kernels read them ([E][panels] per projection):
  // the layer's own buffers, or a read-only packed-cache mapping.
  const kt::bf16_t* packed_weights(int proj) const { return wp_[proj]; }
  // The stored base weights of projection proj as bytes, whatever the
  // format: [E][stored_expert_bytes] (bf16 panels, or a quantized layer's
  // codes and scales, formats/packed_quant.h).
  const uint8_t* stored_weights(int proj) const {
    return quantized_ ? qp_[proj] : reinterpret_cast<const uint8_t*>(wp_[proj]);
  }
  int64_t stored_expert_bytes(int proj) const {
    return quantized_ ? qshape(proj).expert_bytes
                      : panel_shape(proj).elements() * static_cast<int64_t>(sizeof(kt::bf16_t));
  }
  const float* biases(int proj) const { return b_[proj].data(); }
  const std::vector<uint8_t>& loaded_mask() const { return loaded_; }
  bool weights_mapped() const { return mapping_ != nullptr; }
  // Replaces every expert's packed weights, biases and loaded flag (call
  // under the compute lock, after every check: it cannot fail). The weights
  // stay where they are, inside `mapping`, which the layer keeps alive until
  // it is destroyed or weights are loaded again; in KT_MODE_FULL they are
  // copied into the layer's buffers instead, since params_changed repacks
  // into those (quantized layers are never in KT_MODE_FULL). weights[p]
  // is laid out as stored_weights(p). biases may be null when the layer has
  // none.
  void adopt_packed(std::shared_ptr<const void> mapping, const uint8_t* const weights[3],
                    const float* const biases[3], const uint8_t* loaded);

  // A new context with its handle and `holds` holds (1 for a submitted
  // forward, which drops it when it ends).
  kt_context* new_context(const ForwardCall& call, int holds);
  // The live context of handle `ctx` with one more hold, or KT_ERR_CONTEXT
  // naming `where` (NULL, released, another layer's).
  kt_context* hold_context(const kt_context* ctx, const char* where);
  // Ends a hold; frees the context when it was released and this was the last.
  void drop_hold(kt_context* c);
  // Ends the handle `ctx`; the context is freed now, or when its last hold
  // ends. False when ctx is not a live context of this layer.
  bool release_context(kt::HandleId ctx);
  // Ends every context handle of the layer (destruction): later releases
  // of them are refused instead of reaching a freed layer.
  void end_context_handles();

  // The tensor bound to id, or null (kt_optimizer reads the bindings).
  const kt::View* bound_view(int id) const {
    return id >= 0 && id < kt::kMaxArgId && bound_[id].set ? &bound_[id].view : nullptr;
  }
  // Full mode, for kt_optimizer's step, which packs the updated weights
  // itself: the layer's own packed panels and fp32 biases of projection
  // proj, written in place (call under the compute lock), and the end of
  // such a write (every expert is then loaded, as after params_changed).
  kt::bf16_t* writable_packed(int proj) {
    own_weights();
    return w_[proj].data();
  }
  float* writable_biases(int proj) { return b_[proj].data(); }
  // Stores experts that come quantized in the layer's format (checkpoint
  // loads): fill(i, proj, dst) writes projection proj of expert map[i] into
  // its block of quant_shape(proj).expert_bytes; with biases (when the
  // layer has them) biases[proj] holds map.size() rows of out fp32 values.
  // Call under the compute lock, every source checked first.
  void store_quantized(const std::vector<int64_t>& map, const std::function<void(int64_t, int, uint8_t*)>& fill,
                       const std::vector<float>* biases);
  const kt::QuantShape& quant_shape(int proj) const { return qshape(proj); }

  void weights_written() { std::fill(loaded_.begin(), loaded_.end(), uint8_t{1}); }

  // NUMA (the engine's layout): the node (index) that owns expert e and
  // whose workers compute it, and the node projection proj's weights of
  // each expert were asked to live on (-1: not placed, one node or mapped
  // weights).
  int expert_node(int64_t e) const { return engine_->numa.expert_node(e, E_); }
  const std::vector<int>& weights_node(int proj) const { return weights_node_[proj]; }
  // Records the workers of each expert's GEMMs into *watch from now on
  // (null: stop); call under the compute lock.
  void watch_workers(kt::ExpertWorkers* watch) { watch_ = watch; }

  // Optimizers created over this layer (under the engine's compute lock);
  // the layer detaches them when it is destroyed.
  void attach_optimizer(kt_optimizer* o) { optimizers_.push_back(o); }
  void detach_optimizer(kt_optimizer* o) {
    optimizers_.erase(std::remove(optimizers_.begin(), optimizers_.end(), o), optimizers_.end());
  }
  // Every attached optimizer, the layer's list then empty.
  std::vector<kt_optimizer*> take_optimizers() { return std::move(optimizers_); }

  // The hook kt_moe_set_grad_hook set, with this layer's handle.
  kt::GradHook grad_hook() const {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return kt::GradHook{hook_fn_, hook_user_, handle_};
  }
  void set_grad_hook(kt_grad_ready_fn fn, void* user) {
    std::lock_guard<std::mutex> lock(state_mutex_);
    hook_fn_ = fn;
    hook_user_ = fn ? user : nullptr;
  }

  // Guards the state of the layer's contexts, its hook and its jobs.
  std::mutex& state_mutex() const { return state_mutex_; }
  // Submitted jobs (call under state_mutex()).
  kt::LayerJobs& jobs() { return jobs_; }

 private:
  bool lora_on(int p) const { return opt_.mode == KT_MODE_LORA && (opt_.lora_targets >> p) & 1u; }
  const kt::QuantShape& qshape(int proj) const { return proj == kt::kDown ? down_q_ : gate_q_; }
  const uint8_t* qexpert(int proj, int64_t e) const { return qp_[proj] + e * qshape(proj).expert_bytes; }
  // Grows the shared workspace's per-worker scratch to this layer's tiles.
  void fit_workspace();
  // Asks for each expert's block of projection proj's weights at data to
  // live on the node that owns the expert (weights_node_).
  void place_weights(int proj, void* data);
  // ws_->items (sorted by expert) in ranges per node of the experts'
  // owners, for ThreadPool::run_grouped (one group: ItemRanges(items, threads)).
  kt::ItemRanges node_ranges() const;
  void note_worker(int64_t e, int tid) const {
    if (watch_) watch_->by_expert[static_cast<size_t>(e)].fetch_or(uint64_t{1} << (tid & 63), std::memory_order_relaxed);
  }
  // Points the weight operands at the stored weights (after wp_ or qp_ change).
  void bind_operands();
  void route(const ForwardCall& call, kt::Routing* out);
  void pack_rows_a(const kt::View& src, int64_t T, int64_t kp, void* dst, float* f32_copy);
  // Rows [0, n) of src (fp32 or bf16, ld elements apart) as int8 A rows of
  // operand w (w.int8_rows()), w.int8_row_stride() apart.
  void quantize_rows(const void* src, kt::DType dtype, int64_t n, int64_t k, int64_t ld,
                     const kt::WeightOperand& w, kt::Buffer<uint8_t>* dst);
  void snapshot_lora();
  // The forward's stages (moe_forward.cpp), over what they share.
  struct ForwardPass;
  void forward_inputs(ForwardPass& f, kt_context* save);
  bool plan_gate_up(ForwardPass& f);
  kt::PrefetchRegion gate_up_block(const ForwardPass& f, int q, int64_t item) const;
  void gate_up_item(const ForwardPass& f, kt::ThreadScratch& s, int64_t item, const kt::PrefetchRegion& next);
  void gate_up_row(const ForwardPass& f, kt::ThreadScratch& s, int64_t e, int64_t p, int64_t col0, int64_t ncols,
                   float* gi, float* ui);
  void forward_whole_experts(const ForwardPass& f);
  void forward_gate_up(const ForwardPass& f);
  void forward_down(const ForwardPass& f);
  void forward_down_by_node(const ForwardPass& f);
  void down_block(const ForwardPass& f, kt::ThreadScratch& s, int64_t item, int64_t width, int64_t ldy,
                  const kt::PrefetchRegion& next);
  void down_item(const ForwardPass& f, const kt::CombineSplit& split, kt::ThreadScratch& s, int64_t item,
                 const kt::PrefetchRegion& after);
  // The backward's stages (moe_backward.cpp), over what they share.
  struct BackwardPass;
  void backward_inputs(BackwardPass& b);
  void backward_down(const BackwardPass& b);
  void backward_down_item(const BackwardPass& b, kt::ThreadScratch& s, int64_t item, int64_t wide,
                          const kt::PrefetchRegion& next);
  void backward_dx(const BackwardPass& b);
  void dx_item(const BackwardPass& b, const kt::CombineSplit& split, kt::ThreadScratch& s, int64_t item);
  void backward_dx_by_node(const BackwardPass& b);
  void dx_block(const BackwardPass& b, kt::ThreadScratch& s, int64_t item, int64_t ldx);
  // Whether expert e's dx (and its dg, du) multiply by W's panels straight.
  bool reads_w_straight(const kt::Routing& R, int64_t e) const;
  void dx_product(const BackwardPass& b, kt::ThreadScratch& s, bool straight, int64_t e, int64_t p0, int m,
                  int64_t c0, int64_t sn, float* cx, int64_t ldc, const kt::PrefetchRegion& next_gate,
                  const kt::PrefetchRegion& next_up);
  void routing_weight_gradients(const BackwardPass& b);
  // Forward on a quantized base at decode: expert e's down for its routes
  // into their rows of yr_, and y from those rows (moe_forward.cpp).
  void down_rows(kt::ThreadScratch& s, const kt::Routing& R, int64_t e, float* la_down, int64_t ldy,
                 const kt::PrefetchRegion& next);
  void combine_rows(const ForwardCall& c, const kt::Routing& R, int64_t ldy);
  void chunk_items(const kt::Routing& R);                // (expert, row chunk)
  // (expert, column block of `width`) items over the columns [0, cols).
  void block_items(const kt::Routing& R, int64_t cols, int64_t width);
  // The row of each route's token (src: rows row_bytes apart, by token)
  // into dst in route order.
  void rows_by_route(const kt::Routing& R, const char* src, int64_t row_bytes,
                     kt::Buffer<char>* dst);
  // out[pos] = row(pos) . M[e]^T for every position, M = mats + e*r*in
  // ([r, in] per expert); row(pos) = src + token(pos)*ld when by_token, else
  // src + pos*ld.
  void project_rows(const kt::Routing& R, const float* mats, int64_t in, bool by_token,
                    const float* src, int64_t ld, float* out);
  void check_bound_memory(const std::vector<std::pair<int, kt::View>>& accepted, const char* where) const;
  void lora_gradients(kt_context* ctx, const BackwardCall& c);
  void full_gradients(kt_context* ctx, const BackwardCall& c);
  // The same on bf16 operands (kernels with gemm_zip_bf16).
  void full_gradients_zipped(kt_context* ctx, const BackwardCall& c);
  // dst[e][row0 + i][j] (=|+=) scale * src(i, j); src is [rows, cols] with
  // rows ld apart (ld 0: cols), or [cols, rows] when transpose_src. A 2-D
  // dst ([E, n], biases) takes rows == 1.
  void write_grad(const kt::View& dst, int64_t e, int64_t row0, const float* src, int64_t rows,
                  int64_t cols, bool transpose_src, float scale, bool accumulate, int64_t ld = 0) const;

  // Makes the layer's own buffers hold the weights again (copying them out
  // of a mapping), before weights are packed into them.
  void own_weights();

  kt::HandleId handle_ = 0;
  std::shared_ptr<kt_engine> engine_ref_;
  kt_engine* engine_;
  kt_moe_options opt_;
  int64_t E_, top_k_, H_, I_, r_;
  float lora_scale_ = 0.f;
  kt::PanelShape gate_shape_, down_shape_;  // [I,H] (gate and up), [H,I]
  // Quantized bases (opt_.weight_format): the stored panels' shapes; the A
  // rows are then padded to their kq (gate_shape_.kp, down_shape_.kp).
  bool quantized_ = false;
  kt::QuantShape gate_q_, down_q_;

  bool counted_ = false;  // in engine_->num_layers
  const kt::Kernels& kernels_;
  int a_size_;  // bytes per A-format element
  // Packed base weights [E][panels] and fp32 biases. The kernels read the
  // weights through wp_ (qp_ for a quantized base): w_ (q_) itself, or a
  // packed-cache mapping held by mapping_ (w_, q_ are then released).
  kt::Buffer<kt::bf16_t> w_[3];
  kt::Buffer<uint8_t> q_[3];  // quantized bases: [E][expert block] (formats/packed_quant.h)
  const kt::bf16_t* wp_[3] = {nullptr, nullptr, nullptr};
  const uint8_t* qp_[3] = {nullptr, nullptr, nullptr};
  std::shared_ptr<const void> mapping_;
  // The base weights of each projection as the GEMMs read them (gate, up,
  // down), made with the layer from its format, compute and kernels.
  kt::WeightOperand operand_[3];
  std::vector<int> weights_node_[3];  // per expert (NUMA placement)
  kt::ExpertWorkers* watch_ = nullptr;
  kt::Buffer<float> b_[3];  // [E, I] gate/up, [E, H] down
  std::vector<uint8_t> loaded_, skipped_;
  kt::LoraFactors lora_[3];
  bool lora_ready_ = false;
  // Bound tensors (retained views), indexed by kt_arg_id.
  struct Bound {
    bool set = false;
    kt::View view;
  };
  Bound bound_[kt::kMaxArgId];
  kt_load_options bound_load_options_;

  // Shared with the engine's other layers (moe/workspace.h).
  std::shared_ptr<kt::MoeWorkspace> ws_;

  std::vector<kt_optimizer*> optimizers_;
  kt_grad_ready_fn hook_fn_ = nullptr;
  void* hook_user_ = nullptr;
  mutable std::mutex state_mutex_;
  kt::LayerJobs jobs_;

  void recycle_context(kt_context* c);  // under state_mutex_
  std::unordered_map<kt::HandleId, kt_context*> contexts_;  // live handles
  std::unordered_set<kt_context*> retiring_;  // released while held
};
