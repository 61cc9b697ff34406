// cublaslt.h: the cuBLASLt functions strata calls, loaded when a GPU first runs a matmul.
//
// libcublasLt's static initialisers touch about 100 MB and took 0.4 s of every process that
// linked it, on the 2-core CI machine: every `strata` command (plan, tokenize, --version) and
// every test binary, GPU or not. So strata does not link it. The first matmul on a GPU opens
// the library (the one found at build time, else libcublasLt.so.<major> on the loader's path)
// and calls through this table; a library that cannot be opened is an error naming what was
// tried. The CPU emulator's build fills the table with the emulator's functions.
#pragma once

#include <cublasLt.h>

#include <string>
#include <vector>

namespace strata {

// clang-format off
#define STRATA_CUBLASLT_FUNCTIONS(X) \
  X(Create) \
  X(Destroy) \
  X(GetStatusName) \
  X(GetStatusString) \
  X(Matmul) \
  X(MatmulAlgoGetHeuristic) \
  X(MatmulDescCreate) \
  X(MatmulDescDestroy) \
  X(MatmulDescSetAttribute) \
  X(MatmulPreferenceCreate) \
  X(MatmulPreferenceDestroy) \
  X(MatmulPreferenceSetAttribute) \
  X(MatrixLayoutCreate) \
  X(MatrixLayoutDestroy)
// clang-format on

// cublasLt<Name> as member <Name>: cublaslt().Matmul(...) calls cublasLtMatmul.
struct CublasLtApi {
#define STRATA_CUBLASLT_MEMBER(name) decltype(&::cublasLt##name) name = nullptr;
  STRATA_CUBLASLT_FUNCTIONS(STRATA_CUBLASLT_MEMBER)
#undef STRATA_CUBLASLT_MEMBER
};

// The table, the library opened on the first call (thread-safe). Throws strata::Error when the
// library or one of its functions cannot be found.
const CublasLtApi& cublaslt();

#if !defined(STRATA_CUDA_EMU)
// Where cublaslt() looks, in order: the library this build was compiled against, then
// libcublasLt.so.<major> on the loader's search path.
std::vector<std::string> cublaslt_candidates();
// The table from the first of `candidates` that opens; an error naming each failure otherwise.
CublasLtApi open_cublaslt(const std::vector<std::string>& candidates);
#endif

}  // namespace strata
