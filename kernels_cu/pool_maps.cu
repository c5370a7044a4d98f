// pool_maps.cu: max and average pooling over a neighbour map, one kernel per pass.
//
// The map (sparsecore/neighbour_map.py): neighbours int32 [N, K], the row of the
// other side paired with row r through offset k, -1 for none. The forward reads
// the output side (the inputs of each output window, offsets in order); the
// backward reads the input side (the outputs each input feeds), so each element
// of every gradient row is summed by one thread in a fixed order (offsets
// ascending): no atomics, no scatter, bitwise deterministic. A symmetric
// (submanifold) map stores one side; its input side is the output side with the
// offsets reversed (`reversed`: table column K - 1 - k is offset k).
//
// T is float, double, __half or __nv_bfloat16, compared and summed in its
// accumulator type (float, or double for double). One thread per element of a
// [rows, channels] result, in grid-stride loops.

#include "sc_common.cuh"

// out[o, j] = max over k of features[neighbours[o, k], j]; argmax[o, j] = that row.
//   features   T     [num_in, channels]
//   neighbours int32 [num_out, K]        the output side
//   out        T     [num_out, channels]
//   argmax     int32 [num_out, channels]
// The first input (in offset order) is taken, and a later one replaces it only
// when strictly greater, so ties keep the earliest offset; a NaN replaces a
// number and is kept. An output without inputs gives 0 and argmax -1.
template <typename T>
__global__ void sc_max_pool_map(const T* __restrict__ features, const int* __restrict__ neighbours,
                                long long num_out, int volume, long long channels, T* __restrict__ out,
                                int* __restrict__ argmax) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long j) {
    Acc best = Acc(0);
    int best_row = -1;
    for (int k = 0; k < volume; ++k) {
      const int row = __ldg(neighbours + o * volume + k);
      if (row < 0) continue;
      const Acc value = static_cast<Acc>(sc::widen(features[static_cast<long long>(row) * channels + j]));
      if (best_row < 0 || value > best || (value != value && best == best)) {
        best = value;
        best_row = row;
      }
    }
    out[e] = sc::narrow<T>(best);
    argmax[e] = best_row;
  });
}

// grad_in[i, j] = sum over k (ascending) of grad_out[o, j] for o = the output
// input i feeds through offset k, where argmax[o, j] == i (else an exact +0).
//   grad_out   T     [num_out, channels]
//   argmax     int32 [num_out, channels]  from sc_max_pool_map
//   neighbours int32 [num_in, K]          the input side (reversed: the output side of a symmetric map)
//   grad_in    T     [num_in, channels]   every element written
template <typename T>
__global__ void sc_max_pool_map_backward(const T* __restrict__ grad_out, const int* __restrict__ argmax,
                                         const int* __restrict__ neighbours, long long num_in, int volume,
                                         int reversed, long long channels, T* __restrict__ grad_in) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_in, channels, [&](long long e, long long i, long long j) {
    Acc sum = Acc(0);
    for (int k = 0; k < volume; ++k) {
      const int o = __ldg(neighbours + i * volume + (reversed ? volume - 1 - k : k));
      if (o < 0) continue;
      const long long o_element = static_cast<long long>(o) * channels + j;
      sum += __ldg(argmax + o_element) == i ? static_cast<Acc>(sc::widen(grad_out[o_element])) : Acc(0);
    }
    grad_in[e] = sc::narrow<T>(sum);
  });
}

// out[o, j] = (sum over k, ascending, of features[neighbours[o, k], j]) / (the
// window's inputs), in Acc; 0 for an output without inputs.
//   features   T     [num_in, channels]
//   neighbours int32 [num_out, K]        the output side
//   out        T     [num_out, channels]
template <typename T>
__global__ void sc_avg_pool_map(const T* __restrict__ features, const int* __restrict__ neighbours,
                                long long num_out, int volume, long long channels, T* __restrict__ out) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long j) {
    Acc sum = Acc(0);
    int count = 0;
    for (int k = 0; k < volume; ++k) {
      const int row = __ldg(neighbours + o * volume + k);
      if (row < 0) continue;
      ++count;
      sum += static_cast<Acc>(sc::widen(features[static_cast<long long>(row) * channels + j]));
    }
    out[e] = sc::narrow<T>(count ? sum / static_cast<Acc>(count) : Acc(0));
  });
}

// grad_in[i, j] = sum over k (ascending) of grad_out[o, j] / count(o), each
// quotient in Acc, for o = the output input i feeds through offset k;
// count(o) = the set bits of output o's mask (its window's inputs).
//   grad_out     T      [num_out, channels]
//   neighbours   int32  [num_in, K]              the input side (reversed: see above)
//   output_masks uint32 [num_out, mask_words]    the output side's masks
//   grad_in      T      [num_in, channels]       every element written
template <typename T>
__global__ void sc_avg_pool_map_backward(const T* __restrict__ grad_out, const int* __restrict__ neighbours,
                                         const unsigned int* __restrict__ output_masks, long long num_in,
                                         int volume, int mask_words, int reversed, long long channels,
                                         T* __restrict__ grad_in) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_in, channels, [&](long long e, long long i, long long j) {
    Acc sum = Acc(0);
    for (int k = 0; k < volume; ++k) {
      const int o = __ldg(neighbours + i * volume + (reversed ? volume - 1 - k : k));
      if (o < 0) continue;
      int count = 0;
      for (int w = 0; w < mask_words; ++w) count += __popc(__ldg(output_masks + static_cast<long long>(o) * mask_words + w));
      sum += static_cast<Acc>(sc::widen(grad_out[static_cast<long long>(o) * channels + j])) / static_cast<Acc>(count);
    }
    grad_in[e] = sc::narrow<T>(sum);
  });
}
