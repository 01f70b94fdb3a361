# The optimizer (src/optim): the update loops one unit per ISA, no FMA
# contraction beyond the explicit fmaf calls (every ISA gives the same bits),
# sqrtf as an instruction.
list(APPEND KT_CORE_SOURCES
  src/optim/optimizer.cpp
  src/optim/step_job.cpp
  src/optim/update_generic.cpp
)
set_source_files_properties(src/optim/update_generic.cpp PROPERTIES
  COMPILE_OPTIONS "-O3;-ffp-contract=off;-fno-math-errno")
if(KT_HAVE_AVX2)
  list(APPEND KT_CORE_SOURCES src/optim/update_avx2.cpp)
  set_source_files_properties(src/optim/update_avx2.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx2;-mfma;-O3;-ffp-contract=off;-fno-math-errno")
endif()
if(KT_HAVE_AVX512BF16)
  list(APPEND KT_CORE_SOURCES src/optim/update_avx512.cpp)
  # (GCC 12 warns falsely inside its own AVX-512 intrinsic headers.)
  set_source_files_properties(src/optim/update_avx512.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx2;-mfma;-O3;-ffp-contract=off;-fno-math-errno;-Wno-maybe-uninitialized;-Wno-uninitialized")
endif()
