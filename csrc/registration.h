#pragma once

#include <Python.h>

#define _SPARSEVER_CONCAT(A, B) A##B
#define SPARSEVER_CONCAT(A, B) _SPARSEVER_CONCAT(A, B)
#define _SPARSEVER_STRINGIFY(A) #A
#define SPARSEVER_STRINGIFY(A) _SPARSEVER_STRINGIFY(A)

// A Python module with no methods: importing it (vllm_sparsever._C or _C_avx512) runs the
// TORCH_LIBRARY static registrations, as vLLM's own _C does.
#define SPARSEVER_REGISTER_EXTENSION(NAME)                                        \
  PyMODINIT_FUNC SPARSEVER_CONCAT(PyInit_, NAME)() {                              \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,                    \
                                        SPARSEVER_STRINGIFY(NAME), nullptr, 0,    \
                                        nullptr};                                 \
    return PyModule_Create(&module);                                              \
  }
