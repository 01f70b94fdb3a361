// The macro-kernel of the GEMMs on a quantized base's codes (gemm_quant,
// gemm_int8; contracts in kernels.h), written once over a per-ISA micro-tile
// trait. The driver owns what every ISA does alike: the rows in balanced
// tiles and the panels in groups under them (strided where a tile streams its
// panels from memory), the walk over K in groups and steps, the chains of
// partial sums, the fetches ahead (the codes, their scales, and past a
// tile's K range the streams that follow it), and each group's end: the
// chains added, the group's value times its scale added to the row's sums,
// which live in registers, in L1 or in C. A trait supplies only its
// micro-tile: how a step's codes are loaded and expanded, the A operand, the
// dot product, and how a group's sums become fp32 values.
//
// A trait T has:
//   Row                    the A rows' element type
//   Sum, F                 a chain's register of partial sums; an fp32 vector
//   kV                     registers per 16-lane panel (16 / lanes)
//   kS                     A operands per step (sub-steps)
//   kStepK, kStepBytes     K values and code bytes of one panel's step
//   kBlock                 steps summed in an Inner register before the chain
//                          (0: the dot goes straight into the chain)
//   kUnroll                the fewest steps per round of the K loop
//   kXsumStride            the rows' group sums apart in xsum (0: none)
//   kRowScale              the rows carry an fp32 scale applied at the end
//   kFetchScales           the scales (zero points) are fetched ahead too
//   ahead_bytes(C, NP)     how far ahead of its loads a stream is fetched
//   panel_at_a_time(MR,NP) a step expands one panel, then all rows take it
//                          (else all panels' codes are loaded first)
//   hold_rows(MR, NP)      panel at a time: the rows' operands of a step are
//                          made once before the panels (else at each use)
//   load(src) -> Raw; codes_of(w, zero_at) -> Codes (the panel and group's
//   decode state); expand(Raw, s, Codes, B (&)[kV]);
//   a_operand(row, step, s) -> A; dot(Sum, A, B) -> Sum;
//   [kBlock: Inner, inner_zero(), inner_dot(Inner, A, B), flush(Sum, Inner)]
//   sum_zero(), add(Sum, Sum)
//   scales_of(w, at) -> Group (the group's fp32 scales g.scale[kV] and what
//   value() needs); row_group(row, r, j, w, xsum) -> RowGroup;
//   value(Sum (&)[kV], Group, RowGroup, F (&)[kV]): the group's fp32 values
//   in lane order, before the scale;
//   [kRowScale: row_scale(row, w) -> F]
//   [kInlineTake: each product inlined always (InlineTake)]
//   fzero, fload, fstore, fadd, fmul, ffma(a, b, c) = a * b + c.
//
// Each (row, column)'s operations run in one order whatever the tile's
// height and panel count, so a result does not depend on how the work was
// cut (C, the chains, is chosen per call, never per tile, unless the sums
// are exact integers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "formats/panels.h"
#include "kernels/kernels.h"

