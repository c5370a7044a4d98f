// implicit_gemm.cu: a sparse convolution's feature passes over a neighbour map, one kernel each.
//
// The map (sparsecore/neighbour_map.py): neighbours int32 [N, K] (the row of the
// other side paired with row r through offset k, -1 for none), masks uint32
// [N, W] (bit k % 32 of word k / 32 set where neighbours[r, k] >= 0, W =
// ceil(K / 32)) and order [N] (the rows sorted by mask, so a tile of consecutive
// rows in that order shares most of its offsets), read as int32 words
// order[p * order_step]: order_step 1 for an int32 order, 2 for a row plan
// (int64 slots whose low words are the order: neighbour_map.cu section 4).
//
// Weights stay in spconv's layout [C_out, K, a] (kernel axes flattened, a =
// C_in / groups, b = C_out / groups) and are read in place with strides: the
// matrix of offset k and group g is W[g][c][j] = weight[((g * b + j) * K + k) * a + c].
// A group is a column block of the features: input channels [g * a, (g + 1) * a),
// output channels [g * b, (g + 1) * b).
//
// sc_implicit_gemm (forward and input gradient; output-stationary): a block owns a
// tile of 64 rows in `order` and 64 columns of one group (the last row tiles, which
// hold the most offsets, first). It ORs its rows' masks,
// and for each offset present in the tile gathers the rows' neighbours (zeros for
// -1) into shared memory, stages the offset's weight block beside them, and
// multiplies into registers; at the end it writes each of its rows once, plus
// the bias. No gathered buffer in global memory, no scatter, no atomics in a sum:
// every output element is written by one thread, its sum taken in a fixed order
// (offsets ascending, channels ascending), so results are bitwise reproducible.
// A layer with fewer tiles than the GPU has block slots splits each tile's offsets
// over `splits` blocks: each writes its partial tile to scratch, and the last to
// finish (an atomic counter) adds them in split order before the epilogue.
//   forward:        dst = out [N_out, g * b],  src = features,    M_k = W_k      [a, b]
//   input gradient: dst = dx  [N_in,  g * a],  src = grad_out,    M_k = W_k^T    [b, a]
//                   over the input side of the map; a symmetric (submanifold)
//                   map gives its output side with the offsets reversed
//                   (table column k holds weight offset K - 1 - k).
//
// sc_weight_gradient: dW_k[g][c][j] = sum over rows o with i = neighbours[o, k] >= 0
// of features[i, g * a + c] * grad_out[o, g * b + j], over the output side. A
// block owns (offset, group, 64 x 64 channel tile, split of the offset's row
// tiles); it walks only the row tiles whose OR mask holds its offset (the map's
// row plan holds a bit set of them per offset, built once per map:
// neighbour_map.cu section 4), its split's partial sums go to scratch, and the
// last block of a tile to finish (an atomic counter after a __threadfence) sums
// them in split order and writes dW in the weight layout. The atomics decide who
// sums, not what: the result is bitwise reproducible.
//
// Operands reach shared memory in rounds of kStep reduction elements, two stages
// deep: round r + 1's copies are issued before round r is multiplied (run_rounds).
// Each row of an operand tile is contiguous in global memory and in shared memory
// (pitch: the row plus 16 bytes), so whole 16-byte chunks go by cp.async on sm_80+
// (zero-filled for a missing row) and by 16-byte loads and stores below sm_80;
// a tail or an odd channel pitch goes element by element. The same scheme serves
// every element type (float16 and bfloat16 included).
//
// Arithmetic engines (the Math tag of each instantiation):
//   sc::Simt  float / double: 256 threads, each a 4 x 4 register micro-tile, 16
//             reduction elements per round, sums in the storage type's
//             accumulator (float, double); NVRTC contracts a * b + c to FMA.
//   sc::Wmma  __half / __nv_bfloat16 and float on TF32 (operands rounded to TF32 as
//             they are loaded) on tensor cores, all accumulating in float: 128
//             threads, 4 warps of 32 x 32. On sm_80+ both kernels issue mma.sync
//             with the tile's rows on the instruction's n side, 4 row slices of 8
//             x 2 fragments of 16 columns (m16n8k16 with ldmatrix fragments for
//             both 16-bit types, Mma16Engine; m16n8k8 TF32, MmaTf32Engine), so
//             rows (the weight gradient's: input channels) are skipped 8 at a
//             time; float16 on sm_75 runs wmma (the forward 8 x 32 fragments,
//             m8n32k16; the weight gradient 16 x 16). The tile goes through
//             shared memory for the epilogue. float16 has tensor cores from sm_70
//             on; bfloat16 and TF32 from sm_80 on: on sm_75 those two Wmma
//             instantiations compile to the SIMT engine (128 threads, float
//             accumulation, full float32 products).
// A launch must use the engine's thread count (kSimtThreads / kWmmaThreads);
// any other block size traps. 1-D grids; a block walks the work items
// blockIdx.x, blockIdx.x + gridDim.x, ...
//
// Under the CPU emulation (tests/cuda_emulation) wmma, mma.sync, ldmatrix and cp.async are the
// shims of cuda_shim.h, so the same text runs there (SC_EMULATED_ARCH picks the sm_75 path).

#include "sc_common.cuh"

#ifndef SPARSECORE_CPU_EMULATION
#include <mma.h>
#endif

// The architecture the code is compiled for: __CUDA_ARCH__ under NVRTC; under the CPU
// emulation SC_EMULATED_ARCH (the tests build sm_75 and sm_80+ variants), else 900.
#if defined(__CUDA_ARCH__)
#define SC_ARCH __CUDA_ARCH__
#elif defined(SC_EMULATED_ARCH)
#define SC_ARCH SC_EMULATED_ARCH
#else
#define SC_ARCH 900
#endif

