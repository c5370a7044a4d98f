// cuda_shim.h: just enough of CUDA, in standard C++20, for g++ to compile the
// very same kernels_cu/*.cu sources for the CPU (force-included with -include).
//
// Execution model of a launch (sc_emu::launch): blocks run one after another;
// the threads of a block run concurrently as std::threads, with a std::barrier
// for __syncthreads(). Because only one block runs at a time, `__shared__`
// can be a function-local static. Atomics go through std::atomic_ref.
// __half and __nv_bfloat16 are 16-bit storage types with round-to-nearest-even
// conversions, as on the GPU. Only what the kernels use is here.
#ifndef SPARSECORE_CUDA_SHIM_H
#define SPARSECORE_CUDA_SHIM_H

#define SPARSECORE_CPU_EMULATION 1

#include <math.h>  // floor(float) and friends in the global namespace

#include <atomic>
#include <barrier>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
// __restrict__ is understood by g++ as it is.

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace sc_emu {
inline thread_local std::barrier<>* block_barrier = nullptr;
}  // namespace sc_emu

inline void __syncthreads() { sc_emu::block_barrier->arrive_and_wait(); }

template <typename T>
inline T __ldg(const T* address) { return *address; }

// ---- atomics (return the old value, like CUDA's) ----
template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;
}
template <typename T>
inline T atomicAdd(T* address, T value) { return std::atomic_ref<T>(*address).fetch_add(value); }
template <typename T>
inline T atomicExch(T* address, T value) { return std::atomic_ref<T>(*address).exchange(value); }
template <typename T>
inline T atomicMin(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (value < old && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}
template <typename T>
inline T atomicMax(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (value > old && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}

// ---- 16-bit floating types ----
struct __half {
  unsigned short bits;
};
struct __nv_bfloat16 {
  unsigned short bits;
};

namespace sc_emu {
inline unsigned int float_bits(float value) {
  unsigned int bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
inline float bits_float(unsigned int bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
// Rounds `magnitude >> shift` to nearest, ties to even.
inline unsigned int shift_round_even(unsigned int magnitude, int shift) {
  const unsigned int kept = magnitude >> shift;
  const unsigned int rest = magnitude & ((1u << shift) - 1u);
  const unsigned int half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}
}  // namespace sc_emu

inline float __half2float(__half value) {
  const unsigned int sign = (value.bits & 0x8000u) << 16;
  const unsigned int exponent = (value.bits >> 10) & 0x1fu;
  const unsigned int mantissa = value.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    return sc_emu::bits_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return sc_emu::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline __half __float2half_rn(float value) {
  const unsigned int bits = sc_emu::float_bits(value);
  const unsigned short sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const unsigned int magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return __half{static_cast<unsigned short>(sign | 0x7e00u)};
  const int exponent = static_cast<int>(magnitude >> 23) - 127 + 15;
  if (exponent >= 31) return __half{static_cast<unsigned short>(sign | 0x7c00u)};
  if (exponent <= 0) {  // half subnormal (or zero), in units of 2^-24
    if (exponent < -10) return __half{sign};
    const unsigned int significand = (magnitude & 0x7fffffu) | 0x800000u;
    return __half{static_cast<unsigned short>(sign | sc_emu::shift_round_even(significand, 14 - exponent))};
  }
  const unsigned int normal = (static_cast<unsigned int>(exponent) << 23) | (magnitude & 0x7fffffu);
  return __half{static_cast<unsigned short>(sign | sc_emu::shift_round_even(normal, 13))};
}
inline __half __float2half(float value) { return __float2half_rn(value); }

inline float __bfloat162float(__nv_bfloat16 value) {
  return sc_emu::bits_float(static_cast<unsigned int>(value.bits) << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float value) {
  const unsigned int bits = sc_emu::float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return __nv_bfloat16{static_cast<unsigned short>((bits >> 16) | 0x40u)};
  }
  return __nv_bfloat16{static_cast<unsigned short>(sc_emu::shift_round_even(bits, 16))};
}
inline __nv_bfloat16 __float2bfloat16(float value) { return __float2bfloat16_rn(value); }

// ---- int8 dot products and correctly rounded float32 arithmetic (int8.cu) ----
// __dp4a: the four signed byte products of a and b, summed into c (int32, wrapping).
inline int __dp4a(int a, int b, int c) {
  unsigned int sum = static_cast<unsigned int>(c);
  for (int lane = 0; lane < 4; ++lane) {
    const int x = static_cast<signed char>((a >> (8 * lane)) & 0xff);
    const int y = static_cast<signed char>((b >> (8 * lane)) & 0xff);
    sum += static_cast<unsigned int>(x * y);
  }
  return static_cast<int>(sum);
}
// Each rounds once to nearest even, as on the GPU (g++ in ISO C++ mode never
// contracts them into an FMA).
inline float __int2float_rn(int value) { return static_cast<float>(value); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

// ---- launching ----
namespace sc_emu {

inline std::mutex launch_mutex;

template <typename... Params, std::size_t... I>
void call_with(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

// Runs kernel<<<grid, block>>>(args...), args as in cudaLaunchKernel: args[i]
// points at the value of parameter i. Returns 0, or 1 for a bad configuration.
template <typename... Params>
int launch(void (*kernel)(Params...), unsigned int grid, unsigned int block, void** args) {
  if (grid == 0 || block == 0 || block > 1024) return 1;
  std::lock_guard<std::mutex> lock(launch_mutex);
  for (unsigned int b = 0; b < grid; ++b) {
    std::barrier<> barrier(block);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned int t = 0; t < block; ++t) {
      threads.emplace_back([&, b, t] {
        threadIdx = dim3{t, 1, 1};
        blockIdx = dim3{b, 1, 1};
        blockDim = dim3{block, 1, 1};
        gridDim = dim3{grid, 1, 1};
        block_barrier = &barrier;
        call_with(kernel, args, std::index_sequence_for<Params...>{});
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  return 0;
}

// One code per type: kind letter (f float, i signed, u unsigned, h __half,
// b __nv_bfloat16) and size in bytes.
template <typename T>
std::string type_code() {
  char kind = '?';
  if constexpr (std::is_same_v<T, __half>) kind = 'h';
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) kind = 'b';
  else if constexpr (std::is_floating_point_v<T>) kind = 'f';
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) kind = 'i';
  else if constexpr (std::is_integral_v<T>) kind = 'u';
  return std::string(1, kind) + std::to_string(sizeof(T));
}

// The parameter list of a kernel, e.g. "p:f4,p:i4,s:i8" (p pointer, s scalar).
template <typename... Params>
const char* signature(void (*)(Params...)) {
  static const std::string text = [] {
    std::string joined;
    ((joined += (joined.empty() ? "" : ","),
      joined += std::is_pointer_v<Params>
                    ? "p:" + type_code<std::remove_cv_t<std::remove_pointer_t<Params>>>()
                    : "s:" + type_code<std::remove_cv_t<Params>>()),
     ...);
    return joined;
  }();
  return text.c_str();
}

}  // namespace sc_emu

#endif  // SPARSECORE_CUDA_SHIM_H
