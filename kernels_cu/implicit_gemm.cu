// implicit_gemm.cu: a sparse convolution's feature passes over a neighbour map, one kernel each.
//
// The map (sparsecore/neighbour_map.py): neighbours int32 [N, K] (the row of the
// other side paired with row r through offset k, -1 for none), masks uint32
// [N, W] (bit k % 32 of word k / 32 set where neighbours[r, k] >= 0, W =
// ceil(K / 32)) and order int32 [N] (the rows stably sorted by mask, so a tile
// of consecutive rows in that order shares most of its offsets).
//
// Weights stay in spconv's layout [C_out, K, a] (kernel axes flattened, a =
// C_in / groups, b = C_out / groups) and are read in place with strides: the
// matrix of offset k and group g is W[g][c][j] = weight[((g * b + j) * K + k) * a + c].
// A group is a column block of the features: input channels [g * a, (g + 1) * a),
// output channels [g * b, (g + 1) * b).
//
// sc_implicit_gemm (forward and input gradient; output-stationary): a block owns a
// tile of 64 rows in `order` and 64 columns of one group. It ORs its rows' masks,
// and for each offset present in the tile gathers the rows' neighbours (zeros for
// -1) into shared memory, stages the offset's weight block beside them, and
// multiplies into registers; at the end it writes each of its rows once, plus
// the bias. No gathered buffer in global memory, no scatter, no atomics: every
// output element is written by one thread, its sum taken in a fixed order
// (offsets ascending, channels ascending), so results are bitwise reproducible.
//   forward:        dst = out [N_out, g * b],  src = features,    M_k = W_k      [a, b]
//   input gradient: dst = dx  [N_in,  g * a],  src = grad_out,    M_k = W_k^T    [b, a]
//                   over the input side of the map; a symmetric (submanifold)
//                   map gives its output side with the offsets reversed
//                   (table column k holds weight offset K - 1 - k).
//
// sc_weight_gradient: dW_k[g][c][j] = sum over rows o with i = neighbours[o, k] >= 0
// of features[i, g * a + c] * grad_out[o, g * b + j], over the output side. A
// block owns (offset, group, 64 x 64 channel tile, split of the rows in order);
// each split's partial sums go to scratch, and the last block of a tile to finish
// (an atomic counter after a __threadfence) sums them in split order and writes dW
// in the weight layout. The counter is the only atomic, and it decides who sums,
// not what: the result is bitwise reproducible.
//
// Arithmetic engines (the Math tag of each instantiation):
//   sc::Simt  float / double: 256 threads, each a 4 x 4 register micro-tile, 16
//             reduction elements staged per round, sums in the storage type's
//             accumulator (float, double); NVRTC contracts a * b + c to FMA.
//   sc::Wmma  __half / __nv_bfloat16 on tensor cores (m16n16k16), float on TF32
//             tensor cores (m16n16k8, operands rounded to TF32 as they are
//             loaded), all accumulating in float: 128 threads, 4 warps of 32 x
//             32 (2 x 2 fragments); the tile goes through shared memory for the
//             epilogue. On a device older than sm_80 the Wmma instantiations
//             compile to the SIMT engine (128 threads) instead.
// A launch must use the engine's thread count (kSimtThreads / kWmmaThreads);
// any other block size traps. 1-D grids; a block walks the work items
// blockIdx.x, blockIdx.x + gridDim.x, ...
//
// Under the CPU emulation (tests/cuda_emulation) wmma is the shim of
// cuda_shim.h, so the same text runs there.

#include "sc_common.cuh"

#ifndef SPARSECORE_CPU_EMULATION
#include <mma.h>
#endif