namespace kt {
namespace generic {

// f(std::integral_constant<int, n>{}) for a count 1 <= n <= Max known only
// at run time (tile heights and panel counts are template arguments).
template <int Max, class F>
static void with_count(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// The panels of w from panel p on.
static inline QuantPanels panels_from(const QuantPanels& w, int p) {
  QuantPanels wp = w;
  wp.codes = w.codes + p * w.code_panel_bytes;
  wp.scales = w.scales + p * w.scale_panel * w.scale_bytes;
  if (w.zeros) wp.zeros = w.zeros + p * w.scale_panel;
  return wp;
}

// Inlined always: GCC takes a function that only prefetches for one
// without effects and may drop its calls.
__attribute__((always_inline)) static inline void fetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

// A tile's fetches beyond its codes: where its streams go on past its K
// range: panel p at cont + p * code_panel_bytes for p < cont_np, and their
// scales (zero points) at cont_scales (cont_zeros) in the layout of w's
// (nullptr: not fetched).
// goes_on: the tile's streams go on, each into the panel right after its
// own (a strided call's next tile, strided_tiles), and are fetched on as one.
struct TileAhead {
  const uint8_t* cont;
  int cont_np;
  const uint8_t* cont_scales;
  const uint8_t* cont_zeros;
  bool goes_on = false;
};

// What the tiles of a call fetch ahead beyond their own codes: the heads of
// the streams that follow each tile's (the next tile's panels, and past the
// call's last tile the next call's, from the caller's next region), fetched
// as the tile's own streams near their ends; not the whole next region over
// the call: at decode, that doubled the lines in flight into L1 and crowded
// the call's own stream. Many rows fetch the same way: the next region
// spread over the tiles with the codes 4 KiB ahead into L2 ran slower there
// too (bench/README.md).
struct TileShares {
  // The next call's next_np panels, their scales and zero points.
  const uint8_t *next_codes = nullptr, *next_scales = nullptr, *next_zeros = nullptr;
  int next_np = 0;
  TileShares(const PrefetchRegion& r, int64_t code_panel_bytes) {
    if (r.chunks == 1) {
      next_codes = static_cast<const uint8_t*>(r.base);
      next_scales = static_cast<const uint8_t*>(r.quant_scales);
      next_zeros = static_cast<const uint8_t*>(r.quant_zeros);
      next_np = static_cast<int>(r.chunk_bytes / code_panel_bytes);
    }
  }
  // The next tile's fetches: over wp, the first n of the np_left panels left
  // in this call (the rest are its streams' continuation).
  TileAhead tile(const QuantPanels& wp, int n, int np_left) const {
    TileAhead a{next_codes, next_np, next_scales, next_zeros, false};
    if (n < np_left) {
      a.cont = wp.codes + n * wp.code_panel_bytes;
      a.cont_np = np_left - n;
      a.cont_scales = wp.scales + n * wp.scale_panel * wp.scale_bytes;
      a.cont_zeros = wp.zeros ? wp.zeros + n * wp.scale_panel : nullptr;
    }
    return a;
  }
};

// The tail of an int8 A row (kernels.h) for the int8 traits: the row's
// code sum of group j (row_group), and its scale (e2m1 codes, stored
// doubled: halved).
struct Int8RowTail {
  static inline int32_t row_group(const uint8_t* row, int, int64_t j, const QuantPanels& w, const float*) {
    int32_t sum;
    __builtin_memcpy(&sum, row + w.kq + 4 * j, 4);
    return sum;
  }
  static inline float row_scale_of(const uint8_t* row, const QuantPanels& w, bool e2m1) {
    float s;
    __builtin_memcpy(&s, row + w.kq + 4 * (w.kq / w.group), 4);
    return e2m1 ? s * 0.5f : s;
  }
};

// Where a group's sums go: registers (few of them), an L1 buffer (the
// registers then hold the step's sums only), or C itself (the tile then
// spans more panels; C of a tile stays in L1).
enum class SumsIn { kRegisters, kL1, kC };

// The parts of a tile below are inlined always: they are one loop nest cut
// for reading, and GCC takes a part that only prefetches for one without
// effects and may drop its calls.
#define KT_TILE_PART __attribute__((always_inline)) static inline

// A tile's walk over K: its operands and the sizes of its K range.
template <class T, int NP>
struct TileWalk {
  const T& t;
  const QuantPanels& w;
  const typename T::Row* const* a;
  const TileAhead& ahead_of;
  int64_t groups, steps_per_group, panel_bytes, code_stride, scale_stride;
  TileWalk(const T& t_, const QuantPanels& w_, const typename T::Row* const* a_, const TileAhead& ahead, int64_t ps)
      : t(t_), w(w_), a(a_), ahead_of(ahead), groups(w_.kq / w_.group), steps_per_group(w_.group / T::kStepK),
        panel_bytes(w_.kq / T::kStepK * T::kStepBytes), code_stride(ps * w_.code_panel_bytes),
        scale_stride(ps * w_.scale_panel) {}
};

// The scales' (zero points') line of the group ahead_bytes of codes on from
// group j, once per line; past the K range's end, of the stream that follows.
template <class T, int NP>
KT_TILE_PART void fetch_scales_ahead(const TileWalk<T, NP>& k, int64_t j, int64_t groups_ahead) {
  const QuantPanels& w = k.w;
  const int64_t ja = j + groups_ahead;
  const bool within = k.ahead_of.goes_on || ja < k.groups;
  const uint8_t* scales = within ? w.scales : k.ahead_of.cont_scales;
  const uint8_t* zeros = within ? w.zeros : k.ahead_of.cont_zeros;
  const int np_ahead = within ? NP : scales ? k.ahead_of.cont_np : 0;
  const int64_t stride = within ? k.scale_stride : w.scale_panel;
  const int64_t at = (within ? ja : ja - k.groups) * kPanelRows;
  #pragma GCC unroll 16
  for (int p = 0; p < NP; ++p) {
    if (p >= np_ahead) break;
    if ((at * w.scale_bytes) % 64 == 0) fetch_line(scales + (p * stride + at) * w.scale_bytes);
    if (zeros && at % 64 == 0) fetch_line(zeros + p * stride + at);
  }
}

// One step's products of row r and panel p into chain ch (or a block's
// Inner sums).
template <class T, int MR, int NP, int C, class Inner>
KT_TILE_PART void take_step(const T& t, typename T::Sum (&part)[C][MR][NP][T::kV], Inner& inner, int ch, int r, int p,
                            const typename T::A& x, const typename T::B (&b)[T::kV]) {
  #pragma GCC unroll 4
  for (int v = 0; v < T::kV; ++v) {
    if constexpr (T::kBlock > 0) {
      inner[r][p][v] = t.inner_dot(inner[r][p][v], x, b[v]);
    } else {
      part[ch][r][p][v] = t.dot(part[ch][r][p][v], x, b[v]);
    }
  }
}

// [T::kInlineTake]: a step's products go into the sums inlined always.
// With GCC's own inlining the AVX2 tiles' K loops (16 registers) kept sums
// on the stack (the 2-row loops: int4 codes 20 vector operations on the
// stack, now 8-10; int8 codes 8, now none). Absent: GCC's choice.
template <class T, class = void>
struct InlineTake : std::false_type {};
template <class T>
struct InlineTake<T, std::void_t<decltype(T::kInlineTake)>> : std::bool_constant<T::kInlineTake> {};

// One round of kRound steps from step sr: each panel's codes loaded and
// expanded, each row's operand taken, the products into chain (i S + s) % C
// (or a block's Inner sums, added to chain 0 at the block's end). The first
// step of each line of a stream fetches the line kAhead bytes on; past the
// K range's end, in the streams that follow.
template <class T, int MR, int NP, int C, int kRound, int64_t kAhead>
KT_TILE_PART void code_round(const TileWalk<T, NP>& k, const typename T::Codes (&codes)[NP],
                             typename T::Sum (&part)[C][MR][NP][T::kV], int64_t sr) {
  constexpr int V = T::kV, S = T::kS;
  constexpr int64_t kStepBytes = T::kStepBytes;
  constexpr bool kHoldRows = T::hold_rows(MR, NP);
  const T& t = k.t;
  const QuantPanels& w = k.w;
  [[maybe_unused]] typename T::Inner inner[T::kBlock > 0 ? MR : 1][T::kBlock > 0 ? NP : 1][V];
  #pragma GCC unroll 8
  for (int i = 0; i < kRound; ++i) {
    const int64_t st = sr + i;
    if constexpr (T::kBlock > 0) {
      if (i % T::kBlock == 0)
        for (auto& row : inner)
          for (auto& panel : row)
            for (auto& v : panel) v = T::inner_zero();
    }
    const bool fetch_now = (i * kStepBytes) % 64 == 0;
    const int64_t fetch_at = st * kStepBytes + kAhead;
    const bool fetch_within = k.ahead_of.goes_on || fetch_at < k.panel_bytes;
    const uint8_t* fetch_from = fetch_within     ? w.codes + fetch_at
                                : k.ahead_of.cont ? k.ahead_of.cont + (fetch_at - k.panel_bytes)
                                                  : nullptr;
    const int64_t fetch_stride = fetch_within ? k.code_stride : w.code_panel_bytes;
    const int fetch_np = fetch_within ? NP : fetch_from ? k.ahead_of.cont_np : 0;
    // take_body writes the loop out rather than call take_step: through
    // the call GCC inlined the AVX-512 tiles differently, and they were
    // measured as they compile this way.
    const auto take_body = [&](int r, int p, int s, const typename T::A& x, const typename T::B (&b)[V]) {
      const int ch = (i * S + s) % C;
      #pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        if constexpr (T::kBlock > 0) {
          inner[r][p][v] = t.inner_dot(inner[r][p][v], x, b[v]);
        } else {
          part[ch][r][p][v] = t.dot(part[ch][r][p][v], x, b[v]);
        }
      }
    };
    const auto take_inlined = [&](int r, int p, int s, const typename T::A& x, const typename T::B (&b)[V])
                                  __attribute__((always_inline)) {
      take_step<T, MR, NP, C>(t, part, inner, (i * S + s) % C, r, p, x, b);
    };
    const auto take = [&]() __attribute__((always_inline)) {
      if constexpr (InlineTake<T>::value) {
        return take_inlined;
      } else {
        return take_body;
      }
    }();
    if constexpr (T::panel_at_a_time(MR, NP)) {
      // The rows' operands of the step, once (hold_rows), or at each use.
      [[maybe_unused]] typename T::A held[kHoldRows ? MR : 1][kHoldRows ? S : 1];
      if constexpr (kHoldRows)
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          #pragma GCC unroll 8
          for (int s = 0; s < S; ++s) held[r][s] = t.a_operand(k.a[r], st, s);
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        if (fetch_now && p < fetch_np) fetch_line(fetch_from + p * fetch_stride);
        const auto raw = t.load(w.codes + p * k.code_stride + st * kStepBytes);
        #pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
          typename T::B b[V];
          t.expand(raw, s, codes[p], b);
          #pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            if constexpr (kHoldRows) {
              take(r, p, s, held[r][s], b);
            } else {
              take(r, p, s, t.a_operand(k.a[r], st, s), b);
            }
          }
        }
      }
    } else {
      decltype(t.load(w.codes)) raw[NP];
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        if (fetch_now && p < fetch_np) fetch_line(fetch_from + p * fetch_stride);
        raw[p] = t.load(w.codes + p * k.code_stride + st * kStepBytes);
      }
      #pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        typename T::B b[NP][V];
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) t.expand(raw[p], s, codes[p], b[p]);
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const typename T::A x = t.a_operand(k.a[r], st, s);
          #pragma GCC unroll 16
          for (int p = 0; p < NP; ++p) take(r, p, s, x, b[p]);
        }
      }
    }
    if constexpr (T::kBlock > 0) {
      if (i % T::kBlock == T::kBlock - 1)
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          #pragma GCC unroll 16
          for (int p = 0; p < NP; ++p)
            #pragma GCC unroll 4
            for (int v = 0; v < V; ++v) part[0][r][p][v] = t.flush(part[0][r][p][v], inner[r][p][v]);
    }
  }
}

