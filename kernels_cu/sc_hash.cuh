// sc_hash.cuh: the slot of a key in sparsecore's open-addressing hash tables.
//
// Included by hash_table.cu and neighbour_map.cu (the registry inlines it into
// each). Keys are int64 >= 0, tables have a power-of-two capacity, and a key's
// home slot is splitmix64's output finaliser of the key masked to the
// capacity; collisions probe linearly (slot + 1, wrapping).
#ifndef SPARSECORE_SC_HASH_CUH
#define SPARSECORE_SC_HASH_CUH

namespace sc {

// splitmix64's output finaliser: a bijective 64-bit mix.
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ long long home_slot(long long key, long long capacity) {
  return static_cast<long long>(mix64(static_cast<unsigned long long>(key)) &
                                static_cast<unsigned long long>(capacity - 1));
}

}  // namespace sc

#endif  // SPARSECORE_SC_HASH_CUH