namespace sc {

struct Simt {};
struct Wmma {};

constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kTileElements = kTileRows * kTileCols;
constexpr int kSimtThreads = 256;
constexpr int kWmmaThreads = 128;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kTensorCores = false;  // bfloat16 and TF32 wmma need sm_80
#else
constexpr bool kTensorCores = true;
#endif

// ---------------------------------------------------------------- SIMT engine
// Stages [kStep][kPitch] of widened values, a[s][m] and b[s][n]; thread (ty, tx)
// owns rows ty + i * kRowThreads and columns tx + j * kColThreads.
template <typename T, int kThreads>
struct SimtEngine {
  using Acc = typename Accumulator<T>::type;
  using Stage = Acc;
  static constexpr int kStep = 16;
  static constexpr int kPitch = kTileCols + 4;
  static constexpr int kColThreads = 16;
  static constexpr int kRowThreads = kThreads / kColThreads;
  static constexpr int kMicroRows = kTileRows / kRowThreads;
  static constexpr int kMicroCols = kTileCols / kColThreads;
  static constexpr int threads = kThreads;

  Acc acc[kMicroRows][kMicroCols];

  __device__ __forceinline__ static Stage stage(T value) { return widen(value); }
  __device__ __forceinline__ static Stage zero() { return Stage(0); }

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < kMicroRows; ++i) {
      for (int j = 0; j < kMicroCols; ++j) acc[i][j] = Acc(0);
    }
  }

  __device__ __forceinline__ void multiply(const Stage (*a)[kPitch], const Stage (*b)[kPitch]) {
    const int tx = threadIdx.x % kColThreads;
    const int ty = threadIdx.x / kColThreads;
    for (int s = 0; s < kStep; ++s) {
      Acc left[kMicroRows];
      Acc right[kMicroCols];
      for (int i = 0; i < kMicroRows; ++i) left[i] = a[s][ty + i * kRowThreads];
      for (int j = 0; j < kMicroCols; ++j) right[j] = b[s][tx + j * kColThreads];
      for (int i = 0; i < kMicroRows; ++i) {
        for (int j = 0; j < kMicroCols; ++j) acc[i][j] += left[i] * right[j];
      }
    }
  }

  // write(m, n, value) for every element of the tile this thread owns.
  template <typename Write>
  __device__ __forceinline__ void store(Write write) const {
    const int tx = threadIdx.x % kColThreads;
    const int ty = threadIdx.x / kColThreads;
    for (int i = 0; i < kMicroRows; ++i) {
      for (int j = 0; j < kMicroCols; ++j) write(ty + i * kRowThreads, tx + j * kColThreads, acc[i][j]);
    }
  }
};

// ---------------------------------------------------------------- WMMA engine
template <typename T>
struct WmmaTypes;

template <>
struct WmmaTypes<__half> {
  using Element = __half;
  using Precision = __half;
  static constexpr int kK = 16;
  static constexpr int kStep = 32;
  static constexpr int kPitch = kTileCols + 8;
};

template <>
struct WmmaTypes<__nv_bfloat16> {
  using Element = __nv_bfloat16;
  using Precision = __nv_bfloat16;
  static constexpr int kK = 16;
  static constexpr int kStep = 32;
  static constexpr int kPitch = kTileCols + 8;
};

template <>
struct WmmaTypes<float> {  // TF32
  using Element = float;
  using Precision = nvcuda::wmma::precision::tf32;
  static constexpr int kK = 8;
  static constexpr int kStep = 16;
  static constexpr int kPitch = kTileCols + 4;
};

// a[s][m] is matrix_a (m x s) in column-major order, b[s][n] matrix_b (s x n) in
// row-major order, both with leading dimension kPitch; warp w owns rows
// 32 * (w / 2) and columns 32 * (w % 2) of the tile.
template <typename T>
struct WmmaEngine {
  using Types = WmmaTypes<T>;
  using Acc = float;
  using Stage = typename Types::Element;
  static constexpr int kStep = Types::kStep;
  static constexpr int kPitch = Types::kPitch;
  static constexpr int kK = Types::kK;
  static constexpr int kOutPitch = kTileCols + 4;
  static constexpr int threads = kWmmaThreads;
  using AccFragment = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, kK, float>;
  using AFragment = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, kK, typename Types::Precision,
                                           nvcuda::wmma::col_major>;
  using BFragment = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, kK, typename Types::Precision,
                                           nvcuda::wmma::row_major>;

  AccFragment acc[2][2];

