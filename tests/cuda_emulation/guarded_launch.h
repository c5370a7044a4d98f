// guarded_launch.h: bounds-checked launches for the CPU emulation of CUDA.
//
// sc_emu::guarded_launch runs a kernel like sc_emu::launch (cuda_shim.h), but
// first copies every array argument into its own guarded mapping:
//
//   [ 1 MiB PROT_NONE ][ data | tail ... up to a page boundary ][ 1 MiB PROT_NONE ]
//                        ^ page aligned
//
// The data starts exactly at a page boundary (aligned for any vector access),
// so ANY access before element 0 (row -1 of any width, down to 1 MiB before)
// hits the guard, as does any access that leaves the data's last page. The
// tail between the data's end and that page boundary is filled with a canary
// (0x7f bytes: huge floats and indices, a NaN for __half) and checked after
// the launch, so a write past the end is caught wherever it lands, and a read
// there poisons the result. A fault in a guard is recorded (argument and byte
// offset), the page is opened so the thread can go on, and the launch reports
// status 2; the harness raises with the kernel, the argument and the index.
// A fault at an unmapped address outside every array (a wild index, e.g. a
// row read from a canary) is recorded too: a zero page is mapped there for
// the rest of the launch and removed after it. Faults at mapped but protected
// addresses go to the previous handler (a real crash stays one).
// Kernels with several blocks of threads fault concurrently: only the first
// fault is kept. Arguments that overlap in memory are passed unguarded (their
// copies would diverge).
#ifndef SPARSECORE_GUARDED_LAUNCH_H
#define SPARSECORE_GUARDED_LAUNCH_H

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

