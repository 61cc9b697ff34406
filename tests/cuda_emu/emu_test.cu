// emu_test.cu: the emulator's own checks, written as CUDA and run through rewrite.cpp like
// strata's kernels: that a block's threads meet at barriers and exchange values in shuffles,
// and that what would hang, fault or race on a GPU shows up here instead of passing.
#include "gpu/mma_sync.cuh"

#include <cuda_bf16.h>
#include <gtest/gtest.h>
#include <mma.h>

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

namespace {

__global__ void block_sum(const float* x, float* out, int n) {
  __shared__ float partial[32];
  float v = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v += x[i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) out[blockIdx.x] = v;
  }
}

// Each thread but the first reads its left neighbour's value, with or without the barrier
// between: threads run in index order get it right without one, by luck.
__global__ void left_neighbour(float* out, bool barrier) {
  extern __shared__ float values[];
  values[threadIdx.x] = static_cast<float>(threadIdx.x);
  if (barrier) __syncthreads();
  const unsigned left = threadIdx.x == 0 ? 0 : threadIdx.x - 1;
  out[blockIdx.x * blockDim.x + threadIdx.x] = values[left];
}

// out[t] = the value lane t reads with __shfl_xor_sync(mask 16) in groups of 16 lanes.
__global__ void xor_in_groups_of_16(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<float>(threadIdx.x), 16, 16);
}

// Lanes past `live` return at once; the others broadcast lane 0's value under a full mask.
__global__ void broadcast_after_some_exit(float* out, unsigned live) {
  if (threadIdx.x >= live) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, 100.0f + static_cast<float>(threadIdx.x), 0);
}

// Only block 0 writes its static shared variable; every block reads it.
__global__ void written_in_block_zero_only(float* out) {
  __shared__ float value[1];
  if (blockIdx.x == 0 && threadIdx.x == 0) value[0] = 42.0f;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = value[0];
}

/* The rewrites leave comments and literals alone: a block comment that speaks of a launch,
   kernel<<<grid, block>>> and then its arguments, or of a __shared__ array, is not code (the
   rewriter used to stop at the first of these: "no argument list after kernel"). */
const char* const kLooksLikeALaunch = "copy<<<1, 1>>>(p); __shared__ float s[2];";
const char kQuote = '"';
constexpr int kSeparated = 1'000;  // digit separators, not character literals
constexpr unsigned kHexSeparated = 0xff'ff;

// Half of the block waits at a barrier the other half never reaches.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  }
}

using namespace nvcuda;

// c[16 x 32] = a[16 x 32] . b[32 x 32], a row-major, b row- or column-major (ld 40 and 48
// elements), through two accumulators; then each row r of c is scaled by r + 1 through the
// accumulators' elements, finding each element's row from a fragment loaded from a matrix of
// row numbers (what a kernel may do without knowing the GPU's layout); stored row-major to c,
// column-major to ct.
__global__ void wmma_product(float* c, float* ct, const __nv_bfloat16* a, const __nv_bfloat16* b,
                             bool b_row_major, float* rows) {
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2], row_of;
  for (int n = 0; n < 2; ++n) wmma::fill_fragment(acc[n], 0.0f);
  for (int k = 0; k < 2; ++k) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + 16 * k, 40);
    for (int n = 0; n < 2; ++n) {
      if (b_row_major) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, b + 16 * k * 48 + 16 * n, 48);
        wmma::mma_sync(acc[n], fa, fb, acc[n]);
      } else {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, b + 16 * n * 48 + 16 * k, 48);
        wmma::mma_sync(acc[n], fa, fb, acc[n]);
      }
    }
  }
  for (int i = threadIdx.x; i < 256; i += 32) rows[i] = static_cast<float>(i / 16);
  __syncwarp();
  wmma::load_matrix_sync(row_of, rows, 16, wmma::mem_row_major);
  for (int n = 0; n < 2; ++n) {
    for (int i = 0; i < acc[n].num_elements; ++i) acc[n].x[i] *= row_of.x[i] + 1.0f;
    wmma::store_matrix_sync(c + 16 * n, acc[n], 32, wmma::mem_row_major);
    wmma::store_matrix_sync(ct + 16 * n * 16, acc[n], 16, wmma::mem_col_major);
  }
}

