# Install rules, the CMake package (find_package(kt 1) -> kt::kt), kt.pc, Debian
# packages through CPack, the ABI gate, and the tests of programs that consume kt
# the way its users do (CMake, pkg-config, dlopen, the .deb, Rust, Go).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kt" CACHE STRING
  "Where ktConfig.cmake is installed (relative to the prefix)")
set(KT_INSTALL_PYTHONDIR "lib/python3/dist-packages" CACHE STRING
  "Where the Python package kt is installed (relative to the prefix)")
set(KT_PACKAGE_CONTACT "kt maintainers <kt@localhost>" CACHE STRING
  "Maintainer field of the Debian packages")

set(_kt_pkg_dir "${CMAKE_CURRENT_LIST_DIR}")
set(_kt_src_dir "${CMAKE_CURRENT_SOURCE_DIR}")

# ------------------------------------------------------------------ install
# Component runtime: libkt.so.<abi> (+ the full-version file it points to).
# Component dev: the libkt.so link, the header, the CMake package and kt.pc.
install(TARGETS kt EXPORT ktTargets
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT runtime NAMELINK_COMPONENT dev
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT dev
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT runtime)
install(FILES "${_kt_src_dir}/include/kt_c_api.h"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" COMPONENT dev)

set(_kt_components runtime dev)
if(TARGET kt_cli)
  install(TARGETS kt_cli RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT tools)
  list(APPEND _kt_components tools)
  # kt-moe bench: the benchmark and the scripts it runs, beside each other.
  if(TARGET kt_bench)
    install(TARGETS kt_bench RUNTIME DESTINATION "${CMAKE_INSTALL_LIBEXECDIR}/kt" COMPONENT tools)
    install(FILES ${KT_BENCH_SCRIPTS} DESTINATION "${CMAKE_INSTALL_LIBEXECDIR}/kt" COMPONENT tools)
  endif()
endif()
if(IS_DIRECTORY "${_kt_src_dir}/plugins/python/kt")
  install(DIRECTORY "${_kt_src_dir}/plugins/python/kt"
    DESTINATION "${KT_INSTALL_PYTHONDIR}" COMPONENT python
    PATTERN "__pycache__" EXCLUDE PATTERN "*.pyc" EXCLUDE
    # Written by the in-tree development install; names a build tree.
    PATTERN "_libpath.py" EXCLUDE)
  list(APPEND _kt_components python)
endif()

# CMake package. libkt's private dependencies (threads, libstdc++) are linked
# into the shared object, so the exported target carries none of them.
install(EXPORT ktTargets NAMESPACE kt:: FILE ktTargets.cmake
  DESTINATION "${KT_INSTALL_CMAKEDIR}" COMPONENT dev)
configure_package_config_file("${_kt_pkg_dir}/ktConfig.cmake.in"
  "${CMAKE_CURRENT_BINARY_DIR}/packaging/ktConfig.cmake"
  INSTALL_DESTINATION "${KT_INSTALL_CMAKEDIR}")
# The package version is the library version; its major equals the ABI major
# (both defined in kt_c_api.h), so SameMajorVersion accepts exactly the
# versions a program built against kt 1 can load.
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/packaging/ktConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMajorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/packaging/ktConfig.cmake"
  "${CMAKE_CURRENT_BINARY_DIR}/packaging/ktConfigVersion.cmake"
  DESTINATION "${KT_INSTALL_CMAKEDIR}" COMPONENT dev)

# pkg-config: the prefix is derived from the .pc file's own place, so the same
# file works in /usr, in /usr/local and in a prefix given to `cmake --install`.
set(_kt_pc_dir "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
file(RELATIVE_PATH _kt_pc_to_prefix "/prefix/${_kt_pc_dir}" "/prefix")
string(REGEX REPLACE "/$" "" _kt_pc_to_prefix "${_kt_pc_to_prefix}")
set(KT_PC_PREFIX "\${pcfiledir}/${_kt_pc_to_prefix}")
# <dlpack/dlpack.h> is found by default in /usr/include; elsewhere say where.
set(KT_PC_DLPACK_CFLAGS "")
if(NOT KT_DLPACK_INCLUDE IN_LIST CMAKE_C_IMPLICIT_INCLUDE_DIRECTORIES)
  set(KT_PC_DLPACK_CFLAGS " -I${KT_DLPACK_INCLUDE}")
endif()
configure_file("${_kt_pkg_dir}/kt.pc.in" "${CMAKE_CURRENT_BINARY_DIR}/packaging/kt.pc" @ONLY)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/packaging/kt.pc"
  DESTINATION "${_kt_pc_dir}" COMPONENT dev)

