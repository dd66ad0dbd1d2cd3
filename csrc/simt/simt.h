// SIMT executor: runs CUDA-style kernels (bodies in csrc/kernels/*.cuh) on the CPU, for tests only.
//
// Model (what a kernel may rely on, and nothing more):
//   * One CUDA thread = one fiber (its own stack); one thread block = one OS thread running all of its
//     fibers cooperatively; blocks of a grid are spread over a few OS worker threads.
//   * A fiber runs until it reaches a barrier (__syncthreads, __syncwarp, a warp shuffle/vote) or
//     returns; the barrier is released when every live thread of the block (or every lane named in the
//     warp mask) has arrived. Threads that returned no longer count, as on Volta and later.
//   * __shared__ variables are `static thread_local`: one copy per OS thread, i.e. per running block.
//     Dynamic shared memory is a per-block buffer sized at launch (SV_DYNAMIC_SHARED in compat.cuh).
//   * Atomics are real atomics (blocks run concurrently on several OS threads).
//   * Asynchronous copies (cp.async) are queued per thread and land in shared memory only when the thread
//     waits for their group (cp.async.wait_group): a kernel that reads a stage before waiting for it
//     reads stale data, as it may on a GPU, and its tests fail.
//   * Misuse that CUDA leaves undefined is reported as an error rather than silently tolerated:
//     __syncthreads reached from different source lines in one phase, warp masks that disagree,
//     shuffles that read from an absent lane, deadlock.
// Context switches use a tiny x86-64 assembly routine; build with -DSIMT_USE_UCONTEXT (automatic on other
// architectures) to use ucontext instead, about 10x slower (it makes a signal-mask system call per switch;
// measured 40 vs 360 ns per switch with 2 workers on the project's machine).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(SIMT_USE_UCONTEXT)
#define SIMT_USE_UCONTEXT 1
#endif
#if defined(SIMT_USE_UCONTEXT)
#include <ucontext.h>
#endif

namespace simt {

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

constexpr int kWarpSize = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;

// ---------------------------------------------------------------------------------------------
// Context switching
// ---------------------------------------------------------------------------------------------
namespace detail {

#if !defined(SIMT_USE_UCONTEXT)
// simt_swap_stack(void** save_sp, void* load_sp): push the callee-saved registers (SysV: rbp, rbx,
// r12-r15, MXCSR, x87 control word), store rsp in *save_sp, switch to load_sp and pop the same set.
// Weak so that every translation unit including this header can emit it.
// simt_fiber_trampoline: first "return address" of a new fiber; calls r13(r12) and never returns.
__asm__(R"(
  .text
  .weak simt_swap_stack
  .hidden simt_swap_stack
  .type simt_swap_stack, @function
simt_swap_stack:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size simt_swap_stack, .-simt_swap_stack

  .weak simt_fiber_trampoline
  .hidden simt_fiber_trampoline
  .type simt_fiber_trampoline, @function
simt_fiber_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size simt_fiber_trampoline, .-simt_fiber_trampoline
)");
extern "C" void simt_swap_stack(void** save_sp, void* load_sp);
extern "C" void simt_fiber_trampoline();
#endif

// A suspended execution context: either a saved stack pointer (asm) or a ucontext.
struct Context {
#if defined(SIMT_USE_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

inline void swap_context(Context& save, Context& load) {
#if defined(SIMT_USE_UCONTEXT)
  if (swapcontext(&save.uc, &load.uc) != 0) std::abort();
#else
  simt_swap_stack(&save.sp, load.sp);
#endif
}

#if defined(SIMT_USE_UCONTEXT)
// makecontext passes int arguments only: split the pointer in two.
using FiberEntry = void (*)(void*);
struct UcontextStart {
  static void entry(unsigned lo, unsigned hi, unsigned flo, unsigned fhi) {
    auto arg = reinterpret_cast<void*>((static_cast<uintptr_t>(hi) << 32) | lo);
    auto fn = reinterpret_cast<FiberEntry>((static_cast<uintptr_t>(fhi) << 32) | flo);
    fn(arg);
    std::abort();  // fibers never return
  }
};
#endif

// Prepare `ctx` so that switching to it runs fn(arg) on the stack [stack, stack + size).
inline void make_context(Context& ctx, char* stack, size_t size, void (*fn)(void*), void* arg) {
#if defined(SIMT_USE_UCONTEXT)
  if (getcontext(&ctx.uc) != 0) std::abort();
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  auto a = reinterpret_cast<uintptr_t>(arg);
  auto f = reinterpret_cast<uintptr_t>(fn);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(&UcontextStart::entry), 4, unsigned(a), unsigned(a >> 32),
              unsigned(f), unsigned(f >> 32));
#else
  // Stack image popped by simt_swap_stack: [mxcsr|fpcw][r15][r14][r13][r12][rbx][rbp][ret].
  // After `ret` into the trampoline rsp is 16-byte aligned, as the `call` there requires.
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
  auto* slots = reinterpret_cast<uint64_t*>(top - 8 * 8);
  uint32_t mxcsr;
  uint16_t fpcw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpcw));
  slots[0] = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
  slots[1] = 0;                                  // r15
  slots[2] = 0;                                  // r14
  slots[3] = reinterpret_cast<uint64_t>(fn);     // r13
  slots[4] = reinterpret_cast<uint64_t>(arg);    // r12
  slots[5] = 0;                                  // rbx
  slots[6] = 0;                                  // rbp
  slots[7] = reinterpret_cast<uint64_t>(&simt_fiber_trampoline);
  ctx.sp = slots;
#endif
}

