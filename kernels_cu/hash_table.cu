// hash_table.cu: an open-addressing hash table of int64 keys on the GPU.
//
// Layout (both arrays allocated and initialised by the caller):
//   table_keys   int64 [capacity], every slot -1 (empty) before the first insert
//   table_values V     [capacity], every slot the largest V (INT32_MAX for int,
//                INT64_MAX for long long) before the first insert
//   capacity     a power of two, at least 2 * (number of keys inserted), so that
//                every probe sequence reaches an empty slot
// V is int (row indices, what rulebooks use) or long long (general values).
//
// Keys are >= 0. A slot stores the key itself, never a hash of it, so two keys
// cannot alias. The home slot of a key is splitmix64's finaliser of the key
// masked to the capacity; collisions probe linearly (slot + 1, wrapping).
//
// Duplicate keys: all inserts of one key land in one slot, which keeps the
// MINIMUM of their values (atomicMin), so lookups do not depend on thread
// order. Which slot a key gets may differ from run to run when keys collide;
// lookup results never do. To reject duplicates, look the inserted keys up
// again: a key whose value comes back different from the value inserted for
// it was inserted more than once (the answer is the smallest value given).
//
// Negative keys and queries are skipped by insert and answer -1 on lookup.
//
// Also here: sc_pack_keys / sc_unpack_keys, the keys of sites (at the end).

#include "sc_common.cuh"
#include "sc_hash.cuh"

namespace sc {

constexpr long long kEmptyKey = -1;

// Value stored for `query`, or -1 when it is absent (or negative).
template <typename V>
__device__ __forceinline__ V find_value(const long long* __restrict__ table_keys,
                                        const V* __restrict__ table_values, long long capacity,
                                        long long query) {
  if (query < 0) {
    return static_cast<V>(-1);
  }
  long long slot = home_slot(query, capacity);
  for (long long probe = 0; probe < capacity; ++probe) {
    const long long stored = __ldg(table_keys + slot);
    if (stored == query) {
      return __ldg(table_values + slot);
    }
    if (stored == kEmptyKey) {
      return static_cast<V>(-1);
    }
    slot = (slot + 1) & (capacity - 1);
  }
  return static_cast<V>(-1);
}

}  // namespace sc

// Inserts keys[i] -> values[i] for i < n (see the layout above).
template <typename V>
__global__ void sc_hash_insert(const long long* __restrict__ keys, const V* __restrict__ values,
                               long long n, long long* table_keys, V* table_values,
                               long long capacity) {
  const long long step = sc::grid_thread_count();
  for (long long i = sc::grid_thread_index(); i < n; i += step) {
    const long long key = keys[i];
    if (key < 0) {
      continue;
    }
    const V value = values[i];
    long long slot = sc::home_slot(key, capacity);
    for (long long probe = 0; probe < capacity; ++probe) {
      const long long previous = static_cast<long long>(
          atomicCAS(reinterpret_cast<unsigned long long*>(table_keys + slot),
                    static_cast<unsigned long long>(sc::kEmptyKey),
                    static_cast<unsigned long long>(key)));
      if (previous == sc::kEmptyKey || previous == key) {
        atomicMin(table_values + slot, value);
        break;
      }
      slot = (slot + 1) & (capacity - 1);
    }
  }
}

// out[i] = value of queries[i], or -1 when absent, for i < n.
template <typename V>
__global__ void sc_hash_lookup(const long long* __restrict__ queries, long long n,
                               const long long* __restrict__ table_keys,
                               const V* __restrict__ table_values, long long capacity,
                               V* __restrict__ out) {
  const long long step = sc::grid_thread_count();
  for (long long i = sc::grid_thread_index(); i < n; i += step) {
    out[i] = sc::find_value(table_keys, table_values, capacity, queries[i]);
  }
}

// Neighbour lookup for all kernel offsets in one launch:
//   out[k * n + i] = value of (keys[i] + deltas[k]), or -1,   k < num_offsets, i < n
// (out is row-major [num_offsets, n]).
//
// Contract: no range check happens here, so the caller packs keys on a grid
// padded by the kernel's reach r_d on both sides of every spatial axis: site
// (b, c_0..c_{D-1}) has key ((b * S_0 + c_0 + r_0) * S_1 + c_1 + r_1) ... with
// S_d = shape_d + 2 r_d, both for the keys inserted into the table and for
// `keys` here, and deltas[k] = sum_d o_kd * stride_d with |o_kd| <= r_d and
// stride_d the padded grid's row-major stride of axis d. Then key + delta never
// wraps into another row or batch element, and a neighbour outside the real
// grid lands in the padding, where no site has a key: the lookup answers -1.
// A negative base key answers -1 for every offset.
template <typename V>
__global__ void sc_hash_lookup_offsets(const long long* __restrict__ keys, long long n,
                                       const long long* __restrict__ deltas, int num_offsets,
                                       const long long* __restrict__ table_keys,
                                       const V* __restrict__ table_values, long long capacity,
                                       V* __restrict__ out) {
  const long long total = n * num_offsets;
  const long long step = sc::grid_thread_count();
  for (long long e = sc::grid_thread_index(); e < total; e += step) {
    const long long offset = e / n;
    const long long base = keys[e - offset * n];
    const long long query = base < 0 ? -1 : base + __ldg(deltas + offset);
    out[e] = sc::find_value(table_keys, table_values, capacity, query);
  }
}

// Packed keys of sites (the layout of sparsecore.hashing.pack_keys): for site i of
// indices int32 [n, columns] (batch first), key[i] = sum_c (indices[i, c] + addends[c])
// * strides[c], with strides int64 [columns] (the packed grid's row-major strides, the
// last 1) and addends int64 [columns] (0 for the batch, the margin for each axis). The
// caller checks that every key fits int64 and every site lies in the padded grid.
// Launch over n threads.
__global__ void sc_pack_keys(const int* __restrict__ indices, long long n, int columns,
                             const long long* __restrict__ strides,
                             const long long* __restrict__ addends, long long* __restrict__ keys) {
  sc::for_each_element(n, 1, [&](long long i, long long, long long) {
    long long key = 0;
    for (int c = 0; c < columns; ++c) {
      key += (static_cast<long long>(indices[i * columns + c]) + __ldg(addends + c)) * __ldg(strides + c);
    }
    keys[i] = key;
  });
}

// The inverse of sc_pack_keys for keys >= 0 of the packed grid: indices[i, c] =
// (key[i] % strides[c - 1]) / strides[c] - addends[c] (the batch: key[i] / strides[0]),
// as int32 [n, columns]. Launch over n threads.
__global__ void sc_unpack_keys(const long long* __restrict__ keys, long long n, int columns,
                               const long long* __restrict__ strides,
                               const long long* __restrict__ addends, int* __restrict__ indices) {
  sc::for_each_element(n, 1, [&](long long i, long long, long long) {
    long long remainder = keys[i];
    for (int c = 0; c < columns; ++c) {
      const long long stride = __ldg(strides + c);
      indices[i * columns + c] = static_cast<int>(remainder / stride - __ldg(addends + c));
      remainder %= stride;
    }
  });
}
