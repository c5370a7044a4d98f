// neighbour_map.cu: a rulebook built as per-row neighbour tables (sparsecore/neighbour_map.py).
//
// Output row o's entry at kernel offset k, output_neighbours[o * K + k], is the
// input row that feeds o through k, or -1; input row i's entry,
// input_neighbours[i * K + k], is the output row that i feeds through k, or -1.
// Row masks are uint32 [rows, W] (W = ceil(K / 32)): bit k % 32 of word k / 32
// is set exactly when the entry at k is >= 0. Every kernel writes whole rows
// that its thread owns: no atomics on the tables, results independent of
// thread order.
//
// Sites are int32 [n, 1 + ndim] (batch first, 1 <= ndim <= 4). Per-axis values
// travel as four long long scalars (unused axes: any value), so a build needs
// no host-to-device copy of parameters.
//
// 1. The sites' hash table (sc_map_insert_sites, sc_map_check_sites):
//      table int64 [2 * capacity], every entry -1 before the insert
//      (capacity a power of two >= 2n): slots [0, capacity) hold keys,
//      slots [capacity, 2 * capacity) the smallest row inserted for the key
//      (atomicMin on the unsigned view: -1 is the largest).
//    Key of a site on a grid padded by margin_d on both sides of axis d:
//      ((b * P_0 + c_0 + margin_0) * P_1 + c_1 + margin_1) ...,  P_d = extent_d + 2 margin_d
//    (the layout of sparsecore.hashing.pack_keys). A site outside the grid
//    (b not in [0, batch_size) or c_d not in [0, extent_d)) is not inserted.
//    sc_map_check_sites (the first, untrusted layer only; with skip_padding, rows whose batch index is -1
//    are a capacity-mode input's padding and are skipped) ORs into
//    problems[slot] the bits (1 << shift) for a site outside the grid and
//    (2 << shift) for a site whose key holds a smaller row (a duplicate).
//
// 2. A submanifold map (sc_map_submanifold), over the table of 1. built with
//    margin_d = dilation_d * (kernel_d - 1) / 2 (the kernel's reach r_d): one
//    thread per site i writes output_neighbours[i, :] and its mask words:
//      offset k (row-major over the kernel axes, position p_d on axis d) looks
//      up the site at c_d + p_d * dilation_d - r_d, whose padded coordinate is
//      c_d + p_d * dilation_d: never outside [0, P_d), so keys never wrap.
//    The map is symmetric: input_neighbours[i, k] == output_neighbours[i, K - 1 - k].
//
// 3. A strided (regular), transposed or pooling map, over candidates:
//      candidate f = i * K + k: the output key of input site i at offset k, or -1
//        regular:    x_d = c_d + padding_d - p_d * dilation_d must be >= 0 and a
//                    multiple of stride_d, y_d = x_d / stride_d < out_d;
//        transposed: y_d = c_d * stride_d - padding_d + p_d * dilation_d in [0, out_d);
//        key = ((b * out_0 + y_0) * out_1 + y_1) ..., -1 when b is not in [0, batch_size).
//      a. sc_map_candidates writes keys int64 [n * K] (candidate f at f).
//      b. order = a stable argsort of the keys (xp, int64 [n * K]).
//      c. sc_map_mark_outputs writes marks[t] = 1 where sorted position t holds the
//         first candidate of a valid key (keys recomputed from the sites, so marks
//         may overwrite the keys' buffer), else 0.
//      d. marks -> ranks: an inclusive cumsum (xp); ranks[n * K - 1] is
//         the output count (read back by the host: the build's one read).
//      e. sc_map_strided, over n + n * K items: item i < n writes input row i
//         (a binary search of each candidate's key among the sorted candidates
//         gives its first position t, and output row ranks[t] - 1); item
//         n + t, for a first position t, writes output row o = ranks[t] - 1:
//         its site (the key unpacked) and its row of the table (the candidates
//         of its key's run), both masks from the rows written.
//    Output rows are the distinct valid keys in increasing key order (the
//    CPU builders' order).

#include "sc_common.cuh"
#include "sc_hash.cuh"

