// gather_scatter.cu: row gathers and deterministic row scatters for the
// gather -> GEMM -> scatter feature passes.
//
// All matrices are dense row-major and contiguous: [rows, channels] with
// element (r, j) at r * channels + j. T is float, double, __half or
// __nv_bfloat16; sums are carried in Acc (float for the first three and the
// 16-bit types, double for double) and rounded to T once, at the store.
// No kernel here uses atomics: every output element is written by exactly one
// thread, so results are bitwise reproducible.
//
// Vectorised access: the row kernels take `vector`, the number of consecutive
// elements each thread moves as one aligned access (1, 2, 4 or 8; the caller
// picks it so that channels % vector == 0, vector * sizeof(T) <= 16 and every
// array's base address is a multiple of vector * sizeof(T)). The arithmetic is
// the same element by element for any vector, so results do not depend on it.

#include "sc_common.cuh"

namespace sc {

// N consecutive elements of T moved as one aligned load or store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T lane[N];
};

// A vector width as a type, so a runtime width can select a template instance.
template <int N>
struct Width {
  static constexpr int value = N;
};

// Calls body(Width<N>()) for the runtime `vector` (8, 4, 2, else 1).
template <typename Body>
__device__ __forceinline__ void with_vector_width(int vector, Body body) {
  switch (vector) {
    case 8: body(Width<8>()); break;
    case 4: body(Width<4>()); break;
    case 2: body(Width<2>()); break;
    default: body(Width<1>()); break;
  }
}

// The grid-stride loop over the N-element packs of [rows, channels] matrices:
// body(e, r, q, packs, in, out) for pack e = r * packs + q (packs = channels / N),
// with the matrices `in` (read) and `out` seen as arrays of packs.
template <typename T, int N, typename Body>
__device__ __forceinline__ void for_each_pack(long long rows, long long channels, const T* __restrict__ in,
                                              T* __restrict__ out, Body body) {
  using P = Packed<T, N>;
  const long long packs = channels / N;
  const P* in_packs = reinterpret_cast<const P*>(in);
  P* out_packs = reinterpret_cast<P*>(out);
  for_each_element(rows, packs, [&](long long e, long long r, long long q) {
    body(e, r, q, packs, in_packs, out_packs);
  });
}

template <typename T, int N>
__device__ __forceinline__ void gather_rows_packed(const T* __restrict__ src, const int* __restrict__ rows,
                                                   long long m, long long channels, T* __restrict__ out) {
  Packed<T, N> zero;
  for (int i = 0; i < N; ++i) {
    zero.lane[i] = narrow<T>(typename Accumulator<T>::type(0));
  }
  for_each_pack<T, N>(m, channels, src, out, [&](long long e, long long r, long long q, long long packs,
                                                 const Packed<T, N>* src_packs, Packed<T, N>* out_packs) {
    const int row = __ldg(rows + r);
    out_packs[e] = row >= 0 ? src_packs[static_cast<long long>(row) * packs + q] : zero;
  });
}

template <typename T, int N>
__device__ __forceinline__ void scatter_add_rows_packed(const T* __restrict__ src, const int* __restrict__ rows,
                                                        long long m, long long channels, T* __restrict__ dst) {
  for_each_pack<T, N>(m, channels, src, dst, [&](long long e, long long r, long long q, long long packs,
                                                 const Packed<T, N>* src_packs, Packed<T, N>* dst_packs) {
    const int row = __ldg(rows + r);
    if (row < 0) {
      return;
    }
    const Packed<T, N> addend = src_packs[e];
    Packed<T, N>* target = dst_packs + static_cast<long long>(row) * packs + q;
    Packed<T, N> value = *target;
    for (int i = 0; i < N; ++i) {
      value.lane[i] = narrow<T>(widen(value.lane[i]) + widen(addend.lane[i]));
    }
    *target = value;
  });
}

template <typename T, typename Acc, int N>
__device__ __forceinline__ void sum_run_rows_packed(const T* __restrict__ src, const int* __restrict__ slots,
                                                    long long num_runs, long long slot_stride, long long n,
                                                    long long channels, T* __restrict__ dst) {
  for_each_pack<T, N>(n, channels, src, dst, [&](long long e, long long r, long long q, long long packs,
                                                 const Packed<T, N>* src_packs, Packed<T, N>* dst_packs) {
    Acc acc[N];
    for (int i = 0; i < N; ++i) {
      acc[i] = Acc(0);
    }
    for (long long run = 0; run < num_runs; ++run) {
      const int p = __ldg(slots + run * slot_stride + r);
      if (p >= 0) {
        const Packed<T, N> value = src_packs[static_cast<long long>(p) * packs + q];
        for (int i = 0; i < N; ++i) {
          acc[i] += static_cast<Acc>(widen(value.lane[i]));
        }
      }
    }
    Packed<T, N> value = dst_packs[e];
    for (int i = 0; i < N; ++i) {
      value.lane[i] = narrow<T>(static_cast<Acc>(widen(value.lane[i])) + acc[i]);
    }
    dst_packs[e] = value;
  });
}

}  // namespace sc

