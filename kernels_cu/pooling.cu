// pooling.cu: max and average pooling over CSR groupings of a pooling rulebook.
//
// Matrices are dense row-major [rows, channels]; T is float, double, __half or
// __nv_bfloat16, compared and summed in its accumulator type (float, or double
// for double). Every output element is produced by one thread walking its
// group in the given order: no atomics, bitwise deterministic.
//
// Two groupings of the same pairs (i -> o) are used:
//   by output (forward):  input_rows[output_starts[o] .. output_starts[o + 1])
//                         are the input rows of output o, in kernel-offset order
//                         (a stable argsort of pair_output over pairs stored
//                         offset by offset gives that order);
//   by input (backward):  output_rows[input_starts[i] .. input_starts[i + 1])
//                         are the output rows that input i feeds (a stable
//                         argsort of pair_input).
// Starts are int64 [rows + 1], non-decreasing, starting at 0. A row of -1 in
// either grouping is padding (a pair of a padded pair map with no input or no
// output): every kernel skips it without reading through it. Global pooling
// uses the same kernels: group sites by batch element for the forward, and
// give each input its single batch element (input_starts = 0, 1, ..., N) for
// the backward.

#include "sc_common.cuh"

// out[o, j] = max over the group of o of features[i, j]; argmax[o, j] = that i.
//   features      T     [num_in, channels]
//   input_rows    int32 [P]                  grouped by output, offset order; -1 skipped
//   output_starts int64 [num_out + 1]
//   out           T     [num_out, channels]
//   argmax        int32 [num_out, channels]
// The first input of a group is taken, and a later one replaces it only when
// strictly greater, so ties keep the earliest kernel offset; a NaN replaces a
// number and is kept (NaN propagates, as in torch's max_pool and NumPy's max).
// An empty group gives out = 0 and argmax = -1.
template <typename T>
__global__ void sc_max_pool_forward(const T* __restrict__ features,
                                    const int* __restrict__ input_rows,
                                    const long long* __restrict__ output_starts, long long num_out,
                                    long long channels, T* __restrict__ out,
                                    int* __restrict__ argmax) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long j) {
    Acc best = Acc(0);
    int best_row = -1;
    sc::for_each_group_entry(input_rows, output_starts, o, [&](long long, int row) {
      const Acc value = static_cast<Acc>(sc::widen(features[static_cast<long long>(row) * channels + j]));
      if (best_row < 0 || value > best || (value != value && best == best)) {
        best = value;
        best_row = row;
      }
    });
    out[e] = sc::narrow<T>(best);
    argmax[e] = best_row;
  });
}

// grad_in[i, j] = sum over the outputs o of input i (in group order) with
// argmax[o, j] == i of grad_out[o, j]. Overwrites every row of grad_in.
//   grad_out     T     [num_out, channels]
//   argmax       int32 [num_out, channels]   from sc_max_pool_forward
//   output_rows  int32 [P]                   grouped by input; -1 skipped
//   input_starts int64 [num_in + 1]
//   grad_in      T     [num_in, channels]
template <typename T>
__global__ void sc_max_pool_backward(const T* __restrict__ grad_out, const int* __restrict__ argmax,
                                     const int* __restrict__ output_rows,
                                     const long long* __restrict__ input_starts, long long num_in,
                                     long long channels, T* __restrict__ grad_in) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_in, channels, [&](long long e, long long i, long long j) {
    // outputs whose maximum came from elsewhere add an exact +0 (the sum never holds -0)
    grad_in[e] = sc::narrow<T>(sc::group_sum<Acc>(output_rows, input_starts, i, [&](long long, int o) {
      const long long o_element = static_cast<long long>(o) * channels + j;
      return __ldg(argmax + o_element) == i ? static_cast<Acc>(sc::widen(grad_out[o_element])) : Acc(0);
    }));
  });
}

// out[o, j] = (sum over the group of o of features[i, j]) / (its inputs that
// are not -1), in Acc, summed in group order; 0 for a group without inputs.
//   features      T     [num_in, channels]
//   input_rows    int32 [P]                  grouped by output; -1 skipped
//   output_starts int64 [num_out + 1]
//   out           T     [num_out, channels]
template <typename T>
__global__ void sc_avg_pool_forward(const T* __restrict__ features,
                                    const int* __restrict__ input_rows,
                                    const long long* __restrict__ output_starts, long long num_out,
                                    long long channels, T* __restrict__ out) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long j) {
    long long count = 0;
    const Acc sum = sc::group_sum<Acc>(input_rows, output_starts, o, [&](long long, int row) {
      ++count;
      return static_cast<Acc>(sc::widen(features[static_cast<long long>(row) * channels + j]));
    });
    out[e] = sc::narrow<T>(count ? sum / static_cast<Acc>(count) : Acc(0));
  });
}

// grad_in[i, j] = sum over the outputs o of input i (in group order) of
// grad_out[o, j] / count(o), each quotient taken in Acc, where count(o) =
// output_starts[o + 1] - output_starts[o] (the forward grouping's sizes: build
// it from pairs whose input row is not -1). Overwrites every row of grad_in.
//   grad_out      T     [num_out, channels]
//   output_rows   int32 [P]                  grouped by input; -1 skipped
//   input_starts  int64 [num_in + 1]
//   output_starts int64 [num_out + 1]        the forward's starts
//   grad_in       T     [num_in, channels]
template <typename T>
__global__ void sc_avg_pool_backward(const T* __restrict__ grad_out,
                                     const int* __restrict__ output_rows,
                                     const long long* __restrict__ input_starts,
                                     const long long* __restrict__ output_starts, long long num_in,
                                     long long channels, T* __restrict__ grad_in) {
  using Acc = typename sc::Accumulator<T>::type;
  sc::for_each_element(num_in, channels, [&](long long e, long long i, long long j) {
    grad_in[e] = sc::narrow<T>(sc::group_sum<Acc>(output_rows, input_starts, i, [&](long long, int o) {
      const Acc count = static_cast<Acc>(__ldg(output_starts + o + 1) - __ldg(output_starts + o));
      return static_cast<Acc>(sc::widen(grad_out[static_cast<long long>(o) * channels + j])) / count;
    }));
  });
}