  __device__ __forceinline__ static Stage stage(T value) { return value; }
  __device__ __forceinline__ static Stage zero() { return narrow<Stage>(0.0f); }

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 2; ++j) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
    }
  }

  template <typename Fragment>
  __device__ __forceinline__ static void round_operands(Fragment& fragment) {
    if constexpr (kK == 8) {
      for (int t = 0; t < fragment.num_elements; ++t) fragment.x[t] = nvcuda::wmma::__float_to_tf32(fragment.x[t]);
    }
  }

  __device__ __forceinline__ void multiply(const Stage (*a)[kPitch], const Stage (*b)[kPitch]) {
    const int warp = threadIdx.x / 32;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    for (int k = 0; k < kStep; k += kK) {
      AFragment left[2];
      BFragment right[2];
      for (int i = 0; i < 2; ++i) {
        nvcuda::wmma::load_matrix_sync(left[i], &a[k][row0 + 16 * i], kPitch);
        round_operands(left[i]);
      }
      for (int j = 0; j < 2; ++j) {
        nvcuda::wmma::load_matrix_sync(right[j], &b[k][col0 + 16 * j], kPitch);
        round_operands(right[j]);
      }
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) nvcuda::wmma::mma_sync(acc[i][j], left[i], right[j], acc[i][j]);
      }
    }
  }

  // The block's output tile in shared memory: one per engine, whatever store() writes through.
  __device__ __forceinline__ static float (*output_tile())[kOutPitch] {
    __shared__ __align__(32) float tile[kTileRows][kOutPitch];
    return tile;
  }

  // Through shared memory: write(m, n, value) over the whole tile, spread over
  // the block. Every thread of the block must call it (it has barriers).
  template <typename Write>
  __device__ __forceinline__ void store(Write write) const {
    float(*tile)[kOutPitch] = output_tile();
    const int warp = threadIdx.x / 32;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        nvcuda::wmma::store_matrix_sync(&tile[row0 + 16 * i][col0 + 16 * j], acc[i][j], kOutPitch,
                                        nvcuda::wmma::mem_row_major);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTileElements; e += kWmmaThreads) {
      write(e / kTileCols, e % kTileCols, tile[e / kTileCols][e % kTileCols]);
    }
    __syncthreads();  // the tile is rewritten by the next work item
  }
};

template <typename T, typename Math>
struct EngineOf {
  using type = SimtEngine<T, kSimtThreads>;
};

template <typename T>
struct EngineOf<T, Wmma> {
  template <bool kTensor, int kUnused = 0>
  struct Pick {
    using type = WmmaEngine<T>;
  };
  template <int kUnused>
  struct Pick<false, kUnused> {
    using type = SimtEngine<T, kWmmaThreads>;
  };
  using type = typename Pick<kTensorCores>::type;
};

// Whether any of the tile's 64 entries (shared) is >= 0; the same answer in every thread.
__device__ __forceinline__ bool any_row(const int* rows) {
  bool any = false;
  for (int m = 0; m < kTileRows; ++m) any = any || rows[m] >= 0;
  return any;
}

}  // namespace sc