// What a GPU leaves undefined, each a fault here: kind 0 a pointer that is not 32-byte aligned,
// 1 half the warp in the product, 2 lanes loading from different rows.
__global__ void wmma_misuse(float* c, const __nv_bfloat16* a, int kind) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  const unsigned lane = threadIdx.x % 32;
  wmma::load_matrix_sync(fa, a + (kind == 0 ? 8 : kind == 2 ? 16 * (lane % 2) : 0), 16);
  wmma::load_matrix_sync(fb, a, 16);
  if (kind != 1 || lane < 16) wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// mma_sync.cuh's fragment loaders and product against the PTX ISA's layouts, written out here
// once more from its tables: a (16 x 16) and b (16 x 16, k x n), both row-major in global
// memory, staged in shared memory with a padded stride; b also transposed (n x k). d (16 x 16)
// = a . b from two m16n8k16 products, stored by the C layout. bad[lane] counts the registers
// that differ from the tables' (ldmatrix of a, of b, and of b^T).
__global__ void ptx_product(float* d, int* bad, const __nv_bfloat16* a, const __nv_bfloat16* b) {
  constexpr int ld = 24;
  extern __shared__ __nv_bfloat16 tiles[];  // 3 x 16 x ld, 16-byte aligned rows
  __nv_bfloat16* sa = tiles;
  __nv_bfloat16* sb = sa + 16 * ld;
  __nv_bfloat16* sbt = sb + 16 * ld;
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  for (int i = lane; i < 256; i += 32) {
    sa[(i / 16) * ld + i % 16] = a[i];
    sb[(i / 16) * ld + i % 16] = b[i];
    sbt[(i % 16) * ld + i / 16] = b[i];
  }
  __syncwarp();
  auto bits = [](__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return static_cast<uint32_t>(lo.x) | static_cast<uint32_t>(hi.x) << 16;
  };
  uint32_t fa[4], fb[4], fbt[4];
  strata::gpu::load_a(fa, sa, ld, 0, 0, lane);
  strata::gpu::load_b(fb, sb, ld, 0, 0, lane);
  strata::gpu::load_b_transposed(fbt, sbt, ld, 0, 0, lane);
  int wrong = 0;
  for (int r = 0; r < 4; ++r) {
    // A: register r holds row g + 8 (r % 2), columns 2t + 8 (r / 2) and the next.
    const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
    wrong += fa[r] != bits(a[row * 16 + col], a[row * 16 + col + 1]);
    // B of n-tile r / 2: register r % 2 holds rows k = 2t + 8 (r % 2) and the next, column g.
    const int k = 2 * t + 8 * (r % 2), n = g + 8 * (r / 2);
    const uint32_t want_b = bits(b[k * 16 + n], b[(k + 1) * 16 + n]);
    wrong += (fb[r] != want_b) + (fbt[r] != want_b);
  }
  bad[lane] = wrong;
  float acc[2][4] = {};
  strata::gpu::mma_16816(acc[0], fa, fb[0], fb[1]);
  strata::gpu::mma_16816(acc[1], fa, fb[2], fb[3]);
  for (int n = 0; n < 2; ++n)
    for (int r = 0; r < 4; ++r) d[(g + 8 * (r / 2)) * 16 + 8 * n + 2 * t + r % 2] = acc[n][r];
}

class CudaEmu : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override { (void)cudaStreamDestroy(stream_); }
  float* device_floats(size_t n) {
    float* p = nullptr;
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)), cudaSuccess);
    allocations_.push_back(p);
    return p;
  }
  std::vector<float> fetch(const float* p, size_t n) {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpyAsync(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return h;
  }
  ~CudaEmu() override {
    for (float* p : allocations_) (void)cudaFree(p);
  }
  cudaStream_t stream_ = nullptr;
  std::vector<float*> allocations_;
};