namespace sc {

struct Simt {};
struct Wmma {};

constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kTileElements = kTileRows * kTileCols;
constexpr int kSimtThreads = 256;
constexpr int kWmmaThreads = 128;
constexpr int kMaxMaskWords = 64;  // kernels of up to 2048 offsets (the launch wrapper checks)

// ------------------------------------------------------------ copies into shared memory
// copy16: 16 bytes from global to shared memory, the last 16 - src_bytes of them zeros
// (src_bytes is 0 or 16). On sm_80+ an asynchronous cp.async that lands at the
// wait_copies of its group; below, a plain 16-byte load and store.
#ifndef SPARSECORE_CPU_EMULATION
__device__ __forceinline__ void copy16(void* shared_destination, const void* global_source, int src_bytes) {
#if SC_ARCH >= 800
  const unsigned int destination = static_cast<unsigned int>(__cvta_generic_to_shared(shared_destination));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(src_bytes));
#else
  uint4 value = make_uint4(0u, 0u, 0u, 0u);
  if (src_bytes != 0) value = __ldg(reinterpret_cast<const uint4*>(global_source));
  *reinterpret_cast<uint4*>(shared_destination) = value;
#endif
}
__device__ __forceinline__ void commit_copies() {
#if SC_ARCH >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if SC_ARCH >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}
#else  // the emulation's cp.async (cuda_shim.h): copies land at the wait of their group
__device__ __forceinline__ void copy16(void* shared_destination, const void* global_source, int src_bytes) {
  __pipeline_memcpy_async(shared_destination, global_source, 16, static_cast<unsigned long>(16 - src_bytes));
}
__device__ __forceinline__ void commit_copies() { __pipeline_commit(); }
template <int kPending>
__device__ __forceinline__ void wait_copies() { __pipeline_wait_prior(kPending); }
#endif

template <typename T>
__device__ __forceinline__ T zero_of() {
  return narrow<T>(typename Accumulator<T>::type(0));
}

__device__ __forceinline__ bool aligned16(const void* pointer) {
  return (reinterpret_cast<unsigned long long>(pointer) & 15ull) == 0;
}

// Stages `rows` rows of kWidth elements into dst (row r at dst + r * pitch): row r is
// source_of(r) (nullptr: zeros), its first `count` elements valid, the rest zeros.
// Whole 16-byte chunks go by copy16 where `vector` says every row pointer is 16-byte
// aligned; other chunks (a tail past `count`, an odd channel pitch) element by element,
// each chunk's loads issued before its stores.
template <typename T, int kWidth, typename SourceOf>
__device__ __forceinline__ void stage_rows(T* dst, int pitch, int rows, int count, bool vector,
                                           const T* fallback, SourceOf source_of) {
  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunks = kWidth / kVector;
  static_assert(kWidth % kVector == 0, "rows are whole 16-byte chunks");
  for (int e = threadIdx.x; e < rows * kChunks; e += blockDim.x) {
    const int r = e / kChunks;
    const int c = (e - r * kChunks) * kVector;
    const T* source = source_of(r);
    T* to = dst + r * pitch + c;
    if (vector && c + kVector <= count) {
      copy16(to, source != nullptr ? source + c : fallback, source != nullptr ? 16 : 0);
    } else {
      T values[kVector];
      for (int v = 0; v < kVector; ++v) values[v] = source != nullptr && c + v < count ? source[c + v] : zero_of<T>();
      for (int v = 0; v < kVector; ++v) to[v] = values[v];
    }
  }
}

// The staging geometry of an element type: a round stages kStep reduction elements.
// "Narrow" rows hold kStep elements (pitch kStep + 16 bytes), "wide" rows 64 (pitch
// 64 + 16 bytes): every row starts 16-byte aligned and consecutive rows start 16 bytes
// apart modulo 128, so 16-byte copies and fragment loads of 8 rows hit distinct banks.
template <typename T, int kStepElements>
struct Staging {
  static constexpr int kStep = kStepElements;
  static constexpr int kPad = 16 / static_cast<int>(sizeof(T));
  static constexpr int kNarrowPitch = kStep + kPad;
  static constexpr int kWidePitch = kTileCols + kPad;
  static constexpr int kOperandElements =
      kTileRows * kNarrowPitch > kStep * kWidePitch ? kTileRows * kNarrowPitch : kStep * kWidePitch;
  static constexpr int kOperandBytes = (kOperandElements * static_cast<int>(sizeof(T)) + 127) / 128 * 128;
  static constexpr int kStageBytes = 4 * kOperandBytes;  // a and b, two stages
};

// What of a staged round is worth multiplying: tile rows m with present[m] >= 0 (every
// row when present is nullptr) and m < rows, the first `reduce` reduction elements (the
// rest are zeros), the first `columns` columns. An engine skips work at the granularity
// of its warps (a warp's rows, a fragment's 16 columns or k elements), so every skip is
// warp-uniform; skipped products are products with zero operands.
struct Extent {
  const int* present;
  int rows;
  int reduce;
  int columns;
};

__device__ __forceinline__ bool any_present(const Extent& extent, int first_row, int count) {
  if (first_row >= extent.rows) return false;
  if (extent.present == nullptr) return true;
  bool any = false;
  for (int r = 0; r < count; ++r) any = any || extent.present[first_row + r] >= 0;
  return any;
}

// ---------------------------------------------------------------- SIMT engine
// Thread (ty, tx) owns rows ty * kMicroRows + i and columns tx + j * kColThreads of the
// 64 x 64 tile, so a warp owns 2 * kMicroRows consecutive rows (8 at 256 threads): it
// skips a round where none of them is present. Operands are read from the staged tiles in any of their layouts:
// a(m, s) at a[m * lda + s] (kARowMajor) or a[s * lda + m]; b(s, n) at b[s * ldb + n]
// (b_row_major) or b[n * ldb + s].
template <typename T, int kThreads>
struct SimtEngine {
  using Acc = typename Accumulator<T>::type;
  using Stage = T;
  using Geometry = Staging<T, 16>;
  static constexpr int kStep = Geometry::kStep;
  static constexpr int kColThreads = 16;
  static constexpr int kRowThreads = kThreads / kColThreads;
  static constexpr int kMicroRows = kTileRows / kRowThreads;
  static constexpr int kMicroCols = kTileCols / kColThreads;
  static constexpr int threads = kThreads;
  static constexpr int kSharedBytes = Geometry::kStageBytes;

  Acc acc[kMicroRows][kMicroCols];

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < kMicroRows; ++i) {
      for (int j = 0; j < kMicroCols; ++j) acc[i][j] = Acc(0);
    }
  }

  template <bool kARowMajor>
  __device__ __forceinline__ void multiply(const Stage* a, int lda, const Stage* b, int ldb, bool b_row_major,
                                           const Extent& extent) {
    const int tx = threadIdx.x % kColThreads;
    const int ty = threadIdx.x / kColThreads;
    constexpr int kWarpRows = 32 / kColThreads * kMicroRows;
    if (!any_present(extent, threadIdx.x / 32 * kWarpRows, kWarpRows)) return;  // warp-uniform
    const int used_columns = (extent.columns + kColThreads - 1) / kColThreads;
    const int reduce = extent.reduce < kStep ? extent.reduce : kStep;
    const int b_step = b_row_major ? ldb : 1;
    const int b_column = b_row_major ? 1 : ldb;
    for (int s = 0; s < reduce; ++s) {
      Acc left[kMicroRows];
      Acc right[kMicroCols];
      for (int i = 0; i < kMicroRows; ++i) {
        const int m = ty * kMicroRows + i;
        left[i] = widen(kARowMajor ? a[m * lda + s] : a[s * lda + m]);
      }
      for (int j = 0; j < kMicroCols; ++j) {
        right[j] = j < used_columns ? widen(b[s * b_step + (tx + j * kColThreads) * b_column]) : Acc(0);
      }
      for (int i = 0; i < kMicroRows; ++i) {
        for (int j = 0; j < kMicroCols; ++j) {
          if (j < used_columns) acc[i][j] += left[i] * right[j];
        }
      }
    }
  }

  // write(m, n, value) for every element of the tile this thread owns (no barrier).
  template <typename Write>
  __device__ __forceinline__ void store(unsigned char*, Write write) const {
    const int tx = threadIdx.x % kColThreads;
    const int ty = threadIdx.x / kColThreads;
    for (int i = 0; i < kMicroRows; ++i) {
      for (int j = 0; j < kMicroCols; ++j) write(ty * kMicroRows + i, tx + j * kColThreads, acc[i][j]);
    }
  }
};

// ---------------------------------------------------------------- WMMA engine
template <bool kFirst, typename First, typename Second>
struct Choose {
  using type = First;
};
template <typename First, typename Second>
struct Choose<false, First, Second> {
  using type = Second;
};

// float16's engine below sm_80 (where mma.sync m16n8k16 does not exist): wmma m16n16k16 or
// m8n32k16. Warp w owns rows 32 * (w / 2) and columns 32 * (w % 2) of the 64 x 64 tile, as
// (32 / kM) x (32 / kN) fragments of kM x kN: 16 x 16 (the weight gradient), or 8 x 32 where
// the forward skips 8-row slices; operand layouts as in SimtEngine.
template <typename T, int kM = 16, int kN = 16>
struct WmmaEngine {
  using Acc = float;
  using Stage = T;
  using Geometry = Staging<T, 32>;
  static constexpr int kStep = Geometry::kStep;
  static constexpr int kK = 16;
  static constexpr int kOutPitch = kTileCols + 4;
  static constexpr int threads = kWmmaThreads;
  static constexpr int kOutBytes = kTileRows * kOutPitch * 4;
  static constexpr int kSharedBytes = Geometry::kStageBytes > kOutBytes ? Geometry::kStageBytes : kOutBytes;
  using Precision = T;  // __half
  static constexpr int kFragmentRows = 32 / kM;
  static constexpr int kFragmentCols = 32 / kN;
  using AccFragment = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kM, kN, kK, float>;
  template <typename Layout>
  using AFragment = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, kM, kN, kK, Precision, Layout>;
  template <typename Layout>
  using BFragment = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, kM, kN, kK, Precision, Layout>;