# -------------------------------------------------------------------- CPack
# `cpack -G DEB` in the build tree writes libkt<abi>_<version>_<arch>.deb
# (runtime), libkt-dev_... (header, link, CMake package, kt.pc) and, when they
# are built, kt-tools_... (the kt command) and python3-kt_... .
set(CPACK_PACKAGE_NAME "kt")
set(CPACK_PACKAGE_VENDOR "kt")
set(CPACK_PACKAGE_CONTACT "${KT_PACKAGE_CONTACT}")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "CPU engine for the routed experts of Mixture-of-Experts models")
set(CPACK_PACKAGE_DESCRIPTION
  "kt computes the routed experts of Mixture-of-Experts layers on the CPU (forward,\n backward, LoRA and full fine-tuning gradients) behind a stable C ABI.")
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
set(CPACK_GENERATOR "TGZ")
find_program(KT_DPKG_DEB dpkg-deb)
if(KT_DPKG_DEB)
  set(CPACK_GENERATOR "DEB")
endif()
set(CPACK_COMPONENTS_ALL ${_kt_components})
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_ARCHIVE_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME "DEB-DEFAULT")
set(CPACK_DEBIAN_PACKAGE_PRIORITY "optional")

set(_kt_deb_version "${PROJECT_VERSION}")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME "libkt${KT_ABI_VERSION}")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION "libs")
# shlibs + ldconfig trigger, as Debian shared-library packages have.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
find_program(KT_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(KT_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
  set(CPACK_DEBIAN_TOOLS_PACKAGE_SHLIBDEPS ON)
else()
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1")
  set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1")
endif()
set(CPACK_DEBIAN_DEV_PACKAGE_NAME "libkt-dev")
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION "libdevel")
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
  "${CPACK_DEBIAN_RUNTIME_PACKAGE_NAME} (= ${_kt_deb_version}), libdlpack-dev")
set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME "kt-tools")
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION "science")
if(KT_DPKG_SHLIBDEPS)
  # The kt command links libkt.so.<abi> from the runtime package: dpkg-shlibdeps
  # finds it in the build tree, and the exact dependency is stated here.
  get_target_property(_kt_lib_out kt LIBRARY_OUTPUT_DIRECTORY)
  if(NOT _kt_lib_out)
    set(_kt_lib_out "${CMAKE_BINARY_DIR}")
  endif()
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${_kt_lib_out}")
  set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "${CPACK_DEBIAN_RUNTIME_PACKAGE_NAME} (= ${_kt_deb_version})")
endif()
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME "python3-kt")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION "python")
set(CPACK_DEBIAN_PYTHON_PACKAGE_ARCHITECTURE "all")
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
  "${CPACK_DEBIAN_RUNTIME_PACKAGE_NAME} (>= ${_kt_deb_version}), python3, python3-numpy")
set(CPACK_COMPONENT_RUNTIME_DESCRIPTION "kt shared library")
set(CPACK_COMPONENT_DEV_DESCRIPTION "kt development files: header, CMake package, pkg-config")
set(CPACK_COMPONENT_TOOLS_DESCRIPTION "kt command-line tool")
set(CPACK_COMPONENT_PYTHON_DESCRIPTION "kt Python package (ctypes binding)")
include(CPack)

