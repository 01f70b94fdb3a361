// The rows kt_dist_moe moves between ranks: a token's row into and out of
// the wire buffers, fp32 from a bf16|fp32 row, the expert-parallel
// dispatch's messages (each rank's outcome and head, then its routes) and
// replies (each rank's outcome, then its rows), and the combine that sums a
// token's routes in the order one process adds them.
// Private to src/dist.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "dist/comm.h"

namespace kt::dist {

// Copies row t of a [T, n] view (inner stride 1) to dst, and back.
void copy_row_out(const View& v, int64_t t, void* dst);
void copy_row_in(const View& v, int64_t t, const void* src);

// Converts a bf16|fp32 row of n elements (raw bytes) to fp32.
void raw_to_f32(const char* src, DType d, int64_t n, float* dst);

// The routes of a rank's tokens in the order the origin sums them: for
// token t, route_order[begin[t], begin[t+1]) are its slots t*k+j with an
// expert, ascending by (expert, j), as one process's combine adds them.
void token_order(const View& ids, int64_t T, int64_t K, std::vector<int64_t>* begin, std::vector<int64_t>* order);

// Sums the fp32 rows (n wide) of each token's routes in its order, from
// zero, and stores the sums into out's rows (fp32, or bf16 rounded to
// nearest even, as one process's combine stores its sums).
void combine_rows(const std::vector<int64_t>& begin, const std::vector<int64_t>& order,
                  const std::vector<int64_t>& route_row, const char* rows, int64_t row_stride, int64_t n,
                  const View& out);

// What a message of X rows carries ahead of them: their number (tokens to
// the owner, routes in a dispatch) and X's dtype, which the ranks must
// agree on.
struct RowsHead {
  int64_t rows;
  int32_t dtype;
  int32_t unused;
};

// Where the routes of a dispatch message begin, behind its outcome and head.
constexpr size_t kDispatchRows = kOutcomeBytes + sizeof(RowsHead);

// The first message of a dispatch holds a decode token's k routes of bf16
// rows, so that a forward at T=1 is one trip each way (a larger T, or fp32
// rows, may need a second message).
size_t inline_routes_bytes(int64_t K, int64_t H);

// A route of the dispatch: its token's x row (X's dtype), its global expert
// (int32) and its weight (fp32).
inline int64_t route_bytes(int64_t H, DType xd) { return H * static_cast<int64_t>(dtype_size(xd)) + 8; }

// This rank's dispatch message to each rank: its outcome, head, then the
// routes to that rank (to[r], each a slot t*k+j, in order).
std::vector<std::vector<char>> dispatch_messages(const Outcome& mine, const View& x, const View& ids, const View& w,
                                                 const std::vector<std::vector<int64_t>>& to, int64_t K);

// The first `bytes` of the head of every rank's message (exchange_messages'),
// one after another, as check_same reads them.
std::vector<char> heads_of(const std::vector<std::vector<char>>& in, size_t bytes);

// What each rank sends back after its compute: its outcome, then (when it
// succeeded) the outputs of the routes it received from that rank, yrow
// bytes each; the byte counts of both directions of the exchange.
std::vector<char> outcome_and_rows(const Outcome& computed, const std::vector<int64_t>& received,
                                   const std::vector<int64_t>& sent, const char* y, int64_t yrow,
                                   std::vector<int64_t>* send_bytes, std::vector<int64_t>* recv_bytes);

// The replies in from every rank: each one's outcome raised, its rows
// packed in rank (route_row) order.
std::vector<char> rows_of_replies(const char* back, const std::vector<int64_t>& sent, int64_t yrow,
                                  const char* where);

}  // namespace kt::dist