TEST_F(CudaEmu, BarriersAndShufflesGiveABlockReduction) {
  const int n = 100000, blocks = 7;
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i % 10);
  float* dx = device_floats(n);
  float* out = device_floats(blocks);
  ASSERT_EQ(cudaMemcpyAsync(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
  block_sum<<<blocks, 256, 0, stream_>>>(dx, out, n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  double total = 0;
  for (float v : fetch(out, blocks)) total += v;
  EXPECT_EQ(total, 450000.0);
}

TEST_F(CudaEmu, AMissingBarrierGivesWrongValuesInSomeBlock) {
  const unsigned threads = 64, blocks = 2;
  float* out = device_floats(threads * blocks);
  for (const bool barrier : {true, false}) {
    left_neighbour<<<blocks, threads, threads * sizeof(float), stream_>>>(out, barrier);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<float> got = fetch(out, threads * blocks);
    int wrong = 0;
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        wrong += !(got[b * threads + t] == static_cast<float>(t == 0 ? 0 : t - 1));
    if (barrier)
      EXPECT_EQ(wrong, 0);
    else
      EXPECT_GT(wrong, 0) << "threads ran in an order that hid the missing barrier";
  }
}

// CUDA's rules: with width 16, lane ^ 16 is an earlier group's lane for lanes 16-31 (read) and
// past the group's end for lanes 0-15 (their own value back); lanes that have exited may be
// named in the mask; a block of 16 threads shuffles in its half warp.
TEST_F(CudaEmu, ShufflesFollowCudasRulesForWidthsAndExitedLanes) {
  float* out = device_floats(32);
  xor_in_groups_of_16<<<1, 32, 0, stream_>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> got = fetch(out, 32);
  for (int t = 0; t < 32; ++t)
    EXPECT_EQ(got[size_t(t)], static_cast<float>(t < 16 ? t : t - 16)) << "lane " << t;
  xor_in_groups_of_16<<<1, 16, 0, stream_>>>(out);
  got = fetch(out, 16);
  for (int t = 0; t < 16; ++t) EXPECT_EQ(got[size_t(t)], static_cast<float>(t)) << "lane " << t;
  broadcast_after_some_exit<<<1, 32, 0, stream_>>>(out, 8);
  got = fetch(out, 8);
  for (int t = 0; t < 8; ++t) EXPECT_EQ(got[size_t(t)], 100.0f) << "lane " << t;
}

// Shared memory is the block's own: a block that reads a static __shared__ variable nobody in
// it wrote gets NaN, not what the previous block left there.
TEST_F(CudaEmu, StaticSharedMemoryStartsAsNaNInEveryBlock) {
  float* out = device_floats(3);
  written_in_block_zero_only<<<3, 32, 0, stream_>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> got = fetch(out, 3);
  EXPECT_EQ(got[0], 42.0f);
  EXPECT_TRUE(std::isnan(got[1]) && std::isnan(got[2])) << got[1] << " " << got[2];
}

TEST_F(CudaEmu, RewritesLeaveCommentsAndLiteralsAlone) {
  EXPECT_EQ(std::string(kLooksLikeALaunch),
            std::string("copy<") + "<<1, 1>>" + ">(p); __sha" + "red__ float s[2];");
  EXPECT_EQ(kQuote, '\x22');
  EXPECT_EQ(kSeparated, 1000);
  EXPECT_EQ(kHexSeparated, 65535u);
}

TEST_F(CudaEmu, LaunchesAGpuWouldRefuseAreRefused) {
  float* out = device_floats(4096);
  left_neighbour<<<1, 2048, 0, stream_>>>(out, true);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  left_neighbour<<<1, 64, 64 * 1024, stream_>>>(out, true);  // over 48 KiB, no attribute set
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(
      cudaFuncSetAttribute(left_neighbour, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
      cudaSuccess);
  left_neighbour<<<1, 64, 64 * 1024, stream_>>>(out, true);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

TEST_F(CudaEmu, WmmaProductsMatchALoopInAnyLayout) {
  // Integer-valued inputs: every product and sum is exact in f32, whatever the order.
  std::vector<__nv_bfloat16> a(16 * 40), b(32 * 48);
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = __float2bfloat16_rn(static_cast<float>(static_cast<int>(i * 7 % 11) - 5));
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = __float2bfloat16_rn(static_cast<float>(static_cast<int>(i * 5 % 13) - 6));
  __nv_bfloat16 *da = nullptr, *db = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&da), a.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&db), b.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  float* c = device_floats(16 * 32);
  float* ct = device_floats(32 * 16);
  float* rows = device_floats(256);
  for (const bool b_row_major : {true, false}) {
    wmma_product<<<1, 32, 0, stream_>>>(c, ct, da, db, b_row_major, rows);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<float> got = fetch(c, 16 * 32), got_t = fetch(ct, 32 * 16);
    int wrong = 0;
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 32; ++n) {
        float want = 0.0f;
        for (int k = 0; k < 32; ++k) {
          const size_t bi = b_row_major ? size_t(k) * 48 + size_t(n) : size_t(n) * 48 + size_t(k);
          want += __bfloat162float(a[size_t(r) * 40 + size_t(k)]) * __bfloat162float(b[bi]);
        }
        want *= static_cast<float>(r + 1);
        const size_t tile = size_t(n) / 16, col = size_t(n) % 16;
        wrong += got[size_t(r) * 32 + size_t(n)] != want;
        wrong += got_t[tile * 256 + col * 16 + size_t(r)] != want;
      }
    EXPECT_EQ(wrong, 0) << (b_row_major ? "b row-major" : "b column-major");
  }
  (void)cudaFree(da);
  (void)cudaFree(db);
}

TEST_F(CudaEmu, PtxFragmentsFollowTheDocumentedLayouts) {
  // Integer-valued inputs: every product and sum is exact in f32, whatever the order.
  std::vector<__nv_bfloat16> a(256), b(256);
  for (size_t i = 0; i < 256; ++i) {
    a[i] = __float2bfloat16_rn(static_cast<float>(static_cast<int>(i * 7 % 11) - 5));
    b[i] = __float2bfloat16_rn(static_cast<float>(static_cast<int>(i * 5 % 13) - 6));
  }
  __nv_bfloat16 *da = nullptr, *db = nullptr;
  int* bad = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&da), 512), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&db), 512), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&bad), 32 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(da, a.data(), 512, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db, b.data(), 512, cudaMemcpyHostToDevice), cudaSuccess);
  float* d = device_floats(256);
  ptx_product<<<1, 32, 3 * 16 * 24 * 2, stream_>>>(d, bad, da, db);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> got = fetch(d, 256);
  std::vector<int> wrong_registers(32);
  ASSERT_EQ(cudaMemcpy(wrong_registers.data(), bad, 32 * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int l = 0; l < 32; ++l) EXPECT_EQ(wrong_registers[size_t(l)], 0) << "lane " << l;
  int wrong = 0;
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      float want = 0.0f;
      for (int k = 0; k < 16; ++k)
        want += __bfloat162float(a[size_t(r * 16 + k)]) * __bfloat162float(b[size_t(k * 16 + n)]);
      wrong += got[size_t(r * 16 + n)] != want;
    }
  EXPECT_EQ(wrong, 0);
  (void)cudaFree(da);
  (void)cudaFree(db);
  (void)cudaFree(bad);
}

