// cuda_shim.h: just enough of CUDA, in standard C++20, for g++ to compile the
// very same kernels_cu/*.cu sources for the CPU (force-included with -include).
//
// Execution model of a launch (sc_emu::launch): blocks run one after another;
// the threads of a block run concurrently as std::threads, with a barrier for
// __syncthreads() and one per warp (32 consecutive threads) for __syncwarp()
// and the warp collectives. Because only one block runs at a time, `__shared__`
// can be a function-local static. Atomics go through std::atomic_ref.
// __half and __nv_bfloat16 are 16-bit storage types with round-to-nearest-even
// conversions, as on the GPU. Only what the kernels use is here.
//
// Hangs fail instead of hanging: a barrier notices when a thread of its block
// (or warp) has exited while others wait at it, or arrive later (a
// __syncthreads() in a branch not every thread takes), and every wait has the
// launch's deadline (sc_emu::set_timeout_seconds) as a backstop; the launch
// then stops with status 4 (deadlock) or 5 (timeout) and a message
// (sc_emu::failure_message). __trap() stops it with status 6.
//
// Tensor cores: nvcuda::wmma (fragment, fill_fragment, load_matrix_sync,
// mma_sync, store_matrix_sync, precision::tf32, __float_to_tf32) with every
// lane of a warp holding the whole tile. fill, load and mma are full-tile
// operations each lane does on its own copy (reads only); store is a warp
// collective: the warp meets at its barrier, lane 0 writes, the warp meets
// again (which also makes the store visible, as __syncwarp would). Loops over
// frag.x[i] keep their meaning, since CUDA leaves the lane mapping of
// elements unspecified. mma_sync sums in float, k in order, each product of
// 16-bit (or TF32) values exact. mma.sync m16n8k8 TF32 and m16n8k16 float16 / bfloat16
// (sc_emu::mma_m16n8k8_tf32, mma_m16n8k16) and ldmatrix (sc_emu::ldmatrix): warp
// collectives on the PTX fragments, each lane holding its own registers.
#ifndef SPARSECORE_CUDA_SHIM_H
#define SPARSECORE_CUDA_SHIM_H

#define SPARSECORE_CPU_EMULATION 1

#include <math.h>  // floor(float) and friends in the global namespace

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
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
#define __align__(bytes) __attribute__((aligned(bytes)))
// __restrict__ is understood by g++ as it is.

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace sc_emu {

// Statuses of a failed launch (0 is success, 1 a bad configuration; guarded_launch.h adds 2 and 3).
constexpr int kStatusDeadlock = 4;
constexpr int kStatusTimeout = 5;
constexpr int kStatusTrap = 6;

// Thrown inside a kernel thread to stop it; caught where the thread starts.
struct LaunchFailure {
  int status;
  std::string message;
};

// How long a launch may take before a waiting barrier gives up (seconds).
inline std::atomic<double> timeout_seconds{600.0};
inline void set_timeout_seconds(double seconds) { timeout_seconds.store(seconds); }

// The failure of the current launch: its first status and message.
struct FailureRecord {
  std::mutex mutex;
  int status = 0;
  std::string message;
};
inline FailureRecord failure;
inline const std::string& failure_message() { return failure.message; }
inline void record_failure(int status, const std::string& message) {
  std::lock_guard<std::mutex> lock(failure.mutex);
  if (failure.status == 0) {
    failure.status = status;
    failure.message = message;
  }
}

class BlockState;

// A barrier of `expected` threads (a block or a warp) that fails instead of hanging.
class Barrier {
 public:
  Barrier(int expected, std::string name, BlockState* block) : expected_(expected), name_(std::move(name)), block_(block) {}
  void arrive_and_wait();
  // The calling thread returned from the kernel (or stopped): later waits can never complete.
  void thread_exited();
  // Wakes every waiter with `status` (another barrier of the block failed).
  void fail(int status) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_ == 0) broken_ = status;
    released_.notify_all();
  }

 private:
  [[noreturn]] void stop(int status, const std::string& message);
  std::mutex mutex_;
  std::condition_variable released_;
  int expected_;
  int arrived_ = 0;
  int exited_ = 0;
  int broken_ = 0;
  long long generation_ = 0;
  std::string name_;
  BlockState* block_;
};