// ---------------------------------------------------------------------------------------------
// Block state
// ---------------------------------------------------------------------------------------------
enum class FiberState : uint8_t { kRunnable, kWaitBlock, kWaitWarp, kDone };

// One queued cp.async: `src_bytes` bytes copied from src, the rest of `bytes` zero-filled (PTX src-size).
struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes;
  unsigned src_bytes;
};

struct Fiber {
  Context ctx;
  dim3 thread_idx;
  unsigned linear = 0;
  FiberState state = FiberState::kRunnable;
  uint64_t wait_generation = 0;
  std::vector<AsyncCopy> async_open;                 // issued since the last commit_group
  std::vector<std::vector<AsyncCopy>> async_groups;  // committed groups, oldest first
};

struct Barrier {
  uint64_t generation = 0;
  unsigned arrived = 0;
  const char* site_file = nullptr;  // where the first thread of this phase arrived
  int site_line = 0;
  unsigned mask = 0;  // warp barriers: lanes taking part in this phase
};

struct Warp {
  Barrier barrier;
  unsigned exist_mask = 0;  // lanes that exist (a partial last warp has fewer)
  unsigned live_mask = 0;   // lanes that exist and have not returned
  alignas(16) unsigned char exchange[2][kWarpSize][16];  // double-buffered by generation parity
};

struct Block {
  dim3 grid_dim, block_dim, block_idx;
  unsigned num_threads = 0;
  unsigned live = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier barrier;
  Context scheduler;
  Fiber* current = nullptr;
  unsigned char* dynamic_smem = nullptr;
  const std::function<void()>* body = nullptr;
  std::string error;
};

inline thread_local Block* tls_block = nullptr;

inline Block& block() {
  Block* b = tls_block;
  if (b == nullptr) {
    std::fprintf(stderr, "simt: device function called outside simt::launch\n");
    std::abort();
  }
  return *b;
}

inline Fiber& fiber() { return *block().current; }

// Record the first error of the block; the scheduler stops the block and launch() throws.
inline void fail(const std::string& message) {
  Block& b = block();
  if (b.error.empty()) b.error = message;
}

// Return control to the scheduler. The fiber resumes when its wait condition holds.
inline void yield() {
  Block& b = block();
  swap_context(b.current->ctx, b.scheduler);
}

inline unsigned lane_id() { return fiber().linear % kWarpSize; }
inline unsigned warp_id() { return fiber().linear / kWarpSize; }

// Stop a fiber that hit an error: it stays suspended forever (the block is abandoned).
[[noreturn]] inline void abandon(const std::string& message) {
  fail(message);
  Block& b = block();
  b.current->state = FiberState::kDone;
  for (;;) swap_context(b.current->ctx, b.scheduler);
}

