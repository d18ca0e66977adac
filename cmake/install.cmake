# What `cmake --install` puts where (included by CMakeLists.txt once every target is defined).
#
# By default, a C++ installation: `cmake --install build --prefix P` gives
#   P/include/gradlink/*.h                  the public API
#   P/lib/libgradlink.so.0.1.0 (+ .so.0.1, .so)  SONAME libgradlink.so.0.1
#   P/bin/gradlink-{scheduler,server,bench,run}
#   P/lib/cmake/gradlink/                   find_package(gradlink) -> gradlink::gradlink
# Installed files keep an absolute RUNPATH to the UCX they were built against (gradlink's
# patched UCX in GRADLINK_UCX_PREFIX, which stays where scripts/ucx/build.sh put it); with the
# system's UCX they need none.
#
# GRADLINK_PYTHON_PACKAGE=ON (setup.py, for `pip install .` and `pip wheel .`): the compiled
# parts of the Python package instead, with the prefix being the package's directory:
#   _gradlink*.so, _gradlink_c10d*.so       RUNPATH $ORIGIN/lib
#   lib/libgradlink.so.0.1                  RUNPATH $ORIGIN
#   lib/libuc{p,t,s,m}.so.0, lib/ucx/*.so.0 gradlink's patched UCX and its transport modules,
#                                           RUNPATH $ORIGIN (modules: $ORIGIN/..). libucs finds
#                                           the modules in lib/ucx beside itself (UCX looks for
#                                           <directory of libucs>/ucx first)
#   bin/gradlink-{scheduler,server,bench}   RUNPATH $ORIGIN/../lib
#   bin/gradlink-run
# so that nothing outside the package (no build tree, no ~/.cache/gradlink) is needed.

option(GRADLINK_PYTHON_PACKAGE "Install the Python package's compiled parts (setup.py)" OFF)
set(_gradlink_binaries gradlink-scheduler gradlink-server gradlink-bench)

