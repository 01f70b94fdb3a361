# The kernel tables (src/kernels/README.md): the portable table and dispatch
# with the core's flags, each ISA's unit with its own (only on compilers that
# know them, KT_HAVE_*). A new ISA adds its unit here, with its flags.
# The ISA units start each function on a 64-byte line: where the hot loops
# fall relative to the lines otherwise moved with every change elsewhere in
# the library, and moved the time of the same code by up to 8 % (bench/README.md).
set(KT_KERNEL_ALIGN "-falign-functions=64")
list(APPEND KT_CORE_SOURCES
  src/kernels/dispatch.cpp
  src/kernels/gemm_choice.cpp
  src/kernels/ref/kernels_ref.cpp
  src/kernels/int8_rows.cpp
)
set_source_files_properties(src/kernels/ref/kernels_ref.cpp PROPERTIES COMPILE_OPTIONS "-O3")
# Int8 rows: every table quantizes activations to the same bits.
set_source_files_properties(src/kernels/int8_rows.cpp PROPERTIES COMPILE_OPTIONS "-O3;-ffp-contract=off")
if(KT_HAVE_AVX2)
  list(APPEND KT_CORE_SOURCES src/kernels/avx2/kernels_avx2.cpp)
  set_source_files_properties(src/kernels/avx2/kernels_avx2.cpp PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-O3;${KT_KERNEL_ALIGN}")
endif()
if(KT_HAVE_AVX512BF16)
  list(APPEND KT_CORE_SOURCES src/kernels/avx512bf16/kernels_avx512bf16.cpp)
  # (GCC 12 warns falsely inside its own AVX-512 intrinsic headers.)
  set_source_files_properties(src/kernels/avx512bf16/kernels_avx512bf16.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512bf16;-mavx2;-mfma;-O3;${KT_KERNEL_ALIGN};-Wno-maybe-uninitialized;-Wno-uninitialized")
endif()
if(KT_HAVE_AMX)
  # table_amx.cpp makes the table at load with baseline flags (any CPU).
  list(APPEND KT_CORE_SOURCES src/kernels/amx/kernels_amx.cpp src/kernels/amx/table_amx.cpp)
  # -fno-dse: GCC 12 has dropped the stores of a tile configuration before
  # ldtilecfg as dead (the kernel also fences them).
  set_source_files_properties(src/kernels/amx/kernels_amx.cpp PROPERTIES
    COMPILE_OPTIONS "-mamx-tile;-mamx-bf16;-mamx-int8;-mavx512f;-mavx512bw;-mavx512vl;-mavx512bf16;-mavx2;-mfma;-O3;${KT_KERNEL_ALIGN};$<$<CXX_COMPILER_ID:GNU>:-fno-dse>;-Wno-maybe-uninitialized;-Wno-uninitialized")
endif()
# The optimizer's update loops (update.h), one unit per ISA: no FMA
# contraction beyond the explicit fmaf calls (every ISA gives the same bits),
# sqrtf as an instruction.
list(APPEND KT_CORE_SOURCES src/kernels/update_generic.cpp)
set_source_files_properties(src/kernels/update_generic.cpp PROPERTIES
  COMPILE_OPTIONS "-O3;-ffp-contract=off;-fno-math-errno")
if(KT_HAVE_AVX2)
  list(APPEND KT_CORE_SOURCES src/kernels/update_avx2.cpp)
  set_source_files_properties(src/kernels/update_avx2.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx2;-mfma;-O3;-ffp-contract=off;-fno-math-errno")
endif()
if(KT_HAVE_AVX512BF16)
  list(APPEND KT_CORE_SOURCES src/kernels/update_avx512.cpp)
  # (GCC 12 warns falsely inside its own AVX-512 intrinsic headers.)
  set_source_files_properties(src/kernels/update_avx512.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx2;-mfma;-O3;-ffp-contract=off;-fno-math-errno;-Wno-maybe-uninitialized;-Wno-uninitialized")
endif()