// Four per-axis long long scalars: name_0 .. name_3.
#define SC_AXES(name) long long name##_0, long long name##_1, long long name##_2, long long name##_3
#define SC_AXES_VALUE(name) sc::Axes{{name##_0, name##_1, name##_2, name##_3}}
// The geometry of a strided map: kernel, stride, padding, dilation and output extents.
#define SC_STRIDED_GEOMETRY SC_AXES(kernel), SC_AXES(stride), SC_AXES(padding), SC_AXES(dilation), SC_AXES(out)
#define SC_STRIDED_GEOMETRY_VALUE                                                                         \
  sc::StridedGeometry{SC_AXES_VALUE(kernel), SC_AXES_VALUE(stride), SC_AXES_VALUE(padding),              \
                      SC_AXES_VALUE(dilation), SC_AXES_VALUE(out)}

namespace sc {

constexpr int kMapAxes = 4;
constexpr unsigned long long kNoEntry = ~0ULL;  // -1: an empty table slot

struct Axes {
  long long value[kMapAxes];
};

struct StridedGeometry {
  Axes kernel;
  Axes stride;
  Axes padding;
  Axes dilation;
  Axes out;
};

// Whether site (b, c_0 ..) lies in [0, batch_size) x the grid.
__device__ __forceinline__ bool site_in_grid(const int* site, int ndim, long long batch_size, const Axes& extent) {
  bool inside = site[0] >= 0 && site[0] < batch_size;
  for (int d = 0; d < ndim; ++d) {
    inside = inside && site[1 + d] >= 0 && site[1 + d] < extent.value[d];
  }
  return inside;
}

// Key of a site of the grid padded by `margin`, its coordinate on axis d moved by shift[d].
__device__ __forceinline__ long long padded_key(const int* site, int ndim, const Axes& extent, const Axes& margin,
                                                const long long* shift) {
  long long key = site[0];
  for (int d = 0; d < ndim; ++d) {
    key = key * (extent.value[d] + 2 * margin.value[d]) + (site[1 + d] + margin.value[d] + shift[d]);
  }
  return key;
}

// Row stored for `query` in a table of section 1, or -1.
__device__ __forceinline__ long long find_row(const long long* __restrict__ table, long long capacity,
                                              long long query) {
  long long slot = home_slot(query, capacity);
  for (long long probe = 0; probe < capacity; ++probe) {
    const long long stored = table[slot];
    if (stored == query) {
      return table[capacity + slot];
    }
    if (stored == -1) {
      return -1;
    }
    slot = (slot + 1) & (capacity - 1);
  }
  return -1;
}

// Position p_d of offset k on every axis (row-major over the kernel axes, the last fastest).
__device__ __forceinline__ void kernel_position(long long k, int ndim, const Axes& kernel, long long* position) {
  for (int d = ndim - 1; d >= 0; --d) {
    position[d] = k % kernel.value[d];
    k /= kernel.value[d];
  }
}

// Output key of candidate f = i * volume + k (section 3), or -1.
__device__ __forceinline__ long long candidate_key(const int* __restrict__ indices, int ndim, long long batch_size,
                                                   const StridedGeometry& geometry, int transposed, int volume,
                                                   long long f) {
  const long long i = f / volume;
  long long position[kMapAxes];
  kernel_position(f - i * volume, ndim, geometry.kernel, position);
  const int* site = indices + i * (ndim + 1);
  long long key = site[0];
  bool valid = key >= 0 && key < batch_size;
  for (int d = 0; d < ndim && valid; ++d) {
    const long long stride = geometry.stride.value[d];
    const long long reach = position[d] * geometry.dilation.value[d];
    long long out_coordinate;
    if (transposed) {
      out_coordinate = site[1 + d] * stride - geometry.padding.value[d] + reach;
    } else {
      const long long shifted = site[1 + d] + geometry.padding.value[d] - reach;
      valid = shifted >= 0 && shifted % stride == 0;
      out_coordinate = shifted / stride;
    }
    valid = valid && out_coordinate >= 0 && out_coordinate < geometry.out.value[d];
    key = key * geometry.out.value[d] + out_coordinate;
  }
  return valid ? key : -1;
}

// *problems |= bits, by compare-and-swap from a guess of 0 (an OR: the result does not depend on thread order).
__device__ __forceinline__ void or_bits(long long* problems, long long bits) {
  unsigned long long* word = reinterpret_cast<unsigned long long*>(problems);
  const unsigned long long wanted = static_cast<unsigned long long>(bits);
  unsigned long long seen = 0ULL;
  while (true) {
    const unsigned long long before = atomicCAS(word, seen, seen | wanted);
    if (before == seen || (before & wanted) == wanted) {
      break;
    }
    seen = before;
  }
}

// Accumulates mask bit k of a row, storing word k / 32 when it is complete.
__device__ __forceinline__ void add_mask_bit(unsigned int* __restrict__ masks, int k, int volume, bool present,
                                             unsigned int* word) {
  *word |= present ? (1u << (k & 31)) : 0u;
  if ((k & 31) == 31 || k == volume - 1) {
    masks[k >> 5] = *word;
    *word = 0u;
  }
}

}  // namespace sc

