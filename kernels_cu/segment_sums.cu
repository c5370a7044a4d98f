// segment_sums.cu: deterministic sums of row segments, the kernel backend's index_add.
//
// Matrices are dense row-major and contiguous: [rows, channels] with element
// (r, j) at r * channels + j. Sums are carried in Acc and rounded to T once,
// at the store. No atomics: every output element is written by exactly one
// thread, so results are bitwise reproducible. (The feature passes of a
// convolution or a pool are the fused kernels of implicit_gemm.cu and
// pool_maps.cu.)

#include "sc_common.cuh"

// Segmented row sum, in one launch for all segments:
//   for s < num_segments, j < channels:
//     acc = 0 (in Acc)
//     for p in [segment_starts[s], segment_starts[s + 1]):   in this order
//       acc += src[order[p], j]
//     dst[segment_rows[s], j] = T(Acc(dst[segment_rows[s], j]) + acc)
//   src            T     [P, channels]
//   order          int32 [Q]             rows of src, grouped by segment
//   segment_starts int64 [num_segments + 1], non-decreasing, last entry <= Q
//   segment_rows   int32 [num_segments]  destination rows, unique, >= 0
//   dst            T     [N, channels]   updated in place (start from zeros or
//                                        a bias)
// order = a stable argsort of the destination rows, segments = runs of equal
// rows: each (segment, channel) is summed by one thread in a fixed order, so
// the result is bitwise deterministic, without atomics.
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