  AccFragment acc[kFragmentRows][kFragmentCols];

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < kFragmentRows; ++i) {
      for (int j = 0; j < kFragmentCols; ++j) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
    }
  }

  template <bool kARowMajor, bool kBRowMajor>
  __device__ __forceinline__ void multiply_layouts(const Stage* a, int lda, const Stage* b, int ldb,
                                                   const Extent& extent) {
    using ALayout = typename Choose<kARowMajor, nvcuda::wmma::row_major, nvcuda::wmma::col_major>::type;
    using BLayout = typename Choose<kBRowMajor, nvcuda::wmma::row_major, nvcuda::wmma::col_major>::type;
    const int warp = threadIdx.x / 32;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    bool rows[kFragmentRows];
    bool columns[kFragmentCols];
    bool any_rows = false;
    for (int i = 0; i < kFragmentRows; ++i) {  // warp-uniform skips
      rows[i] = any_present(extent, row0 + kM * i, kM);
      any_rows = any_rows || rows[i];
    }
    for (int j = 0; j < kFragmentCols; ++j) columns[j] = col0 + kN * j < extent.columns;
    if (!any_rows || !columns[0]) return;
    for (int k = 0; k < kStep && k < extent.reduce; k += kK) {
      AFragment<ALayout> left[kFragmentRows];
      BFragment<BLayout> right[kFragmentCols];
      for (int i = 0; i < kFragmentRows; ++i) {
        if (!rows[i]) continue;
        const int m = row0 + kM * i;
        nvcuda::wmma::load_matrix_sync(left[i], kARowMajor ? a + m * lda + k : a + k * lda + m, lda);
      }
      for (int j = 0; j < kFragmentCols; ++j) {
        if (!columns[j]) continue;
        const int n = col0 + kN * j;
        nvcuda::wmma::load_matrix_sync(right[j], kBRowMajor ? b + k * ldb + n : b + n * ldb + k, ldb);
      }
      for (int i = 0; i < kFragmentRows; ++i) {
        for (int j = 0; j < kFragmentCols; ++j) {
          if (rows[i] && columns[j]) nvcuda::wmma::mma_sync(acc[i][j], left[i], right[j], acc[i][j]);
        }
      }
    }
  }

  template <bool kARowMajor>
  __device__ __forceinline__ void multiply(const Stage* a, int lda, const Stage* b, int ldb, bool b_row_major,
                                           const Extent& extent) {
    if (b_row_major) {
      multiply_layouts<kARowMajor, true>(a, lda, b, ldb, extent);
    } else {
      multiply_layouts<kARowMajor, false>(a, lda, b, ldb, extent);
    }
  }

  // Through shared memory (`shared`, at least kOutBytes, free when called): write(m, n,
  // value) over the whole tile, spread over the block. Every thread of the block must
  // call it (it has barriers).
  template <typename Write>
  __device__ __forceinline__ void store(unsigned char* shared, Write write) const {
    float* tile = reinterpret_cast<float*>(shared);
    const int warp = threadIdx.x / 32;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    for (int i = 0; i < kFragmentRows; ++i) {
      for (int j = 0; j < kFragmentCols; ++j) {
        nvcuda::wmma::store_matrix_sync(tile + (row0 + kM * i) * kOutPitch + col0 + kN * j, acc[i][j], kOutPitch,
                                        nvcuda::wmma::mem_row_major);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTileElements; e += kWmmaThreads) {
      write(e / kTileCols, e % kTileCols, tile[(e / kTileCols) * kOutPitch + e % kTileCols]);
    }
    __syncthreads();  // the tile is rewritten by the next work item
  }
};

#if SC_ARCH >= 800
// ---------------------------------------------------------------- TF32 mma engine
// The TF32 engine of both kernels on sm_80+: mma.sync.m16n8k8 with the tile's rows on the
// instruction's n side, so rows are skipped 8 at a time (wmma's only TF32 shape, m16n16k8,
// skips 16: 1.58x of the basic network's forward FLOPs were issued against 1.43x for the
// 16-bit types). The weight gradient's staging is [row][channel] for both operands (wide
// pitch, 68 floats): its reads are 2-way bank conflicted.
// 128 threads; warp w owns rows 32 * (w / 2) and columns 32 * (w % 2) of the 64 x 64 tile
// as 4 row slices of 8 x 2 column fragments of 16; each mma computes the transposed product
// D^T (16 columns x 8 rows) = M^T (16 x 8 reduction) A^T (8 reduction x 8 rows). Lane
// (g, t) = (lane / 4, lane % 4) holds, for columns n0.., rows m0.., reduction k..:
//   weight operand w(n, s) = b(s, n): w0 (n0+g, k+t), w1 (n0+g+8, k+t), w2 (n0+g, k+t+4), w3 (n0+g+8, k+t+4)
//   row operand    r(s, m) = a(m, s): r0 (k+t, m0+g), r1 (k+t+4, m0+g)
//   accumulator    c(n, m):           c0 (n0+g, m0+2t), c1 (n0+g, m0+2t+1), c2 (n0+g+8, m0+2t), c3 (n0+g+8, m0+2t+1)
// Operands are rounded to TF32 (cvt.rna) as they are read, as wmma's TF32 path does. Reads
// from the narrow-pitch staging (20 floats) hit 32 distinct banks; the input gradient's
// weight block (wide pitch, 68 floats) 2-way. Under the emulation the mma is the warp
// collective of cuda_shim.h (sc_emu::mma_m16n8k8_tf32), on the same fragments.
__device__ __forceinline__ unsigned int to_tf32(float value) {
#ifndef SPARSECORE_CPU_EMULATION
  unsigned int bits;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(bits) : "f"(value));
  return bits;
#else
  return sc_emu::float_bits(nvcuda::wmma::__float_to_tf32(value));
#endif
}

// d += w r over one m16n8k8 TF32 tile: a warp collective (every lane of the warp calls it).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned int (&w)[4], const unsigned int (&r)[2]) {
#ifndef SPARSECORE_CPU_EMULATION
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(r[0]), "r"(r[1]));
#else
  sc_emu::mma_m16n8k8_tf32(d, w, r);
#endif
}

// What the two mma engines share: the warp's 4 row slices of 8 x 2 column fragments of 16 (four
// float accumulators each, in the m16n8 layout: c0 (n0+g, m0+2t), c1 (n0+g, m0+2t+1), c2
// (n0+g+8, m0+2t), c3 (n0+g+8, m0+2t+1)), which of them a round must multiply, and the epilogue
// through shared memory.
template <typename T, int kStepElements>
struct MmaTile {
  using Acc = float;
  using Stage = T;
  using Geometry = Staging<T, kStepElements>;
  static constexpr int kStep = Geometry::kStep;
  static constexpr int kOutPitch = kTileCols + 4;
  static constexpr int threads = kWmmaThreads;
  static constexpr int kOutBytes = kTileRows * kOutPitch * 4;
  static constexpr int kSharedBytes = Geometry::kStageBytes > kOutBytes ? Geometry::kStageBytes : kOutBytes;
  static constexpr int kSlices = 4;     // 8 rows each
  static constexpr int kFragments = 2;  // 16 columns each

  float acc[kSlices][kFragments][4];

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < kSlices; ++i) {
      for (int j = 0; j < kFragments; ++j) {
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
      }
    }
  }

  // The warp's row slices and column fragments worth multiplying (warp-uniform); false: none.
  __device__ __forceinline__ static bool parts(const Extent& extent, bool (&rows)[kSlices], bool (&columns)[kFragments]) {
    const int warp = threadIdx.x / 32;
    bool any_rows = false;
    for (int i = 0; i < kSlices; ++i) {
      rows[i] = any_present(extent, (warp / 2) * 32 + 8 * i, 8);
      any_rows = any_rows || rows[i];
    }
    for (int j = 0; j < kFragments; ++j) columns[j] = (warp % 2) * 32 + 16 * j < extent.columns;
    return any_rows && columns[0];
  }

  // As WmmaEngine::store: through shared memory, every thread of the block calls it.
  template <typename Write>
  __device__ __forceinline__ void store(unsigned char* shared, Write write) const {
    float* tile = reinterpret_cast<float*>(shared);
    const int warp = threadIdx.x / 32;
    const int g = threadIdx.x % 32 / 4;
    const int t = threadIdx.x % 4;
    for (int i = 0; i < kSlices; ++i) {
      for (int j = 0; j < kFragments; ++j) {
        float* at = tile + ((warp / 2) * 32 + 8 * i + 2 * t) * kOutPitch + (warp % 2) * 32 + 16 * j + g;
        at[0] = acc[i][j][0];
        at[kOutPitch] = acc[i][j][1];
        at[8] = acc[i][j][2];
        at[kOutPitch + 8] = acc[i][j][3];
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTileElements; e += kWmmaThreads) {
      write(e / kTileCols, e % kTileCols, tile[(e / kTileCols) * kOutPitch + e % kTileCols]);
    }
    __syncthreads();  // the tile is rewritten by the next work item
  }
};

