# Checkpoint I/O (safetensors, model layouts, writers); its kt_ckpt_* calls are in src/api/ckpt.cpp.
# nlohmann-json is header-only (Debian nlohmann-json3-dev); its directory is
# added for the core sources when it is not a default one.
find_path(KT_NLOHMANN_JSON_INCLUDE nlohmann/json.hpp REQUIRED)
if(NOT KT_NLOHMANN_JSON_INCLUDE STREQUAL "/usr/include")
  include_directories(SYSTEM ${KT_NLOHMANN_JSON_INCLUDE})
endif()
list(APPEND KT_CORE_SOURCES
  src/io/elements.cpp
  src/io/exporters.cpp
  src/io/layout.cpp
  src/io/layout_config.cpp
  src/io/layout_names.cpp
  src/io/layout_read.cpp
  src/io/packed_cache.cpp
  src/io/publish.cpp
  src/io/quant_fp8_block.cpp
  src/io/quant_int4_group.cpp
  src/io/quant_mxfp4.cpp
  src/io/safetensors.cpp
  src/io/writer.cpp
)