inline void block_barrier(const char* file, int line) {
  Block& b = block();
  Barrier& bar = b.barrier;
  if (bar.arrived == 0) {
    bar.site_file = file;
    bar.site_line = line;
  } else if (bar.site_line != line || std::strcmp(bar.site_file, file) != 0) {
    abandon("simt: __syncthreads reached from different places in one phase (" + std::string(bar.site_file) +
            ":" + std::to_string(bar.site_line) + " and " + file + ":" + std::to_string(line) +
            "): divergent barrier");
  }
  if (++bar.arrived == b.live) {
    bar.arrived = 0;
    ++bar.generation;  // release everybody waiting on this phase; the last arriver keeps running
    return;
  }
  Fiber& f = fiber();
  f.state = FiberState::kWaitBlock;
  f.wait_generation = bar.generation;
  yield();
}

inline void warp_barrier(unsigned mask) {
  Block& b = block();
  Fiber& f = fiber();
  unsigned lane = f.linear % kWarpSize;
  Warp& w = b.warps[f.linear / kWarpSize];
  if (!(mask >> lane & 1u)) abandon("simt: warp operation called by a lane not in its mask");
  unsigned expected_lanes = mask & w.exist_mask;
  if (expected_lanes & ~w.live_mask) abandon("simt: warp operation names a lane that has returned");
  if (w.barrier.arrived == 0) {
    w.barrier.mask = mask;
  } else if (w.barrier.mask != mask) {
    abandon("simt: lanes of one warp reached warp operations with different masks");
  }
  if (++w.barrier.arrived == unsigned(__builtin_popcount(expected_lanes))) {
    w.barrier.arrived = 0;
    ++w.barrier.generation;
    return;
  }
  f.state = FiberState::kWaitWarp;
  f.wait_generation = w.barrier.generation;
  yield();
}

// Exchange one value per lane through the warp's buffer; returns the slot array for this phase.
template <typename T>
inline const unsigned char (*warp_exchange(unsigned mask, const T& value))[16] {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
  Block& b = block();
  Fiber& f = fiber();
  Warp& w = b.warps[f.linear / kWarpSize];
  auto& slots = w.exchange[w.barrier.generation & 1];
  std::memcpy(slots[f.linear % kWarpSize], &value, sizeof(T));
  warp_barrier(mask);
  return slots;
}

template <typename T>
inline T shuffle_from(unsigned mask, const T& value, int src_lane) {
  auto slots = warp_exchange(mask, value);
  Block& b = block();
  Warp& w = b.warps[fiber().linear / kWarpSize];
  if (src_lane < 0 || src_lane >= kWarpSize || !((mask & w.exist_mask) >> src_lane & 1u)) {
    abandon("simt: shuffle reads lane " + std::to_string(src_lane) + ", which is not an active lane of the mask");
  }
  T out;
  std::memcpy(&out, slots[src_lane], sizeof(T));
  return out;
}