// Forward (flags & 2 == 0) or input gradient (flags & 2) of a convolution over a map.
//   source     T      [num_source, groups * S]   features (forward) or grad_out (input gradient)
//   weight     T      [groups * b, K, a]         spconv's layout, contiguous
//   bias       T      [groups * b]               read when flags & 4 (forward only); else any array
//   neighbours int32  [num_rows, K]              the written side's table (-1: none)
//   masks      uint32 [num_rows, mask_words]
//   order      int32  [num_rows]                 a permutation of the rows
//   flags      1: reversed offsets (table column k is weight offset K - 1 - k),
//              2: transposed weights (the input gradient: M_k = W_k^T), 4: add the bias
//   out        T      [num_rows, groups * D]     every row written once (D = b forward, a transposed)
// S = a, D = b forward; S = b, D = a for the input gradient.
template <typename T, typename Math>
__global__ void sc_implicit_gemm(const T* __restrict__ source, const T* __restrict__ weight,
                                 const T* __restrict__ bias, const int* __restrict__ neighbours,
                                 const unsigned int* __restrict__ masks, const int* __restrict__ order,
                                 long long num_rows, int volume, int mask_words, int groups, int in_per_group,
                                 int out_per_group, int flags, T* __restrict__ out) {
  using Engine = typename sc::EngineOf<T, Math>::type;
  using Stage = typename Engine::Stage;
  using Acc = typename Engine::Acc;
  constexpr int kStep = Engine::kStep;
  constexpr int kThreads = Engine::threads;
  if (blockDim.x != kThreads) __trap();
  const bool reversed = (flags & 1) != 0;
  const bool transposed = (flags & 2) != 0;
  const bool has_bias = (flags & 4) != 0;
  const int reduce = transposed ? out_per_group : in_per_group;
  const int width = transposed ? in_per_group : out_per_group;
  const long long source_pitch = static_cast<long long>(groups) * reduce;
  const long long out_pitch = static_cast<long long>(groups) * width;
  const long long weight_row = static_cast<long long>(volume) * in_per_group;  // between output channels
  const long long reduce_stride = transposed ? weight_row : 1;
  const long long width_stride = transposed ? 1 : weight_row;
  const long long col_tiles = (width + sc::kTileCols - 1) / sc::kTileCols;
  const long long items = (num_rows + sc::kTileRows - 1) / sc::kTileRows * groups * col_tiles;
  const int tid = threadIdx.x;

  __shared__ int rows[sc::kTileRows];
  __shared__ int found[sc::kTileRows];
  __shared__ unsigned int words[sc::kTileRows];
  __shared__ __align__(32) Stage a_tile[kStep][Engine::kPitch];
  __shared__ __align__(32) Stage b_tile[kStep][Engine::kPitch];

  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const long long row_tile = item / (groups * col_tiles);
    const long long rest = item - row_tile * groups * col_tiles;
    const int g = static_cast<int>(rest / col_tiles);
    const int col0 = static_cast<int>(rest - static_cast<long long>(g) * col_tiles) * sc::kTileCols;
    if (tid < sc::kTileRows) {
      const long long position = row_tile * sc::kTileRows + tid;
      rows[tid] = position < num_rows ? __ldg(order + position) : -1;
    }
    Engine engine;
    engine.clear();
    __syncthreads();
    for (int w = 0; w < mask_words; ++w) {
      if (tid < sc::kTileRows) {
        const int row = rows[tid];
        words[tid] = row >= 0 ? __ldg(masks + static_cast<long long>(row) * mask_words + w) : 0u;
      }
      __syncthreads();
      unsigned int word = 0;
      for (int m = 0; m < sc::kTileRows; ++m) word |= words[m];
      __syncthreads();  // words is rewritten for the next word
      while (word != 0) {  // the same offsets in every thread: block-uniform
        const int k = w * 32 + __ffs(word) - 1;
        word &= word - 1;
        if (tid < sc::kTileRows) {
          const int row = rows[tid];
          found[tid] = row >= 0 ? __ldg(neighbours + static_cast<long long>(row) * volume + k) : -1;
        }
        const int weight_offset = reversed ? volume - 1 - k : k;
        const T* block = weight + static_cast<long long>(g) * out_per_group * weight_row +
                         static_cast<long long>(weight_offset) * in_per_group + col0 * width_stride;
        const T* rows_of_group = source + static_cast<long long>(g) * reduce;
        __syncthreads();
        for (int s0 = 0; s0 < reduce; s0 += kStep) {
          for (int e = tid; e < sc::kTileRows * kStep; e += kThreads) {
            const int m = e / kStep;
            const int s = e - m * kStep;
            const int row = found[m];
            a_tile[s][m] = row >= 0 && s0 + s < reduce
                               ? Engine::stage(rows_of_group[static_cast<long long>(row) * source_pitch + s0 + s])
                               : Engine::zero();
          }
          for (int e = tid; e < kStep * sc::kTileCols; e += kThreads) {
            // consecutive threads read consecutive addresses of the weight
            const int s = transposed ? e / sc::kTileCols : e % kStep;
            const int n = transposed ? e % sc::kTileCols : e / kStep;
            b_tile[s][n] = s0 + s < reduce && col0 + n < width
                               ? Engine::stage(block[(s0 + s) * reduce_stride + n * width_stride])
                               : Engine::zero();
          }
          __syncthreads();
          engine.multiply(a_tile, b_tile);
          __syncthreads();
        }
      }
    }
    const T* group_bias = bias + static_cast<long long>(g) * width + col0;
    T* group_out = out + static_cast<long long>(g) * width + col0;
    engine.store([&](int m, int n, Acc value) {
      const int row = rows[m];
      if (row >= 0 && col0 + n < width) {
        if (has_bias) value += static_cast<Acc>(sc::widen(group_bias[n]));
        group_out[static_cast<long long>(row) * out_pitch + n] = sc::narrow<T>(value);
      }
    });
    __syncthreads();  // rows is rewritten by the next work item
  }
}