if(NOT GRADLINK_PYTHON_PACKAGE)
  include(GNUInstallDirs)
  include(CMakePackageConfigHelpers)
  set(_gradlink_ucx_rpath "")
  if(GRADLINK_UCX_FIXED)
    set(_gradlink_ucx_rpath "${UCX_LIBDIR}")
  endif()
  set_target_properties(gradlink ${_gradlink_binaries} PROPERTIES
    INSTALL_RPATH "${_gradlink_ucx_rpath}")
  install(TARGETS gradlink EXPORT gradlinkTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(DIRECTORY include/gradlink DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.h")
  install(TARGETS ${_gradlink_binaries} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(PROGRAMS tools/gradlink-run DESTINATION ${CMAKE_INSTALL_BINDIR})

  set(_gradlink_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/gradlink)
  install(EXPORT gradlinkTargets NAMESPACE gradlink:: DESTINATION ${_gradlink_cmake_dir})
  configure_package_config_file(cmake/gradlinkConfig.cmake.in
    ${CMAKE_BINARY_DIR}/gradlinkConfig.cmake INSTALL_DESTINATION ${_gradlink_cmake_dir})
  # Before 1.0 a minor version may change the API: only the same 0.x answers a request.
  write_basic_package_version_file(${CMAKE_BINARY_DIR}/gradlinkConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES ${CMAKE_BINARY_DIR}/gradlinkConfig.cmake
          ${CMAKE_BINARY_DIR}/gradlinkConfigVersion.cmake DESTINATION ${_gradlink_cmake_dir})
  return()
endif()

if(NOT TARGET _gradlink)
  message(FATAL_ERROR "gradlink: GRADLINK_PYTHON_PACKAGE needs the Python binding (pybind11: "
                      "apt-get install python3-pybind11)")
endif()
set_target_properties(gradlink PROPERTIES INSTALL_RPATH "$ORIGIN")
# The SONAME's name only: a wheel holds no symbolic links.
install(FILES $<TARGET_FILE:gradlink> DESTINATION lib RENAME $<TARGET_SONAME_FILE_NAME:gradlink>)
# (install(FILES) does not rewrite the RUNPATH: done below with the UCX libraries.)
set_target_properties(${_gradlink_binaries} PROPERTIES INSTALL_RPATH "$ORIGIN/../lib")
install(TARGETS ${_gradlink_binaries} RUNTIME DESTINATION bin)
install(PROGRAMS tools/gradlink-run DESTINATION bin)
foreach(_m _gradlink _gradlink_c10d)
  if(TARGET ${_m})
    set(_rpath "$ORIGIN/lib")
    if(_m STREQUAL "_gradlink_c10d")
      # torch's libraries where they are not in a system directory (Debian's are).
      get_filename_component(_torch_lib_dir "${GRADLINK_TORCH_LIB_torch}" DIRECTORY)
      if(NOT _torch_lib_dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
        list(APPEND _rpath "${_torch_lib_dir}")
      endif()
    endif()
    set_target_properties(${_m} PROPERTIES INSTALL_RPATH "${_rpath}")
    install(TARGETS ${_m} LIBRARY DESTINATION .)
  endif()
endforeach()

# UCX: the libraries libgradlink links, under their SONAMEs, and every transport module.
set(_gradlink_bundled "lib/$<TARGET_SONAME_FILE_NAME:gradlink>=$ORIGIN")
if(GRADLINK_UCX_FIXED)
  foreach(_l ucp uct ucs ucm)
    file(REAL_PATH "${UCX_LIBDIR}/lib${_l}.so.0" _real)
    install(FILES "${_real}" DESTINATION lib RENAME lib${_l}.so.0)
    list(APPEND _gradlink_bundled "lib/lib${_l}.so.0=$ORIGIN")
  endforeach()
  file(GLOB _gradlink_ucx_modules "${UCX_LIBDIR}/ucx/lib*.so.0")
  if(NOT _gradlink_ucx_modules)
    message(FATAL_ERROR "gradlink: no UCX modules in ${UCX_LIBDIR}/ucx")
  endif()
  foreach(_mod ${_gradlink_ucx_modules})
    get_filename_component(_name "${_mod}" NAME)
    file(REAL_PATH "${_mod}" _real)
    install(FILES "${_real}" DESTINATION lib/ucx RENAME ${_name})
    list(APPEND _gradlink_bundled "lib/ucx/${_name}=$ORIGIN/..")
  endforeach()
else()
  message(WARNING "gradlink: the Python package uses the system's UCX (${UCX_LIBDIR}), which "
                  "the machines it is installed on must have too")
endif()
# Their RUNPATHs (each holds an absolute one to GRADLINK_UCX_PREFIX, or libgradlink's to the
# build tree, longer than what replaces it), and --strip.
install(CODE "
  set(_entries \"${_gradlink_bundled}\")
  foreach(_entry IN LISTS _entries)
    string(REPLACE \"=\" \";\" _entry \"\${_entry}\")
    list(GET _entry 0 _file)
    list(GET _entry 1 _rpath)
    # (libucm has none: it needs nothing but libc.)
    unset(_old)
    unset(_old_rpath)
    file(READ_ELF \"\${CMAKE_INSTALL_PREFIX}/\${_file}\" RUNPATH _old RPATH _old_rpath)
    if(_old OR _old_rpath)
      file(RPATH_SET FILE \"\${CMAKE_INSTALL_PREFIX}/\${_file}\" NEW_RPATH \"\${_rpath}\")
    endif()
    if(CMAKE_INSTALL_DO_STRIP)  # cmake --install --strip strips install(TARGETS) files only
      execute_process(COMMAND \"${CMAKE_STRIP}\" --strip-unneeded
                              \"\${CMAKE_INSTALL_PREFIX}/\${_file}\" COMMAND_ERROR_IS_FATAL ANY)
    endif()
  endforeach()
")