// Every lane's `value` (all 32 lanes of the warp must take part): the warp-wide operand gather that
// emulated warp-synchronous instructions (mma.sync, ldmatrix) are built on.
template <typename T>
inline void warp_allgather(const T& value, T (&out)[kWarpSize]) {
  auto slots = warp_exchange(0xffffffffu, value);
  if (block().warps[fiber().linear / kWarpSize].exist_mask != 0xffffffffu) {
    abandon("simt: a warp-synchronous matrix instruction needs all 32 lanes of the warp");
  }
  for (int l = 0; l < kWarpSize; ++l) std::memcpy(&out[l], slots[l], sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// Per-OS-thread resources: fiber stacks (with a guard page each) and dynamic shared memory.
// ---------------------------------------------------------------------------------------------
inline size_t stack_size() {
  static const size_t size = [] {
    const char* env = std::getenv("SIMT_STACK_KB");
    size_t kb = env ? std::strtoul(env, nullptr, 10) : 64;
    return std::max<size_t>(kb, 16) * 1024;
  }();
  return size;
}

struct StackPool {
  unsigned char* base = nullptr;
  size_t count = 0;
  size_t stride = 0;
  std::vector<unsigned char> dynamic_smem;

  ~StackPool() {
    if (base) munmap(base, count * stride);
  }
  unsigned char* stack(size_t i) { return base + i * stride + page(); }
  static size_t page() { return size_t(sysconf(_SC_PAGESIZE)); }

  void reserve(size_t n) {
    if (n <= count) return;
    if (base) munmap(base, count * stride);
    stride = stack_size() + page();
    void* mem = mmap(nullptr, n * stride, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) throw std::runtime_error("simt: cannot map fiber stacks");
    base = static_cast<unsigned char*>(mem);
    count = n;
    for (size_t i = 0; i < n; ++i) mprotect(base + i * stride, page(), PROT_NONE);  // overflow -> SIGSEGV
  }
};

inline StackPool& stack_pool() {
  thread_local StackPool pool;
  return pool;
}

inline void fiber_main(void* arg) {
  auto* b = static_cast<Block*>(arg);
  Fiber& f = *b->current;
  try {
    (*b->body)();
  } catch (const std::exception& e) {
    fail(std::string("simt: exception in kernel: ") + e.what());
  } catch (...) {
    fail("simt: unknown exception in kernel");
  }
  // Returned: stop counting this thread in block and warp barriers, possibly releasing them.
  f.state = FiberState::kDone;
  --b->live;
  if (b->barrier.arrived > 0 && b->barrier.arrived == b->live) {
    b->barrier.arrived = 0;
    ++b->barrier.generation;
  }
  Warp& w = b->warps[f.linear / kWarpSize];
  unsigned bit = 1u << (f.linear % kWarpSize);
  w.live_mask &= ~bit;
  if (w.barrier.arrived > 0 && (w.barrier.mask & bit)) {
    fail("simt: a lane returned while other lanes wait for it in a warp operation (divergent shuffle/vote)");
  }
  for (;;) swap_context(f.ctx, b->scheduler);
}

inline bool can_run(const Block& b, const Fiber& f) {
  switch (f.state) {
    case FiberState::kRunnable:
      return true;
    case FiberState::kWaitBlock:
      return b.barrier.generation != f.wait_generation;
    case FiberState::kWaitWarp:
      return b.warps[f.linear / kWarpSize].barrier.generation != f.wait_generation;
    case FiberState::kDone:
      return false;
  }
  return false;
}

// Run one thread block to completion on the calling OS thread. Returns an error message or "".
inline std::string run_block(dim3 grid, dim3 block_dim, dim3 block_idx, size_t smem_bytes,
                             const std::function<void()>& body) {
  StackPool& pool = stack_pool();
  Block b;
  b.grid_dim = grid;
  b.block_dim = block_dim;
  b.block_idx = block_idx;
  b.num_threads = block_dim.x * block_dim.y * block_dim.z;
  b.live = b.num_threads;
  b.body = &body;
  pool.reserve(b.num_threads);
  if (pool.dynamic_smem.size() < smem_bytes) pool.dynamic_smem.resize(smem_bytes);
  b.dynamic_smem = pool.dynamic_smem.data();
  b.fibers.resize(b.num_threads);
  b.warps.resize((b.num_threads + kWarpSize - 1) / kWarpSize);
  for (unsigned w = 0; w < b.warps.size(); ++w) {
    unsigned lanes = std::min<unsigned>(kWarpSize, b.num_threads - w * kWarpSize);
    b.warps[w].exist_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
    b.warps[w].live_mask = b.warps[w].exist_mask;
  }
  for (unsigned t = 0; t < b.num_threads; ++t) {
    Fiber& f = b.fibers[t];
    f.linear = t;
    f.thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y));
    make_context(f.ctx, reinterpret_cast<char*>(pool.stack(t)), stack_size(), &fiber_main, &b);
  }
  Block* saved = tls_block;
  tls_block = &b;
  // Round-robin over runnable fibers until all returned; a pass in which nobody could run is a deadlock.
  while (b.live > 0 && b.error.empty()) {
    bool ran = false;
    for (unsigned t = 0; t < b.num_threads && b.error.empty(); ++t) {
      Fiber& f = b.fibers[t];
      if (!can_run(b, f)) continue;
      if (f.state != FiberState::kDone) f.state = FiberState::kRunnable;
      b.current = &f;
      swap_context(b.scheduler, f.ctx);
      ran = true;
    }
    if (!ran && b.live > 0 && b.error.empty()) {
      b.error = "simt: deadlock: " + std::to_string(b.live) +
                " threads wait at barriers that can never be released (a barrier not reached by all threads?)";
    }
  }
  tls_block = saved;
  b.current = nullptr;
  return b.error;
}