// Each misuse in a child process: the fault is sticky for the rest of the process.
TEST_F(CudaEmu, WmmaMisuseIsAFaultNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* const expected[] = {"not 32-byte aligned", "different warp-wide operations",
                                  "pointer, stride or layout differs"};
  for (int kind = 0; kind < 3; ++kind)
    EXPECT_EXIT(
        {
          __nv_bfloat16* da = nullptr;
          float* dc = nullptr;
          (void)cudaMalloc(reinterpret_cast<void**>(&da), 1024 * 2);
          (void)cudaMalloc(reinterpret_cast<void**>(&dc), 256 * 4);
          const std::vector<__nv_bfloat16> zeros(1024, __float2bfloat16_rn(0.0f));
          (void)cudaMemcpy(da, zeros.data(), 1024 * 2, cudaMemcpyHostToDevice);
          wmma_misuse<<<1, 64>>>(dc, da, kind);
          std::exit(cudaDeviceSynchronize() == cudaErrorLaunchFailure ? 3 : 4);
        },
        ::testing::ExitedWithCode(3), expected[kind]);
}

// Last: the fault is sticky for the rest of the process, as on a GPU.
TEST_F(CudaEmu, ZZABarrierNotEveryThreadReachesIsAStickyFault) {
  float* out = device_floats(32);
  // The stream holds the kernel back until the launch has been checked: otherwise the fault
  // can already be sticky when cudaGetLastError asks (it was in about half the runs here).
  std::atomic<bool> checked{false};
  ASSERT_EQ(cudaLaunchHostFunc(
                stream_,
                [](void* flag) {
                  while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
                },
                &checked),
            cudaSuccess);
  divergent_barrier<<<1, 32, 0, stream_>>>(out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the launch itself is fine
  checked = true;
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
}

}  // namespace
