# Compile-only check of the CUDA kernels against a CPU-only torch (no GPU, no CUDA torch): builds the
# OBJECT library `sparsever_cuda_compile_check` and links nothing. c10/cuda headers need the define below
# when torch was built without CUDA. tools/check_cuda_compile.sh does the same without CMake (and is what
# CI runs); this target checks that the CMake CUDA section itself configures and compiles:
#   cmake -S . -B build/cmake_cuda_check -DSPARSEVER_CUDA_COMPILE_CHECK=ON -DSPARSEVER_CUDA_ARCHS=80 \
#         -DCMAKE_PREFIX_PATH=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)') -G Ninja
#   cmake --build build/cmake_cuda_check --target sparsever_cuda_compile_check
include_guard(GLOBAL)
include(${CMAKE_CURRENT_LIST_DIR}/cuda.cmake)
sparsever_cuda_kernels_object(sparsever_cuda_compile_check C10_CUDA_NO_CMAKE_CONFIGURE_FILE)
set_target_properties(sparsever_cuda_compile_check PROPERTIES EXCLUDE_FROM_ALL ON)
