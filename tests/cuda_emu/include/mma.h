// mma.h (CUDA emulator): the warp matrix functions (nvcuda::wmma) strata's kernels use, for
// 16 x 16 x 16 tiles of bf16 or f16 inputs with f32 accumulators.
//
// On a GPU, which elements of a tile each lane's fragment holds is unspecified, and a kernel
// may only rely on load/store/mma and on element-wise work over `x`. The emulator spreads a
// tile over the lanes in its own order (element i of lane l is the tile's element 32 i + l in
// row-major order), unlike any GPU's, so a kernel that assumed one GPU's layout goes wrong here.
//
// Every operation is warp-wide, as on a GPU: the warp's 32 lanes meet in it (kernel.cpp's
// warp_collective), each lane's arguments must be the same (pointer, stride, layout), and
// pointers must be 32-byte aligned with a stride that is a multiple of 16 bytes. Anything else
// is a fault naming the kernel, block and thread. The product sums in f32 in k order, rounding
// as written; a tensor core's order and internal precision differ, so results agree with a GPU
// to a tolerance.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16 x 16 x 16 tiles only");
  static constexpr int num_elements = 8;
  T x[num_elements];
};

namespace detail {

constexpr int kTile = 16;

// The tile position (row, column) of element i of lane l.
inline void position(int lane, int i, int& row, int& col) {
  const int p = 32 * i + lane;
  row = p / kTile;
  col = p % kTile;
}

inline float to_float(float v) {
  return v;
}
inline float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
inline float to_float(__half v) {
  return __half2float(v);
}

// One lane's arguments to a load or store.
struct Transfer {
  const char* what;
  void* memory;
  void* fragment;
  unsigned ldm;
  bool row_major;  // the memory's layout
  unsigned element_bytes;
  void (*move)(void* memory, void* fragment, int lane, int i, size_t offset);
};

inline void check_transfer(void* const* args) {
  const auto& t0 = *static_cast<const Transfer*>(args[0]);
  if (reinterpret_cast<uintptr_t>(t0.memory) % 32 != 0)
    throw std::runtime_error(std::string(t0.what) + ": the pointer is not 32-byte aligned");
  if (t0.ldm * t0.element_bytes % 16 != 0)
    throw std::runtime_error(std::string(t0.what) + ": the stride " + std::to_string(t0.ldm) +
                             " elements is not a multiple of 16 bytes");
  for (int l = 1; l < 32; ++l) {
    const auto& t = *static_cast<const Transfer*>(args[l]);
    if (t.memory != t0.memory || t.ldm != t0.ldm || t.row_major != t0.row_major)
      throw std::runtime_error(std::string(t0.what) + ": lane " + std::to_string(l) +
                               "'s pointer, stride or layout differs from lane 0's");
  }
}

inline void run_transfer(void* const* args) {
  check_transfer(args);
  for (int l = 0; l < 32; ++l) {
    const auto& t = *static_cast<const Transfer*>(args[l]);
    for (int i = 0; i < 8; ++i) {
      int r = 0, c = 0;
      position(l, i, r, c);
      const size_t offset = t.row_major ? size_t{t.ldm} * r + c : size_t{t.ldm} * c + r;
      t.move(t.memory, t.fragment, l, i, offset);
    }
  }
}

template <typename Frag, typename T, bool kLoad>
void move_element(void* memory, void* fragment, int /*lane*/, int i, size_t offset) {
  auto& f = *static_cast<Frag*>(fragment);
  T* m = static_cast<T*>(memory);
  if constexpr (kLoad)
    f.x[i] = m[offset];
  else
    m[offset] = f.x[i];
}

template <typename Frag, typename T, bool kLoad>
void transfer(const char* what, Frag& f, T* p, unsigned ldm, bool row_major) {
  Transfer t{what,
             const_cast<std::remove_const_t<T>*>(p),
             &f,
             ldm,
             row_major,
             sizeof(T),
             &move_element<Frag, std::remove_const_t<T>, kLoad>};
  ::cuda_emu::warp_collective(what, &run_transfer, &t);
}

// One lane's arguments to mma_sync.
struct Product {
  float* d;
  const float* c;
  const void* a;
  const void* b;
  float (*a_at)(const void* frag, int i);
  float (*b_at)(const void* frag, int i);
};

template <typename Frag>
float element(const void* frag, int i) {
  return to_float(static_cast<const Frag*>(frag)->x[i]);
}

inline void run_product(void* const* args) {
  float a[kTile][kTile], b[kTile][kTile], c[kTile][kTile];
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const Product*>(args[l]);
    for (int i = 0; i < 8; ++i) {
      int r = 0, col = 0;
      position(l, i, r, col);
      a[r][col] = p.a_at(p.a, i);
      b[r][col] = p.b_at(p.b, i);
      c[r][col] = p.c[i];
    }
  }
  // Every lane's inputs are gathered before any lane's d (which may be its c) is written.
  for (int l = 0; l < 32; ++l) {
    const auto& p = *static_cast<const Product*>(args[l]);
    for (int i = 0; i < 8; ++i) {
      int r = 0, col = 0;
      position(l, i, r, col);
      float sum = c[r][col];
      for (int k = 0; k < kTile; ++k) sum += a[r][k] * b[k][col];
      p.d[i] = sum;
    }
  }
}

template <typename L>
constexpr bool is_row_major() {
  static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>);
  return std::is_same_v<L, row_major>;
}

}  // namespace detail

template <typename Use, typename T, typename L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  detail::transfer<fragment<Use, 16, 16, 16, T, L>, const T, true>("wmma::load_matrix_sync", f, p,
                                                                   ldm, detail::is_row_major<L>());
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  detail::transfer<fragment<accumulator, 16, 16, 16, float>, const float, true>(
      "wmma::load_matrix_sync", f, p, ldm, layout == mem_row_major);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  auto& frag = const_cast<fragment<accumulator, 16, 16, 16, float>&>(f);
  detail::transfer<fragment<accumulator, 16, 16, 16, float>, float, false>(
      "wmma::store_matrix_sync", frag, p, ldm, layout == mem_row_major);
}

// Not warp-wide on a GPU either in effect, but it must be called by every lane: a plain loop.
template <typename Use, typename T, typename L, typename V>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const V& v) {
  for (T& e : f.x) e = static_cast<T>(v);
}

template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  using A = fragment<matrix_a, 16, 16, 16, T, LA>;
  using B = fragment<matrix_b, 16, 16, 16, T, LB>;
  detail::Product p{d.x, c.x, &a, &b, &detail::element<A>, &detail::element<B>};
  ::cuda_emu::warp_collective("wmma::mma_sync", &detail::run_product, &p);
}

}  // namespace nvcuda::wmma
