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
//         its site (the key unpacked), its row of the table (the candidates
//         of its key's run) and its mask. The input side gets no masks: the
//         pooling kernels never read them; the first conv that tiles that side
//         by mask makes them from the input table (sc_map_row_masks, below).
//    Output rows are the distinct valid keys in increasing key order (the
//    CPU builders' order).
//
// 4. A side's row plan (sc_map_row_plan; sparsecore.tile_order, _kernel_maps.row_plan),
//    in place over plan int64 [N], the rows stably sorted by mask (xp.argsort): each
//    slot keeps its row in its low 32-bit word (rows < 2^31, so the high word is 0).
//    One thread per row tile of 64 positions regroups the tile's rows (two greedy
//    passes: 16-row groups, then 8-row halves of each; kept only where neither the
//    8-row nor the 16-row slices hold more offsets than in the sort;
//    sparsecore/tile_order.py holds the rule and its NumPy twin) and writes them back
//    into the same slots' low words.
//    A block owns 32 consecutive tiles (a chunk c) and, when volume * C <= N (C =
//    ceil(tiles / 32)), writes the high word of slot k * C + c: bit j set when tile
//    32 c + j holds offset k in a row's mask (the per-offset row-tile bit sets the
//    weight gradient walks). Low words are written only by their tile's thread, high
//    words only by their chunk's block: no two threads write the same 32-bit word,
//    and a thread reads only low words. Masks of more than kPlanWords words are not
//    regrouped (the host does not launch: the plan stays the sort).

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
                                             int* __restrict__ input_neighbours, long long e) {
  auto sorted_key = [&](long long t) {
    return candidate_key(indices, ndim, batch_size, geometry, transposed, volume, order[t]);
  };
  if (e < n) {  // input row e
    int* row = input_neighbours + e * volume;
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
                               int* __restrict__ input_neighbours) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(n + total, 1, [&](long long e, long long, long long) {
    sc::strided_item(indices, n, ndim, batch_size, geometry, transposed, volume, words, order, ranks, total,
                     total + 1, output_indices, output_neighbours, output_masks, input_neighbours, e);
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
                                        int* __restrict__ input_neighbours, long long capacity,
                                        int* __restrict__ status, int problem_shift) {
  const sc::StridedGeometry geometry = SC_STRIDED_GEOMETRY_VALUE;
  sc::for_each_element(n + total, 1, [&](long long e, long long, long long) {
    if (e == 0) {
      const long long last = ranks[total - 1];
      const long long needed = last & ((1LL << problem_shift) - 1);
      status[0] = static_cast<int>(needed < 2147483647LL ? needed : 2147483647LL);
      status[1] = static_cast<int>(last >> problem_shift);
    }
    sc::strided_item(indices, n, ndim, batch_size, geometry, transposed, volume, words, order, ranks, total,
                     capacity, output_indices, output_neighbours, output_masks, input_neighbours, e);
  });
}

// Section 3f: a table's row masks (a strided map's input side, made when a conv first tiles it by mask):
// one thread per row writes masks[r, :] from neighbours[r, :] (bit k set where the entry is >= 0), as
// sc_map_submanifold and sc_map_strided write theirs. Launch over rows threads.
__global__ void sc_map_row_masks(const int* __restrict__ neighbours, long long rows, int volume, int words,
                                 unsigned int* __restrict__ masks) {
  sc::for_each_element(rows, 1, [&](long long r, long long, long long) {
    const int* row = neighbours + r * volume;
    unsigned int word = 0u;
    for (int k = 0; k < volume; ++k) {
      sc::add_mask_bit(masks + r * words, k, volume, row[k] >= 0, &word);
    }
  });
}

namespace sc {

constexpr int kPlanTileRows = 64;  // sc::kTileRows of implicit_gemm.cu
constexpr int kPlanThreads = 32;   // threads (tiles) of a block: one bit-set word
constexpr int kPlanWords = 2;      // sparsecore.tile_order.MAX_REGROUP_WORDS

// Shared memory of sc_map_row_plan: per thread (last index) its tile's slots (the
// sorted positions 0..63): row, mask words and offset count; the arrangement of
// slots (-1: none) and the next pass's; the tile's OR mask.
struct PlanShared {
  int row[kPlanTileRows][kPlanThreads];
  unsigned int mask[kPlanWords][kPlanTileRows][kPlanThreads];
  int count[kPlanTileRows][kPlanThreads];
  signed char arrangement[kPlanTileRows][kPlanThreads];
  signed char next[kPlanTileRows][kPlanThreads];
  unsigned int tile_or[kPlanWords][kPlanThreads];
};

// One greedy pass of sparsecore.tile_order over thread `tid`'s arrangement: each segment of
// `segment` positions into groups of `group` rows (seed: most offsets; then fewest new
// offsets, most offsets, earliest position); -1 entries go after the segment's rows.
__device__ __forceinline__ void plan_pass(PlanShared& shared, int tid, int words, int segment, int group) {
  const int most = 32 * words + 1;
  for (int s0 = 0; s0 < kPlanTileRows; s0 += segment) {
    unsigned long long taken = 0ull;
    for (int p = 0; p < segment; ++p) {
      if (shared.arrangement[s0 + p][tid] < 0) taken |= 1ull << p;
    }
    unsigned int held[kPlanWords] = {0u, 0u};
    for (int pick = 0; pick < segment; ++pick) {
      if (pick % group == 0) {
        held[0] = 0u;
        held[1] = 0u;
      }
      int best = -1;
      int best_key = 0;
      for (int p = 0; p < segment; ++p) {
        if ((taken >> p) & 1ull) continue;
        const int slot = shared.arrangement[s0 + p][tid];
        const int count = shared.count[slot][tid];
        int key;
        if (pick % group == 0) {
          key = (most - count) * segment + p;
        } else {
          int growth = 0;
          for (int w = 0; w < words; ++w) growth += __popc(shared.mask[w][slot][tid] & ~held[w]);
          key = (growth * most + (most - count)) * segment + p;
        }
        if (best < 0 || key < best_key) {
          best = p;
          best_key = key;
        }
      }
      if (best < 0) {
        shared.next[s0 + pick][tid] = -1;
        continue;
      }
      const int slot = shared.arrangement[s0 + best][tid];
      taken |= 1ull << best;
      for (int w = 0; w < words; ++w) held[w] |= shared.mask[w][slot][tid];
      shared.next[s0 + pick][tid] = static_cast<signed char>(slot);
    }
  }
  for (int p = 0; p < kPlanTileRows; ++p) shared.arrangement[p][tid] = shared.next[p][tid];
}

// The offsets held by thread `tid`'s 8-row slices (summed) plus (1 << 20) times those held by its
// 16-row slices, for its arrangement (`sorted`: the identity, slots in sorted order).
__device__ __forceinline__ long long plan_slice_counts(const PlanShared& shared, int tid, int words, bool sorted) {
  long long eight = 0;
  long long sixteen = 0;
  for (int w = 0; w < words; ++w) {
    for (int s = 0; s < kPlanTileRows; s += 16) {
      unsigned int halves[2] = {0u, 0u};
      for (int p = 0; p < 16; ++p) {
        const int slot = sorted ? s + p : shared.arrangement[s + p][tid];
        if (slot >= 0) halves[p / 8] |= shared.mask[w][slot][tid];  // a missing row's mask is 0
      }
      eight += __popc(halves[0]) + __popc(halves[1]);
      sixteen += __popc(halves[0] | halves[1]);
    }
  }
  return eight + (sixteen << 20);
}

}  // namespace sc

// Section 4: a side's row plan, in place. Launch with kPlanThreads threads per block, any grid.
__global__ void sc_map_row_plan(const unsigned int* __restrict__ masks, long long num_rows, int mask_words,
                                int volume, long long* plan) {
  if (blockDim.x != sc::kPlanThreads || mask_words > sc::kPlanWords) __trap();
  __shared__ sc::PlanShared shared;
  int* low = reinterpret_cast<int*>(plan);  // slot p: low word 2 p, high word 2 p + 1
  const int tid = threadIdx.x;
  const long long tiles = (num_rows + sc::kPlanTileRows - 1) / sc::kPlanTileRows;
  const long long chunks = (tiles + sc::kPlanThreads - 1) / sc::kPlanThreads;
  const bool bit_sets = static_cast<long long>(volume) * chunks <= num_rows;
  for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const long long tile = chunk * sc::kPlanThreads + tid;
    const long long first = tile * sc::kPlanTileRows;
    const int rows = tile < tiles ? static_cast<int>(num_rows - first < sc::kPlanTileRows ? num_rows - first
                                                                                             : sc::kPlanTileRows)
                                  : 0;
    unsigned int tile_or[sc::kPlanWords] = {0u, 0u};
    for (int j = 0; j < sc::kPlanTileRows; ++j) {
      const bool valid = j < rows;
      const int row = valid ? low[2 * (first + j)] : -1;
      int count = 0;
      for (int w = 0; w < sc::kPlanWords; ++w) {
        const unsigned int word = valid && w < mask_words ? __ldg(masks + static_cast<long long>(row) * mask_words + w)
                                                          : 0u;
        shared.mask[w][j][tid] = word;
        tile_or[w] |= word;
        count += __popc(word);
      }
      shared.row[j][tid] = row;
      shared.count[j][tid] = count;
      shared.arrangement[j][tid] = static_cast<signed char>(valid ? j : -1);
    }
    const long long before = sc::plan_slice_counts(shared, tid, mask_words, true);
    sc::plan_pass(shared, tid, mask_words, sc::kPlanTileRows, 16);
    sc::plan_pass(shared, tid, mask_words, 16, 8);
    const long long after = sc::plan_slice_counts(shared, tid, mask_words, false);
    const bool keep = (after & 0xFFFFF) <= (before & 0xFFFFF) && (after >> 20) <= (before >> 20);
    if (keep) {
      for (int p = 0; p < rows; ++p) low[2 * (first + p)] = shared.row[shared.arrangement[p][tid]][tid];
    }
    for (int w = 0; w < sc::kPlanWords; ++w) shared.tile_or[w][tid] = tile_or[w];
    __syncthreads();
    if (bit_sets) {
      for (int k = tid; k < volume; k += sc::kPlanThreads) {
        unsigned int bits = 0u;
        for (int j = 0; j < sc::kPlanThreads; ++j) {
          bits |= ((shared.tile_or[k >> 5][j] >> (k & 31)) & 1u) << j;  // tiles past the end hold nothing
        }
        low[2 * (static_cast<long long>(k) * chunks + chunk) + 1] = static_cast<int>(bits);
      }
    }
    __syncthreads();  // tile_or is rewritten by the next chunk
  }
}