// Section 1: inserts each site inside the grid (key -> row). Launch over n threads.
__global__ void sc_map_insert_sites(const int* __restrict__ indices, long long n, int ndim, long long batch_size,
                                    SC_AXES(extent), SC_AXES(margin), long long* table, long long capacity) {
  const sc::Axes extent = SC_AXES_VALUE(extent);
  const sc::Axes margin = SC_AXES_VALUE(margin);
  const long long no_shift[sc::kMapAxes] = {0, 0, 0, 0};
  sc::for_each_element(n, 1, [&](long long i, long long, long long) {
    const int* site = indices + i * (ndim + 1);
    if (!sc::site_in_grid(site, ndim, batch_size, extent)) {
      return;
    }
    const long long key = sc::padded_key(site, ndim, extent, margin, no_shift);
    long long slot = sc::home_slot(key, capacity);
    for (long long probe = 0; probe < capacity; ++probe) {
      const unsigned long long previous = atomicCAS(reinterpret_cast<unsigned long long*>(table + slot),
                                                    sc::kNoEntry, static_cast<unsigned long long>(key));
      if (previous == sc::kNoEntry || previous == static_cast<unsigned long long>(key)) {
        atomicMin(reinterpret_cast<unsigned long long*>(table + capacity + slot),
                  static_cast<unsigned long long>(i));
        break;
      }
      slot = (slot + 1) & (capacity - 1);
    }
  });
}

// Section 1: the problem bits of the sites, after sc_map_insert_sites on the same table. Launch over n threads.
__global__ void sc_map_check_sites(const int* __restrict__ indices, long long n, int ndim, long long batch_size,
                                   SC_AXES(extent), SC_AXES(margin), const long long* __restrict__ table,
                                   long long capacity, long long* problems, long long slot, int shift,
                                   int skip_padding) {
  const sc::Axes extent = SC_AXES_VALUE(extent);
  const sc::Axes margin = SC_AXES_VALUE(margin);
  const long long no_shift[sc::kMapAxes] = {0, 0, 0, 0};
  sc::for_each_element(n, 1, [&](long long i, long long, long long) {
    const int* site = indices + i * (ndim + 1);
    if (skip_padding && site[0] == -1) {  // a padding row of a capacity-mode input (sparsecore.capacity)
      return;
    }
    if (!sc::site_in_grid(site, ndim, batch_size, extent)) {
      sc::or_bits(problems + slot, 1LL << shift);
    } else if (sc::find_row(table, capacity, sc::padded_key(site, ndim, extent, margin, no_shift)) != i) {
      sc::or_bits(problems + slot, 2LL << shift);
    }
  });
}

