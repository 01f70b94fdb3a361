# The Python wheel (pyproject.toml at the top, built by scikit-build-core):
# everything it needs is installed as the component "wheel", under the
# package directory kt/ of the wheel's platlib:
#   kt/libkt.so.<abi>               the library, one real file under its SONAME
#                                   (wheels hold no symlinks), found by kt._capi
#   kt/bin/kt-moe                   the kt tool (RUNPATH $ORIGIN/..), run by the
#                                   `kt-moe` console command and `python -m kt`
#                                   (kt._cli)
#   kt/libexec/kt/kt_bench          `kt-moe bench`, beside the scripts it runs
#                                   (torch baselines, the peers' driver)
# The Python sources of kt/ come from plugins/python/kt (wheel.packages).
if(NOT TARGET kt_cli)
  message(FATAL_ERROR "kt: the Python wheel needs the kt tool (tools/CMakeLists.txt)")
endif()

install(FILES "$<TARGET_FILE:kt>" DESTINATION kt RENAME "libkt.so.${KT_ABI_VERSION}"
  PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE
  COMPONENT wheel)

set_target_properties(kt_cli PROPERTIES INSTALL_RPATH "\$ORIGIN/..")
install(TARGETS kt_cli RUNTIME DESTINATION kt/bin COMPONENT wheel)
if(TARGET kt_bench)
  set_target_properties(kt_bench PROPERTIES INSTALL_RPATH "\$ORIGIN/../..")
  install(TARGETS kt_bench RUNTIME DESTINATION kt/libexec/kt COMPONENT wheel)
  install(FILES ${KT_BENCH_SCRIPTS} DESTINATION kt/libexec/kt COMPONENT wheel)
endif()