struct MmaTf32Engine : MmaTile<float, 16> {
  static constexpr int kK = 8;

  template <bool kARowMajor>
  __device__ __forceinline__ void multiply(const float* a, int lda, const float* b, int ldb, bool b_row_major,
                                           const Extent& extent) {
    bool rows[kSlices];
    bool columns[kFragments];
    if (!parts(extent, rows, columns)) return;
    const int warp = threadIdx.x / 32;
    const int g = threadIdx.x % 32 / 4;
    const int t = threadIdx.x % 4;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    const int b_step = b_row_major ? ldb : 1;    // between reduction elements
    const int b_column = b_row_major ? 1 : ldb;  // between columns
    for (int k = 0; k < kStep && k < extent.reduce; k += kK) {
      unsigned int w[kFragments][4] = {};
      unsigned int r[kSlices][2] = {};
      for (int j = 0; j < kFragments; ++j) {
        if (!columns[j]) continue;
        const float* column = b + (col0 + 16 * j + g) * b_column + (k + t) * b_step;
        w[j][0] = to_tf32(column[0]);
        w[j][1] = to_tf32(column[8 * b_column]);
        w[j][2] = to_tf32(column[4 * b_step]);
        w[j][3] = to_tf32(column[8 * b_column + 4 * b_step]);
      }
      for (int i = 0; i < kSlices; ++i) {
        if (!rows[i]) continue;
        const int m = row0 + 8 * i + g;
        r[i][0] = to_tf32(kARowMajor ? a[m * lda + k + t] : a[(k + t) * lda + m]);
        r[i][1] = to_tf32(kARowMajor ? a[m * lda + k + t + 4] : a[(k + t + 4) * lda + m]);
      }
      for (int i = 0; i < kSlices; ++i) {
        for (int j = 0; j < kFragments; ++j) {
          if (rows[i] && columns[j]) mma_tf32(acc[i][j], w[j], r[i]);
        }
      }
    }
  }
};

// ---------------------------------------------------------------- 16-bit mma engine
// The float16 / bfloat16 engine of both kernels on sm_80+: mma.sync.m16n8k16 with the tile's
// rows on the instruction's n side, as MmaTf32Engine (4 row slices of 8 x 2 column fragments
// of 16 per warp), both types loading their fragments from the staged tiles with ldmatrix
// (wmma compiled bfloat16's to 32-bit shared loads, float16's to ldmatrix). Lane (g, t)
// holds, each register two consecutive reduction elements (the lower in the low half):
//   weight operand w(n, s): w0 (n0+g, k+2t..), w1 (n0+g+8, k+2t..), w2 (n0+g, k+8+2t..), w3 (n0+g+8, k+8+2t..)
//   row operand    r(s, m): r0 (k+2t.., m0+g), r1 (k+8+2t.., m0+g)
//   accumulator as MmaTf32Engine's.
// ldmatrix.x4 gives the four 8 x 8 blocks of the weight operand in one instruction: non-
// transposed from the forward's [column][channel] staging, transposed (.trans) from the input
// gradient's [channel][column] and the weight gradient's [row][output channel]; .x2 the two
// blocks of a row slice from the forward's [row][channel] staging, transposed from the weight
// gradient's [row][input channel]. Each 8-address phase reads 8 rows 16 bytes long at the
// narrow (40-half) or wide (72-half) pitch: 32 distinct banks. Under the emulation ldmatrix
// and the mma are warp collectives of cuda_shim.h on the same registers.
#ifndef SPARSECORE_CPU_EMULATION
__device__ __forceinline__ unsigned int shared_address(const void* pointer) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}
template <bool kTransposed>
__device__ __forceinline__ void load_matrices4(unsigned int (&r)[4], const void* row) {
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
}
template <bool kTransposed>
__device__ __forceinline__ void load_matrices2(unsigned int (&r)[2], const void* row) {
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
  }
}
__device__ __forceinline__ void mma_16(float (&d)[4], const unsigned int (&w)[4], const unsigned int (&r)[2], __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(r[0]), "r"(r[1]));
}
__device__ __forceinline__ void mma_16(float (&d)[4], const unsigned int (&w)[4], const unsigned int (&r)[2],
                                       __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(r[0]), "r"(r[1]));
}
#else
template <bool kTransposed>
__device__ __forceinline__ void load_matrices4(unsigned int (&r)[4], const void* row) {
  sc_emu::ldmatrix<4>(r, row, kTransposed);
}
template <bool kTransposed>
__device__ __forceinline__ void load_matrices2(unsigned int (&r)[2], const void* row) {
  sc_emu::ldmatrix<2>(r, row, kTransposed);
}
template <typename T>
__device__ __forceinline__ void mma_16(float (&d)[4], const unsigned int (&w)[4], const unsigned int (&r)[2], T) {
  sc_emu::mma_m16n8k16<T>(d, w, r);
}
#endif

template <typename T>
struct Mma16Engine : MmaTile<T, 32> {
  using Base = MmaTile<T, 32>;
  static constexpr int kK = 16;

  template <bool kARowMajor>
  __device__ __forceinline__ void multiply(const T* a, int lda, const T* b, int ldb, bool b_row_major,
                                           const Extent& extent) {
    constexpr int kSlices = Base::kSlices;
    constexpr int kFragments = Base::kFragments;
    constexpr int kStep = Base::kStep;
    bool rows[kSlices];
    bool columns[kFragments];
    if (!Base::parts(extent, rows, columns)) return;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int row0 = (warp / 2) * 32;
    const int col0 = (warp % 2) * 32;
    // each lane's row of the 8 x 8 blocks it addresses: block lane / 8, row lane % 8
    const int block_row = lane % 8;
    const int block = lane / 8;
    for (int k = 0; k < kStep && k < extent.reduce; k += kK) {
      unsigned int w[kFragments][4] = {};
      unsigned int r[kSlices][2] = {};
      for (int j = 0; j < kFragments; ++j) {
        if (!columns[j]) continue;
        const int n0 = col0 + 16 * j;
        if (b_row_major) {  // [s][n]: blocks (s 0-7 | 8-15) x (n 0-7 | 8-15), transposed
          load_matrices4<true>(w[j], b + (k + block_row + 8 * (block / 2)) * ldb + n0 + 8 * (block % 2));
        } else {  // [n][s]: blocks (n 0-7 | 8-15) x (s 0-7 | 8-15)
          load_matrices4<false>(w[j], b + (n0 + block_row + 8 * (block % 2)) * ldb + k + 8 * (block / 2));
        }
      }
      for (int i = 0; i < kSlices; ++i) {
        if (!rows[i]) continue;
        if (kARowMajor) {  // [m][s]: blocks m x (s 0-7 | 8-15)
          load_matrices2<false>(r[i], a + (row0 + 8 * i + block_row) * lda + k + 8 * (block % 2));
        } else {  // [s][m]: blocks (s 0-7 | 8-15) x m, transposed
          load_matrices2<true>(r[i], a + (k + block_row + 8 * (block % 2)) * lda + row0 + 8 * i);
        }
      }
      for (int i = 0; i < kSlices; ++i) {
        for (int j = 0; j < kFragments; ++j) {
          if (rows[i] && columns[j]) mma_16(this->acc[i][j], w[j], r[i], T());
        }
      }
    }
  }
};
#endif

template <typename T>
struct HasTensorCores {
  static constexpr bool value = SC_ARCH >= 800;
};
template <>
struct HasTensorCores<__half> {
  static constexpr bool value = SC_ARCH >= 700;
};
template <>
struct HasTensorCores<double> {
  static constexpr bool value = false;
};

