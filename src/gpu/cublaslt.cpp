// cublaslt.cpp: cuBLASLt opened on first use (see cublaslt.h for why it is not linked).
#include "gpu/cublaslt.h"

#include "core/error.h"

#if !defined(STRATA_CUDA_EMU)
#include <cuda_runtime_api.h>  // CUDART_VERSION, named in the errors
#include <dlfcn.h>

#include <type_traits>
#endif

namespace strata {

#if defined(STRATA_CUDA_EMU)

const CublasLtApi& cublaslt() {
  static const CublasLtApi api = [] {
    CublasLtApi a;
#define STRATA_CUBLASLT_DIRECT(name) a.name = &::cublasLt##name;
    STRATA_CUBLASLT_FUNCTIONS(STRATA_CUBLASLT_DIRECT)
#undef STRATA_CUBLASLT_DIRECT
    return a;
  }();
  return api;
}

#else

std::vector<std::string> cublaslt_candidates() {
  std::vector<std::string> names;
#if defined(STRATA_CUBLASLT_LIBRARY)
  names.emplace_back(STRATA_CUBLASLT_LIBRARY);
#endif
  names.push_back("libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  return names;
}

CublasLtApi open_cublaslt(const std::vector<std::string>& names) {
  void* lib = nullptr;
  std::string tried, opened;
  for (const std::string& name : names) {
    lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      opened = name;
      break;
    }
    const char* why = dlerror();
    tried += fmt::format("{}{}", tried.empty() ? "" : "; ", why != nullptr ? why : name);
  }
  if (lib == nullptr)
    fail(
        "cannot load cuBLASLt, which the GPU's matmuls need ({}); it comes with the CUDA toolkit "
        "strata was built with (CUDA {}): put the directory holding libcublasLt.so.{} on "
        "LD_LIBRARY_PATH",
        tried, CUDART_VERSION, CUBLAS_VER_MAJOR);
  CublasLtApi a;
  auto find = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)> >(dlsym(lib, symbol));
    if (fn == nullptr)
      fail("cuBLASLt ({}) has no {}: it is older than the CUDA {} toolkit strata was built with",
           opened, symbol, CUDART_VERSION);
  };
#define STRATA_CUBLASLT_FIND(name) find(a.name, "cublasLt" #name);
  STRATA_CUBLASLT_FUNCTIONS(STRATA_CUBLASLT_FIND)
#undef STRATA_CUBLASLT_FIND
  return a;  // the library stays open for the process's life
}

const CublasLtApi& cublaslt() {
  static const CublasLtApi api = open_cublaslt(cublaslt_candidates());
  return api;
}

#endif

}  // namespace strata
