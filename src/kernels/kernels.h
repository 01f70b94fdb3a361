// The per-ISA micro-kernels behind one dispatch table. Everything above this
// table (routing, tiling, packing loops, threading, LoRA, gradients) is written
// once in src/moe; only these functions differ per ISA. The registry, the
// names and what a new ISA or kernel adds: src/kernels/README.md.
//
// The packed weight layout the kernels read: formats/panels.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "formats/panels.h"
#include "kt_c_api.h"

namespace kt {

namespace optim {
struct UpdateKernels;  // kernels/update.h
}

// Activation parameters (docs/math.md, "Activations"): kind is a
// kt_activation; limit <= 0 means no clamp.
struct ActParams {
  int kind;
  float alpha;
  float limit;
};

// Walks the cache lines of a PrefetchRegion in order, issuing a prefetch per
// call (portable builtin: every ISA unit can use it).
class PrefetchCursor {
 public:
  explicit PrefetchCursor(const PrefetchRegion& r)
      : chunk_(static_cast<const char*>(r.base)), per_chunk_(r.lines_per_chunk()), stride_(r.stride),
        left_(r.lines()) {}
  inline void issue(int64_t n) {
    for (; n > 0 && left_ > 0; --n, --left_) {
      __builtin_prefetch(chunk_ + line_ * 64, 0, 3);
      if (++line_ == per_chunk_) {
        line_ = 0;
        chunk_ += stride_;
      }
    }
  }

 private:
  const char* chunk_;
  int64_t line_ = 0, per_chunk_, stride_, left_;
};

// The most rows any weight GEMM kernel takes in a single row tile
// (AVX-512 BF16, one panel).
constexpr int kGemmSingleTileRows = 16;

// ---- int8 compute (KT_COMPUTE_INT8): activations quantized to int8 per row.
// An int8 A row of K kq (int8_row_bytes(kq, group) bytes, kept 64-byte
// aligned by its stride): kq int8 codes q (zero past the row's values), then
// kq / group int32 sums of the codes of each group of K, then the fp32 scale
// s; the row stands for s * q. With nibble_order (rows for 4-bit weights)
// each quad of codes is stored as (k, k + 2, k + 1, k + 3): the order in
// which a 32-byte step of 4-bit panels expands into bytes (the nibble
// layout of formats/packed_quant.h), so the codes meet their weights without
// a shuffle.
int64_t int8_row_bytes(int64_t kq, int64_t group);
// The largest K an int8 compute layer takes: vector kernels sum codes
// offset to unsigned bytes, |sum| <= 127 * 255 * K, exact in int32.
constexpr int64_t kInt8ComputeMaxK = 65536;
// s = max |x| / 127 (0 for a row of zeros; NaN when x holds a NaN or an
// infinity, which then reaches every output of the row); q = x * (127 /
// max |x|) rounded to the nearest integer, ties to even.
void quantize_int8_row(const float* x, int64_t k, int64_t kq, int64_t group, bool nibble_order, void* row);

// A kernel table: what a unit (an ISA, or a variant of one) computes with.
// Each table is made with named fields (ref/kernels_ref.cpp and the others);
// a member it leaves out keeps the default below (a null entry, an
// out-of-range tuning number), which KernelRegistry.* (tests/unit/
// test_kernel_registry.cpp) rejects. Which entries may be null is said at
// each one.
struct Kernels {
  // ---- what the table is.
  kt_isa isa = KT_ISA_AUTO;
  // The weight GEMM's name in the grammar of src/kernels/README.md.
  const char* gemm_name = nullptr;
  // Element size of the "A format" the GEMM reads: 2 = bf16, 4 = fp32.
  int a_elem_size = 0;

  // ---- entries. Every entry is required unless its comment says where it
  // is null.

