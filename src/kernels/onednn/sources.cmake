# The oneDNN GEMM backend (KT_GEMM_ONEDNN): compiled always, and reports the
# backend unsupported at engine creation where oneDNN was not usable
# (KT_HAVE_ONEDNN 0, set by the top-level CMakeLists.txt before this).
list(APPEND KT_CORE_SOURCES src/kernels/onednn/gemm_onednn.cpp)
set_source_files_properties(src/kernels/onednn/gemm_onednn.cpp PROPERTIES
  COMPILE_DEFINITIONS KT_HAVE_ONEDNN=${KT_HAVE_ONEDNN})