// out[r, :] = src[rows[r], :] for r < m, or zeros where rows[r] < 0.
//   src  T     [N, channels]
//   rows int32 [m]            each -1 or in [0, N)
//   out  T     [m, channels]
// One launch gathers the input rows of every kernel offset (pass the
// concatenated pair_input of a rulebook).
template <typename T>
__global__ void sc_gather_rows(const T* __restrict__ src, const int* __restrict__ rows, long long m,
                               long long channels, int vector, T* __restrict__ out) {
  sc::with_vector_width(vector, [&](auto width) {
    sc::gather_rows_packed<T, decltype(width)::value>(src, rows, m, channels, out);
  });
}

// dst[rows[r], :] += src[r, :] for r < m, skipping rows[r] < 0.
//   src  T     [m, channels]
//   rows int32 [m]            the non-negative entries unique within the launch
//   dst  T     [N, channels]  updated in place
// Plain read-add-write without atomics, which is only correct (and then
// deterministic) because no two threads touch the same destination element.
template <typename T>
__global__ void sc_scatter_add_rows_unique(const T* __restrict__ src, const int* __restrict__ rows,
                                           long long m, long long channels, int vector, T* __restrict__ dst) {
  sc::with_vector_width(vector, [&](auto width) {
    sc::scatter_add_rows_packed<T, decltype(width)::value>(src, rows, m, channels, dst);
  });
}

// Segmented row sum, in one launch for all segments:
//   for s < num_segments, j < channels:
//     acc = 0 (in Acc)
//     for p in [segment_starts[s], segment_starts[s + 1]):   in this order
//       acc += src[order[p], j]
//     dst[segment_rows[s], j] = T(Acc(dst[segment_rows[s], j]) + acc)
//   src            T     [P, channels]   e.g. the per-pair partial products of
//                                        all kernel offsets, in pair order
//   order          int32 [Q]             rows of src, grouped by segment
//   segment_starts int64 [num_segments + 1], non-decreasing, last entry <= Q
//   segment_rows   int32 [num_segments]  destination rows, unique, >= 0
//   dst            T     [N, channels]   updated in place (start from zeros or
//                                        a bias)
// This is how a convolution scatters the products of every offset into its
// outputs without atomics: order = a stable argsort of pair_output, segments
// = runs of equal output rows. Each (segment, channel) is summed by one thread
// in a fixed order, so the result is bitwise deterministic.
template <typename T, typename Acc>
__global__ void sc_segment_sum_rows(const T* __restrict__ src, const int* __restrict__ order,
                                    const long long* __restrict__ segment_starts,
                                    const int* __restrict__ segment_rows, long long num_segments,
                                    long long channels, T* __restrict__ dst) {
  sc::for_each_element(num_segments, channels, [&](long long, long long s, long long j) {
    const Acc acc = sc::group_sum<Acc>(order, segment_starts, s, [&](long long, int source_row) {
      return static_cast<Acc>(sc::widen(src[static_cast<long long>(source_row) * channels + j]));
    });
    T* target = dst + static_cast<long long>(__ldg(segment_rows + s)) * channels + j;
    *target = sc::narrow<T>(static_cast<Acc>(sc::widen(*target)) + acc);
  });
}

// Sum of several runs' rows into their target rows, without sorting or atomics:
//   for r < n, j < channels:
//     acc = 0 (in Acc)
//     for run in [0, num_runs):                        in this order
//       p = slots[run * slot_stride + r]
//       if p >= 0: acc += src[p, j]
//     dst[r, j] = T(Acc(dst[r, j]) + acc)
//   src         T     [P, channels]            e.g. the products of a chunk of
//                                              kernel offsets (one run each)
//   slots       int32 [num_runs, slot_stride]  slot_stride >= n: the source row
//                                              feeding target row r in each run,
//                                              or -1 (a run feeds a row at most once)
//   dst         T     [n, channels]            updated in place
// The caller fills slots with one scatter of the pairs (slots[run, row] = p).
// Each (row, channel) is summed by one thread in run order, so the result is
// bitwise deterministic, and equals sc_segment_sum_rows over the same pairs
// grouped by a stable sort of their rows.
template <typename T, typename Acc>
__global__ void sc_sum_run_rows(const T* __restrict__ src, const int* __restrict__ slots, long long num_runs,
                                long long slot_stride, long long n, long long channels, int vector,
                                T* __restrict__ dst) {
  sc::with_vector_width(vector, [&](auto width) {
    sc::sum_run_rows_packed<T, Acc, decltype(width)::value>(src, slots, num_runs, slot_stride, n, channels, dst);
  });
}