  // C[r, 16*p + c] (=|+=) sum_k A[r][k] * W_p[c][k] for r < m, p < np, c < 16.
  // a_rows[r] points at a row in A format of kp elements (kp even, zero
  // padded); panels are np consecutive packed panels, panel_stride elements
  // apart (= 16*kp). C rows are ldc floats apart and hold 16*np columns.
  // Any m >= 0 and np >= 1. next (base may be NULL) is what the caller reads
  // next (the next weight panels): a kernel may fetch it into cache while it
  // computes, so the next panels come from memory while these are in use.
  // A kernel may ignore it (gemm_bf16w_fetches_panels says where the
  // panels' own stream is fetched ahead by the kernel).
  void (*gemm_bf16w)(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                     int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                     const PrefetchRegion& next) = nullptr;
  // The product with W itself on the same panels (backward's da' and dx
  // without building W^T panels): C[r, j] (=|+=) sum over i < 16 np of
  // A[r][i] * W[i][c0 + j] for r < m, j < n. W's rows i are the np panels'
  // (panel_stride elements apart, the panels' K padded to kp); a_rows[r]
  // points at a row in A format of 16 np elements (zero where W's rows are
  // padding). c0 is even and c0 + n <= kp; any m >= 0, n >= 1. Each C value
  // is one fixed-order sum, whatever m and n. next: what the caller reads
  // next, as transpose_source describes a block of columns (the slices of
  // its panels); a kernel may fetch the heads of its chunks. NULL where the
  // unit has none (callers build W^T panels and run gemm_bf16w).
  void (*gemm_bf16w_nn)(const void* const* a_rows, int m, const bf16_t* panels, int64_t panel_stride, int np,
                        int64_t c0, int64_t n, float* c, int64_t ldc, bool accumulate,
                        const PrefetchRegion& next) = nullptr;

  // Weight gradients on bf16 operands (NULL where the A format is fp32): both
  // operands come as zipped row pairs, [group][column][2] bf16 with the pair
  // (row 2g, row 2g+1) innermost, ld elements between groups. For o < m and
  // c < 16 * np: C[o, c] (=|+=) sum over g < groups, j < 2 of
  // scale * D[g][o][j] * Z[g][c][j]. d points at the first of the m columns
  // of D; Z holds 16 * np columns per group (zero past the real ones).
  // stream: C is written once and not read soon (gradients in memory): the
  // kernel may store around the caches where C is 64-byte aligned.
  void (*gemm_zip_bf16)(const bf16_t* d, int64_t ldd, int m, const bf16_t* z, int64_t ldz, int np,
                        int64_t groups, float* c, int64_t ldc, bool accumulate, float scale, bool stream) = nullptr;
  // dst[2j] = bf16(r0[j]), dst[2j + 1] = bf16(r1[j]) (0 when r1 is NULL) for
  // j < n: one group of the zipped format. NULL with gemm_zip_bf16.
  void (*zip_rows_bf16)(const float* r0, const float* r1, int64_t n, bf16_t* dst) = nullptr;

  // Converts k fp32 values to A format, zero padding to kp elements.
  void (*pack_a_f32)(const float* src, int64_t k, int64_t kp, void* dst) = nullptr;

  // C[m,n] (=|+=) sum_j A_r[j] * B[j, n], a_rows[r] fp32 rows of k values,
  // B row-major k x n with leading dimension ldb. Vectorised over n.
  void (*sgemm_nn)(int m, int n, int k, const float* const* a_rows, const float* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate) = nullptr;

  // C[m,n] (=|+=) sum_j A_r[j] * B[n, j]: dot products of a_rows[r] with the
  // k-value rows of B (row-major n x k, leading dimension ldb).
  void (*sgemm_nt)(int m, int n, int k, const float* const* a_rows, const float* b, int64_t ldb,
                   float* c, int64_t ldc, bool accumulate) = nullptr;

  // C[m,n] (=|+=) sum_r A[r, m] * B_r[n] over r < k: outer-product
  // accumulation over rows (weight gradients). A row-major with lda,
  // b_rows[r] fp32 rows of n values. Vectorised over n.
  void (*sgemm_tn)(int m, int n, int k, const float* a, int64_t lda, const float* const* b_rows,
                   float* c, int64_t ldc, bool accumulate) = nullptr;

  // W^T panels made in cache (formats/packed_bf16.h, transpose_panels): from
  // np packed panels (panel_stride elements apart) builds the packed panels
  // of columns [c0, c0 + cb) (c0 even) with K' = 16 * np.
  void (*transpose_panels)(const bf16_t* packed, int64_t np, int64_t panel_stride, int64_t c0,
                           int64_t cb, bf16_t* dst) = nullptr;

  // a[j] = act(g[j], u[j]) for j < n.
  void (*act_forward)(const ActParams& p, const float* g, const float* u, float* a, int64_t n) = nullptr;
  // From the pre-activations and da' (the gradient of a before the routing
  // weight w): dg = w * da' * da/dg, du = w * da' * da/du (zero where
  // clamped), a_out = a when not NULL; returns sum_j da'[j] * a[j].
  float (*act_backward)(const ActParams& p, const float* g, const float* u, const float* da, float w,
                        float* dg, float* du, float* a_out, int64_t n) = nullptr;