// The weight gradient of a convolution over the output side of its map.
//   features   T     [num_input, groups * a]
//   grad_out   T     [num_rows, groups * b]
//   neighbours int32 [num_rows, K]       the output side (not reversed)
//   order      int32 [num_rows]
//   splits     row splits per tile (>= 1): tile t's split s covers row tiles
//              [s * per, min((s + 1) * per, row tiles)), per = ceil(row tiles / splits)
//   scratch    Acc   [tiles * splits * 4096 + counters]: the partial tiles, then one
//              uint32 counter per tile, zero on entry (left zero on exit); unused
//              (any array) when splits == 1
//   grad_weight T    [groups * b, K, a]  every element written once
// tiles = K * groups * ceil(a / 64) * ceil(b / 64); work items = tiles * splits.
template <typename T, typename Math>
__global__ void sc_weight_gradient(const T* __restrict__ features, const T* __restrict__ grad_out,
                                   const int* __restrict__ neighbours, const int* __restrict__ order,
                                   long long num_rows, int volume, int groups, int in_per_group, int out_per_group,
                                   int splits, typename sc::Accumulator<T>::type* __restrict__ scratch,
                                   T* __restrict__ grad_weight) {
  using Engine = typename sc::EngineOf<T, Math>::type;
  using Stage = typename Engine::Stage;
  using Acc = typename Engine::Acc;
  static_assert(sizeof(Acc) == sizeof(typename sc::Accumulator<T>::type), "partials are kept in Accumulator<T>");
  constexpr int kStep = Engine::kStep;
  constexpr int kThreads = Engine::threads;
  if (blockDim.x != kThreads) __trap();
  const int in_tiles = (in_per_group + sc::kTileRows - 1) / sc::kTileRows;
  const int out_tiles = (out_per_group + sc::kTileCols - 1) / sc::kTileCols;
  const long long tiles = static_cast<long long>(volume) * groups * in_tiles * out_tiles;
  const long long row_tiles = (num_rows + sc::kTileRows - 1) / sc::kTileRows;
  const long long per_split = (row_tiles + splits - 1) / splits;
  const long long in_pitch = static_cast<long long>(groups) * in_per_group;
  const long long out_pitch = static_cast<long long>(groups) * out_per_group;
  Acc* partials = reinterpret_cast<Acc*>(scratch);
  unsigned int* counters = reinterpret_cast<unsigned int*>(partials + tiles * splits * sc::kTileElements);
  const int tid = threadIdx.x;

  __shared__ int rows[sc::kTileRows];
  __shared__ int found[sc::kTileRows];
  __shared__ bool last;
  __shared__ __align__(32) Stage a_tile[kStep][Engine::kPitch];
  __shared__ __align__(32) Stage b_tile[kStep][Engine::kPitch];

  for (long long item = blockIdx.x; item < tiles * splits; item += gridDim.x) {
    const long long tile = item / splits;
    const int split = static_cast<int>(item - tile * splits);
    long long rest = tile;
    const int out_tile = static_cast<int>(rest % out_tiles);
    rest /= out_tiles;
    const int in_tile = static_cast<int>(rest % in_tiles);
    rest /= in_tiles;
    const int g = static_cast<int>(rest % groups);
    const int k = static_cast<int>(rest / groups);
    const int c0 = in_tile * sc::kTileRows;
    const int j0 = out_tile * sc::kTileCols;
    const T* group_features = features + static_cast<long long>(g) * in_per_group + c0;
    const T* group_grad = grad_out + static_cast<long long>(g) * out_per_group + j0;
    Engine engine;
    engine.clear();
    const long long first = split * per_split;
    const long long stop = first + per_split < row_tiles ? first + per_split : row_tiles;
    for (long long row_tile = first; row_tile < stop; ++row_tile) {
      if (tid < sc::kTileRows) {
        const long long position = row_tile * sc::kTileRows + tid;
        const int row = position < num_rows ? __ldg(order + position) : -1;
        rows[tid] = row;
        found[tid] = row >= 0 ? __ldg(neighbours + static_cast<long long>(row) * volume + k) : -1;
      }
      __syncthreads();
      if (sc::any_row(found)) {  // block-uniform: skips row tiles without offset k
        for (int r0 = 0; r0 < sc::kTileRows; r0 += kStep) {
          for (int e = tid; e < kStep * sc::kTileRows; e += kThreads) {
            const int r = e / sc::kTileRows;
            const int c = e - r * sc::kTileRows;
            const int input = found[r0 + r];
            a_tile[r][c] = input >= 0 && c0 + c < in_per_group
                               ? Engine::stage(group_features[static_cast<long long>(input) * in_pitch + c])
                               : Engine::zero();
          }
          for (int e = tid; e < kStep * sc::kTileCols; e += kThreads) {
            const int r = e / sc::kTileCols;
            const int j = e - r * sc::kTileCols;
            b_tile[r][j] = found[r0 + r] >= 0 && j0 + j < out_per_group
                               ? Engine::stage(group_grad[static_cast<long long>(rows[r0 + r]) * out_pitch + j])
                               : Engine::zero();
          }
          __syncthreads();
          engine.multiply(a_tile, b_tile);
          __syncthreads();
        }
      }
      __syncthreads();  // rows and found are rewritten by the next row tile
    }
    // dW[(g * b + j) * K + k][c] for this tile's element (c, j) = (m, n)
    T* tile_weight = grad_weight + (static_cast<long long>(g) * out_per_group + j0) * volume * in_per_group +
                     static_cast<long long>(k) * in_per_group + c0;
    const long long weight_row = static_cast<long long>(volume) * in_per_group;
    if (splits == 1) {
      engine.store([&](int m, int n, Acc value) {
        if (c0 + m < in_per_group && j0 + n < out_per_group) tile_weight[n * weight_row + m] = sc::narrow<T>(value);
      });
      continue;
    }
    Acc* own = partials + (tile * splits + split) * sc::kTileElements;
    engine.store([&](int m, int n, Acc value) { own[m * sc::kTileCols + n] = value; });
    __threadfence();  // this split's partials before its count
    __syncthreads();
    if (tid == 0) last = atomicAdd(counters + tile, 1u) == static_cast<unsigned int>(splits - 1);
    __syncthreads();
    if (last) {  // every split of the tile is written: sum them in split order
      __threadfence();
      const Acc* tile_partials = partials + tile * splits * sc::kTileElements;
      for (int e = tid; e < sc::kTileElements; e += kThreads) {
        const int m = e / sc::kTileCols;
        const int n = e - m * sc::kTileCols;
        if (c0 + m < in_per_group && j0 + n < out_per_group) {
          Acc sum = Acc(0);
          for (int s = 0; s < splits; ++s) sum += __ldcg(tile_partials + static_cast<long long>(s) * sc::kTileElements + e);
          tile_weight[n * weight_row + m] = sc::narrow<T>(sum);
        }
      }
      if (tid == 0) counters[tile] = 0u;
    }
    __syncthreads();  // last is rewritten by the next work item
  }
}