// The barriers of the block being run, and its deadline.
class BlockState {
 public:
  BlockState(unsigned int block, unsigned int block_index, std::chrono::steady_clock::time_point deadline)
      : deadline(deadline), block_index(block_index), block_barrier(static_cast<int>(block), "__syncthreads()", this) {
    for (unsigned int first = 0; first < block; first += 32) {
      const unsigned int lanes = block - first < 32 ? block - first : 32;
      warp_barriers.push_back(std::make_unique<Barrier>(
          static_cast<int>(lanes), "the barrier of warp " + std::to_string(first / 32) + " (__syncwarp, wmma store)",
          this));
    }
  }
  void fail_all(int status) {
    block_barrier.fail(status);
    for (auto& warp : warp_barriers) warp->fail(status);
  }
  std::chrono::steady_clock::time_point deadline;
  unsigned int block_index;
  Barrier block_barrier;
  std::vector<std::unique_ptr<Barrier>> warp_barriers;
};

inline void Barrier::stop(int status, const std::string& message) {
  record_failure(status, message);
  block_->fail_all(status);
  throw LaunchFailure{status, message};
}

inline void Barrier::arrive_and_wait() {
  std::string message;
  int status = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (broken_ != 0) throw LaunchFailure{broken_, "stopped: another thread of the block failed"};
    if (exited_ > 0) {
      status = kStatusDeadlock;
      message = name_ + " in block " + std::to_string(block_->block_index) + ": a thread waits at it after " +
                std::to_string(exited_) + " of its " + std::to_string(expected_) +
                " threads returned from the kernel: a barrier in a branch not every thread takes";
    } else {
      const long long generation = generation_;
      if (++arrived_ == expected_) {
        arrived_ = 0;
        ++generation_;
        released_.notify_all();
        return;
      }
      while (generation == generation_ && broken_ == 0) {
        if (released_.wait_until(lock, block_->deadline) == std::cv_status::timeout && generation == generation_ &&
            broken_ == 0) {
          status = kStatusTimeout;
          message = name_ + " in block " + std::to_string(block_->block_index) + ": " + std::to_string(arrived_) +
                    " of its " + std::to_string(expected_) +
                    " threads still waited when the launch's time ran out (a barrier some threads never reach)";
          break;
        }
      }
      if (status == 0 && generation == generation_) {
        throw LaunchFailure{broken_, "stopped: another thread of the block failed"};
      }
      if (status == 0) return;
    }
  }
  stop(status, message);
}

inline void Barrier::thread_exited() {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++exited_;
    if (arrived_ == 0 || broken_ != 0) return;
    message = name_ + " in block " + std::to_string(block_->block_index) + ": a thread returned from the kernel while " +
              std::to_string(arrived_) + " of its " + std::to_string(expected_) +
              " threads waited at it: a barrier in a branch not every thread takes";
  }
  record_failure(kStatusDeadlock, message);
  block_->fail_all(kStatusDeadlock);
}

inline thread_local Barrier* block_barrier = nullptr;
inline thread_local Barrier* warp_barrier = nullptr;

}  // namespace sc_emu

inline void __syncthreads() { sc_emu::block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { sc_emu::warp_barrier->arrive_and_wait(); }
// Only one block runs at a time and every thread of it is a std::thread: the
// mutex and joins already order memory between blocks; within a block, a
// sequentially consistent fence.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
namespace sc_emu {
// __trap() with a message naming the cause (the shims' own checks of the kernels).
[[noreturn]] inline void trap_with(const std::string& message) {
  record_failure(kStatusTrap, message);
  throw LaunchFailure{kStatusTrap, message};
}
}  // namespace sc_emu
[[noreturn]] inline void __trap() { sc_emu::trap_with("__trap() was called"); }

template <typename T>
inline T __ldg(const T* address) { return *address; }
template <typename T>
inline T __ldcg(const T* address) { return *address; }

inline int __ffs(int value) { return __builtin_ffs(value); }
inline int __ffs(unsigned int value) { return __builtin_ffs(static_cast<int>(value)); }
inline int __popc(unsigned int value) { return __builtin_popcount(value); }

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
inline T atomicOr(T* address, T value) { return std::atomic_ref<T>(*address).fetch_or(value); }
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

// ---- tensor cores: nvcuda::wmma, every lane holding the whole tile (see the top of this file) ----
namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}  // namespace precision

namespace detail {
template <typename T>
struct element_of {
  using type = T;
};
template <>
struct element_of<precision::tf32> {
  using type = float;
};
inline float as_float(float value) { return value; }
inline float as_float(__half value) { return __half2float(value); }
inline float as_float(__nv_bfloat16 value) { return __bfloat162float(value); }
template <typename Use, int M, int N, int K>
struct extent {  // accumulator: M x N
  static constexpr int rows = M;
  static constexpr int cols = N;
};
template <int M, int N, int K>
struct extent<matrix_a, M, N, K> {
  static constexpr int rows = M;
  static constexpr int cols = K;
};
template <int M, int N, int K>
struct extent<matrix_b, M, N, K> {
  static constexpr int rows = K;
  static constexpr int cols = N;
};
}  // namespace detail