  // ---- quantized frozen bases (formats/packed_quant.h).
  // Codes of np panels (code_panel_bytes apart), columns [k0, k0 + kc) (both
  // multiples of 32), to bf16 packed panels of kc columns at dst (panel
  // stride 16 * kc). scales NULL: the code values, exact in bf16. Otherwise
  // each value times its fp32 scale scales[p * scale_stride + ((k - k0) /
  // group) * 16 + lane] (group a multiple of 32), rounded to bf16 once; a
  // product below the smallest normal fp32 may come out as the zero of its
  // sign instead (the AVX-512 BF16 conversion flushes such inputs).
  void (*dequant_i8)(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                     const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) = nullptr;
  void (*dequant_i4)(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                     const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) = nullptr;
  // The same for fp8 e4m3 codes (the int8 byte order) and fp4 e2m1 codes
  // (the int4 nibble order); their values are exact in bf16 (e4m3 NaN codes
  // never reach a kernel: loads refuse them).
  void (*dequant_e4m3)(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                       const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) = nullptr;
  void (*dequant_e2m1)(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                       const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) = nullptr;
  // dequant_i4 for asymmetric int4: a code nibble u stands for u - zero,
  // zero the byte zeros[p * zero_stride + ((k - k0) / group) * 16 + lane]
  // (z + 8); (u - zero) is an integer in [-15, 15], exact in bf16.
  void (*dequant_i4_zero)(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                          const uint8_t* zeros, int64_t zero_stride, const float* scales, int64_t scale_stride,
                          int64_t group, bf16_t* dst) = nullptr;
  // gemm_bf16w with a scale per column and group of K: C[r, 16p + c] (=|+=)
  // sum over groups j of scales[p * scale_stride + 16 j + c] * (sum over k
  // in [j * group, (j + 1) * group) of A[r][k] * W_p[c][k]): the scale is
  // applied in fp32 to each group's partial sum. group is a multiple of 32
  // that divides kp.
  void (*gemm_bf16w_grouped)(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                             int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                             int64_t group, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) = nullptr;
  // C[r, 16p + c] (=|+=) sum over groups j of scale(p, j, c) * (sum over k in
  // group j of A[r][k] * code(p, c, k)) for p < np, straight from the codes
  // (QuantPanels): for few rows (decode), where dequantizing into panels in
  // cache first would leave the code stream from memory waiting. A rows hold
  // w.kq values. nullptr where the unit has none (dequant_* and
  // gemm_bf16w_grouped then). Used for m up to gemm_quant_rows_int8,
  // _e4m3 or _4bit rows (the tuning below).
  // next: as gemm_bf16w's, but only the first lines of each of its panels
  // are fetched, as this call's streams end (the whole next region on the
  // way crowded this call's own stream): a region of whole panels of the
  // same code_panel_bytes and scale_panel (the next call's codes, with
  // quant_scales and quant_zeros).
  void (*gemm_quant)(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                     bool accumulate, const PrefetchRegion& next) = nullptr;
  // Int8 compute on an integer base (w.code kInt: int8 per channel, group =
  // kq, or int4 groups, with or without zero points; or kE2M1, whose codes
  // doubled are the integers -12..12): for r < m, p < np, c < 16,
  // C[r, 16p + c] (=|+=) s'_r * sum over groups j, in order, of
  // scale(p, j, c) * d_j, d_j = sum over k in group j of q_r[k] * code(p, c, k)
  // in int32 (exact; e2m1: code doubled); each d_j is converted to fp32 once
  // and taken into an fp32 sum by fma, which is multiplied by s'_r last
  // (s_r, halved for e2m1). a_rows: int8 A rows of
  // w.kq (int8_row_bytes(w.kq, w.group); nibble_order for 4-bit codes).
  // Every table computes the same bits. next: as gemm_quant's.
  void (*gemm_int8)(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                    bool accumulate, const PrefetchRegion& next) = nullptr;
  // The optimizer's per-element loops compiled for this table's ISA
  // (kernels/update.h: AdamW, SGD, the finiteness check, the sum of squares,
  // the bf16 panels of a full-weight step). Every table's compute the same
  // bits.
  const optim::UpdateKernels* optimizer = nullptr;

  // ---- tuning: where a caller switches between entries, and how the
  // entries want their operands. Each table says why it chose its numbers;
  // the measurements behind them are in bench/README.md (kernels).