inline unsigned num_workers() {
  static const unsigned n = [] {
    const char* env = std::getenv("SIMT_NUM_WORKERS");
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    return env ? std::max(1u, unsigned(std::strtoul(env, nullptr, 10))) : std::min(hw, 2u);
  }();
  return n;
}

// Run every block of the grid over a few OS threads (blocks are independent, as in CUDA).
inline void run_grid(dim3 grid, dim3 block_dim, size_t smem_bytes, const std::function<void()>& body) {
  unsigned threads = block_dim.x * block_dim.y * block_dim.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock) {
    throw std::invalid_argument("simt: block of " + std::to_string(threads) + " threads (must be 1..1024)");
  }
  if (tls_block != nullptr) throw std::logic_error("simt: launch from inside a kernel is not supported");
  uint64_t num_blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (num_blocks == 0) return;
  std::atomic<uint64_t> next{0};
  std::mutex error_mutex;
  std::string first_error;
  auto worker = [&] {
    for (uint64_t i = next++; i < num_blocks; i = next++) {
      dim3 idx(unsigned(i % grid.x), unsigned((i / grid.x) % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y)));
      std::string err = run_block(grid, block_dim, idx, smem_bytes, body);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) {
          first_error = err + " [block (" + std::to_string(idx.x) + "," + std::to_string(idx.y) + "," +
                        std::to_string(idx.z) + ")]";
        }
        next = num_blocks;  // stop handing out blocks
      }
    }
  };
  unsigned workers = unsigned(std::min<uint64_t>(num_workers(), num_blocks));
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

}  // namespace detail

// Counters of launches and of the emulated warp-level instructions, so tests can assert which path ran.
struct Counters {
  std::atomic<uint64_t> mma{0};         // mma.sync tiles
  std::atomic<uint64_t> ldmatrix{0};    // ldmatrix instructions (per warp)
  std::atomic<uint64_t> async_bytes{0};  // bytes landed by cp.async
  std::atomic<uint64_t> launches{0};     // kernel launches (simt::launch)
};
inline Counters& counters() {
  static Counters c;
  return c;
}

// Launch `kernel` like kernel<<<grid, block, smem_bytes>>>(args...): arguments are converted to the
// kernel's parameter types once and every thread receives its own copy, as CUDA passes them by value.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, size_t smem_bytes, void (*kernel)(Params...), Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::tuple<std::decay_t<Params>...> packed(std::forward<Args>(args)...);
  std::function<void()> body = [&packed, kernel] {
    auto copy = packed;
    std::apply(kernel, copy);
  };
  ++counters().launches;
  detail::run_grid(grid, block, smem_bytes, body);
}

// Device-side API (what the compat macros in csrc/kernels/compat.cuh expand to).
inline const dim3& thread_idx() { return detail::fiber().thread_idx; }
inline const dim3& block_idx() { return detail::block().block_idx; }
inline const dim3& block_dim() { return detail::block().block_dim; }
inline const dim3& grid_dim() { return detail::block().grid_dim; }
inline unsigned char* dynamic_shared_memory() { return detail::block().dynamic_smem; }
inline void syncthreads(const char* file, int line) { detail::block_barrier(file, line); }
inline void syncwarp(unsigned mask) { detail::warp_barrier(mask); }