// x holds the whole rows x cols tile, row-major, in every lane.
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  using element_type = typename detail::element_of<T>::type;
  static constexpr int rows = detail::extent<Use, M, N, K>::rows;
  static constexpr int cols = detail::extent<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  element_type x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& frag,
                          const typename fragment<Use, M, N, K, T, Layout>::element_type& value) {
  for (int i = 0; i < frag.num_elements; ++i) frag.x[i] = value;
}

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& frag,
                             const typename fragment<Use, M, N, K, T, Layout>::element_type* pointer,
                             unsigned int ldm) {
  static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>,
                "matrix_a / matrix_b fragments have a row_major or col_major layout");
  for (int r = 0; r < frag.rows; ++r) {
    for (int c = 0; c < frag.cols; ++c) {
      frag.x[r * frag.cols + c] = std::is_same_v<Layout, row_major> ? pointer[r * ldm + c] : pointer[c * ldm + r];
    }
  }
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& frag, const T* pointer, unsigned int ldm,
                             layout_t layout) {
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      frag.x[r * N + c] = layout == mem_row_major ? pointer[r * ldm + c] : pointer[c * ldm + r];
    }
  }
}

// A warp collective: the warp meets, lane 0 writes the tile, the warp meets again.
template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* pointer, const fragment<accumulator, M, N, K, T>& frag, unsigned int ldm,
                              layout_t layout) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    for (int r = 0; r < M; ++r) {
      for (int c = 0; c < N; ++c) {
        (layout == mem_row_major ? pointer[r * ldm + c] : pointer[c * ldm + r]) = frag.x[r * N + c];
      }
    }
  }
  __syncwarp();
}

// d = a b + c in float: per element, c plus the products in k order.
template <int M, int N, int K, typename TA, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TA, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  float result[M * N];
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = c.x[i * N + j];
      for (int k = 0; k < K; ++k) {
        sum += detail::as_float(a.x[i * K + k]) * detail::as_float(b.x[k * N + j]);
      }
      result[i * N + j] = sum;
    }
  }
  for (int e = 0; e < M * N; ++e) d.x[e] = result[e];
}

// cvt.rna.tf32.f32: 10 fraction bits kept, rounded to nearest, ties away from zero.
inline float __float_to_tf32(float value) {
  const unsigned int bits = sc_emu::float_bits(value);
  if ((bits & 0x7f800000u) == 0x7f800000u) return value;  // inf and NaN stay
  return sc_emu::bits_float((bits + 0x1000u) & 0xffffe000u);
}

}  // namespace wmma
}  // namespace nvcuda