# ----------------------------------------------------------------- ABI gate
# The recorded ABI lives in packaging/abi/kt_abi.json, and the bindings' raw
# layers are generated from it (abi/gen_bindings.py). Re-record it and
# regenerate them (after any header change, or raising KT_ABI_VERSION):
#   cmake --build <build> --target kt_abi_record
find_package(Python3 COMPONENTS Interpreter QUIET)
find_program(KT_CLANG NAMES clang clang-16 clang-15 clang-14)
set(_kt_abi_tool "${_kt_pkg_dir}/abi/kt_abi.py")
set(_kt_abi_args --header "${_kt_src_dir}/include/kt_c_api.h" --include "${KT_DLPACK_INCLUDE}"
  --clang "${KT_CLANG}" --cc "${CMAKE_C_COMPILER}")
if(Python3_Interpreter_FOUND AND KT_CLANG)
  add_custom_target(kt_abi_record
    COMMAND "${Python3_EXECUTABLE}" "${_kt_abi_tool}" dump ${_kt_abi_args}
      --library "$<TARGET_FILE:kt>" -o "${_kt_pkg_dir}/abi/kt_abi.json"
    COMMAND "${Python3_EXECUTABLE}" "${_kt_pkg_dir}/abi/gen_bindings.py"
    DEPENDS kt
    COMMENT "Recording the ABI of kt_c_api.h and libkt in packaging/abi/kt_abi.json, generating the bindings from it"
    VERBATIM)
endif()

