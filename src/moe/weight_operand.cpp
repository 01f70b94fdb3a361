#include "moe/weight_operand.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <utility>

#include "moe/blocking.h"

namespace kt {

namespace {

// The kernel that turns a format's codes into bf16 panels.
decltype(Kernels::dequant_i8) dequant_kernel(const Kernels& k, const QuantShape& qs) {
  switch (qs.code) {
    case QuantCode::kE4M3: return k.dequant_e4m3;
    case QuantCode::kE2M1: return k.dequant_e2m1;
    case QuantCode::kInt: break;
  }
  return qs.bits == 4 ? k.dequant_i4 : k.dequant_i8;
}

// Per-thread scratch of a quantized base, in elements: dequantized panels
// (a K chunk of a column block, or W'^T slices of up to kBlockCols + 32
// columns for transposed), their fp32 scales, and zero points.
struct QuantScratchSizes {
  int64_t deq, scales, zeros;
  QuantScratchSizes(int64_t kpad, bool zero_points) {
    const int64_t deq_cols = kBlockCols + kQuantKAlign;
    deq = std::max(kBlockPanels * kPanelRows * kQuantChunk, deq_cols * kpad);
    scales = std::max(kBlockPanels * kQuantChunk, deq_cols / kQuantKAlign * kpad);
    zeros = zero_points ? deq_cols / kQuantKAlign * kpad : 0;
  }
};

// Whether every e2m1 value (magnitudes 0.5 to 6) times each of these e8m0
// scales is a normal fp32 number, so exact in bf16 (2 significant bits) and
// kept by the bf16 conversion, which flushes subnormals: powers of two 2^e
// with -125 <= e <= 125.
bool scaled_e2m1_exact(const float* scales, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, scales + i, 4);
    const uint32_t exponent = (bits >> 23) & 0xff;
    if ((bits & 0x807fffffu) != 0 || exponent < 2 || exponent > 252) return false;
  }
  return true;
}

// Of bf16 panels only the head of each slice is fetched ahead: the
// transposes fetch the rest of each slice a few panels ahead of their reads,
// and whole slices fetched during the GEMMs before them crowd those GEMMs'
// own loads (bench/README.md).
constexpr int64_t kTransposeHeadBytes = 512;

}  // namespace

WeightOperand::WeightOperand(const Kernels& k, const PanelShape& ps, const QuantShape& qs, bool quantized,
                             bool int8_rows)
    : k_(&k), ps_(ps), qs_(qs), a_size_(k.a_elem_size) {
  if (!quantized) {
    path_ = Path::kPanels;
    expert_bytes_ = ps.elements() * static_cast<int64_t>(sizeof(bf16_t));
    return;
  }
  path_ = int8_rows ? Path::kInt8 : Path::kCodes;
  expert_bytes_ = qs.expert_bytes;
  if (k.gemm_quant) quant_rows_ = qs.bits == 4 ? code_rows_4bit(k) : k.gemm_quant_rows_8bit(qs.code);
  dequant_ = dequant_kernel(k, qs);
  per_row_ = qs.group == qs.kq && !qs.zero_points;
  e2m1_ = qs.code == QuantCode::kE2M1;
}