// Group j's end: the chains added in order, then each (row, panel) takes
// the group's value times its scale into its sums (acc, l1 or C).
// acc and l1 are the tile's sums where kSums says so (else one element).
template <class T, int MR, int NP, int C, SumsIn kSums, class Acc, class L1>
KT_TILE_PART void end_group(const TileWalk<T, NP>& k, typename T::Sum (&part)[C][MR][NP][T::kV], Acc& acc, L1& l1,
                            int64_t j, float* c, int64_t ldc, bool accumulate, const float* xsum, int64_t ps) {
  constexpr int V = T::kV, kLanes = kPanelRows / T::kV;
  const T& t = k.t;
  #pragma GCC unroll 16
  for (int i = 1; i < C; ++i)
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p)
        #pragma GCC unroll 4
        for (int v = 0; v < V; ++v) part[0][r][p][v] = T::add(part[0][r][p][v], part[i][r][p][v]);
  decltype(t.row_group(k.a[0], 0, j, k.w, xsum)) row_groups[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) row_groups[r] = t.row_group(k.a[r], r, j, k.w, xsum);
  #pragma GCC unroll 16
  for (int p = 0; p < NP; ++p) {
    const typename T::Group g = t.scales_of(k.w, p * k.scale_stride + j * kPanelRows);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      typename T::F f[V];
      t.value(part[0][r][p], g, row_groups[r], f);
      #pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        if constexpr (kSums == SumsIn::kRegisters) {
          acc[r][p][v] = T::ffma(f[v], g.scale[v], acc[r][p][v]);
        } else {
          float* at;
          if constexpr (kSums == SumsIn::kC) {
            at = c + r * ldc + p * ps * kPanelRows + v * kLanes;
          } else {
            at = l1[r][p] + v * kLanes;
          }
          const typename T::F before = kSums == SumsIn::kC && j == 0 && !accumulate ? T::fzero() : T::fload(at);
          T::fstore(at, T::ffma(f[v], g.scale[v], before));
        }
      }
    }
  }
}

