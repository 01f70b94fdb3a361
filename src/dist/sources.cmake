# Communicators and distributed layers (src/dist; their kt_comm_* /
# kt_dist_* calls are in src/api/dist.cpp). Both collective engines are optional, each found without
# letting the configure step fail, and each reported by one status line:
# - Gloo (Debian libgloo-dev): headers and libgloo, linked into libkt.
# - NCCL: nccl.h and the CUDA runtime headers (CUDA's include directory,
#   KT_NCCL_ROOT, default /usr/local/cuda); nothing is linked, libkt opens
#   libnccl.so.2 and libcudart.so at run time (src/dist/nccl_transport.cpp).
# Without them the calls exist and return KT_ERR_UNSUPPORTED.
option(KT_WITH_GLOO "Build the Gloo communicator backend when libgloo-dev is found" ON)
option(KT_WITH_NCCL "Build the NCCL communicator backend when nccl.h and the CUDA headers are found" ON)
set(KT_NCCL_ROOT "/usr/local/cuda" CACHE PATH "Where to look for nccl.h and the CUDA runtime headers")

set(KT_HAVE_GLOO 0)
if(NOT KT_WITH_GLOO)
  message(STATUS "kt: Gloo communicator backend off (KT_WITH_GLOO=OFF)")
else()
  find_path(KT_GLOO_INCLUDE gloo/rendezvous/context.h)
  find_library(KT_GLOO_LIBRARY gloo)
  if(KT_GLOO_INCLUDE AND KT_GLOO_LIBRARY)
    set(KT_HAVE_GLOO 1)
    message(STATUS "kt: Gloo communicator backend enabled (${KT_GLOO_LIBRARY})")
  else()
    message(STATUS "kt: Gloo not found (install libgloo-dev); building without the Gloo communicator backend")
  endif()
endif()

set(KT_HAVE_NCCL 0)
if(NOT KT_WITH_NCCL)
  message(STATUS "kt: NCCL communicator backend off (KT_WITH_NCCL=OFF)")
else()
  find_path(KT_NCCL_INCLUDE nccl.h HINTS "${KT_NCCL_ROOT}/include" /usr/local/cuda/include)
  find_path(KT_CUDART_INCLUDE cuda_runtime_api.h HINTS "${KT_NCCL_ROOT}/include" /usr/local/cuda/include)
  if(KT_NCCL_INCLUDE AND KT_CUDART_INCLUDE)
    set(KT_HAVE_NCCL 1)
    message(STATUS "kt: NCCL communicator backend enabled (${KT_NCCL_INCLUDE}/nccl.h; libnccl is opened at run time)")
  else()
    message(STATUS "kt: NCCL or CUDA headers not found under ${KT_NCCL_ROOT}; building without the NCCL communicator backend")
  endif()
endif()

list(APPEND KT_CORE_SOURCES
  src/dist/backend.cpp
  src/dist/comm.cpp
  src/dist/comm_create.cpp
  src/dist/dist_ckpt.cpp
  src/dist/dist_ckpt_plan.cpp
  src/dist/dist_moe.cpp
  src/dist/dist_moe_rows.cpp
  src/dist/gloo_transport.cpp
  src/dist/nccl_transport.cpp
)
set_source_files_properties(src/dist/gloo_transport.cpp PROPERTIES COMPILE_DEFINITIONS KT_HAVE_GLOO=${KT_HAVE_GLOO})
set_source_files_properties(src/dist/nccl_transport.cpp PROPERTIES COMPILE_DEFINITIONS KT_HAVE_NCCL=${KT_HAVE_NCCL})
if(KT_HAVE_GLOO AND NOT KT_GLOO_INCLUDE STREQUAL "/usr/include")
  set_property(SOURCE src/dist/gloo_transport.cpp APPEND PROPERTY INCLUDE_DIRECTORIES "${KT_GLOO_INCLUDE}")
endif()
if(KT_HAVE_NCCL)
  # System headers: CUDA's own headers are not written for -Wextra -Werror.
  set_property(SOURCE src/dist/nccl_transport.cpp APPEND PROPERTY COMPILE_OPTIONS
    "-isystem${KT_NCCL_INCLUDE}" "-isystem${KT_CUDART_INCLUDE}")
endif()
# What libkt links (after its targets exist).
set(KT_DIST_LIBRARIES ${CMAKE_DL_LIBS})
if(KT_HAVE_GLOO)
  list(APPEND KT_DIST_LIBRARIES "${KT_GLOO_LIBRARY}")
endif()