// ---- mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (PTX), a warp collective ----
// Lane l = 4 g + t of the warp holds a[4] (A, 16 x 8: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
// a3 (g + 8, t + 4)), b[2] (B, 8 x 8: b0 (t, g), b1 (t + 4, g)), each a TF32 value in a 32-bit
// register, and d[4] (D = A B + D, 16 x 8: d0 (g, 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8,
// 2t + 1)). The lanes publish their operands, meet, each computes its own d (in float, k in
// order, every TF32 product exact, as mma_sync above), and meet again before the exchange is
// reused. An operand with any of its 13 low bits set (not rounded to TF32) stops the launch
// with status 6, as would a lane missing from the warp (the barrier's deadlock check).
namespace sc_emu {
struct MmaExchange {
  unsigned int a[32][4];
  unsigned int b[32][2];
};

// The warp's registers of one mma: each lane stores its own, then the warp meets. Returns the
// warp's exchange (one per warp of the running block; one block runs at a time).
inline const MmaExchange& publish_operands(const unsigned int (&a)[4], const unsigned int (&b)[2]) {
  static MmaExchange exchanges[32];
  MmaExchange& exchange = exchanges[threadIdx.x / 32];
  for (int e = 0; e < 4; ++e) exchange.a[threadIdx.x % 32][e] = a[e];
  for (int e = 0; e < 2; ++e) exchange.b[threadIdx.x % 32][e] = b[e];
  __syncwarp();
  return exchange;
}

// d += left right for this lane's four accumulators of the 16 x 8 result (d0 (g, 2t), d1 (g, 2t + 1),
// d2 (g + 8, 2t), d3 (g + 8, 2t + 1)), in float, k in order; then the warp meets (the exchange is free).
template <int K>
inline void accumulate_lane(float (&d)[4], const float (&left)[16][K], const float (&right)[K][8]) {
  const int g = static_cast<int>(threadIdx.x % 32 / 4);
  const int t = static_cast<int>(threadIdx.x % 4);
  for (int e = 0; e < 4; ++e) {
    float sum = d[e];
    for (int k = 0; k < K; ++k) sum += left[g + 8 * (e / 2)][k] * right[k][2 * t + e % 2];
    d[e] = sum;
  }
  __syncwarp();
}

// Both mma shapes share one fragment layout, scaled by the P elements a 32-bit register holds (P = 1
// for TF32, 2 for the 16-bit types, the lower column in the low half): lane 4 g + t holds A's
// (g, P t + h), (g + 8, P t + h), (g, P t + 4 P + h), (g + 8, P t + 4 P + h) in a0..a3 and B's
// (P t + h, g), (P t + 4 P + h, g) in b0, b1 (h < P), K = 8 P. decode(bits) gives an element's value.
template <int kPerRegister, typename Decode>
inline void multiply_fragments(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2],
                               Decode decode) {
  constexpr int K = 8 * kPerRegister;
  constexpr int kBits = 32 / kPerRegister;
  constexpr unsigned int kMask = kPerRegister == 1 ? 0xffffffffu : (1u << kBits) - 1u;
  const MmaExchange& exchange = publish_operands(a, b);
  float left[16][K];
  float right[K][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4;
    const int t = l % 4;
    for (int h = 0; h < kPerRegister; ++h) {
      const int near = kPerRegister * t + h;
      const int far = near + 4 * kPerRegister;
      const auto element = [&](unsigned int bits) { return decode(bits >> (kBits * h) & kMask); };
      left[g][near] = element(exchange.a[l][0]);
      left[g + 8][near] = element(exchange.a[l][1]);
      left[g][far] = element(exchange.a[l][2]);
      left[g + 8][far] = element(exchange.a[l][3]);
      right[near][g] = element(exchange.b[l][0]);
      right[far][g] = element(exchange.b[l][1]);
    }
  }
  accumulate_lane(d, left, right);
}

inline void mma_m16n8k8_tf32(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
  for (unsigned int value : {a[0], a[1], a[2], a[3], b[0], b[1]}) {
    if ((value & 0x1fffu) != 0u) trap_with("mma.sync TF32: an operand not rounded to TF32 (cvt.rna.tf32.f32)");
  }
  multiply_fragments<1>(d, a, b, [](unsigned int bits) { return bits_float(bits); });
}

// ---- ldmatrix.sync.aligned.m8n8.x{2,4}[.trans].shared.b16 and mma.sync m16n8k16 (float16 / bfloat16) ----
// ldmatrix: lane 8 q + i gives the address of row i of 8 x 8 block q (16 bytes: 8 16-bit
// elements); lane l receives in register q the elements 2 (l % 4) and 2 (l % 4) + 1 of row
// l / 4 of block q, or transposed (.trans) rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4,
// the first in the low half. A warp collective: the lanes publish their addresses, meet,
// read, meet again (every lane reads shared memory the others may rewrite afterwards). A row
// address that is not 16-byte aligned (a fault on the GPU) stops the launch with status 6.
struct LoadExchange {
  const unsigned short* rows[32];
};

template <int kBlocks>
inline void ldmatrix(unsigned int (&r)[kBlocks], const void* row, bool transposed) {
  static LoadExchange exchanges[32];  // one per warp of the running block
  const unsigned int lane = threadIdx.x % 32;
  LoadExchange& exchange = exchanges[threadIdx.x / 32];
  if (reinterpret_cast<unsigned long long>(row) % 16 != 0) trap_with("ldmatrix: a row address not 16-byte aligned");
  exchange.rows[lane] = static_cast<const unsigned short*>(row);
  __syncwarp();
  for (int q = 0; q < kBlocks; ++q) {
    unsigned int low, high;
    if (transposed) {
      low = exchange.rows[8 * q + 2 * (lane % 4)][lane / 4];
      high = exchange.rows[8 * q + 2 * (lane % 4) + 1][lane / 4];
    } else {
      low = exchange.rows[8 * q + lane / 4][2 * (lane % 4)];
      high = exchange.rows[8 * q + lane / 4][2 * (lane % 4) + 1];
    }
    r[q] = low | (high << 16);
  }
  __syncwarp();
}

