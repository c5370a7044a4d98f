// gather_scatter.cu: row gathers and deterministic row scatters for the
// gather -> GEMM -> scatter feature passes.
//
// All matrices are dense row-major and contiguous: [rows, channels] with
// element (r, j) at r * channels + j. T is float, double, __half or
// __nv_bfloat16; sums are carried in Acc (float for the first three and the
// 16-bit types, double for double) and rounded to T once, at the store.
// No kernel here uses atomics: every output element is written by exactly one
// thread, so results are bitwise reproducible.

#include "sc_common.cuh"

// out[r, :] = src[rows[r], :] for r < m, or zeros where rows[r] < 0.
//   src  T     [N, channels]
//   rows int32 [m]            each -1 or in [0, N)
//   out  T     [m, channels]
// One launch gathers the input rows of every kernel offset (pass the
// concatenated pair_input of a rulebook).
template <typename T>
__global__ void sc_gather_rows(const T* __restrict__ src, const int* __restrict__ rows, long long m,
                               long long channels, T* __restrict__ out) {
  const long long total = m * channels;
  const long long step = sc::grid_thread_count();
  const T zero = sc::narrow<T>(typename sc::Accumulator<T>::type(0));
  for (long long e = sc::grid_thread_index(); e < total; e += step) {
    const long long r = e / channels;
    const long long j = e - r * channels;
    const int row = __ldg(rows + r);
    out[e] = row >= 0 ? src[static_cast<long long>(row) * channels + j] : zero;
  }
}

// dst[rows[r], :] += src[r, :] for r < m, skipping rows[r] < 0.
//   src  T     [m, channels]
//   rows int32 [m]            the non-negative entries unique within the launch
//   dst  T     [N, channels]  updated in place
// Plain read-add-write without atomics, which is only correct (and then
// deterministic) because no two threads touch the same destination element.
template <typename T>
__global__ void sc_scatter_add_rows_unique(const T* __restrict__ src, const int* __restrict__ rows,
                                           long long m, long long channels, T* __restrict__ dst) {
  const long long total = m * channels;
  const long long step = sc::grid_thread_count();
  for (long long e = sc::grid_thread_index(); e < total; e += step) {
    const long long r = e / channels;
    const long long j = e - r * channels;
    const int row = __ldg(rows + r);
    if (row < 0) {
      continue;
    }
    T* target = dst + static_cast<long long>(row) * channels + j;
    *target = sc::narrow<T>(sc::widen(*target) + sc::widen(src[e]));
  }
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
  const long long total = num_segments * channels;
  const long long step = sc::grid_thread_count();
  for (long long e = sc::grid_thread_index(); e < total; e += step) {
    const long long s = e / channels;
    const long long j = e - s * channels;
    const long long begin = __ldg(segment_starts + s);
    const long long end = __ldg(segment_starts + s + 1);
    Acc acc = Acc(0);
    for (long long p = begin; p < end; ++p) {
      const long long source_row = __ldg(order + p);
      acc += static_cast<Acc>(sc::widen(src[source_row * channels + j]));
    }
    T* target = dst + static_cast<long long>(__ldg(segment_rows + s)) * channels + j;
    *target = sc::narrow<T>(static_cast<Acc>(sc::widen(*target)) + acc);
  }
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
                                long long slot_stride, long long n, long long channels,
                                T* __restrict__ dst) {
  const long long total = n * channels;
  const long long step = sc::grid_thread_count();
  for (long long e = sc::grid_thread_index(); e < total; e += step) {
    const long long r = e / channels;
    const long long j = e - r * channels;
    Acc acc = Acc(0);
    for (long long run = 0; run < num_runs; ++run) {
      const int p = __ldg(slots + run * slot_stride + r);
      if (p >= 0) {
        acc += static_cast<Acc>(sc::widen(src[static_cast<long long>(p) * channels + j]));
      }
    }
    dst[e] = sc::narrow<T>(static_cast<Acc>(sc::widen(dst[e])) + acc);
  }
}