# ----------------------------------------------------------------- examples
# dlopen host: resolves every call at run time; loads libkt.so.<abi> by SONAME.
if(KT_BUILD_EXAMPLES)
  add_executable(kt_c_dlopen "${_kt_src_dir}/examples/c-dlopen/kt_dlopen.c")
  target_include_directories(kt_c_dlopen PRIVATE "${_kt_src_dir}/include" "${KT_DLPACK_INCLUDE}")
  target_link_libraries(kt_c_dlopen PRIVATE ${CMAKE_DL_LIBS} m)
  set_target_properties(kt_c_dlopen PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
  target_compile_options(kt_c_dlopen PRIVATE ${KT_WARNINGS})
  add_dependencies(kt_c_dlopen kt)
  if(KT_SANITIZE AND KT_HAVE_ONEDNN)
    # libgomp (oneDNN's OpenMP runtime) allocates at load and never frees;
    # when dlclose() unloads it with libkt, LeakSanitizer reports that memory.
    # The sanitized host keeps libgomp loaded, as a host using OpenMP does.
    target_link_options(kt_c_dlopen PRIVATE "LINKER:--no-as-needed" -lgomp "LINKER:--as-needed")
  endif()
endif()

if(NOT KT_BUILD_TESTS)
  return()
endif()

# Exit code 77 = skipped (a toolchain this test needs is not installed).
set(_kt_skip 77)
set(_kt_consumers "${_kt_src_dir}/tests/consumers")
set(_kt_work "${CMAKE_CURRENT_BINARY_DIR}/consumers")

if(Python3_Interpreter_FOUND AND KT_CLANG)
  add_test(NAME kt_abi_gate
    COMMAND "${Python3_EXECUTABLE}" "${_kt_abi_tool}" check ${_kt_abi_args}
      --library "$<TARGET_FILE:kt>" --baseline "${_kt_pkg_dir}/abi/kt_abi.json")
  add_test(NAME kt_abi_gate_selftest
    COMMAND "${Python3_EXECUTABLE}" "${_kt_pkg_dir}/abi/test_kt_abi.py" ${_kt_abi_args}
      --work "${_kt_work}/abi_selftest")
  # The committed Python, Rust and Go raw layers are what the record gives,
  # the record describes the header, and ctypes lays the structs out as recorded.
  add_test(NAME kt_bindings_generated
    COMMAND "${Python3_EXECUTABLE}" "${_kt_pkg_dir}/abi/gen_bindings.py" --check ${_kt_abi_args})
else()
  add_test(NAME kt_abi_gate COMMAND sh -c "echo 'skipped: the ABI gate needs python3 and clang'; exit ${_kt_skip}")
  if(Python3_Interpreter_FOUND)
    add_test(NAME kt_bindings_generated COMMAND "${Python3_EXECUTABLE}" "${_kt_pkg_dir}/abi/gen_bindings.py" --check)
  endif()
endif()
set_tests_properties(kt_abi_gate PROPERTIES SKIP_RETURN_CODE ${_kt_skip} LABELS "abi;packaging")
if(TEST kt_bindings_generated)
  set_tests_properties(kt_bindings_generated PROPERTIES LABELS "abi;bindings")
endif()

if(TARGET kt_c_dlopen)
  add_test(NAME kt_c_dlopen COMMAND kt_c_dlopen)
  set_tests_properties(kt_c_dlopen PROPERTIES
    ENVIRONMENT "LD_LIBRARY_PATH=$<TARGET_FILE_DIR:kt>" LABELS "consumer")
endif()

# Install into a scratch prefix once; the CMake and pkg-config consumers use it.
set(_kt_prefix "${_kt_work}/prefix")
add_test(NAME kt_install_prefix
  COMMAND sh -c "rm -rf \"$1\" && \"$2\" --install \"$3\" --prefix \"$1\""
    kt_install "${_kt_prefix}" "${CMAKE_COMMAND}" "${CMAKE_BINARY_DIR}")
set_tests_properties(kt_install_prefix PROPERTIES FIXTURES_SETUP kt_installed LABELS "consumer")

add_test(NAME kt_consumer_cmake
  COMMAND sh "${_kt_consumers}/cmake_consumer.sh" "${_kt_prefix}" "${_kt_work}/cmake"
    "${CMAKE_COMMAND}" "${CMAKE_C_COMPILER}")
add_test(NAME kt_consumer_pkgconfig
  COMMAND sh "${_kt_consumers}/pkgconfig_consumer.sh" "${_kt_prefix}" "${_kt_work}/pkgconfig"
    "${CMAKE_C_COMPILER}")
set_tests_properties(kt_consumer_cmake kt_consumer_pkgconfig PROPERTIES
  FIXTURES_REQUIRED kt_installed SKIP_RETURN_CODE ${_kt_skip} LABELS "consumer")

# The Debian packages: built by CPack, unpacked with dpkg -x into an empty
# root, inspected, and a consumer compiled and run against what they contain.
add_test(NAME kt_consumer_deb
  COMMAND sh "${_kt_consumers}/deb_consumer.sh" "${CMAKE_BINARY_DIR}" "${_kt_work}/deb"
    "${CMAKE_C_COMPILER}" "${CPACK_DEBIAN_RUNTIME_PACKAGE_NAME}" "${PROJECT_VERSION}"
    "${KT_ABI_VERSION}")
set_tests_properties(kt_consumer_deb PROPERTIES SKIP_RETURN_CODE ${_kt_skip} LABELS "consumer;packaging")

# Rust (plugins/rust: kt-sys + kt) and Go (plugins/go), against the built library.
foreach(_kt_binding rust go)
  if(EXISTS "${_kt_consumers}/${_kt_binding}_test.sh")
    add_test(NAME kt_${_kt_binding}
      COMMAND sh "${_kt_consumers}/${_kt_binding}_test.sh" "${_kt_src_dir}/plugins/${_kt_binding}"
        "${_kt_work}/${_kt_binding}" "$<TARGET_FILE_DIR:kt>" "${_kt_src_dir}/include" "${KT_DLPACK_INCLUDE}")
    set_tests_properties(kt_${_kt_binding} PROPERTIES
      SKIP_RETURN_CODE ${_kt_skip} LABELS "consumer;bindings")
  endif()
endforeach()

# A sanitized libkt needs its sanitizer runtime loaded first; these programs
# (built by other toolchains, or outside this tree) do not load it.
kt_skip_when_sanitized("consumers are compiled outside this build, without the sanitizer runtime"
  kt_install_prefix kt_consumer_cmake kt_consumer_pkgconfig kt_consumer_deb)
foreach(_kt_binding rust go)
  if(EXISTS "${_kt_consumers}/${_kt_binding}_test.sh")
    kt_skip_when_sanitized("the ${_kt_binding} toolchain links the sanitized libkt without the sanitizer runtime"
      kt_${_kt_binding})
  endif()
endforeach()