int WeightOperand::code_rows_4bit(const Kernels& k) {
  // A table whose 4-bit bound lies within a prefill's rows per expert
  // (avx2, amx) was placed by measurement and is taken as it is. One that
  // keeps the codes at every row count (avx512bf16: ahead on AMD Zen4 and
  // Zen5) is measured here, once per process and table: on an Intel CPU
  // without AMX the dequantized path ran faster at prefill rows
  // (bench/README.md).
  constexpr int kMeasuredFrom = 16;
  if (k.gemm_quant_rows_4bit < kMeasuredFrom) return k.gemm_quant_rows_4bit;
  // The probe below is an operand too: its own bound is the table's.
  static thread_local bool probing = false;
  if (probing) return k.gemm_quant_rows_4bit;
  static std::mutex mutex;
  static std::vector<std::pair<const Kernels*, int>> measured;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [table, rows] : measured)
    if (table == &k) return rows;
  // The gate/up GEMM of a Qwen3-30B-A3B expert, int4 in groups of 32, 4
  // column blocks, at 32 and 16 rows (a prefill of a few hundred to a
  // thousand tokens), weights hot: the two paths' sums (wide code tiles, or
  // the grouped GEMM on panels decoded in cache) go group by group in one
  // order, so they give the same bits and only the time is at stake. The
  // dequantized path is taken where it wins by a margin that keeps the
  // choice from flipping run to run.
  const int64_t K = 2048;
  const int np = 4 * static_cast<int>(kBlockPanels);
  const QuantShape qs = QuantShape::of(KT_FORMAT_INT4_G32, np * kPanelRows, K);
  Buffer<uint8_t> expert(static_cast<size_t>(qs.expert_bytes));
  for (int64_t i = 0; i < qs.expert_bytes; ++i) expert.data()[i] = static_cast<uint8_t>(i * 37 % 251);
  for (int64_t i = 0; i < np * qs.scale_panel; ++i) {
    const bf16_t one = f32_to_bf16(0.01f);
    std::memcpy(expert.data() + qs.scales_offset + i * qs.scale_bytes, &one, sizeof(one));
  }
  probing = true;
  WeightOperand op(k, PanelShape::of(qs.n, K), qs, true, false);
  probing = false;
  op.set_weights(expert.data());
  OperandScratch scratch;
  constexpr int kRows = 32;
  op.size_scratch(&scratch, qs.kq, kRows);
  // Rows of zeros in the table's A format: the time does not depend on the values.
  const int64_t row_bytes = qs.kq * k.a_elem_size;
  std::vector<uint8_t> a(static_cast<size_t>(kRows * row_bytes), 0);
  std::vector<const void*> rows(kRows);
  for (int r = 0; r < kRows; ++r) rows[static_cast<size_t>(r)] = a.data() + r * row_bytes;
  std::vector<float> c(static_cast<size_t>(kRows * np * kPanelRows));
  const auto seconds = [&](int code_rows, int m) {
    op.quant_rows_ = code_rows;
    double best = 1e30;
    for (int i = 0; i <= 5; ++i) {  // the first call warms the caches
      const auto start = std::chrono::steady_clock::now();
      op.gemm(scratch, 0, 0, np, rows.data(), m, c.data(), np * kPanelRows, PrefetchRegion{});
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (i > 0) best = std::min(best, t);
    }
    return best;
  };
  // From the most rows down: the bound drops below each row count where
  // the dequantized path wins, down to the first where it does not.
  int rows_4bit = k.gemm_quant_rows_4bit;
  for (int m : {kRows, kMeasuredFrom}) {
    if (seconds(0, m) * 1.05 >= seconds(kRows, m)) break;
    rows_4bit = m - 1;
  }
  measured.emplace_back(&k, rows_4bit);
  return rows_4bit;
}

void WeightOperand::size_scratch(OperandScratch* s, int64_t kpad, int64_t max_rows) const {
  if (path_ == Path::kPanels) return;
  const QuantScratchSizes q(kpad, qs_.zero_points);
  s->deq.reserve(static_cast<size_t>(q.deq));
  s->scale.reserve(static_cast<size_t>(q.scales));
  s->zero.reserve(static_cast<size_t>(q.zeros));
  if (s->rows.size() < static_cast<size_t>(max_rows)) s->rows.resize(static_cast<size_t>(max_rows));
}

CheckedSize WeightOperand::scratch_bytes(bool quantized, int64_t kpad, bool zero_points) {
  if (!quantized) return CheckedSize(0);
  const QuantScratchSizes q(kpad, zero_points);
  return CheckedSize(q.deq) * static_cast<int64_t>(sizeof(bf16_t)) +
         CheckedSize(q.scales) * static_cast<int64_t>(sizeof(float)) + CheckedSize(q.zeros);
}

