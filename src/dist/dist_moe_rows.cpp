#include "dist/dist_moe_rows.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace kt::dist {

namespace {

size_t usize(int64_t v) { return static_cast<size_t>(v); }

// Stores an fp32 row into row t of out.
void store_row(const float* a, int64_t n, const View& out, int64_t t) {
  if (out.dtype == DType::kF32) {
    std::memcpy(out.at(t, 0), a, usize(n) * sizeof(float));
  } else {
    bf16_t* d = reinterpret_cast<bf16_t*>(out.at(t, 0));
    for (int64_t h = 0; h < n; ++h) d[h] = f32_to_bf16(a[h]);
  }
}

}  // namespace

void copy_row_out(const View& v, int64_t t, void* dst) {
  std::memcpy(dst, v.at(t, 0), usize(v.shape[1]) * v.elem_size());
}
void copy_row_in(const View& v, int64_t t, const void* src) {
  std::memcpy(v.at(t, 0), src, usize(v.shape[1]) * v.elem_size());
}

void raw_to_f32(const char* src, DType d, int64_t n, float* dst) {
  if (d == DType::kF32) {
    std::memcpy(dst, src, usize(n) * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      bf16_t b;
      std::memcpy(&b, src + i * 2, 2);
      dst[i] = bf16_to_f32(b);
    }
  }
}

void token_order(const View& ids, int64_t T, int64_t K, std::vector<int64_t>* begin, std::vector<int64_t>* order) {
  begin->assign(usize(T) + 1, 0);
  order->clear();
  std::vector<std::pair<int64_t, int64_t>> routes;
  for (int64_t t = 0; t < T; ++t) {
    routes.clear();
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = ids.get_int(t, j);
      if (e >= 0) routes.emplace_back(e, j);
    }
    std::sort(routes.begin(), routes.end());
    for (const auto& r : routes) order->push_back(t * K + r.second);
    (*begin)[usize(t) + 1] = static_cast<int64_t>(order->size());
  }
}

void combine_rows(const std::vector<int64_t>& begin, const std::vector<int64_t>& order,
                  const std::vector<int64_t>& route_row, const char* rows, int64_t row_stride, int64_t n,
                  const View& out) {
  std::vector<float> acc(usize(std::max<int64_t>(n, 1)));
  const int64_t T = static_cast<int64_t>(begin.size()) - 1;
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    float* a = acc.data();
    for (int64_t q = begin[usize(t)]; q < begin[usize(t) + 1]; ++q) {
      const float* r = reinterpret_cast<const float*>(rows + route_row[usize(order[usize(q)])] * row_stride);
      for (int64_t h = 0; h < n; ++h) a[h] += r[h];
    }
    store_row(a, n, out, t);
  }
}

std::vector<char> outcome_and_rows(const Outcome& computed, const std::vector<int64_t>& received,
                                   const std::vector<int64_t>& sent, const char* y, int64_t yrow,
                                   std::vector<int64_t>* send_bytes, std::vector<int64_t>* recv_bytes) {
  const int W = static_cast<int>(received.size());
  int64_t nrecv = 0;
  for (int64_t n : received) nrecv += n;
  std::vector<char> reply(usize(int64_t{kOutcomeBytes} * W + nrecv * yrow));
  char* s = reply.data();
  int64_t p0 = 0;
  for (int r = 0; r < W; ++r) {
    write_outcome(computed, s);
    const int64_t n = received[usize(r)];
    if (computed.ok() && n) std::memcpy(s + kOutcomeBytes, y + p0 * yrow, usize(n * yrow));
    s += int64_t{kOutcomeBytes} + n * yrow;
    p0 += n;
    (*send_bytes)[usize(r)] = int64_t{kOutcomeBytes} + n * yrow;
    (*recv_bytes)[usize(r)] = int64_t{kOutcomeBytes} + sent[usize(r)] * yrow;
  }
  return reply;
}

std::vector<char> rows_of_replies(const char* back, const std::vector<int64_t>& sent, int64_t yrow,
                                  const char* where) {
  int64_t nsent = 0;
  for (int64_t n : sent) nsent += n;
  std::vector<char> rows(usize(std::max<int64_t>(nsent * yrow, 1)));
  const char* s = back;
  int64_t p0 = 0;
  for (size_t r = 0; r < sent.size(); ++r) {
    raise_outcome(s, static_cast<int>(r), where);
    std::memcpy(rows.data() + p0 * yrow, s + kOutcomeBytes, usize(sent[r] * yrow));
    s += int64_t{kOutcomeBytes} + sent[r] * yrow;
    p0 += sent[r];
  }
  return rows;
}

size_t inline_routes_bytes(int64_t K, int64_t H) { return std::max(kInlineBody, usize(K * (2 * H + 8))); }

std::vector<std::vector<char>> dispatch_messages(const Outcome& mine, const View& x, const View& ids, const View& w,
                                                 const std::vector<std::vector<int64_t>>& to, int64_t K) {
  const int64_t xrow = mine.ok() ? route_bytes(x.shape[1], x.dtype) - 8 : 0;
  std::vector<std::vector<char>> messages;
  for (const std::vector<int64_t>& routes : to) {
    const RowsHead head{static_cast<int64_t>(routes.size()), mine.ok() ? static_cast<int32_t>(x.dtype) : 0, 0};
    messages.push_back(outcome_message(mine, &head, sizeof(head), nullptr, usize(head.rows * (xrow + 8))));
    char* p = messages.back().data() + kDispatchRows;
    for (int64_t s : routes) {
      const int64_t i = s / K, j = s % K;
      copy_row_out(x, i, p);
      const int32_t e = static_cast<int32_t>(ids.get_int(i, j));
      const float wt = w.get(i, j);
      std::memcpy(p + xrow, &e, 4);
      std::memcpy(p + xrow + 4, &wt, 4);
      p += xrow + 8;
    }
  }
  return messages;
}

std::vector<char> heads_of(const std::vector<std::vector<char>>& in, size_t bytes) {
  std::vector<char> heads(in.size() * bytes);
  for (size_t r = 0; r < in.size(); ++r) std::memcpy(heads.data() + r * bytes, in[r].data() + kOutcomeBytes, bytes);
  return heads;
}


}  // namespace kt::dist
