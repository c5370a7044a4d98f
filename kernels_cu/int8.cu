// int8.cu: int8 sparse convolution (dp4a, int32 accumulation, fused
// requantization) and int8 max pooling over a rulebook's pairs grouped by output.
//
// Every output element out[o, c] is produced by one thread that walks the
// pairs of output o (a CSR grouping of the rulebook by output, pairs of one
// output in kernel-offset order) and sums exact int8 x int8 products in int32
// with __dp4a, four input channels per instruction; then applies the epilogue
// of sparsecore/int8.py, each float32 step rounded once (the __f*_rn
// intrinsics are never contracted into an FMA):
//   y = __int2float_rn(acc) * multiplier[c]                 (input_scale * weight_scale[c])
//   y = y + bias[c]                                          (when has_bias)
//   y = y + float(residual[o, c]) * residual_scale           (when has_residual; product, then sum)
//   y = y < 0 ? 0 : y                                        (when relu)
//   int8 output: q = clamp(rint(y / output_scale), -128, 127)
// No atomics: results are bitwise deterministic and equal the NumPy path's.
//
// Packed layouts (made by sparsecore/backends/_kernel_int8.py): with
// in_per_group = C_in / groups and words = ceil(in_per_group / 4), the input
// channels of each group are zero-padded to 4 * words bytes, so any channel
// count works (the padding multiplies zeros):
//   x_packed  int32 [N, groups * words]      row i, group g: words g*words ..
//   w_packed  int32 [K, words, C_out]        word q of offset k for output c
//                                            (consecutive threads read consecutive c)

#include "sc_common.cuh"

namespace sc {

// The epilogue's float32 steps for one accumulator (see the file's comment).
__device__ __forceinline__ float int8_epilogue(int acc, float multiplier, const float* __restrict__ bias,
                                               int has_bias, const signed char* __restrict__ residual,
                                               int has_residual, float residual_scale, int relu,
                                               long long o, long long c, long long channels) {
  float y = __fmul_rn(__int2float_rn(acc), multiplier);
  if (has_bias) {
    y = __fadd_rn(y, bias[c]);
  }
  if (has_residual) {
    const float skip = __fmul_rn(static_cast<float>(residual[o * channels + c]), residual_scale);
    y = __fadd_rn(y, skip);
  }
  if (relu && y < 0.0f) {
    y = 0.0f;
  }
  return y;
}

// float32 to int8: rint (ties to even) of y / scale, saturated to [-128, 127].
__device__ __forceinline__ signed char requantize(float y, float scale) {
  float q = rintf(__fdiv_rn(y, scale));
  q = q < -128.0f ? -128.0f : (q > 127.0f ? 127.0f : q);
  return static_cast<signed char>(static_cast<int>(q));
}

template <typename Out>
struct Int8Store;

template <>
struct Int8Store<signed char> {
  __device__ __forceinline__ static signed char from(float y, float output_scale) {
    return requantize(y, output_scale);
  }
};

template <>
struct Int8Store<float> {
  __device__ __forceinline__ static float from(float y, float) { return y; }
};

}  // namespace sc

// out[o, c] = epilogue(sum over the pairs p of o of dot(x[input_rows[p]], W[pair_offsets[p]][c])).
//   x_packed       int32 [N, groups * words]   see the file's comment
//   w_packed       int32 [K, words, channels]
//   input_rows     int32 [P]     input row of each pair, grouped by output; -1 = no pair
//   pair_offsets   int32 [P]     kernel offset of each pair, same order
//   output_starts  int64 [num_out + 1]
//   multiplier     float [channels]            input_scale * weight_scales (float32 product)
//   bias           float [channels]            read when has_bias
//   residual       int8  [num_out, channels]   read when has_residual
//   out            Out   [num_out, channels]   Out = signed char (requantized) or float
// out_per_group = channels / groups; output channel c belongs to group c / out_per_group.
template <typename Out>
__global__ void sc_int8_conv(const int* __restrict__ x_packed, const int* __restrict__ w_packed,
                             const int* __restrict__ input_rows, const int* __restrict__ pair_offsets,
                             const long long* __restrict__ output_starts, long long num_out,
                             long long channels, long long out_per_group, int words,
                             const float* __restrict__ multiplier, const float* __restrict__ bias, int has_bias,
                             const signed char* __restrict__ residual, int has_residual, float residual_scale,
                             int relu, float output_scale, Out* __restrict__ out) {
  const long long row_words = (channels / out_per_group) * words;
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long c) {
    const long long group_word = (c / out_per_group) * words;
    int acc = 0;
    sc::for_each_group_entry(input_rows, output_starts, o, [&](long long p, int row) {
      const int* x = x_packed + static_cast<long long>(row) * row_words + group_word;
      const int* w = w_packed + static_cast<long long>(__ldg(pair_offsets + p)) * words * channels + c;
      for (int q = 0; q < words; ++q) {
        acc = __dp4a(__ldg(x + q), __ldg(w + static_cast<long long>(q) * channels), acc);
      }
    });
    const float y = sc::int8_epilogue(acc, multiplier[c], bias, has_bias, residual, has_residual,
                                      residual_scale, relu, o, c, channels);
    out[e] = sc::Int8Store<Out>::from(y, output_scale);
  });
}

// out[o, j] = max over the pairs of o of features[input_rows[p], j]; 0 for an output without pairs.
//   features       int8  [N, channels]
//   input_rows     int32 [P]     grouped by output; -1 = no pair
//   output_starts  int64 [num_out + 1]
//   out            int8  [num_out, channels]
__global__ void sc_int8_max_pool(const signed char* __restrict__ features, const int* __restrict__ input_rows,
                                 const long long* __restrict__ output_starts, long long num_out,
                                 long long channels, signed char* __restrict__ out) {
  sc::for_each_element(num_out, channels, [&](long long e, long long o, long long j) {
    int best = 0;
    bool found = false;
    sc::for_each_group_entry(input_rows, output_starts, o, [&](long long, int row) {
      const int value = features[static_cast<long long>(row) * channels + j];
      if (!found || value > best) {
        best = value;
        found = true;
      }
    });
    out[e] = static_cast<signed char>(best);
  });
}