template <typename T, bool kTensor, bool kForward>
struct PickEngine {
  using type = SimtEngine<T, kWmmaThreads>;
};
template <typename T>
struct PickEngine<T, true, false> {  // float16's weight gradient on sm_75: 16 x 16 fragments
  using type = WmmaEngine<T>;
};
template <typename T>
struct PickEngine<T, true, true> {  // float16's forward on sm_75: wmma 8 x 32 fragments (8-row skips)
  using type = WmmaEngine<T, 8, 32>;
};
#if SC_ARCH >= 800
template <>
struct PickEngine<float, true, true> {  // the TF32 forward: mma.sync m16n8k8 (8-row skips)
  using type = MmaTf32Engine;
};
template <>
struct PickEngine<__half, true, true> {  // sm_80+: mma.sync m16n8k16, ldmatrix fragments
  using type = Mma16Engine<__half>;
};
template <>
struct PickEngine<__nv_bfloat16, true, true> {
  using type = Mma16Engine<__nv_bfloat16>;
};
// The weight gradient on sm_80+ too: its tile rows are input channels (8-channel slices), its
// reduction the map's rows.
template <>
struct PickEngine<float, true, false> {
  using type = MmaTf32Engine;
};
template <>
struct PickEngine<__half, true, false> {
  using type = Mma16Engine<__half>;
};
template <>
struct PickEngine<__nv_bfloat16, true, false> {
  using type = Mma16Engine<__nv_bfloat16>;
};
#endif

// kForward: sc_implicit_gemm (forward and input gradient), else sc_weight_gradient.
template <typename T, typename Math, bool kForward>
struct EngineOf {
  using type = SimtEngine<T, kSimtThreads>;
};
template <typename T, bool kForward>
struct EngineOf<T, Wmma, kForward> {
  using type = typename PickEngine<T, HasTensorCores<T>::value, kForward>::type;
};

// The block's shared memory: per-row indices (two buffers each, for the pipeline), the
// tile's OR mask words, and the staging (or epilogue) bytes.
template <typename Engine>
struct Shared {
  int rows[kTileRows];
  int found[2][kTileRows];
  int other[2][kTileRows];
  unsigned int words[kMaxMaskWords];
  int flag;
  alignas(128) unsigned char bytes[Engine::kSharedBytes];
};

// The next offset after `after` present in the tile's OR words, or -1.
__device__ __forceinline__ int next_offset(const unsigned int* words, int mask_words, int after) {
  int w = (after + 1) / 32;
  if (w >= mask_words) return -1;
  unsigned int word = words[w] & (~0u << ((after + 1) % 32));
  while (word == 0u) {
    if (++w >= mask_words) return -1;
    word = words[w];
  }
  return w * 32 + __ffs(word) - 1;
}

// The two-stage pipeline of a work item's rounds: round r + 1's copies are issued
// before round r is multiplied. Round: {bool valid; ...}; next(round) the round after;
// same_rows(a, b) whether b reuses a's row indices; load_rows(round, buffer) fills a
// row-index buffer (threads < 64, plain loads); issue(round, stage, buffer) stages
// operands; multiply(round, stage, buffer). Every thread runs the same rounds
// (block-uniform).
template <typename Round, typename Next, typename SameRows, typename LoadRows, typename Issue, typename Multiply>
__device__ __forceinline__ void run_rounds(Round round, Next next, SameRows same_rows, LoadRows load_rows, Issue issue,
                                           Multiply multiply) {
  if (!round.valid) return;
  int buffer = 0;
  load_rows(round, buffer);
  __syncthreads();
  issue(round, 0, buffer);
  commit_copies();
  int stage = 0;
  while (round.valid) {
    const Round following = next(round);
    int following_buffer = buffer;
    if (following.valid) {
      if (!same_rows(round, following)) {
        following_buffer = buffer ^ 1;
        load_rows(following, following_buffer);
      }
      __syncthreads();  // the new row indices are visible; stage ^ 1 was multiplied and released
      issue(following, stage ^ 1, following_buffer);
      commit_copies();
      wait_copies<1>();  // this round's copies have landed
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    multiply(round, stage, buffer);
    __syncthreads();  // stage is rewritten two rounds on
    round = following;
    buffer = following_buffer;
    stage ^= 1;
  }
}

// The per-offset row-tile bit sets of a row plan (neighbour_map.cu section 4): word c of
// offset k (bit j: row tile 32 c + j holds k) is the high word of slot k * chunks + c.
struct TileSets {
  const unsigned int* words;  // nullptr: no bit sets, every row tile is walked
  long long chunks;
  long long row_tiles;

  __device__ __forceinline__ unsigned int word(int k, long long c) const {
    return __ldg(words + 2 * (static_cast<long long>(k) * chunks + c) + 1);
  }
  // Row tiles holding offset k.
  __device__ __forceinline__ long long count(int k) const {
    if (words == nullptr) return row_tiles;
    long long total = 0;
    for (long long c = 0; c < chunks; ++c) total += __popc(word(k, c));
    return total;
  }
  // The row tile of rank `rank` (0-based) among those holding k, or -1.
  __device__ __forceinline__ long long at(int k, long long rank) const {
    if (words == nullptr) return rank < row_tiles ? rank : -1;
    for (long long c = 0; c < chunks; ++c) {
      unsigned int bits = word(k, c);
      const int held = __popc(bits);
      if (rank < held) {
        for (; rank > 0; --rank) bits &= bits - 1u;  // drop the lowest set bits
        return c * 32 + __ffs(bits) - 1;
      }
      rank -= held;
    }
    return -1;
  }
  // The next row tile after `tile` holding k, or -1.
  __device__ __forceinline__ long long after(int k, long long tile) const {
    if (words == nullptr) return tile + 1 < row_tiles ? tile + 1 : -1;
    long long c = (tile + 1) / 32;
    if (c >= chunks) return -1;
    unsigned int bits = (tile + 1) % 32 == 0 ? word(k, c) : word(k, c) & (~0u << ((tile + 1) % 32));
    while (bits == 0u) {
      if (++c >= chunks) return -1;
      bits = word(k, c);
    }
    return c * 32 + __ffs(bits) - 1;
  }
};

}  // namespace sc

