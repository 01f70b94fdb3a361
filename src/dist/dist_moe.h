// kt_dist_moe: one MoE layer over a communicator's ranks, in owner-rank
// mode (one rank computes every rank's tokens in one batched call) or
// expert-parallel mode (experts sharded over the ranks, routes exchanged
// all-to-all). The local computation is an ordinary kt_moe driven through
// the layer's C++ calls (moe/layer_calls.h); this file moves rows between
// ranks and agrees on outcomes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "runtime/handles.h"
#include "core/dtype.h"
#include "dist/comm.h"
#include "kt_c_api.h"

struct kt_dist_context {
  kt::HandleId handle = 0;
  kt::HandleId layer = 0;  // the kt_dist_moe handle it belongs to
  uint64_t seq = 0;        // forward number on the layer (the same on every rank)
  int64_t tokens = 0;      // this rank's T
  int32_t x_dtype = 0;     // kt::DType of this rank's X
  bool spent = false;
  kt_context* local = nullptr;  // the local layer's context (owner, expert ranks)
  // Owner mode, on the owner: every rank's T.
  std::vector<int64_t> rank_tokens;
  // Expert parallel: routes sent to each rank and received from each rank,
  // and for each of this rank's routes (t*k + j) its row in what came back
  // (-1: no route); the order in which a token's routes are summed (its
  // slots t*k+j with an expert, by ascending (expert, j): one process's
  // order) from route_order[token_begin[t]] to route_order[token_begin[t+1]].
  std::vector<int64_t> sent, received;
  std::vector<int64_t> route_row;
  std::vector<int64_t> token_begin, route_order;
};

struct kt_dist_moe {
  kt::HandleId handle = 0;
  std::shared_ptr<kt_comm> comm;
  kt_moe_options layer_options;  // the whole layer's, as every rank gave them
  kt_dist_moe_options options;
  std::vector<int32_t> expert_rank;  // [E] expert parallel: the rank of each expert
  std::vector<int64_t> local_experts;  // global ids, ascending
  std::vector<int32_t> local_index;    // [E] local index of a global expert, or -1
  kt_moe* local = nullptr;             // the local layer's handle, or null
  uint64_t forwards = 0;

  std::mutex contexts_mutex;
  std::unordered_set<kt::HandleId> contexts;  // live context handles

  ~kt_dist_moe();

  bool owner_mode() const { return options.mode == KT_DIST_OWNER; }
  bool is_owner() const { return owner_mode() && comm->rank == options.owner_rank; }

  void create(kt_engine* engine, const char* where);
  kt_dist_context* forward(const kt_arg* args, size_t n, bool save, const char* where);
  void backward(kt_dist_context* ctx, const kt_backward_options* options, const kt_arg* args, size_t n,
                const char* where);
  // Ends every context handle of the layer (destruction).
  void end_contexts() noexcept;
  // Ends the local layer's handle and the layer, unless the host did.
  void destroy_local() noexcept;

 private:
  struct Forward;
  struct Backward;
  // mine: this rank's argument checks, exchanged first.
  void forward_owner(Forward& f, const kt::dist::Outcome& mine, kt_dist_context* ctx, const char* where);
  void forward_experts(Forward& f, const kt::dist::Outcome& mine, kt_dist_context* ctx, const char* where);
  void forward_received(const std::vector<std::vector<char>>& in, const std::vector<int64_t>& received,
                        kt::DType xd, kt_dist_context* ctx, const char* where);
  void backward_owner(Backward& b, const kt::dist::Outcome& mine, kt_dist_context* ctx, const char* where);
  void backward_experts(Backward& b, const kt::dist::Outcome& mine, kt_dist_context* ctx, const char* where);
  void backward_received(const std::vector<std::vector<char>>& in, kt_dist_context* ctx,
                         const kt_backward_options& opt, kt::DType dyd, bool any_dx, bool any_dw, const char* where);

  // Reused buffers.
  std::vector<char> send_, recv_;
  std::vector<char> x_, ids_, w_, y_, dx_, dw_;
};