namespace sc_emu {

constexpr std::size_t kGuardBytes = std::size_t(1) << 20;
constexpr unsigned char kCanary = 0x7f;
constexpr int kMaxGuardedArguments = 64;

struct GuardedRegion {
  char* reserve = nullptr;
  std::size_t reserve_bytes = 0;
  char* data = nullptr;
  std::size_t bytes = 0;
  std::size_t span = 0;  // readable and writable bytes from data (bytes rounded up to pages)
  int argument = -1;
};

inline GuardedRegion guarded_regions[kMaxGuardedArguments];
inline std::atomic<int> guarded_region_count{0};
inline std::atomic<int> fault_argument{-1};
inline std::atomic<long long> fault_offset{0};
// 1: access in a guard, 2: the canary after the data was overwritten, 3: an unmapped address elsewhere
inline std::atomic<int> fault_kind{0};
inline std::atomic<std::uintptr_t> fault_address{0};
constexpr int kMaxWildPages = 64;
inline void* wild_pages[kMaxWildPages];
inline std::atomic<int> wild_page_count{0};
inline std::mutex guarded_launch_mutex;
inline struct sigaction previous_segv_action;
inline struct sigaction previous_bus_action;

inline std::size_t page_bytes() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

inline void guard_fault_handler(int signal_number, siginfo_t* info, void* context) {
  char* address = static_cast<char*>(info->si_addr);
  const int count = guarded_region_count.load();
  for (int i = 0; i < count; ++i) {
    const GuardedRegion& region = guarded_regions[i];
    if (address < region.reserve || address >= region.reserve + region.reserve_bytes) continue;
    int expected = -1;
    if (fault_argument.compare_exchange_strong(expected, region.argument)) {
      fault_offset.store(static_cast<long long>(address - region.data));
      fault_kind.store(1);
    }
    // open the page so the faulting thread can finish (reads see zeros, writes land in the guard)
    const std::size_t page = page_bytes();
    char* page_start = reinterpret_cast<char*>(reinterpret_cast<std::uintptr_t>(address) & ~(page - 1));
    mprotect(page_start, page, PROT_READ | PROT_WRITE);
    return;
  }
  // an unmapped address (a wild index): map a zero page there so the thread can go on
  const std::size_t page = page_bytes();
  void* page_start = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(address) & ~(page - 1));
  const int slot = wild_page_count.fetch_add(1);
  if (slot < kMaxWildPages) {
    void* mapped = mmap(page_start, page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (mapped == page_start) {
      wild_pages[slot] = mapped;
      int expected = -1;
      if (fault_argument.compare_exchange_strong(expected, kMaxGuardedArguments)) {
        fault_address.store(reinterpret_cast<std::uintptr_t>(address));
        fault_kind.store(3);
      }
      return;
    }
    if (mapped != MAP_FAILED) munmap(mapped, page);
    wild_pages[slot] = nullptr;
  }
  // mapped but protected, or too many: hand the fault to whoever handled it before (it re-executes)
  sigaction(signal_number, signal_number == SIGBUS ? &previous_bus_action : &previous_segv_action, nullptr);
  (void)context;
}

// Maps a guarded copy of `bytes` bytes at `source`; false when the mapping fails.
inline bool map_guarded(GuardedRegion& region, const void* source, std::size_t bytes, int argument) {
  const std::size_t page = page_bytes();
  const std::size_t span = (bytes + page - 1) / page * page;
  region.reserve_bytes = kGuardBytes + span + kGuardBytes;
  void* reserve = mmap(nullptr, region.reserve_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) return false;
  region.reserve = static_cast<char*>(reserve);
  region.data = region.reserve + kGuardBytes;
  region.bytes = bytes;
  region.span = span;
  region.argument = argument;
  if (span && mprotect(region.data, span, PROT_READ | PROT_WRITE) != 0) {
    munmap(region.reserve, region.reserve_bytes);
    return false;
  }
  if (bytes) std::memcpy(region.data, source, bytes);
  if (span > bytes) std::memset(region.data + bytes, kCanary, span - bytes);
  return true;
}

inline bool overlaps(const char* a, long long a_bytes, const char* b, long long b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

// kernel<<<grid, block>>>(args...) with every array argument guarded. `extents[i]`
// is the byte size of the array behind parameter i (ignored for scalars).
// Returns 0, 1 for a bad configuration (as launch), 2 for an out-of-bounds access
// (see fault_argument / fault_offset / fault_kind), 3 when a mapping failed.
template <typename... Params>
int guarded_launch(void (*kernel)(Params...), unsigned int grid, unsigned int block, void** args,
                   const long long* extents) {
  constexpr std::size_t count = sizeof...(Params);
  static_assert(count <= kMaxGuardedArguments, "too many kernel parameters to guard");
  constexpr bool is_pointer[count ? count : 1] = {std::is_pointer_v<Params>...};
  constexpr bool is_const_pointer[count ? count : 1] = {
      std::is_const_v<std::remove_pointer_t<std::remove_cv_t<Params>>>...};
  std::lock_guard<std::mutex> lock(guarded_launch_mutex);  // the region table is shared
  void* pointers[count ? count : 1];
  void* guarded_args[count ? count : 1];
  int region_of[count ? count : 1];
  int regions = 0;
  bool failed = false;
  for (std::size_t i = 0; i < count; ++i) {
    guarded_args[i] = args[i];
    region_of[i] = -1;
    if (!is_pointer[i] || extents[i] < 0) continue;
    const char* original = *static_cast<char* const*>(args[i]);
    bool shared = false;
    for (std::size_t j = 0; j < count; ++j) {
      if (j != i && is_pointer[j] && extents[j] >= 0 &&
          overlaps(original, extents[i], *static_cast<char* const*>(args[j]), extents[j]) && extents[i] > 0 &&
          extents[j] > 0) {
        shared = true;
      }
    }
    if (shared) continue;
    if (!map_guarded(guarded_regions[regions], original, static_cast<std::size_t>(extents[i]),
                     static_cast<int>(i))) {
      failed = true;
      break;
    }
    pointers[i] = guarded_regions[regions].data;
    guarded_args[i] = &pointers[i];
    region_of[i] = regions++;
  }
  fault_argument.store(-1);
  fault_offset.store(0);
  fault_kind.store(0);
  fault_address.store(0);
  wild_page_count.store(0);
  int status = failed ? 3 : 0;
  if (!failed) {
    guarded_region_count.store(regions);
    struct sigaction action;
    std::memset(&action, 0, sizeof action);
    action.sa_sigaction = guard_fault_handler;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &previous_segv_action);
    sigaction(SIGBUS, &action, &previous_bus_action);
    status = sc_emu::launch(kernel, grid, block, guarded_args);
    sigaction(SIGSEGV, &previous_segv_action, nullptr);
    sigaction(SIGBUS, &previous_bus_action, nullptr);
    guarded_region_count.store(0);
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (region_of[i] < 0) continue;
    GuardedRegion& region = guarded_regions[region_of[i]];
    if (status == 0 && fault_argument.load() < 0) {
      for (std::size_t b = region.bytes; b < region.span; ++b) {
        if (static_cast<unsigned char>(region.data[b]) != kCanary) {
          fault_argument.store(static_cast<int>(i));
          fault_offset.store(static_cast<long long>(b));
          fault_kind.store(2);
          break;
        }
      }
    }
    if (!is_const_pointer[i] && region.bytes) {
      std::memcpy(*static_cast<char**>(args[i]), region.data, region.bytes);
    }
  }
  for (int r = 0; r < regions; ++r) munmap(guarded_regions[r].reserve, guarded_regions[r].reserve_bytes);
  const int wild = wild_page_count.load() < kMaxWildPages ? wild_page_count.load() : kMaxWildPages;
  for (int w = 0; w < wild; ++w) {
    if (wild_pages[w]) munmap(wild_pages[w], page_bytes());
  }
  if (status == 0 && fault_argument.load() >= 0) status = 2;
  return status;
}

}  // namespace sc_emu

#endif  // SPARSECORE_GUARDED_LAUNCH_H
