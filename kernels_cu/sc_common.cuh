// sc_common.cuh: small helpers shared by the sparsecore kernels.
//
// Included by every kernels_cu/*.cu file. The Python registry inlines this file
// into each source before handing it to NVRTC (so CuPy's on-disk kernel cache,
// which keys on the source text, sees every edit); the CPU emulation build
// compiles that same expanded text. Everything here must compile under NVRTC
// and under g++ with tests/cuda_emulation/cuda_shim.h.
//
// Numerics: kernels avoid a * b + c patterns, so contraction into FMA cannot
// change results, and IEEE division is NVRTC's default; float results match a
// NumPy evaluation in the same order bit for bit, except that CuPy compiles
// with -ftz=true (appended after the caller's options, so it cannot be undone):
// float32 subnormals (below 2^-126) are flushed to zero on the GPU.
#ifndef SPARSECORE_SC_COMMON_CUH
#define SPARSECORE_SC_COMMON_CUH

#ifndef SPARSECORE_CPU_EMULATION
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace sc {

// Most threads a block may have in kernels that keep per-thread scratch in
// static shared memory (rulebook.cu's compaction). Launch with at most this.
constexpr int kMaxBlockThreads = 1024;

// Index of this thread in the whole grid, and the grid's thread count: the
// start and step of every grid-stride loop. int64, so counts x channels may
// exceed 2^31.
__device__ __forceinline__ long long grid_thread_index() {
  return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long grid_thread_count() {
  return static_cast<long long>(gridDim.x) * blockDim.x;
}

// The grid-stride loop over the elements of a [rows, columns] layout:
// body(e, r, c) for element e = r * columns + c, each element by one thread.
template <typename Body>
__device__ __forceinline__ void for_each_element(long long rows, long long columns, Body body) {
  const long long total = rows * columns;
  const long long step = grid_thread_count();
  for (long long e = grid_thread_index(); e < total; e += step) {
    const long long r = e / columns;
    body(e, r, e - r * columns);
  }
}

// The entries of group g of a CSR grouping, in order, padding (-1) skipped:
// body(p, entries[p]) for p in [starts[g], starts[g + 1]) with entries[p] >= 0.
//   entries int32 [P], starts int64 [groups + 1] (non-decreasing).
template <typename Body>
__device__ __forceinline__ void for_each_group_entry(const int* __restrict__ entries,
                                                     const long long* __restrict__ starts, long long g,
                                                     Body body) {
  const long long end = __ldg(starts + g + 1);
  for (long long p = __ldg(starts + g); p < end; ++p) {
    const int entry = __ldg(entries + p);
    if (entry >= 0) {
      body(p, entry);
    }
  }
}

// The sum in Acc, in group order, of term(p, entries[p]) over group g's entries
// that are not padding (see for_each_group_entry); Acc(0) for an empty group.
template <typename Acc, typename Term>
__device__ __forceinline__ Acc group_sum(const int* __restrict__ entries, const long long* __restrict__ starts,
                                         long long g, Term term) {
  Acc acc = Acc(0);
  for_each_group_entry(entries, starts, g, [&](long long p, int entry) { acc += term(p, entry); });
  return acc;
}

// Accumulator type of a storage type: float for float / __half /
// __nv_bfloat16, double for double.
template <typename T>
struct Accumulator {
  using type = float;
};

template <>
struct Accumulator<double> {
  using type = double;
};

// Widening loads: storage type to its accumulator type (exact).
__device__ __forceinline__ float widen(float value) { return value; }
__device__ __forceinline__ double widen(double value) { return value; }
__device__ __forceinline__ float widen(__half value) { return __half2float(value); }
__device__ __forceinline__ float widen(__nv_bfloat16 value) { return __bfloat162float(value); }

// Narrowing stores: accumulator to storage type, rounding to nearest even.
template <typename T>
struct Narrow {
  template <typename Acc>
  __device__ __forceinline__ static T from(Acc value) {
    return static_cast<T>(value);
  }
};

template <>
struct Narrow<__half> {
  __device__ __forceinline__ static __half from(float value) { return __float2half_rn(value); }
};

template <>
struct Narrow<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from(float value) { return __float2bfloat16_rn(value); }
};

template <typename T, typename Acc>
__device__ __forceinline__ T narrow(Acc value) {
  return Narrow<T>::from(value);
}

}  // namespace sc

#endif  // SPARSECORE_SC_COMMON_CUH
