// What the AMX table takes from the tile kernels (kernels_amx.cpp, compiled
// for AVX-512 and AMX); the table itself is made in table_amx.cpp, compiled
// for the baseline ISA, so that making it at load runs on any CPU.
#pragma once

#include "kernels/kernels.h"

namespace kt {

struct AmxEntries {
  decltype(Kernels::gemm_bf16w) gemm_bf16w;
  decltype(Kernels::gemm_bf16w_grouped) gemm_bf16w_grouped;
  decltype(Kernels::gemm_zip_bf16) gemm_zip_bf16;
  decltype(Kernels::gemm_int8) gemm_int8;  // for CPUs with AMX-INT8
  int min_rows;                            // rows from which a tile pays
};

}  // namespace kt
