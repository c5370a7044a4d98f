// rulebook.cu: pair compaction and output-site candidates for rulebooks.
//
// 1. Stable compaction of a [num_rows, row_length] table of values (-1 meaning
//    "no pair") into pair lists grouped by row, in two deterministic passes
//    without atomics:
//      a. sc_compact_count: each row is cut into tiles of tile_size columns
//         (tiles_per_row = ceil(row_length / tile_size); tile t of row r is
//         tile_counts[r * tiles_per_row + t]); writes the number of valid
//         entries (value >= 0) of every tile to tile_counts (int64).
//      b. on the host side (CuPy, no custom kernel):
//           tile_offsets  = cumsum(tile_counts) - tile_counts   (exclusive, int64)
//           row_counts    = tile_counts.reshape(num_rows, tiles_per_row).sum(1)
//           total         = tile_counts.sum()
//      c. sc_compact_write: writes, for the valid entries in row-major order,
//         pair_column[pos] = column and pair_value[pos] = value (int32), at
//         pos = tile_offsets[tile] + number of valid entries before it in its
//         tile.
//    Both passes must get the same tile_size; any block size up to
//    sc::kMaxBlockThreads works (each thread takes a contiguous run of
//    ceil(tile_size / blockDim.x) entries of a tile, scanned across the block
//    in shared memory). The result depends only on the input.
//    Submanifold: values = sc_hash_lookup_offsets' [K, N] table (input row per
//    output site i and offset k), so pair_column = output row and pair_value =
//    input row. Strided: values = the output rows found for the candidate keys
//    below ([K, N], by input site), so pair_column = input row and pair_value
//    = output row. Rows = kernel offsets: pairs come grouped by offset, and
//    row_counts[k] is the pair count of offset k.
//
// 2. Output-site candidates of a strided (regular) or transposed convolution:
//    for every input site i and kernel offset k the packed key of the output
//    site it feeds, or -1.
//      indices          int32 [n, 1 + ndim]   batch first, then coordinates
//      kernel_positions int32 [K, ndim]       kernel position per axis, 0..k_d-1
//                                             (row-major over the kernel)
//      axis_params      int32 [4, ndim]       rows: stride, padding, dilation,
//                                             output spatial shape
//      out_keys         int64 [K, n]          row-major
//    regular:    x_d = c_d + padding_d - k_d * dilation_d must be >= 0 and
//                divisible by stride_d, and output coordinate x_d / stride_d
//                must be < out_d;
//    transposed: output coordinate c_d * stride_d - padding_d + k_d * dilation_d
//                must lie in [0, out_d).
//    Key = row-major over (batch, out_0, ..., out_{ndim-1}) with no padding:
//    ((b * out_0 + y_0) * out_1 + y_1) ... ; the caller checks that
//    batch_size * prod(out) fits in int64.

#include "sc_common.cuh"

namespace sc {

// Inclusive prefix sum of `value` over the block's threads; `*block_total`
// receives the sum over the whole block. Every thread of the block must call
// it (it synchronises); `scratch` holds blockDim.x ints.
__device__ __forceinline__ int block_inclusive_scan(int value, int* scratch, int* block_total) {
  const int t = static_cast<int>(threadIdx.x);
  scratch[t] = value;
  __syncthreads();
  for (int distance = 1; distance < static_cast<int>(blockDim.x); distance <<= 1) {
    const int addend = t >= distance ? scratch[t - distance] : 0;
    __syncthreads();
    scratch[t] += addend;
    __syncthreads();
  }
  const int inclusive = scratch[t];
  *block_total = scratch[blockDim.x - 1];
  __syncthreads();  // scratch may be reused by the next call
  return inclusive;
}

// The run of tile entries that this thread owns: columns [first, last) of the row.
struct TileRun {
  long long row;
  long long first;
  long long last;
};

__device__ __forceinline__ TileRun tile_run(long long tile, long long tiles_per_row,
                                            long long row_length, long long tile_size) {
  const long long per_thread = (tile_size + blockDim.x - 1) / blockDim.x;
  const long long row = tile / tiles_per_row;
  const long long tile_begin = (tile - row * tiles_per_row) * tile_size;
  long long tile_end = tile_begin + tile_size;
  tile_end = tile_end < row_length ? tile_end : row_length;
  long long first = tile_begin + threadIdx.x * per_thread;
  long long last = first + per_thread;
  first = first < tile_end ? first : tile_end;
  last = last < tile_end ? last : tile_end;
  return TileRun{row, first, last};
}

// Number of values >= 0 in one thread's share of a tile. Both compaction
// passes count with this, so pass c writes exactly where pass a counted.
__device__ __forceinline__ int count_valid(const int* row_values, const TileRun& run) {
  int count = 0;
  for (long long column = run.first; column < run.last; ++column) {
    count += row_values[column] >= 0 ? 1 : 0;
  }
  return count;
}

// The block-stride loop over the tiles of a [num_rows, row_length] table, shared
// by both compaction passes: for each tile of this block, this thread's run of
// it, its row, its count of values >= 0 and the block's inclusive scan of the
// counts: body(tile, run, row_values, count, inclusive, block_total). Every
// thread of a block walks the same tiles (the scan synchronises the block).
template <typename Body>
__device__ __forceinline__ void for_each_tile(const int* __restrict__ values, long long num_rows,
                                              long long row_length, long long tile_size, int* scratch,
                                              Body body) {
  const long long tiles_per_row = (row_length + tile_size - 1) / tile_size;
  const long long num_tiles = num_rows * tiles_per_row;
  for (long long tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileRun run = tile_run(tile, tiles_per_row, row_length, tile_size);
    const int* row_values = values + run.row * row_length;
    const int count = count_valid(row_values, run);
    int block_total = 0;
    const int inclusive = block_inclusive_scan(count, scratch, &block_total);
    body(tile, run, row_values, count, inclusive, block_total);
  }
}

}  // namespace sc

