// The AMX kernel table: the AVX-512 BF16 table with the weight GEMMs on
// tiles. Compiled for the baseline ISA: the table is made while the library
// loads, on every CPU, and copying it must not use AVX-512 registers.
#include "kernels/amx/amx_entries.h"
#include "kernels/kernels.h"

namespace kt {

extern const Kernels kernels_avx512bf16;
extern const AmxEntries amx_entries;

namespace {

// kernels_avx512bf16 and amx_entries are constant-initialised, so both are
// complete before this runs.
Kernels make_amx_table() {
  Kernels k = kernels_avx512bf16;
  k.isa = KT_ISA_AMX;
  k.gemm_name = "gemm_bf16w_bf16_f32_32x32__amx";
  k.gemm_bf16w = amx_entries.gemm_bf16w;
  // Tiles load their rows where they lie when equally spaced (and gather
  // others). Panels that stream from memory come by the hardware's
  // prefetch: a software fetch of the next block evicts the call's own A
  // rows from L1 (bench/README.md, AMX kernels).
  k.gemm_bf16w_fetches_panels = true;
  k.gemm_reads_spaced_rows = true;
  k.gemm_bf16w_grouped = amx_entries.gemm_bf16w_grouped;
  // From a tile's rows on, quantized bases dequantize into cache for the
  // tile GEMMs (plain, or grouped) instead of multiplying straight from the
  // codes on vdpbf16ps; fewer rows (decode) stay on the AVX-512 kernel.
  k.gemm_quant_rows_int8 = amx_entries.min_rows - 1;
  k.gemm_quant_rows_e4m3 = amx_entries.min_rows - 1;
  k.gemm_quant_rows_4bit = amx_entries.min_rows - 1;
  k.gemm_zip_bf16 = amx_entries.gemm_zip_bf16;
  // gemm_bf16w_nn and its row bound stay the AVX-512 table's: up to 4
  // rows, fewer than a tile's, gemm_bf16w would run the AVX-512 kernel too.
  // Without AMX-INT8 the AVX-512 kernel keeps gemm_int8 (same bits).
  if (cpu_has_amx_int8()) k.gemm_int8 = amx_entries.gemm_int8;
  return k;
}

}  // namespace

extern const Kernels kernels_amx = make_amx_table();

}  // namespace kt