inline float element_float(unsigned int bits, __half) { return __half2float(__half{static_cast<unsigned short>(bits)}); }
inline float element_float(unsigned int bits, __nv_bfloat16) {
  return __bfloat162float(__nv_bfloat16{static_cast<unsigned short>(bits)});
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane 4 g + t holds a[4] (A, 16 x 16, two
// elements per register, the lower column in the low half: a0 (g, 2t..), a1 (g + 8, 2t..), a2
// (g, 2t + 8..), a3 (g + 8, 2t + 8..)), b[2] (B, 16 x 8: b0 (2t.., g), b1 (2t + 8.., g)) and d[4] as
// mma_m16n8k8_tf32's. Sums in float, k in order, every 16-bit product exact.
template <typename T>
inline void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
  multiply_fragments<2>(d, a, b, [](unsigned int bits) { return element_float(bits, T()); });
}
}  // namespace sc_emu

// ---- cp.async: __pipeline_memcpy_async / __pipeline_commit / __pipeline_wait_prior ----
// (the names of CUDA's pipeline primitives). A copy reads its source when issued and
// lands in shared memory only when a wait retires its group, so a kernel that reads
// staged data before its wait sees the old contents, as a GPU may. Copies not yet
// committed join the next commit; each thread keeps its own groups (a fresh thread per
// kernel thread, so none carries over between launches).
namespace sc_emu {
struct PendingCopy {
  void* destination;
  unsigned long size;
  unsigned char bytes[16];
};
inline thread_local std::vector<PendingCopy> open_copies;
inline thread_local std::vector<std::vector<PendingCopy>> committed_copies;  // oldest first
}  // namespace sc_emu

// size 4, 8 or 16 bytes; the last `zfill` of them zeros (the source is not read there).
inline void __pipeline_memcpy_async(void* destination, const void* source, unsigned long size,
                                    unsigned long zfill = 0) {
  sc_emu::PendingCopy copy{destination, size, {}};
  if (size > zfill) std::memcpy(copy.bytes, source, size - zfill);
  sc_emu::open_copies.push_back(copy);
}
inline void __pipeline_commit() {
  sc_emu::committed_copies.push_back(std::move(sc_emu::open_copies));
  sc_emu::open_copies.clear();
}
// Lands every committed group but the newest `prior` ones.
inline void __pipeline_wait_prior(unsigned long prior) {
  auto& groups = sc_emu::committed_copies;
  while (groups.size() > prior) {
    for (const sc_emu::PendingCopy& copy : groups.front()) std::memcpy(copy.destination, copy.bytes, copy.size);
    groups.erase(groups.begin());
  }
}

// ---- launching ----
namespace sc_emu {

inline std::mutex launch_mutex;

template <typename... Params, std::size_t... I>
void call_with(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

// Runs kernel<<<grid, block>>>(args...), args as in cudaLaunchKernel: args[i]
// points at the value of parameter i. Returns 0, 1 for a bad configuration,
// or the status of a failure (kStatusDeadlock, kStatusTimeout, kStatusTrap;
// failure_message() says what happened), after which no further block runs.
template <typename... Params>
int launch(void (*kernel)(Params...), unsigned int grid, unsigned int block, void** args) {
  if (grid == 0 || block == 0 || block > 1024) return 1;
  std::lock_guard<std::mutex> lock(launch_mutex);
  {
    std::lock_guard<std::mutex> record(failure.mutex);
    failure.status = 0;
    failure.message.clear();
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_seconds.load()));
  for (unsigned int b = 0; b < grid; ++b) {
    if (std::chrono::steady_clock::now() > deadline) {
      record_failure(kStatusTimeout, "the launch ran past its time before block " + std::to_string(b));
      break;
    }
    BlockState state(block, b, deadline);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned int t = 0; t < block; ++t) {
      threads.emplace_back([&, b, t] {
        threadIdx = dim3{t, 1, 1};
        blockIdx = dim3{b, 1, 1};
        blockDim = dim3{block, 1, 1};
        gridDim = dim3{grid, 1, 1};
        block_barrier = &state.block_barrier;
        warp_barrier = state.warp_barriers[t / 32].get();
        try {
          call_with(kernel, args, std::index_sequence_for<Params...>{});
        } catch (const LaunchFailure&) {
          // recorded where it was thrown
        }
        warp_barrier->thread_exited();
        block_barrier->thread_exited();
      });
    }
    for (std::thread& thread : threads) thread.join();
    if (failure.status != 0) break;
  }
  return failure.status;
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