// ------------------------------------------------- sc_implicit_gemm's offset splits
namespace sc {

// The offset of rank `rank` (0-based, ascending) among those set in the tile's OR words, or -1.
__device__ __forceinline__ int nth_offset(const unsigned int* words, int mask_words, int rank) {
  for (int w = 0; w < mask_words; ++w) {
    unsigned int word = words[w];
    const int count = __popc(word);
    if (rank < count) {
      for (int r = 0; r < rank; ++r) word &= word - 1u;  // clear the lowest set bits
      return w * 32 + __ffs(word) - 1;
    }
    rank -= count;
  }
  return -1;
}

// The offsets set in the tile's OR words.
__device__ __forceinline__ int count_offsets(const unsigned int* words, int mask_words) {
  int count = 0;
  for (int w = 0; w < mask_words; ++w) count += __popc(words[w]);
  return count;
}

// Split `split` of `splits` takes the offsets of ranks [split * present / splits,
// (split + 1) * present / splits) among the tile's `present` ones: equal shares (within
// one), the same in every block of the tile, empty where split * present / splits does
// not grow. (split * present < 2^22: at most kMaxMaskWords * 32 offsets and splits.)
__device__ __forceinline__ int split_rank(int split, int splits, int present) {
  return split * present / splits;
}

// The last block of a tile: for every element it writes (tile row m with rows[m] >= 0,
// column n < columns), the sum of the non-empty splits' partials (tile_partials + s *
// kTileElements, row-major [m][n]) taken in split order 0, 1, ..., then the bias
// (has_bias), rounded once and written to out[rows[m] * out_pitch + n]. A thread sums
// kChunk consecutive elements at a time and loads them from kGroup splits before adding
// (kChunk * kGroup loads in flight; an empty split's stale partial is never read).
template <typename T, typename Acc, int kThreads>
__device__ __forceinline__ void sum_split_partials(const Acc* __restrict__ tile_partials, int splits, int present,
                                                   const int* rows, int columns, const T* __restrict__ bias,
                                                   bool has_bias, T* __restrict__ out, long long out_pitch) {
  constexpr int kChunk = 16 / static_cast<int>(sizeof(Acc));  // 4 floats or 2 doubles
  constexpr int kGroup = 4;
  static_assert(kTileElements % (kThreads * kChunk) == 0, "the tile's elements spread evenly over the block");
  for (int first = threadIdx.x * kChunk; first < kTileElements; first += kThreads * kChunk) {
    const int m = first / kTileCols;
    const int n = first % kTileCols;
    const int row = rows[m];
    if (row < 0 || n >= columns) continue;
    Acc sum[kChunk];
    for (int i = 0; i < kChunk; ++i) sum[i] = Acc(0);
    for (int s0 = 0; s0 < splits; s0 += kGroup) {
      Acc value[kGroup][kChunk];
      for (int j = 0; j < kGroup; ++j) {
        const int s = s0 + j;
        const bool written = s < splits && split_rank(s, splits, present) < split_rank(s + 1, splits, present);
        const Acc* partial = tile_partials + static_cast<long long>(s) * kTileElements + first;
        for (int i = 0; i < kChunk; ++i) value[j][i] = written ? __ldcg(partial + i) : Acc(0);
      }
      // in split order; adding the 0 of a missing split leaves a sum (never -0: it starts at +0) unchanged
      for (int j = 0; j < kGroup; ++j) {
        for (int i = 0; i < kChunk; ++i) sum[i] += value[j][i];
      }
    }
    for (int i = 0; i < kChunk && n + i < columns; ++i) {
      Acc value = sum[i];
      if (has_bias) value += static_cast<Acc>(widen(bias[n + i]));
      out[static_cast<long long>(row) * out_pitch + n + i] = narrow<T>(value);
    }
  }
}

// sc_implicit_gemm's launch bounds: its engine's threads, and the blocks per SM that its
// registers must allow (ptxas keeps them within 65,536 / (threads * blocks)): the residency
// of tile_shapes._FORWARD, which sizes the offset splits. Without the bound, ptxas' choice
// moved by tens of registers with small edits. sm_75 keeps 4 blocks of 128 threads for the
// tensor-core types (its SIMT fallback and float16 wmma need ~115 registers there); the NVRTC
// tests check that no instantiation spills on sm_75 .. sm_90.
template <typename T, typename Math>
struct ForwardBlocks {
  static constexpr int value = 4;  // float SIMT, the 16-bit types' SIMT (narrow reductions)
};
template <>
struct ForwardBlocks<double, Simt> {
  static constexpr int value = 2;
};
template <>
struct ForwardBlocks<__half, Wmma> {  // sm_86 and sm_89 spill a few bytes at 6 (80 registers)
  static constexpr int value = SC_ARCH == 800 || SC_ARCH >= 900 ? 6 : SC_ARCH >= 800 ? 5 : 4;
};
template <>
struct ForwardBlocks<__nv_bfloat16, Wmma> {
  static constexpr int value = ForwardBlocks<__half, Wmma>::value;
};
template <>
struct ForwardBlocks<float, Wmma> {  // TF32
  static constexpr int value = SC_ARCH >= 800 ? 5 : 4;
};

// sc_weight_gradient's, likewise: tile_shapes._WEIGHT_GRADIENT's residency. Without any bound
// sm_75 gave float32 SIMT 93 registers (2 blocks); with the threads alone ptxas took more
// registers for the tensor-core types (float16 93 -> 128 on sm_90), so every type is pinned.
template <typename T, typename Math>
struct WeightGradientBlocks {
  static constexpr int value = 3;  // float SIMT
};
template <>
struct WeightGradientBlocks<double, Simt> {
  static constexpr int value = 2;
};
template <>
struct WeightGradientBlocks<__half, Wmma> {
  static constexpr int value = SC_ARCH >= 800 ? 5 : 4;
};
template <>
struct WeightGradientBlocks<__nv_bfloat16, Wmma> {
  static constexpr int value = SC_ARCH >= 800 ? 4 : 3;
};
template <>
struct WeightGradientBlocks<float, Wmma> {  // TF32: sm_80 spills 4 bytes at 4
  static constexpr int value = SC_ARCH == 800 ? 3 : 4;
};

}  // namespace sc

#ifdef SPARSECORE_CPU_EMULATION
#define SC_LAUNCH_BOUNDS(threads, blocks)
#else
#define SC_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#endif