// Section 2: one thread per site writes its row and mask words. Launch over n threads.
__global__ void sc_map_submanifold(const int* __restrict__ indices, long long n, int ndim, long long batch_size,
                                   SC_AXES(extent), SC_AXES(kernel), SC_AXES(dilation),
                                   const long long* __restrict__ table, long long capacity, int volume, int words,
                                   int* __restrict__ neighbours, unsigned int* __restrict__ masks) {
  const sc::Axes extent = SC_AXES_VALUE(extent);
  const sc::Axes kernel = SC_AXES_VALUE(kernel);
  const sc::Axes dilation = SC_AXES_VALUE(dilation);
  sc::Axes margin = {{0, 0, 0, 0}};
  for (int d = 0; d < ndim; ++d) {
    margin.value[d] = dilation.value[d] * (kernel.value[d] - 1) / 2;
  }
  sc::for_each_element(n, 1, [&](long long i, long long, long long) {
    const int* site = indices + i * (ndim + 1);
    const bool inside = sc::site_in_grid(site, ndim, batch_size, extent);
    int* row = neighbours + i * volume;
    unsigned int* row_masks = masks + i * words;
    unsigned int word = 0u;
    long long position[sc::kMapAxes] = {0, 0, 0, 0};
    long long shift[sc::kMapAxes] = {0, 0, 0, 0};
    for (int k = 0; k < volume; ++k) {
      sc::kernel_position(k, ndim, kernel, position);
      for (int d = 0; d < ndim; ++d) {
        shift[d] = position[d] * dilation.value[d] - margin.value[d];
      }
      const long long found =
          inside ? sc::find_row(table, capacity, sc::padded_key(site, ndim, extent, margin, shift)) : -1;
      row[k] = static_cast<int>(found);
      sc::add_mask_bit(row_masks, k, volume, found >= 0, &word);
    }
  });
}

// Section 3a: keys[f] = candidate_key(f). Launch over n * volume threads.
__global__ void sc_map_candidates(const int* __restrict__ indices, long long n, int ndim, long long batch_size,
                                  SC_STRIDED_GEOMETRY, int transposed, int volume, long long* __restrict__ keys) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(n * volume, 1, [&](long long f, long long, long long) {
    keys[f] = sc::candidate_key(indices, ndim, batch_size, geometry, transposed, volume, f);
  });
}

// Section 3c: marks[t] = 1 where sorted position t starts a run of a valid key. Launch over total threads.
__global__ void sc_map_mark_outputs(const int* __restrict__ indices, int ndim, long long batch_size,
                                    SC_STRIDED_GEOMETRY, int transposed, int volume,
                                    const long long* __restrict__ order, long long total,
                                    long long* __restrict__ marks) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(total, 1, [&](long long t, long long, long long) {
    const long long key = sc::candidate_key(indices, ndim, batch_size, geometry, transposed, volume, order[t]);
    const bool first = key >= 0 &&
        (t == 0 || sc::candidate_key(indices, ndim, batch_size, geometry, transposed, volume, order[t - 1]) != key);
    marks[t] = first ? 1 : 0;
  });
}