// cp.async: queue a copy of this thread; it lands when a wait_group covers its group.
inline void async_copy(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
  if (src_bytes > bytes) detail::abandon("simt: cp.async src-size larger than its copy size");
  detail::fiber().async_open.push_back({dst, src, bytes, src_bytes});
}
inline void async_commit_group() {
  detail::Fiber& f = detail::fiber();
  f.async_groups.push_back(std::move(f.async_open));
  f.async_open.clear();
}
// Land every committed group but the newest `pending` ones (cp.async.wait_group pending).
inline void async_wait_group(int pending) {
  detail::Fiber& f = detail::fiber();
  while (int(f.async_groups.size()) > pending) {
    for (const detail::AsyncCopy& c : f.async_groups.front()) {
      if (c.src_bytes > 0) std::memcpy(c.dst, c.src, c.src_bytes);
      if (c.bytes > c.src_bytes) std::memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
      counters().async_bytes += c.bytes;
    }
    f.async_groups.erase(f.async_groups.begin());
  }
}

template <typename T>
inline T shfl_sync(unsigned mask, T var, int src_lane, int width = kWarpSize) {
  int lane = int(detail::lane_id());
  int src = (lane / width) * width + (src_lane % width);
  return detail::shuffle_from(mask, var, src);
}

template <typename T>
inline T shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = kWarpSize) {
  int lane = int(detail::lane_id());
  int src = lane ^ lane_mask;
  if (src / width > lane / width) src = lane;  // later groups are out of reach: own value
  return detail::shuffle_from(mask, var, src);
}

template <typename T>
inline T shfl_down_sync(unsigned mask, T var, unsigned delta, int width = kWarpSize) {
  int lane = int(detail::lane_id());
  int src = lane + int(delta);
  if (src / width != lane / width) src = lane;
  return detail::shuffle_from(mask, var, src);
}

template <typename T>
inline T shfl_up_sync(unsigned mask, T var, unsigned delta, int width = kWarpSize) {
  int lane = int(detail::lane_id());
  int src = lane - int(delta);
  if (src < 0 || src / width != lane / width) src = lane;
  return detail::shuffle_from(mask, var, src);
}

inline unsigned ballot_sync(unsigned mask, int predicate) {
  auto slots = detail::warp_exchange(mask, predicate);
  unsigned active = mask & detail::block().warps[detail::warp_id()].exist_mask;
  unsigned out = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    if (active >> l & 1u) {
      int p;
      std::memcpy(&p, slots[l], sizeof(int));
      if (p) out |= 1u << l;
    }
  }
  return out;
}

// Lanes of the mask whose `value` equals this lane's (sm_70+'s __match_any_sync).
inline unsigned match_any_sync(unsigned mask, unsigned value) {
  auto slots = detail::warp_exchange(mask, value);
  unsigned active = mask & detail::block().warps[detail::warp_id()].exist_mask;
  unsigned out = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    unsigned v;
    std::memcpy(&v, slots[l], sizeof(unsigned));
    if ((active >> l & 1u) && v == value) out |= 1u << l;
  }
  return out;
}

// Atomics on global or shared memory (GCC builtins: blocks run on several OS threads). The generic
// __atomic_load/__atomic_compare_exchange forms accept floating-point types as well.
template <typename T, typename Op>
inline T atomic_update(T* address, Op op) {
  T expected;
  __atomic_load(address, &expected, __ATOMIC_RELAXED);
  for (;;) {
    T desired = op(expected);
    if (__atomic_compare_exchange(address, &expected, &desired, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      return expected;
    }
  }
}

template <typename T>
inline T atomic_add(T* address, T value) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
  } else {
    return atomic_update(address, [value](T old) { return T(old + value); });
  }
}

template <typename T>
inline T atomic_max(T* address, T value) {
  return atomic_update(address, [value](T old) { return old < value ? value : old; });
}

template <typename T>
inline T atomic_min(T* address, T value) {
  return atomic_update(address, [value](T old) { return value < old ? value : old; });
}

template <typename T>
inline T atomic_cas(T* address, T compare, T value) {
  __atomic_compare_exchange(address, &compare, &value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value, whether or not the exchange happened
}

template <typename T>
inline T atomic_exch(T* address, T value) {
  T old;
  __atomic_exchange(address, &value, &old, __ATOMIC_SEQ_CST);
  return old;
}

}  // namespace simt