// Pass a: tile_counts[tile] = number of values >= 0 in the tile (int64
// [num_rows * tiles_per_row]). Launch with any grid; blockDim.x <= 1024.
__global__ void sc_compact_count(const int* __restrict__ values, long long num_rows,
                                 long long row_length, long long tile_size,
                                 long long* __restrict__ tile_counts) {
  __shared__ int scratch[sc::kMaxBlockThreads];
  sc::for_each_tile(values, num_rows, row_length, tile_size, scratch,
                    [&](long long tile, const sc::TileRun&, const int*, int, int, int block_total) {
                      if (threadIdx.x == 0) {
                        tile_counts[tile] = block_total;
                      }
                    });
}

// Pass c: pair_column / pair_value (int32 [total]) at the positions given by
// tile_offsets (int64 [num_rows * tiles_per_row], exclusive scan of pass a).
__global__ void sc_compact_write(const int* __restrict__ values, long long num_rows,
                                 long long row_length, long long tile_size,
                                 const long long* __restrict__ tile_offsets,
                                 int* __restrict__ pair_column, int* __restrict__ pair_value) {
  __shared__ int scratch[sc::kMaxBlockThreads];
  sc::for_each_tile(values, num_rows, row_length, tile_size, scratch,
                    [&](long long tile, const sc::TileRun& run, const int* row_values, int count, int inclusive,
                        int) {
                      long long position = tile_offsets[tile] + (inclusive - count);
                      for (long long column = run.first; column < run.last; ++column) {
                        const int value = row_values[column];
                        if (value >= 0) {
                          pair_column[position] = static_cast<int>(column);
                          pair_value[position] = value;
                          ++position;
                        }
                      }
                    });
}

namespace sc {

// Shared body of the two candidate kernels; kTransposed picks the formula.
template <bool kTransposed>
__device__ __forceinline__ void conv_candidates(const int* __restrict__ indices, long long n,
                                                int ndim,
                                                const int* __restrict__ kernel_positions,
                                                int num_offsets,
                                                const int* __restrict__ axis_params,
                                                long long* __restrict__ out_keys) {
  for_each_element(num_offsets, n, [&](long long e, long long k, long long i) {
    const int* site = indices + i * (ndim + 1);
    const int* position = kernel_positions + k * ndim;
    long long key = __ldg(site);
    bool valid = key >= 0;
    for (int d = 0; d < ndim && valid; ++d) {
      const long long stride = __ldg(axis_params + d);
      const long long padding = __ldg(axis_params + ndim + d);
      const long long dilation = __ldg(axis_params + 2 * ndim + d);
      const long long extent = __ldg(axis_params + 3 * ndim + d);
      const long long coordinate = __ldg(site + 1 + d);
      const long long reach = static_cast<long long>(__ldg(position + d)) * dilation;
      long long out_coordinate;
      if (kTransposed) {
        out_coordinate = coordinate * stride - padding + reach;
      } else {
        const long long shifted = coordinate + padding - reach;
        valid = shifted >= 0 && shifted % stride == 0;
        out_coordinate = shifted / stride;
      }
      valid = valid && out_coordinate >= 0 && out_coordinate < extent;
      key = key * extent + out_coordinate;
    }
    out_keys[e] = valid ? key : -1;
  });
}

}  // namespace sc

// out_keys[k, i] = output key of input site i at kernel offset k, or -1
// (regular strided convolution or pooling; see 2. above).
__global__ void sc_regular_conv_candidates(const int* __restrict__ indices, long long n, int ndim,
                                           const int* __restrict__ kernel_positions,
                                           int num_offsets, const int* __restrict__ axis_params,
                                           long long* __restrict__ out_keys) {
  sc::conv_candidates<false>(indices, n, ndim, kernel_positions, num_offsets, axis_params,
                             out_keys);
}

// Same for a transposed convolution.
__global__ void sc_transposed_conv_candidates(const int* __restrict__ indices, long long n,
                                              int ndim, const int* __restrict__ kernel_positions,
                                              int num_offsets, const int* __restrict__ axis_params,
                                              long long* __restrict__ out_keys) {
  sc::conv_candidates<true>(indices, n, ndim, kernel_positions, num_offsets, axis_params,
                            out_keys);
}