PrefetchRegion WeightOperand::block(int64_t e, int64_t r0, int64_t rb) const {
  if (path_ != Path::kPanels) return quant_panel_block(expert(e), qs_, r0, rb);
  return panel_block(panels(e), ps_, r0, rb);
}

PrefetchRegion WeightOperand::transposed_block(int64_t e, int64_t c0, int64_t cb) const {
  if (path_ != Path::kPanels) return quant_column_source(expert(e), qs_, c0, cb);
  PrefetchRegion r = transpose_source(panels(e), ps_, c0, cb);
  r.chunk_bytes = std::min(r.chunk_bytes, kTransposeHeadBytes);
  return r;
}

void WeightOperand::gemm(OperandScratch& s, int64_t e, int64_t p0, int np, const void* const* rows, int m,
                         float* c, int64_t ldc, const PrefetchRegion& next) const {
  const Kernels& K = *k_;
  switch (path_) {
    case Path::kPanels:
      // Panels that stream from memory: pass no next region when the tiles
      // fetch the panels ahead themselves (gemm_bf16w_fetches_panels).
      K.gemm_bf16w(rows, m, ps_.kp, panels(e) + p0 * ps_.panel_stride(), ps_.panel_stride(), np, c, ldc, false,
                   K.gemm_bf16w_fetches_panels ? PrefetchRegion{} : next);
      return;
    case Path::kInt8:  // rows are int8 A rows
      K.gemm_int8(qs_.panels(expert(e), p0), rows, m, np, c, ldc, false, next);
      return;
    case Path::kCodes:
      break;
  }
  if (K.gemm_quant && m <= quant_rows_) {
    K.gemm_quant(qs_.panels(expert(e), p0), rows, m, np, c, ldc, false, next);
    return;
  }
  // Dequantized in cache: kBlockPanels panels at a time (the scratch's size).
  if (np > kBlockPanels) {
    for (int j = 0; j < np; j += static_cast<int>(kBlockPanels)) {
      const int n = std::min(np - j, static_cast<int>(kBlockPanels));
      gemm_dequantized(s, e, p0 + j, n, rows, m, c + j * kPanelRows, ldc,
                       j + n < np ? block(e, (p0 + j + n) * kPanelRows,
                                          std::min<int64_t>(kBlockCols, (np - j - n) * kPanelRows))
                                  : next);
    }
    return;
  }
  gemm_dequantized(s, e, p0, np, rows, m, c, ldc, next);
}

