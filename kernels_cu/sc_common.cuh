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
