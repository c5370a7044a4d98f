// voxelize.cu: the per-point step of voxelization, the point's packed voxel key.
//
// Only this step needs a custom kernel. The rest of voxelization is composed
// on the Python side from sort primitives: drop keys of -1, a stable argsort
// of the keys groups points by voxel with the points of a voxel in input
// order, run starts give each voxel's first point (voxels numbered in
// first-seen or in key order, as the caller chooses), and per-voxel features
// (mean, first point, up to max_points points) follow from gathers and the
// segmented sums of gather_scatter.cu. Unpacking a key back to (batch, voxel
// coordinates) is integer arithmetic on the host side (hashing.unpack_keys).
//
//   points        T     [num_points, num_features]  row-major
//   point_columns int32 [ndim]  the point column that grid axis d reads
//                               (e.g. 2, 1, 0 for zyx voxels from xyz points)
//   voxel_size    T     [ndim]  per grid axis, > 0
//   range_min     T     [ndim]  per grid axis
//   grid_shape    int32 [ndim]  voxels per grid axis
//   batch_column  the point column holding the batch index, or -1 (batch 0)
//   batch_size    batch indices must lie in [0, batch_size)
//   out_keys      int64 [num_points]
//
// For grid axis d, v_d = floor((p[point_columns[d]] - range_min[d]) / voxel_size[d])
// computed in T (IEEE subtraction and division, as NumPy does in the same
// dtype). The point is kept when 0 <= v_d < grid_shape[d] on every axis (NaN
// fails) and its batch value b satisfies 0 <= b < batch_size (truncated to an
// integer); then key = ((b * G_0 + v_0) * G_1 + v_1) ..., row-major over
// (batch, grid), else key = -1. The caller checks that batch_size * prod(G)
// fits in int64.

#include "sc_common.cuh"

template <typename T>
__global__ void sc_voxel_keys(const T* __restrict__ points, long long num_points, int num_features,
                              int ndim, const int* __restrict__ point_columns,
                              const T* __restrict__ voxel_size, const T* __restrict__ range_min,
                              const int* __restrict__ grid_shape, int batch_column,
                              long long batch_size, long long* __restrict__ out_keys) {
  const long long step = sc::grid_thread_count();
  for (long long i = sc::grid_thread_index(); i < num_points; i += step) {
    const T* point = points + i * num_features;
    long long key = 0;
    bool valid = true;
    if (batch_column >= 0) {
      const T batch = point[batch_column];
      valid = batch >= T(0) && batch < static_cast<T>(batch_size);
      key = valid ? static_cast<long long>(batch) : 0;
    }
    for (int d = 0; d < ndim && valid; ++d) {
      const T scaled = (point[__ldg(point_columns + d)] - __ldg(range_min + d)) / __ldg(voxel_size + d);
      const T cell = floor(scaled);
      const int extent = __ldg(grid_shape + d);
      valid = cell >= T(0) && cell < static_cast<T>(extent);
      key = key * extent + (valid ? static_cast<long long>(cell) : 0);
    }
    out_keys[i] = valid ? key : -1;
  }
}