  // The most rows (m) for which a caller runs gemm_quant; past them
  // expanding the codes once per row tile costs more than dequantizing once
  // into cache (dequant_* + gemm_bf16w_grouped). For int8 codes, e4m3
  // codes (measured apart: on avx2 their best bound is lower) and 4-bit
  // ones (int4, e2m1); 0 where gemm_quant is
  // null; -1: unset, which the registry test rejects. A 4-bit bound of 16
  // rows or more is the most: the layer measures the two paths once on the
  // CPU (WeightOperand::code_rows_4bit) and may dequantize from 16 rows.
  int gemm_quant_rows_int8 = -1;
  int gemm_quant_rows_e4m3 = -1;
  int gemm_quant_rows_4bit = -1;
  // The 8-bit bound of codes of kind `code` (kInt: int8, kE4M3: e4m3).
  constexpr int gemm_quant_rows_8bit(QuantCode code) const {
    return code == QuantCode::kE4M3 ? gemm_quant_rows_e4m3 : gemm_quant_rows_int8;
  }
  // The most rows of an expert for which backward runs gemm_bf16w_nn on
  // bf16 panels; past them building W^T panels once for gemm_bf16w's tiles
  // costs less. 0 where gemm_bf16w_nn is null; -1: unset.
  int gemm_bf16w_nn_rows = -1;
  // gemm_bf16w's panels come ahead without the caller's help at every row
  // count (the kernel's own fetches, or the hardware's for tiles): a caller
  // whose panels stream from memory passes no next region, which would only
  // crowd them; panels built in cache (dequantized, transposed) still take
  // it, as there it is the only stream from memory.
  bool gemm_bf16w_fetches_panels = false;
  // The weight GEMMs read A rows where they lie only when they are equally
  // spaced (AMX tiles: gemm_bf16w at any spacing, and gemm_int8 where the
  // CPU has AMX-INT8; oneDNN: gemm_bf16w, at least kp apart) and gather others
  // into a block first, on every call: a caller that would hand the same
  // scattered rows to many calls lays them out in order once instead. The
  // vector kernels read each row through its pointer (false).
  bool gemm_reads_spaced_rows = false;
};

// Best ISA the CPU and OS run (cpuid + XCR0 + AMX permission).
kt_isa detect_cpu_isa();
// Kernel table for the highest compiled ISA <= cap that the CPU runs.
const Kernels& select_kernels(kt_isa cap);
// Kernel table of exactly that ISA, or nullptr when not compiled in.
const Kernels* kernels_for(kt_isa isa);
// A compiled table of the registry (kernel_list.inc), as the tests and the
// kernel bench walk them.
struct KernelTableInfo {
  const Kernels* table;
  const char* name;  // "avx2", "avx2_no_vnni": the registry's name
  // What this CPU lacks to run the table as meant ("" when nothing): its
  // ISA, or for a variant the feature without which the ISA's own table
  // already takes the variant's path.
  const char* missing;
};
// Every compiled table, the ISA tables in increasing order, then the
// variants; on any CPU (see missing).
std::vector<KernelTableInfo> compiled_kernel_tables();
// The registry's name of an ISA ("avx2"), "unknown" for others.
const char* kernel_isa_name(kt_isa isa);
// Whether the CPU has AVX-VNNI (the VEX vpdpbusd; cpuid leaf 7.1 EAX bit 4;
// its ymm state is the AVX state the AVX2 level requires): the AVX2 table's
// gemm_int8 uses it there.
bool cpu_has_avx_vnni();
// Whether the CPU has AMX-INT8 (cpuid leaf 7 EDX bit 25): the amx table's
// gemm_int8 runs on tiles there.
bool cpu_has_amx_int8();
// Whether the AMX kernels, on this CPU, computed a known product right
// (checked once; select_kernels uses AVX-512 BF16 instead when not). Only
// call where detect_cpu_isa() is KT_ISA_AMX.
bool amx_kernels_verified();

// The oneDNN GEMM backend: `base` with its weight GEMM done by oneDNN
// matmul on the same packed panels, or nullptr when this build has no
// oneDNN or base's A format is not bf16.
const Kernels* onednn_kernels(const Kernels& base);
bool onednn_compiled();
// The oneDNN implementation a weight GEMM of that shape (with those A rows)
// runs on the calling thread, with " (rows gathered)" where the rows are
// copied first; "" where kt's own kernel runs it (shapes outside oneDNN's
// layout, or those oneDNN has only its reference loop for).
std::string onednn_gemm_impl(const void* const* a_rows, int m, int64_t kp, int np, int64_t ldc,
                             bool accumulate);

// Best-of-reps seconds of one weight GEMM of m rows x kp x (16 * np) with
// table k on the calling thread (synthetic operands).
double time_weight_gemm(const Kernels& k, int m, int64_t kp, int np, int reps);
// What KT_GEMM_AUTO runs for the native table: kt's own, except on the AMX
// tables, where oneDNN's is taken when a decode-sized (4 rows) and a
// prefill-sized (128 rows) GEMM both measured (once per process) at least
// 15 % faster with it. *note says what was measured
// ("" when nothing was).
const Kernels& auto_gemm_kernels(const Kernels& native, std::string* note);

}  // namespace kt
