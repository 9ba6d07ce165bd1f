# The installed baton (step 12): public headers, the static libraries a training program links,
# the tools, and a CMake package, so that a project outside the tree can say
#   find_package(baton CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE baton::baton)
# `cmake --install build --prefix P` puts them under P; `cpack -G DEB` (configured in the top
# CMakeLists.txt) packs the same files. The libraries are static: their private dependencies
# (fmt, Boost, UCX, OpenBLAS, zlib, CUDA) appear in the exported link interface as LINK_ONLY, so
# batonConfig.cmake finds them again for the consumer (cmake/batonConfig.cmake.in).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(_baton_installed_libs kernels transport actors graph observe)
foreach(name IN LISTS _baton_installed_libs)
  set_target_properties(baton_${name} PROPERTIES EXPORT_NAME ${name})
  # Every library keeps its headers under <lib>/include/baton/...; installed, they share one tree.
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${name}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
list(TRANSFORM _baton_installed_libs PREPEND baton_)
install(TARGETS ${_baton_installed_libs} baton_umbrella EXPORT batonTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# The tools, where this build has them. Installed, they keep the link path of libraries outside
# the system's (CUDA's cuBLAS and NCCL under /usr/local/cuda) in their RPATH.
set(_baton_tools baton-train baton-launch baton-serve)
if(TARGET baton-prepare-data)
  list(APPEND _baton_tools baton-prepare-data)
endif()
set_target_properties(${_baton_tools} PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
install(TARGETS ${_baton_tools} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(_baton_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/baton)
install(EXPORT batonTargets NAMESPACE baton:: DESTINATION ${_baton_cmake_dir})
# What batonConfig.cmake.in needs to know of this build.
set(BATON_CONFIG_WITH_CUDA ${BATON_CUDA})
set(BATON_CONFIG_CUDA_ROOT "")
if(BATON_CUDA)
  get_filename_component(BATON_CONFIG_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/batonConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/batonConfig.cmake
                              INSTALL_DESTINATION ${_baton_cmake_dir})
# 0.x: a new minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/batonConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/batonConfig.cmake ${PROJECT_BINARY_DIR}/batonConfigVersion.cmake
        DESTINATION ${_baton_cmake_dir})