// The tile's sums (registers or L1) into C: times the rows' scales where
// the trait has them, added to C's values where accumulating.
template <class T, int MR, int NP, SumsIn kSums, class Acc, class L1>
KT_TILE_PART void store_tile(const TileWalk<T, NP>& k, const Acc& acc, const L1& l1, float* c, int64_t ldc,
                             bool accumulate, int64_t ps) {
  using F = typename T::F;
  constexpr int kLanes = kPanelRows / T::kV;
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    [[maybe_unused]] F sr;
    if constexpr (T::kRowScale) sr = k.t.row_scale(k.a[r], k.w);
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p)
      #pragma GCC unroll 4
      for (int v = 0; v < T::kV; ++v) {
        float* cr = c + r * ldc + p * ps * kPanelRows + v * kLanes;
        F sum;
        if constexpr (kSums == SumsIn::kRegisters) {
          sum = acc[r][p][v];
        } else {
          sum = T::fload(l1[r][p] + v * kLanes);
        }
        if constexpr (T::kRowScale) {
          T::fstore(cr, accumulate ? T::ffma(sum, sr, T::fload(cr)) : T::fmul(sum, sr));
        } else {
          T::fstore(cr, accumulate ? T::fadd(sum, T::fload(cr)) : sum);
        }
      }
  }
}