namespace sc {

// Section 3e, one item e of n + total: an input row, or the output row first at sorted position e - n.
// Output rows o >= capacity are not written (a capacity build's overflow: the count it needed is reported
// apart), and an input row's entry naming one is -1.
__device__ __forceinline__ void strided_item(const int* __restrict__ indices, long long n, int ndim,
                                             long long batch_size, const StridedGeometry& geometry, int transposed,
                                             int volume, int words, const long long* __restrict__ order,
                                             const long long* __restrict__ ranks, long long total,
                                             long long capacity, int* __restrict__ output_indices,
                                             int* __restrict__ output_neighbours,
                                             unsigned int* __restrict__ output_masks,
                                             int* __restrict__ input_neighbours,
                                             unsigned int* __restrict__ input_masks, long long e) {
  auto sorted_key = [&](long long t) {
    return candidate_key(indices, ndim, batch_size, geometry, transposed, volume, order[t]);
  };
  if (e < n) {  // input row e
    int* row = input_neighbours + e * volume;
    unsigned int word = 0u;
    for (int k = 0; k < volume; ++k) {
      const long long key = candidate_key(indices, ndim, batch_size, geometry, transposed, volume, e * volume + k);
      int output = -1;
      if (key >= 0) {
        long long low = 0;  // the first sorted position whose key is >= key
        long long high = total;
        while (low < high) {
          const long long middle = low + (high - low) / 2;
          if (sorted_key(middle) < key) {
            low = middle + 1;
          } else {
            high = middle;
          }
        }
        const long long found = ranks[low] - 1;
        output = found < capacity ? static_cast<int>(found) : -1;
      }
      row[k] = output;
      add_mask_bit(input_masks + e * words, k, volume, output >= 0, &word);
    }
    return;
  }
  const long long t = e - n;  // sorted position t: the first of its key's run?
  if (ranks[t] == (t == 0 ? 0 : ranks[t - 1])) {
    return;
  }
  const long long o = ranks[t] - 1;
  if (o >= capacity) {
    return;
  }
  const long long key = sorted_key(t);
  long long rest = key;
  for (int d = ndim - 1; d >= 0; --d) {
    output_indices[o * (ndim + 1) + 1 + d] = static_cast<int>(rest % geometry.out.value[d]);
    rest /= geometry.out.value[d];
  }
  output_indices[o * (ndim + 1)] = static_cast<int>(rest);
  int* row = output_neighbours + o * volume;
  unsigned int* row_masks = output_masks + o * words;
  for (int k = 0; k < volume; ++k) {
    row[k] = -1;
  }
  for (int w = 0; w < words; ++w) {
    row_masks[w] = 0u;
  }
  for (long long u = t; u < total && sorted_key(u) == key; ++u) {
    const long long f = order[u];
    const long long i = f / volume;
    const int k = static_cast<int>(f - i * volume);
    row[k] = static_cast<int>(i);
    row_masks[k >> 5] |= 1u << (k & 31);
  }
}

}  // namespace sc

// Section 3e: both sides of the map and the output sites (exact mode: the output count was read back and
// every table holds exactly that many rows). Launch over n + total threads.
__global__ void sc_map_strided(const int* __restrict__ indices, long long n, int ndim, long long batch_size,
                               SC_STRIDED_GEOMETRY, int transposed, int volume, int words,
                               const long long* __restrict__ order, const long long* __restrict__ ranks,
                               long long total, int* __restrict__ output_indices,
                               int* __restrict__ output_neighbours, unsigned int* __restrict__ output_masks,
                               int* __restrict__ input_neighbours, unsigned int* __restrict__ input_masks) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(n + total, 1, [&](long long e, long long, long long) {
    sc::strided_item(indices, n, ndim, batch_size, geometry, transposed, volume, words, order, ranks, total,
                     total + 1, output_indices, output_neighbours, output_masks, input_neighbours, input_masks, e);
  });
}

// Section 3e of a capacity build (sparsecore.capacity): no read back. The output tables hold `capacity` rows,
// filled with padding (sites -1, neighbours -1, masks 0) before the launch; rows past the capacity are never
// written. Item 0 also writes status[0] = the output count the build needed (capped at INT32_MAX, it may exceed
// the capacity: the overflow) and status[1] = the problem bits a checked build's last mark carried
// (ranks[total - 1] >> problem_shift). Launch over n + total threads (total >= 1).
__global__ void sc_map_strided_capacity(const int* __restrict__ indices, long long n, int ndim,
                                        long long batch_size, SC_STRIDED_GEOMETRY, int transposed, int volume,
                                        int words, const long long* __restrict__ order,
                                        const long long* __restrict__ ranks, long long total,
                                        int* __restrict__ output_indices, int* __restrict__ output_neighbours,
                                        unsigned int* __restrict__ output_masks,
                                        int* __restrict__ input_neighbours, unsigned int* __restrict__ input_masks,
                                        long long capacity, int* __restrict__ status, int problem_shift) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(n + total, 1, [&](long long e, long long, long long) {
    if (e == 0) {
      const long long last = ranks[total - 1];
      const long long needed = last & ((1LL << problem_shift) - 1);
      status[0] = static_cast<int>(needed < 2147483647LL ? needed : 2147483647LL);
      status[1] = static_cast<int>(last >> problem_shift);
    }
    sc::strided_item(indices, n, ndim, batch_size, geometry, transposed, volume, words, order, ranks, total,
                     capacity, output_indices, output_neighbours, output_masks, input_neighbours, input_masks, e);
  });
}