void WeightOperand::gemm_dequantized(OperandScratch& s, int64_t e, int64_t p0, int np, const void* const* rows,
                                     int m, float* c, int64_t ldc, const PrefetchRegion& next) const {
  const Kernels& K = *k_;
  const QuantShape& qs = qs_;
  const uint8_t* ex = expert(e);
  const uint8_t* codes = ex + p0 * qs.code_panel_bytes;
  const uint8_t* zeros = qs.zero_points ? ex + qs.zeros_offset + p0 * qs.scale_panel : nullptr;
  // Zero points go per group (chunks hold whole groups: kQuantChunk is a
  // multiple of 128).
  float* scales = s.scale.data();
  bf16_t* deq = s.deq.data();
  // The next region comes in over the chunks, a share per chunk. With rows
  // for several tiles the GEMM spreads the share over its K loop (from a
  // contiguous region); otherwise (a single tile prefetches nothing) it is
  // issued at the chunk's start, so that a chunk's share of codes does not
  // stall the dequantization behind it.
  PrefetchCursor ahead(next);
  const int64_t lines = next.lines(), chunks = ceil_div(qs.kq, kQuantChunk);
  const bool spread = m > kGemmSingleTileRows && next.chunks == 1;
  if (per_row_) quant_scales_f32(ex, qs, p0, np, 0, 1, scales);
  for (int64_t k0 = 0, i = 0; k0 < qs.kq; k0 += kQuantChunk, ++i) {
    const int64_t kc = std::min(kQuantChunk, qs.kq - k0);
    const int64_t l0 = lines * i / chunks, l1 = lines * (i + 1) / chunks;
    PrefetchRegion share;
    if (spread) {
      share = PrefetchRegion::block(static_cast<const char*>(next.base) + l0 * 64, (l1 - l0) * 64);
    } else {
      ahead.issue(l1 - l0);
    }
    for (int r = 0; r < m; ++r) s.rows[static_cast<size_t>(r)] = static_cast<const char*>(rows[r]) + k0 * a_size_;
    if (per_row_) {
      dequant_(codes, qs.code_panel_bytes, np, k0, kc, nullptr, 0, 0, deq);
      K.gemm_bf16w(s.rows.data(), m, kc, deq, kPanelRows * kc, np, c, ldc, k0 > 0, share);
      continue;
    }
    const int64_t scale_stride = (kc / qs.group) * kPanelRows;
    quant_scales_f32(ex, qs, p0, np, k0 / qs.group, kc / qs.group, scales);
    if (e2m1_ && scaled_e2m1_exact(scales, np * scale_stride)) {
      // Scaled e2m1 values are exact in bf16: the plain GEMM on them adds
      // no rounding and saves the per-group sums.
      dequant_(codes, qs.code_panel_bytes, np, k0, kc, scales, scale_stride, qs.group, deq);
      K.gemm_bf16w(s.rows.data(), m, kc, deq, kPanelRows * kc, np, c, ldc, k0 > 0, share);
    } else {
      if (zeros) {
        K.dequant_i4_zero(codes, qs.code_panel_bytes, np, k0, kc, zeros + (k0 / qs.group) * kPanelRows,
                          qs.scale_panel, nullptr, 0, qs.group, deq);
      } else {
        dequant_(codes, qs.code_panel_bytes, np, k0, kc, nullptr, 0, 0, deq);
      }
      K.gemm_bf16w_grouped(s.rows.data(), m, kc, deq, kPanelRows * kc, np, scales, scale_stride, qs.group, c,
                           ldc, k0 > 0, share);
    }
  }
  if (per_row_)
    for (int r = 0; r < m; ++r) {
      float* cr = c + r * ldc;
      for (int64_t j = 0; j < np * kPanelRows; ++j) cr[j] *= scales[j];
    }
}

void WeightOperand::transposed(OperandScratch& s, int64_t e, int64_t c0, int64_t cb, bf16_t* dst) const {
  const Kernels& K = *k_;
  if (path_ == Path::kPanels) {
    K.transpose_panels(panels(e), ps_.np, ps_.panel_stride(), c0, cb, dst);
    return;
  }
  // Whole 32-column slices of every panel around [c0, c0 + cb), scaled (one
  // bf16 rounding), then the wanted columns transposed as bf16 panels are.
  // Scales go per 32 columns, whatever the group: the slices start on a
  // multiple of 32 so that each column takes its own group's scale, and end
  // inside the stored codes (kq is a multiple of 32; c0 may be a multiple of
  // 16 only).
  const QuantShape& qs = qs_;
  const uint8_t* ex = expert(e);
  const int64_t start = c0 / kQuantKAlign * kQuantKAlign;
  const int64_t kc = round_up(c0 + cb - start, kQuantKAlign);
  float* scales = s.scale.data();
  bf16_t* deq = s.deq.data();
  quant_scales_cols(ex, qs, start, kc, scales);
  const int64_t stride = (kc / kQuantKAlign) * kPanelRows;
  if (qs.zero_points) {
    uint8_t* zeros = s.zero.data();
    quant_zeros_cols(ex, qs, start, kc, zeros);
    K.dequant_i4_zero(ex, qs.code_panel_bytes, static_cast<int>(qs.np), start, kc, zeros, stride, scales, stride,
                      kQuantKAlign, deq);
  } else {
    dequant_(ex, qs.code_panel_bytes, static_cast<int>(qs.np), start, kc, scales, stride, kQuantKAlign, deq);
  }
  K.transpose_panels(deq, qs.np, kPanelRows * kc, c0 - start, cb, dst);
}

}  // namespace kt