// MR rows x NP panels with C chains per (row, panel, register); the tile's
// panels are ps apart (1: adjacent; strided_tiles). xsum: the rows' group
// sums where the trait's value() takes them (else unused).
template <class T, int MR, int NP, int C, SumsIn kSums>
static void code_tile(const T& t, const QuantPanels& w, const typename T::Row* const* a, float* c, int64_t ldc,
                      bool accumulate, const TileAhead& ahead_of, const float* xsum, int64_t ps) {
  constexpr int V = T::kV;
  // Steps per round: every chain once, a whole line of each stream (one
  // fetch per stream and line, placed when compiling: a test of the step's
  // position in the loop slows the tiles markedly), and whole blocks.
  constexpr int kStepsPerLine = T::kStepBytes >= 64 ? 1 : static_cast<int>(64 / T::kStepBytes);
  constexpr int kChainSteps = C > T::kS ? C / T::kS : 1;
  constexpr int kRound = std::max({kChainSteps, kStepsPerLine, T::kBlock, T::kUnroll});
  constexpr int64_t kAhead = T::ahead_bytes(C, NP);
  static_assert(kRound % (T::kBlock > 0 ? T::kBlock : 1) == 0, "rounds of whole blocks");
  const TileWalk<T, NP> k(t, w, a, ahead_of, ps);
  constexpr bool kInRegs = kSums == SumsIn::kRegisters, kInL1 = kSums == SumsIn::kL1;
  typename T::F acc[kInRegs ? MR : 1][kInRegs ? NP : 1][V];
  for (auto& row : acc)
    for (auto& panel : row)
      for (auto& v : panel) v = T::fzero();
  alignas(64) float l1[kInL1 ? MR : 1][kInL1 ? NP : 1][kPanelRows] = {};
  const int64_t groups_ahead = kAhead / (k.steps_per_group * T::kStepBytes);
  for (int64_t j = 0; j < k.groups; ++j) {
    if constexpr (T::kFetchScales) fetch_scales_ahead(k, j, groups_ahead);
    typename T::Codes codes[NP];
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) codes[p] = t.codes_of(w, p * k.scale_stride + j * kPanelRows);
    typename T::Sum part[C][MR][NP][V];
    for (auto& chain : part)
      for (auto& row : chain)
        for (auto& panel : row)
          for (auto& v : panel) v = T::sum_zero();
    const int64_t st0 = j * k.steps_per_group;
    for (int64_t sr = st0; sr < st0 + k.steps_per_group; sr += kRound)
      code_round<T, MR, NP, C, kRound, kAhead>(k, codes, part, sr);
    end_group<T, MR, NP, C, kSums>(k, part, acc, l1, j, c, ldc, accumulate, xsum, ps);
  }
  if constexpr (kSums != SumsIn::kC) store_tile<T, MR, NP, kSums>(k, acc, l1, c, ldc, accumulate, ps);
}