// Forward (flags & 2 == 0) or input gradient (flags & 2) of a convolution over a map.
//   source     T      [num_source, groups * S]   features (forward) or grad_out (input gradient)
//   weight     T      [groups * b, K, a]         spconv's layout, contiguous
//   bias       T      [groups * b]               read when flags & 4 (forward only); else any array
//   neighbours int32  [num_rows, K]              the written side's table (-1: none)
//   masks      uint32 [num_rows, mask_words]     mask_words <= kMaxMaskWords
//   order      int32  [num_rows * order_step]    a permutation of the rows at order[p * order_step]
//   flags      1: reversed offsets (table column k is weight offset K - 1 - k),
//              2: transposed weights (the input gradient: M_k = W_k^T), 4: add the bias
//   splits     offset splits per output tile (>= 1): tiles * splits work items
//   scratch    uint32, used when splits > 1: counters [counter_words] (one per output tile,
//              zero on entry, left zero on exit), then the partials, Acc [tiles * splits * 4096]
//              from word counter_words (an even number); never zeroed, only written before read
//   out        T      [num_rows, groups * D]     every row written once (D = b forward, a transposed)
// S = a, D = b forward; S = b, D = a for the input gradient.
// Staging: the gathered rows a(m, s) row-major [64][kStep + pad]; the weight block b(s, n)
// as [n][s] forward (a weight row's channels are contiguous) and [s][n] transposed.
// Offset splits (a layer with fewer output tiles than the GPU has block slots): work item
// (tile, split) multiplies only its share of the tile's offsets (sc::split_rank) and writes
// its partial tile to scratch; the last of the tile's blocks to finish (an atomic counter
// after a __threadfence: it decides who sums, not what) adds the partials in split order,
// then the bias, and writes the rows, and sets the counter back to 0. Results depend on
// `splits` (the host chooses it from sizes only), never on the blocks' timing.
template <typename T, typename Math>
SC_LAUNCH_BOUNDS((sc::EngineOf<T, Math, true>::type::threads), (sc::ForwardBlocks<T, Math>::value))
__global__ void sc_implicit_gemm(const T* __restrict__ source, const T* __restrict__ weight,
                                 const T* __restrict__ bias, const int* __restrict__ neighbours,
                                 const unsigned int* __restrict__ masks, const int* __restrict__ order,
                                 int order_step, long long num_rows, int volume, int mask_words, int groups,
                                 int in_per_group, int out_per_group, int flags, int splits,
                                 unsigned int* __restrict__ scratch, long long counter_words, T* __restrict__ out) {
  using Engine = typename sc::EngineOf<T, Math, true>::type;
  using Geometry = typename Engine::Geometry;
  using Acc = typename Engine::Acc;
  constexpr int kStep = Engine::kStep;
  constexpr int kThreads = Engine::threads;
  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  if (blockDim.x != kThreads || mask_words > sc::kMaxMaskWords) __trap();
  const bool reversed = (flags & 1) != 0;
  const bool transposed = (flags & 2) != 0;
  const bool has_bias = (flags & 4) != 0;
  const int reduce = transposed ? out_per_group : in_per_group;
  const int width = transposed ? in_per_group : out_per_group;
  // channel pitches and weight strides in 32 bits (fewer registers: every product with a row or
  // channel index below is taken in 64 bits); the launch wrapper checks that they fit
  const int source_pitch = groups * reduce;
  const int out_pitch = groups * width;
  const int weight_row = volume * in_per_group;  // between output channels
  const int reduce_stride = transposed ? weight_row : 1;
  const int width_stride = transposed ? 1 : weight_row;
  const int col_tiles = (width + sc::kTileCols - 1) / sc::kTileCols;
  const long long tiles = (num_rows + sc::kTileRows - 1) / sc::kTileRows * groups * col_tiles;
  // work items are counted in 32 bits (their divisions stay short); the launch wrapper checks the count
  const bool bad_splits = splits < 1 || splits > sc::kMaxMaskWords * 32 || tiles * splits > 0x7fffffffLL;
  if (bad_splits || (splits > 1 && (counter_words < tiles || counter_words % 2 != 0))) __trap();
  const int items = static_cast<int>(tiles * splits);
  const bool vector_a = sc::aligned16(source) && source_pitch % kVector == 0 && reduce % kVector == 0;
  const bool vector_b = sc::aligned16(weight) && in_per_group % kVector == 0;
  const int tid = threadIdx.x;

  __shared__ sc::Shared<Engine> shared;
  T* stage_bytes = reinterpret_cast<T*>(shared.bytes);
  constexpr int kOperand = Geometry::kOperandBytes / static_cast<int>(sizeof(T));

  struct Round {
    bool valid;
    int k;
    int s0;
  };

  const long long row_tiles = (num_rows + sc::kTileRows - 1) / sc::kTileRows;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    // a tile's splits are consecutive work items, so its blocks run side by side; the last row tiles
    // first: in mask order (ascending) they hold the most offsets, the heaviest work
    const int tile = item / splits;
    const int split = item - tile * splits;
    const int tile_item = tile / (groups * col_tiles);
    const long long row_tile = row_tiles - 1 - tile_item;
    const int rest = tile - tile_item * groups * col_tiles;
    const int g = rest / col_tiles;
    const int col0 = (rest - g * col_tiles) * sc::kTileCols;
    if (tid < mask_words) shared.words[tid] = 0u;
    if (tid < sc::kTileRows) {
      const long long position = row_tile * sc::kTileRows + tid;
      // positions are < 2^31 (the wrapper checks), so position * order_step fits 32 unsigned bits
      shared.rows[tid] = position < num_rows
                             ? __ldg(order + static_cast<unsigned int>(position) * static_cast<unsigned int>(order_step))
                             : -1;
    }
    Engine engine;
    engine.clear();
    __syncthreads();
    if (tid < sc::kTileRows && shared.rows[tid] >= 0) {
      for (int w = 0; w < mask_words; ++w) {
        atomicOr(shared.words + w, __ldg(masks + static_cast<long long>(shared.rows[tid]) * mask_words + w));
      }
    }
    __syncthreads();
    const T* rows_of_group = source + static_cast<long long>(g) * reduce;
    const T* group_weight = weight + static_cast<long long>(g) * out_per_group * weight_row;
    const int width_count = width - col0 < sc::kTileCols ? width - col0 : sc::kTileCols;
    int first_offset, stop_offset;  // this split's offsets: [first_offset, stop_offset) of the tile's
    {
      const int present = sc::count_offsets(shared.words, mask_words);
      const int first_rank = sc::split_rank(split, splits, present);
      const int stop_rank = sc::split_rank(split + 1, splits, present);
      first_offset = first_rank < stop_rank ? sc::nth_offset(shared.words, mask_words, first_rank) : -1;
      stop_offset = stop_rank < present ? sc::nth_offset(shared.words, mask_words, stop_rank) : volume;
    }
    sc::run_rounds(
        Round{first_offset >= 0, first_offset, 0},
        [&](const Round& round) {
          if (round.s0 + kStep < reduce) return Round{true, round.k, round.s0 + kStep};
          const int k = sc::next_offset(shared.words, mask_words, round.k);
          return Round{k >= 0 && k < stop_offset, k, 0};
        },
        [](const Round& a, const Round& b) { return a.k == b.k; },
        [&](const Round& round, int buffer) {
          if (tid < sc::kTileRows) {
            const int row = shared.rows[tid];
            shared.found[buffer][tid] =
                row >= 0 ? __ldg(neighbours + static_cast<long long>(row) * volume + round.k) : -1;
          }
        },
        [&](const Round& round, int stage, int buffer) {
          T* a = stage_bytes + stage * 2 * kOperand;
          T* b = a + kOperand;
          const int count = reduce - round.s0 < kStep ? reduce - round.s0 : kStep;
          const int* found = shared.found[buffer];
          sc::stage_rows<T, kStep>(a, Geometry::kNarrowPitch, sc::kTileRows, count, vector_a, source,
                                   [&](int m) -> const T* {
                                     const int row = found[m];
                                     if (row < 0) return nullptr;
                                     return rows_of_group + static_cast<long long>(row) * source_pitch + round.s0;
                                   });
          const int weight_offset = reversed ? volume - 1 - round.k : round.k;
          const T* block = group_weight + static_cast<long long>(weight_offset) * in_per_group +
                           static_cast<long long>(col0) * width_stride;
          if (!transposed) {  // b(s, n) = block[n * weight_row + s]: [n][s]
            sc::stage_rows<T, kStep>(b, Geometry::kNarrowPitch, sc::kTileCols, count, vector_b, weight,
                                     [&](int n) -> const T* {
                                       if (n >= width_count) return nullptr;
                                       return block + static_cast<long long>(n) * width_stride + round.s0;
                                     });
          } else {  // b(s, n) = block[s * weight_row + n]: [s][n]
            sc::stage_rows<T, sc::kTileCols>(b, Geometry::kWidePitch, kStep, width_count, vector_b, weight,
                                             [&](int s) -> const T* {
                                               if (round.s0 + s >= reduce) return nullptr;
                                               return block + static_cast<long long>(round.s0 + s) * reduce_stride;
                                             });
          }
        },
        [&](const Round& round, int stage, int buffer) {
          const T* a = stage_bytes + stage * 2 * kOperand;
          const int count = reduce - round.s0 < kStep ? reduce - round.s0 : kStep;
          engine.template multiply<true>(a, Geometry::kNarrowPitch, a + kOperand,
                                         transposed ? Geometry::kWidePitch : Geometry::kNarrowPitch, transposed,
                                         sc::Extent{shared.found[buffer], sc::kTileRows, count, width_count});
        });
    const T* group_bias = bias + static_cast<long long>(g) * width + col0;
    T* group_out = out + static_cast<long long>(g) * width + col0;
    auto finish = [&](int m, int n, Acc value) {  // the epilogue: bias, one rounding, the row's one write
      const int row = shared.rows[m];
      if (row >= 0 && n < width_count) {
        if (has_bias) value += static_cast<Acc>(sc::widen(group_bias[n]));
        group_out[static_cast<long long>(row) * out_pitch + n] = sc::narrow<T>(value);
      }
    };
    if (splits == 1) {
      engine.store(shared.bytes, finish);
    } else {
      // recomputed from item and the words rather than kept in registers through the rounds
      const int first_item = item - item % splits;  // the tile's split 0
      const int own_split = item - first_item;
      const int present = sc::count_offsets(shared.words, mask_words);
      Acc* tile_partials = reinterpret_cast<Acc*>(scratch + counter_words) +
                           static_cast<long long>(first_item) * sc::kTileElements;
      unsigned int* counter = scratch + first_item / splits;
      // block-uniform; an empty split writes nothing, and nothing reads it
      if (sc::split_rank(own_split, splits, present) < sc::split_rank(own_split + 1, splits, present)) {
        Acc* own = tile_partials + static_cast<long long>(own_split) * sc::kTileElements;
        engine.store(shared.bytes, [&](int m, int n, Acc value) {
          if (shared.rows[m] >= 0 && n < width_count) own[m * sc::kTileCols + n] = value;
        });
      }
      __threadfence();  // this split's partial before its count
      __syncthreads();
      if (tid == 0) shared.flag = atomicAdd(counter, 1u) == static_cast<unsigned int>(splits - 1);
      __syncthreads();
      if (shared.flag) {  // every split of the tile is written: sum them in split order
        __threadfence();
        sc::sum_split_partials<T, Acc, kThreads>(tile_partials, splits, present, shared.rows, width_count,
                                                 group_bias, has_bias, group_out, out_pitch);
        if (tid == 0) *counter = 0u;  // ready for the next launch on this scratch
      }
    }
    __syncthreads();  // rows, words and flag are rewritten by the next work item
  }
}

