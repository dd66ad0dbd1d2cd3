# CUDA kernels of the sparsever extension (csrc/cuda/*.cu + csrc/cuda/cuda_bindings.cpp, bodies in
# csrc/kernels/*.cuh). Included from the CUDA section of CMakeLists.txt.
#
#   sparsever_cuda_kernels_object(<name> <define>...)  OBJECT library of every CUDA source, compiled once
#   sparsever_add_cuda_kernels(<module>...)             GPU build: link those objects + cudart into modules
#
# Architectures: SPARSEVER_CUDA_ARCHS (CMake CUDA_ARCHITECTURES syntax), default like vLLM's list for the
# toolkit found (sm_80 and newer; CUDA 13 dropped sm_70). "a" variants (90a, 100a) enable arch-specific
# features; the kernels use none, so plain 90 would do, but the compile check covers what vLLM ships.
include_guard(GLOBAL)

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# find_package(Torch) with a CUDA torch adds -gencode flags for TORCH_CUDA_ARCH_LIST (or a guessed list, with
# architectures newer nvcc drop) to CMAKE_CUDA_FLAGS: remove them, so SPARSEVER_CUDA_ARCHS alone decides
# (vLLM's clear_cuda_arches does the same).
string(REGEX REPLACE "-gencode[= ]arch=[^ ]+ *" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")

if(NOT DEFINED SPARSEVER_CUDA_ARCHS)
  set(_sparsever_default_archs "80;86;89;90a")
  if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.8)
    list(APPEND _sparsever_default_archs "100a;120a")
  endif()
  set(SPARSEVER_CUDA_ARCHS "${_sparsever_default_archs}" CACHE STRING "CUDA architectures of the sparsever kernels")
endif()
message(STATUS "sparsever CUDA kernels: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${SPARSEVER_CUDA_ARCHS}")

file(GLOB SPARSEVER_CUDA_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu)
set(SPARSEVER_CUDA_BINDINGS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/cuda_bindings.cpp)

function(sparsever_cuda_kernels_object NAME)
  # ARGN: extra compile definitions
  add_library(${NAME} OBJECT ${SPARSEVER_CUDA_SOURCES} ${SPARSEVER_CUDA_BINDINGS})
  set_target_properties(${NAME} PROPERTIES CUDA_ARCHITECTURES "${SPARSEVER_CUDA_ARCHS}"
                                           POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 20 CXX_STANDARD 20)
  target_include_directories(${NAME} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc ${TORCH_INCLUDE_DIRS})
  target_compile_definitions(${NAME} PRIVATE ${ARGN})
  # torch's own extension flags: c10::Half/BFloat16 provide the conversions, not cuda_fp16.h's operators.
  target_compile_options(${NAME} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__
      -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__>
    $<$<COMPILE_LANGUAGE:CXX>:-O3>)
  # Usage requirements of torch (ABI define, include dirs) without linking anything into an OBJECT library.
  target_compile_options(${NAME} PRIVATE ${TORCH_CXX_FLAGS})
endfunction()

function(sparsever_add_cuda_kernels)
  if(NOT TARGET sparsever_cuda_kernels)
    sparsever_cuda_kernels_object(sparsever_cuda_kernels)
  endif()
  foreach(module IN LISTS ARGN)
    target_sources(${module} PRIVATE $<TARGET_OBJECTS:sparsever_cuda_kernels>)
    target_link_libraries(${module} PRIVATE CUDA::cudart)
  endforeach()
endfunction()
