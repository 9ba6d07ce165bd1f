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

# The CUDA path (step 6): enabled when a toolkit is found (AUTO), required (ON) or skipped (OFF).
# BATON_CUDA is what the rest of the build tests; the kernels library then carries the CUDA
# device, its kernels and the BATON_HAS_CUDA definition. .cu files are C++17 (CMake 3.25 does not
# know CUDA C++20) and hold only launchers with plain-pointer interfaces; the kernel classes
# around them are C++20 in .cpp files.
set(BATON_CUDA FALSE)
set(BATON_NCCL FALSE)
if(NOT BATON_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND NOT CMAKE_CUDA_COMPILER AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
    set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}" CACHE FILEPATH "nvcc")
  endif()
  if(CUDAToolkit_FOUND AND CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "GPU architectures to build for (A100, H100)")
    endif()
    if(CMAKE_CXX_COMPILER_LAUNCHER AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
      set(CMAKE_CUDA_COMPILER_LAUNCHER "${CMAKE_CXX_COMPILER_LAUNCHER}")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    # NCCL (collectives between GPUs), linked as the shared library: libnccl is about 200 MB, and
    # every CUDA install or PyTorch wheel (nvidia/nccl/lib) on a GPU machine carries one.
    # BATON_NCCL is what the rest of the build tests; without it the NCCL API says "built
    # without NCCL".
    find_path(BATON_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(BATON_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    set(BATON_NCCL FALSE)
    if(BATON_NCCL_INCLUDE_DIR AND BATON_NCCL_LIBRARY)
      set(BATON_NCCL TRUE)
    endif()
    set(BATON_CUDA TRUE)
    message(STATUS "baton: CUDA ${CUDAToolkit_VERSION} at ${CUDAToolkit_BIN_DIR}, architectures ${CMAKE_CUDA_ARCHITECTURES}; NCCL: ${BATON_NCCL} (${BATON_NCCL_LIBRARY})")
  elseif(BATON_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "BATON_WITH_CUDA=ON but no CUDA toolkit (nvcc) was found; set CUDAToolkit_ROOT")
  else()
    message(STATUS "baton: no CUDA toolkit found; building the CPU path only")
  endif()
endif()