// Over n >= 2 groups of kNP panels whose K range is the whole panel
// (panel_bytes, of that range: a panel's codes, scales and zero points then
// follow the panel before it): tile t takes panels t, t + n, t + 2n, ..., so
// that each tile's streams go on into the next tile's panels
// (TileAhead::goes_on) and a thread reads kNP streams from end to end of the
// call instead of kNP new ones per tile, each a short stream that started
// cold. The last tile's streams end where an adjacent group's would at the
// strided panels' end: into the rest, or the next call's. Calls
// tile(panels_from(w, t), ahead, t, n) for each tile; returns the panels it
// took (0 where they do not fit this).
template <int kNP, class Tile>
static int strided_tiles(const QuantPanels& w, int np, int64_t panel_bytes, const TileShares& next, Tile&& tile) {
  const int n = np / kNP;
  if (n < 2 || panel_bytes != w.code_panel_bytes) return 0;
  const int last = (n - 1) * kNP;
  const TileAhead at_end = next.tile(panels_from(w, last), kNP, np - last);
  for (int t = 0; t < n; ++t) {
    TileAhead ahead = at_end;
    ahead.goes_on = t + 1 < n;
    tile(panels_from(w, t), ahead, t, n);
  }
  return n * kNP;
}

// A call's schedule, as data. Sh has:
//   kRows             the most rows in a tile (heights balanced: 32 rows go
//                     as 5,5,5,5,6,6 rather than 6,6,6,6,6,2)
//   panels(MR)        panels per tile of MR rows
//   chains(MR, NP)    chains of partial sums
//   sums(MR, NP)      where a group's sums go (SumsIn)
//   strided(MR, tiles) whether a tile of MR rows of a call of `tiles` row
//                     tiles streams strided panels (strided_tiles)
//   kPanelsOuter      the panel groups outside the row tiles (the later
//                     tiles meet a group's codes in L1), else inside
template <class T, class Sh>
static void code_gemm(const T& t, const QuantPanels& w, const typename T::Row* const* a, int m, int np, float* c,
                      int64_t ldc, bool accumulate, const PrefetchRegion& next, const float* xsum) {
  const TileShares shares(next, w.code_panel_bytes);
  const int tiles = (m + Sh::kRows - 1) / Sh::kRows;
  const auto row_tile = [&](int r, int h, int p_begin, int p_end) {
    with_count<Sh::kRows>(h, [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
      constexpr int kNP = Sh::panels(MR);
      const typename T::Row* const* ar = a + r;
      float* cr = c + r * ldc;
      const float* xs = xsum ? xsum + r * T::kXsumStride : nullptr;
      int p = p_begin;
      if (Sh::strided(MR, tiles) && p_begin == 0 && p_end == np)
        p = strided_tiles<kNP>(w, np, w.kq / T::kStepK * T::kStepBytes, shares,
                               [&](const QuantPanels& wp, const TileAhead& ahead, int tp, int n) {
                                 code_tile<T, MR, kNP, Sh::chains(MR, kNP), Sh::sums(MR, kNP)>(
                                     t, wp, ar, cr + tp * kPanelRows, ldc, accumulate, ahead, xs, n);
                               });
      for (; p < p_end; p += kNP) {
        const int n = p_end - p < kNP ? p_end - p : kNP;
        const QuantPanels wp = panels_from(w, p);
        const TileAhead ahead = shares.tile(wp, n, np - p);
        with_count<kNP>(n, [&](auto panels) {
          constexpr int NP = decltype(panels)::value;
          code_tile<T, MR, NP, Sh::chains(MR, NP), Sh::sums(MR, NP)>(t, wp, ar, cr + p * kPanelRows, ldc,
                                                                   accumulate, ahead, xs, 1);
        });
      }
    });
  };
  const auto each_row_tile = [&](int p_begin, int p_end) {
    for (int i = 0, r = 0; i < tiles; ++i) {
      const int h = (m - r) / (tiles - i);
      row_tile(r, h, p_begin, p_end);
      r += h;
    }
  };
  if constexpr (Sh::kPanelsOuter) {
    for (int p = 0; p < np; p += Sh::panels(1)) each_row_tile(p, p + Sh::panels(1) < np ? p + Sh::panels(1) : np);
  } else {
    each_row_tile(0, np);
  }
}

}  // namespace generic
}  // namespace kt
