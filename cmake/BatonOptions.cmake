# Warnings, sanitizers and optional toolkits, as INTERFACE targets every baton target links.
add_library(baton_warnings INTERFACE)
add_library(baton::warnings ALIAS baton_warnings)
target_compile_options(baton_warnings INTERFACE -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wpedantic -Wno-missing-field-initializers)
# GCC 12 reports -Wrestrict inside libstdc++ for `"literal" + std::string&&` at -O3, a known
# false positive (GCC bug 105329); it would fail -Werror builds on code that is fine.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  target_compile_options(baton_warnings INTERFACE -Wno-restrict)
endif()
if(BATON_WERROR)
  target_compile_options(baton_warnings INTERFACE -Werror)
endif()

if(BATON_SANITIZE)
  string(REPLACE ";" "," _baton_san "${BATON_SANITIZE}")
  message(STATUS "baton: building with -fsanitize=${_baton_san}")
  add_compile_options(-fsanitize=${_baton_san} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${_baton_san})
  if("thread" IN_LIST BATON_SANITIZE)
    # GCC warns that TSan does not model atomic_thread_fence; the mailbox's wake-up protocol
    # pairs its fences with seq_cst atomics, which TSan does see.
    add_compile_options(-Wno-tsan)
  endif()
endif()

# The CUDA path (step 6 of the plan) is detected here so that the build reports what it found;
# no CUDA sources exist yet, so nothing is compiled for it.
if(NOT BATON_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    message(STATUS "baton: CUDA toolkit ${CUDAToolkit_VERSION} at ${CUDAToolkit_BIN_DIR} (CUDA kernels arrive with the CUDA path)")
  elseif(BATON_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "BATON_WITH_CUDA=ON but no CUDA toolkit was found")
  else()
    message(STATUS "baton: no CUDA toolkit found; building the CPU path only")
  endif()
endif()