// The weight gradient of a convolution over the output side of its map.
//   features   T     [num_input, groups * a]
//   grad_out   T     [num_rows, groups * b]
//   neighbours int32 [num_rows, K]       the output side (not reversed)
//   order      int32 [num_rows * order_step]  as for sc_implicit_gemm; order_step 2 (a row
//              plan) with mask_words <= 2 and K * ceil(row_tiles / 32) <= num_rows: the
//              plan's high words hold the per-offset row-tile bit sets (TileSets)
//   mask_words the side's mask words (the masks themselves are not read)
//   splits     row splits per tile (>= 1): split s of offset k walks the s-th of `splits`
//              equal chunks of the row tiles holding k (every row tile without bit sets)
//   scratch    Acc   zeroed on entry, layout: partials [tiles * splits * 4096] (used when
//              splits > 1), then 32-bit counters [tiles], left zero on exit
//   grad_weight T    [groups * b, K, a]  every element written once
// tiles = K * groups * ceil(a / 64) * ceil(b / 64); work items = tiles * splits, offsets
// fastest (so the first blocks cover every offset).
// Staging: features a(c, r) as [r][c] (column-major), grad_out b(r, j) as [r][j].
template <typename T, typename Math>
SC_LAUNCH_BOUNDS((sc::EngineOf<T, Math, false>::type::threads), (sc::WeightGradientBlocks<T, Math>::value))
__global__ void sc_weight_gradient(const T* __restrict__ features, const T* __restrict__ grad_out,
                                   const int* __restrict__ neighbours, const int* __restrict__ order,
                                   int order_step, long long num_rows, int volume,
                                   int mask_words, int groups, int in_per_group, int out_per_group, int splits,
                                   typename sc::Accumulator<T>::type* __restrict__ scratch,
                                   T* __restrict__ grad_weight) {
  using Engine = typename sc::EngineOf<T, Math, false>::type;
  using Geometry = typename Engine::Geometry;
  using Acc = typename Engine::Acc;
  static_assert(sizeof(Acc) == sizeof(typename sc::Accumulator<T>::type), "partials are kept in Accumulator<T>");
  constexpr int kStep = Engine::kStep;
  constexpr int kThreads = Engine::threads;
  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  if (blockDim.x != kThreads) __trap();
  const int in_tiles = (in_per_group + sc::kTileRows - 1) / sc::kTileRows;
  const int out_tiles = (out_per_group + sc::kTileCols - 1) / sc::kTileCols;
  const long long tiles = static_cast<long long>(volume) * groups * in_tiles * out_tiles;
  const long long row_tiles = (num_rows + sc::kTileRows - 1) / sc::kTileRows;
  const long long chunks = (row_tiles + 31) / 32;
  const bool bit_sets = order_step == 2 && mask_words <= 2 && static_cast<long long>(volume) * chunks <= num_rows;
  const sc::TileSets sets{bit_sets ? reinterpret_cast<const unsigned int*>(order) : nullptr, chunks, row_tiles};
  const long long in_pitch = static_cast<long long>(groups) * in_per_group;
  const long long out_pitch = static_cast<long long>(groups) * out_per_group;
  Acc* partials = scratch;
  unsigned int* counters =
      reinterpret_cast<unsigned int*>(partials + (splits > 1 ? tiles * splits * sc::kTileElements : 0));
  const bool vector_a = sc::aligned16(features) && in_pitch % kVector == 0 && in_per_group % kVector == 0;
  const bool vector_b = sc::aligned16(grad_out) && out_pitch % kVector == 0 && out_per_group % kVector == 0;
  const int tid = threadIdx.x;

  __shared__ sc::Shared<Engine> shared;
  T* stage_bytes = reinterpret_cast<T*>(shared.bytes);
  constexpr int kOperand = Geometry::kOperandBytes / static_cast<int>(sizeof(T));

  struct Round {
    bool valid;
    long long tile;  // the row tile
    int r0;
  };

  for (long long item = blockIdx.x; item < tiles * splits; item += gridDim.x) {
    const int k = static_cast<int>(item % volume);
    long long rest = item / volume;
    const int split = static_cast<int>(rest % splits);
    rest /= splits;
    const int out_tile = static_cast<int>(rest % out_tiles);
    rest /= out_tiles;
    const int in_tile = static_cast<int>(rest % in_tiles);
    const int g = static_cast<int>(rest / in_tiles);
    const long long tile = ((static_cast<long long>(k) * groups + g) * in_tiles + in_tile) * out_tiles + out_tile;
    const int c0 = in_tile * sc::kTileRows;
    const int j0 = out_tile * sc::kTileCols;
    const long long count = sets.count(k);  // the same in every thread
    const long long per_split = (count + splits - 1) / splits;
    const long long first = split * per_split;
    const long long stop = first + per_split < count ? first + per_split : count;
    const T* group_features = features + static_cast<long long>(g) * in_per_group + c0;
    const T* group_grad = grad_out + static_cast<long long>(g) * out_per_group + j0;
    const int in_count = in_per_group - c0 < sc::kTileRows ? in_per_group - c0 : sc::kTileRows;
    const int out_count = out_per_group - j0 < sc::kTileCols ? out_per_group - j0 : sc::kTileCols;
    Engine engine;
    engine.clear();
    const long long last = first < stop ? sets.at(k, stop - 1) : -1;  // the split's last row tile
    sc::run_rounds(
        Round{first < stop, first < stop ? sets.at(k, first) : -1, 0},
        [&](const Round& round) {
          if (round.r0 + kStep < sc::kTileRows) return Round{true, round.tile, round.r0 + kStep};
          const bool more = round.tile != last;
          return Round{more, more ? sets.after(k, round.tile) : -1, 0};
        },
        [](const Round& a, const Round& b) { return a.tile == b.tile; },
        [&](const Round& round, int buffer) {
          if (tid < sc::kTileRows) {
            const long long position = round.tile * sc::kTileRows + tid;
            const int row = position < num_rows ? __ldg(order + static_cast<unsigned int>(position) *
                                                                     static_cast<unsigned int>(order_step))
                                                : -1;
            shared.other[buffer][tid] = row;
            shared.found[buffer][tid] = row >= 0 ? __ldg(neighbours + static_cast<long long>(row) * volume + k) : -1;
          }
        },
        [&](const Round& round, int stage, int buffer) {
          T* a = stage_bytes + stage * 2 * kOperand;
          T* b = a + kOperand;
          const int* found = shared.found[buffer] + round.r0;
          const int* rows = shared.other[buffer] + round.r0;
          sc::stage_rows<T, sc::kTileRows>(a, Geometry::kWidePitch, kStep, in_count, vector_a, features,
                                           [&](int r) -> const T* {
                                             const int input = found[r];
                                             return input >= 0 ? group_features + input * in_pitch : nullptr;
                                           });
          sc::stage_rows<T, sc::kTileCols>(b, Geometry::kWidePitch, kStep, out_count, vector_b, grad_out,
                                           [&](int r) -> const T* {
                                             return found[r] >= 0 ? group_grad + rows[r] * out_pitch : nullptr;
                                           });
        },
        [&](const Round& round, int stage, int buffer) {
          const int* found = shared.found[buffer] + round.r0;
          bool any = false;  // the same in every thread: a round without the offset is skipped
          for (int r = 0; r < kStep; ++r) any = any || found[r] >= 0;
          if (!any) return;
          const T* a = stage_bytes + stage * 2 * kOperand;
          engine.template multiply<false>(a, Geometry::kWidePitch, a + kOperand, Geometry::kWidePitch, true,
                                          sc::Extent{nullptr, in_count, kStep, out_count});
        });
    // dW[(g * b + j) * K + k][c] for this tile's element (c, j) = (m, n)
    T* tile_weight = grad_weight + (static_cast<long long>(g) * out_per_group + j0) * volume * in_per_group +
                     static_cast<long long>(k) * in_per_group + c0;
    const long long weight_row = static_cast<long long>(volume) * in_per_group;
    if (splits == 1) {
      engine.store(shared.bytes, [&](int m, int n, Acc value) {
        if (m < in_count && n < out_count) tile_weight[n * weight_row + m] = sc::narrow<T>(value);
      });
      __syncthreads();  // flag is rewritten by the next work item
      continue;
    }
    Acc* own = partials + (tile * splits + split) * sc::kTileElements;
    engine.store(shared.bytes, [&](int m, int n, Acc value) { own[m * sc::kTileCols + n] = value; });
    __threadfence();  // this split's partials before its count
    __syncthreads();
    if (tid == 0) shared.flag = atomicAdd(counters + tile, 1u) == static_cast<unsigned int>(splits - 1);
    __syncthreads();
    if (shared.flag) {  // every split of the tile is written: sum them in split order
      __threadfence();
      const Acc* tile_partials = partials + tile * splits * sc::kTileElements;
      for (int e = tid; e < sc::kTileElements; e += kThreads) {
        const int m = e / sc::kTileCols;
        const int n = e - m * sc::kTileCols;
        if (m < in_count && n < out_count) {
          Acc sum = Acc(0);
          for (int s = 0; s < splits; ++s) sum += __ldcg(tile_partials + static_cast<long long>(s) * sc::kTileElements + e);
          tile_weight[n * weight_row + m] = sc::narrow<T>(sum);
        }
      }
      if (tid == 0) counters[tile] = 0u;
    }
    __syncthreads();  // flag is rewritten by the next work item
  }
}
