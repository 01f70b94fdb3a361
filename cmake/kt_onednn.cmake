# Finds a usable oneDNN (Debian libdnnl-dev) without letting it break the
# configure step. Debian's dnnl-config.cmake itself calls
# find_package(OpenCL REQUIRED), which fails where the OpenCL development
# files are absent (libdnnl-dev only recommends them), and no QUIET or
# OPTIONAL on our side can catch that error. So the config is first tried in
# a throw-away child CMake run, which also links a small oneDNN program;
# only when that succeeds is the config loaded here.
#
# Sets KT_ONEDNN_USABLE (cached once it succeeds), KT_ONEDNN_WHY_NOT, and,
# when usable, the targets DNNL::dnnl and OpenMP::OpenMP_CXX. The caller
# prints the one status line.
include_guard(GLOBAL)

if(NOT KT_ONEDNN_USABLE)  # a failed probe is retried at the next configure
  set(_kt_probe_dir "${CMAKE_BINARY_DIR}/kt_onednn_probe")
  file(REMOVE_RECURSE "${_kt_probe_dir}")
  execute_process(
    COMMAND "${CMAKE_COMMAND}" -S "${CMAKE_CURRENT_LIST_DIR}/onednn_probe" -B "${_kt_probe_dir}"
            -G "${CMAKE_GENERATOR}" "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
            "-DCMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH}" -DCMAKE_BUILD_TYPE=Release
    RESULT_VARIABLE _kt_onednn_rc OUTPUT_VARIABLE _kt_onednn_out ERROR_VARIABLE _kt_onednn_out)
  if(_kt_onednn_rc EQUAL 0)
    execute_process(COMMAND "${CMAKE_COMMAND}" --build "${_kt_probe_dir}"
      RESULT_VARIABLE _kt_onednn_rc OUTPUT_VARIABLE _kt_onednn_out ERROR_VARIABLE _kt_onednn_out)
  endif()
  if(_kt_onednn_rc EQUAL 0)
    set(_kt_onednn_ok ON)
    set(_kt_onednn_why "")
  else()
    set(_kt_onednn_ok OFF)
    # The first error line of the child configure or build says why.
    string(REGEX MATCH "Could NOT find [^\n]*" _kt_onednn_why "${_kt_onednn_out}")
    if(_kt_onednn_why STREQUAL "")
      string(REGEX MATCH "error: [^\n]*" _kt_onednn_why "${_kt_onednn_out}")
    endif()
    string(STRIP "${_kt_onednn_why}" _kt_onednn_why)
    if(_kt_onednn_why STREQUAL "")
      set(_kt_onednn_why "its CMake config or a test program failed")
    endif()
  endif()
  set(KT_ONEDNN_USABLE ${_kt_onednn_ok} CACHE BOOL "oneDNN's CMake config loads and a oneDNN program links" FORCE)
  set(KT_ONEDNN_WHY_NOT "${_kt_onednn_why}" CACHE INTERNAL "why oneDNN is not usable" FORCE)
endif()

if(KT_ONEDNN_USABLE)
  find_package(dnnl CONFIG QUIET)
  find_package(OpenMP QUIET COMPONENTS CXX)
  if(NOT (dnnl_FOUND AND OpenMP_CXX_FOUND))
    set(KT_ONEDNN_USABLE OFF CACHE BOOL "" FORCE)
    set(KT_ONEDNN_WHY_NOT "dnnl or OpenMP not found" CACHE INTERNAL "")
  endif()
endif()
