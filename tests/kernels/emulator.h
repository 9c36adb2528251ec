// Runs the CUDA C++ in kernels/ on the CPU, so that CI (which has no GPU) checks what the
// kernels compute: every CUDA thread of a block is a fiber (a stack of its own, switched to
// by saving and loading the stack pointer) on the one OS thread, __syncthreads is a barrier
// of the block, warp shuffles and the mma instructions exchange values through a per-warp
// staging area between two barriers of the warp. A fiber runs until it reaches a barrier or ends; the fibers a barrier
// releases run next, in thread order. Blocks run one after another, so one static buffer
// serves as every block's shared memory. All threads of a block waiting while none can go on
// is a deadlock (a barrier some thread never reaches): the launch throws.
//
// The sanitizers are told about the fibers: AddressSanitizer of each stack switch, and
// ThreadSanitizer sees each fiber as a thread of its own whose only synchronisation is what
// the GPU guarantees (a barrier, and the launch's start and end), so two threads touching
// the same shared memory with no barrier between them is a reported race, whatever order the
// fibers happen to run in. One OS thread also keeps each sanitizer run on one core.
//
// Force-included before a kernel source (`c++ -std=c++20 -include emulator.h`); the kernel
// sources see KERNEL_CPU_EMULATION and take the helpers below instead of inline PTX.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>
#ifndef __x86_64__
#include <ucontext.h>
#endif

// The header makes the poisoning macros no-ops unless the build has AddressSanitizer (GCC or
// Clang).
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>

#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMU_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_TSAN
#include <sanitizer/tsan_interface.h>
// The instrumentation's own entry for a 4-byte write (not in the public header).
extern "C" void __tsan_write4(void* addr);
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define KERNEL_CPU_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// The launch's and the running block's (set before the block's fibers start); each fiber's
// own threadIdx is defined below, with the fibers.
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

using std::max;
using std::min;

namespace {
// Dynamic shared memory of the block that is running (kernels declare
// `extern __shared__ float smem[];`, which names this array).
alignas(16) float smem[64 * 1024];
}  // namespace

namespace emu {

constexpr unsigned WARP = 32;

// The top of a fiber's stack, where the frames of a run that never return lie.
constexpr size_t STALE_FRAMES = 16 * 1024;

#ifdef __x86_64__
// A suspended context: its stack pointer, with the callee-saved registers pushed below the
// address it resumes at. Switching costs a dozen instructions, where swapcontext makes two
// system calls (the signal mask) and, under AddressSanitizer, clears the shadow of the whole
// stack it enters.
struct Context {
    void* sp = nullptr;
};

// Saves the callee-saved registers and the stack pointer into *save, then resumes `load`.
// (Top-level assembly: the harness is the one translation unit that includes this header.)
extern "C" void emu_switch_context(void** save, void* load);
asm(R"(
    .text
    .globl emu_switch_context
    .type emu_switch_context, @function
emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_context, .-emu_switch_context
)");

inline void switch_context(Context& save, const Context& load) {
    emu_switch_context(&save.sp, load.sp);
}

// A context that starts `entry` (which never returns) on `stack`: six zero registers for the
// pops, then `entry` for the `ret`, which leaves the stack pointer 8 past a 16-byte boundary,
// as at any function's entry.
inline void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    // The frames the fiber's last run never returned from (its entry and the final switch)
    // left their red zones poisoned up here.
    ASAN_UNPOISON_MEMORY_REGION(stack + size - STALE_FRAMES, STALE_FRAMES);
    auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack + size) &
                                             ~uintptr_t{15});
    top[-1] = 0;  // the return address of `entry`
    top[-2] = reinterpret_cast<uintptr_t>(entry);
    for (int i = 3; i <= 8; ++i) {
        top[-i] = 0;
    }
    c.sp = top - 8;
}
#else
struct Context {
    ucontext_t uc{};
};

inline void switch_context(Context& save, const Context& load) { swapcontext(&save.uc, &load.uc); }

inline void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    ASAN_UNPOISON_MEMORY_REGION(stack + size - STALE_FRAMES, STALE_FRAMES);
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// cp.async of one word in flight (see cp_async4).
struct AsyncWord {
    void* dst;
    uint32_t value;
};

// One emulated CUDA thread.
struct Fiber {
    enum class State { Ready, Waiting, Done };
    // Room for the kernels' frames with the sanitizers' red zones, and a guard page below so
    // that an overflow faults instead of writing into the next fiber's stack.
    static constexpr size_t STACK = 256 * 1024;

    Fiber() {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        void* p = mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) {
            throw std::runtime_error("could not map a fiber's stack");
        }
        mprotect(p, page, PROT_NONE);
        mapping = p;
        stack = static_cast<char*>(p) + page;
#ifdef EMU_TSAN
        tsan = __tsan_create_fiber(0);
#endif
    }
    ~Fiber() {
        munmap(mapping, STACK + static_cast<size_t>(sysconf(_SC_PAGESIZE)));
#ifdef EMU_TSAN
        __tsan_destroy_fiber(tsan);
#endif
    }
    Fiber(const Fiber&) = delete;
    Fiber& operator=(const Fiber&) = delete;

    Context context;
    void* mapping = nullptr;
    char* stack = nullptr;
    dim3 thread_index;
    // Read and written by the scheduler and by other fibers' barriers: relaxed atomics, which
    // ThreadSanitizer neither reports nor takes for synchronisation (the emulator's
    // bookkeeping is not the kernel's).
    std::atomic<State> state{State::Done};
    std::atomic<const void*> waits_on{nullptr};   // the barrier
    std::atomic<unsigned long> waits_for{0};      // the generation it waits to end
    bool entered = false;  // switched to since the block started
    std::exception_ptr error;
    std::vector<AsyncWord> async_open;                  // not yet committed
    std::vector<std::vector<AsyncWord>> async_groups;  // committed, oldest first
#ifdef EMU_TSAN
    void* tsan = nullptr;
#endif
    void* fake_stack = nullptr;  // AddressSanitizer's, while switched away
};

// The scheduler's side: its context, and what the sanitizers need to switch back to it.
struct Scheduler {
    Context context;
    const std::function<void()>* kernel = nullptr;
    std::atomic<Fiber*> current{nullptr};
    void* fake_stack = nullptr;
    const void* stack_bottom = nullptr;
    size_t stack_size = 0;
#ifdef EMU_TSAN
    void* tsan = nullptr;
#endif
    std::vector<std::unique_ptr<Fiber>> fibers;  // kept between launches: stacks mapped once
};
inline Scheduler scheduler;

inline Fiber& current() { return *scheduler.current.load(std::memory_order_relaxed); }

// AddressSanitizer's notes around a stack switch (nothing in the other builds, whose runtimes
// lack the calls).
inline void start_switch([[maybe_unused]] void** fake_stack, [[maybe_unused]] const void* bottom,
                         [[maybe_unused]] size_t size) {
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#endif
}
inline void finish_switch([[maybe_unused]] void* fake_stack,
                          [[maybe_unused]] const void** old_bottom,
                          [[maybe_unused]] size_t* old_size) {
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake_stack, old_bottom, old_size);
#endif
}

// Back to the scheduler, from a fiber that waits (it is switched to again when released) or
// has ended. Only a fiber's end synchronises with the launch (the join of a thread).
inline void yield() {
    Fiber& f = current();
    const bool done = f.state.load(std::memory_order_relaxed) == Fiber::State::Done;
#ifdef EMU_TSAN
    __tsan_switch_to_fiber(scheduler.tsan, done ? 0 : __tsan_switch_to_fiber_no_sync);
#endif
    start_switch(done ? nullptr : &f.fake_stack, scheduler.stack_bottom, scheduler.stack_size);
    switch_context(f.context, scheduler.context);
    finish_switch(f.fake_stack, nullptr, nullptr);
}

// A reusable barrier of `count` fibers. For ThreadSanitizer every arrival is a release and
// every departure an acquire, on a sync address of its own per generation's parity: a fiber
// already past this barrier that arrives at the next one must not hand its later accesses to
// a fiber still leaving this one. A waiting fiber is ready again once the generation it
// arrived in has ended (the scheduler checks).
class Barrier {
  public:
    explicit Barrier(unsigned count) : count_(count) {}
    void arrive_and_wait() {
        const unsigned long generation = generation_.load(std::memory_order_relaxed);
        [[maybe_unused]] void* sync = &sync_[generation % 2];
#ifdef EMU_TSAN
        __tsan_release(sync);
#endif
        if (arrived_.fetch_add(1, std::memory_order_relaxed) + 1 == count_) {
            arrived_.store(0, std::memory_order_relaxed);
            generation_.store(generation + 1, std::memory_order_relaxed);
        } else {
            Fiber& f = current();
            f.waits_on.store(this, std::memory_order_relaxed);
            f.waits_for.store(generation, std::memory_order_relaxed);
            f.state.store(Fiber::State::Waiting, std::memory_order_relaxed);
            yield();
        }
#ifdef EMU_TSAN
        __tsan_acquire(sync);
#endif
    }
    bool ended(unsigned long generation) const {
        return generation_.load(std::memory_order_relaxed) != generation;
    }

  private:
    unsigned count_;
    std::atomic<unsigned> arrived_{0};
    std::atomic<unsigned long> generation_{0};
    char sync_[2] = {};
};

struct Warp {
    Barrier sync{WARP};
    uint64_t slot[WARP][8];
};

struct Block {
    explicit Block(unsigned threads) : sync(threads), warps(threads / WARP) {}
    Barrier sync;
    std::vector<Warp> warps;
};

void check_no_async_left();  // below, with cp.async

inline Block* block = nullptr;

// The running fiber's lane in its warp.
inline unsigned lane() { return current().thread_index.x % WARP; }

inline Warp& my_warp() { return block->warps[current().thread_index.x / WARP]; }

// Every lane publishes `words` 64-bit values, then reads any lane's.
template <typename F>
auto exchange(const uint64_t* mine, unsigned words, F&& read) {
    Warp& w = my_warp();
    std::memcpy(w.slot[lane()], mine, words * sizeof(uint64_t));
    w.sync.arrive_and_wait();
    auto result = read(w.slot);
    w.sync.arrive_and_wait();
    return result;
}

// A fiber's whole life: the kernel, then the check that no copy was left in flight.
inline void fiber_main() {
    Fiber& f = current();
    finish_switch(nullptr, &scheduler.stack_bottom, &scheduler.stack_size);
    try {
        (*scheduler.kernel)();
        check_no_async_left();
    } catch (...) {
        f.error = std::current_exception();
    }
    f.state.store(Fiber::State::Done, std::memory_order_relaxed);
    yield();  // never resumed: the next block starts the fiber afresh
    std::abort();
}

// Switches to fiber `f` until it waits or ends. Its first switch in a block synchronises
// with the launch (the creation of a thread).
inline void run(Fiber& f) {
    scheduler.current.store(&f, std::memory_order_relaxed);
    // Everything between the sanitizer's switch and the stack's counts as the fiber's.
    [[maybe_unused]] const bool first = !f.entered;
    f.entered = true;
#ifdef EMU_TSAN
    __tsan_switch_to_fiber(f.tsan, first ? 0 : __tsan_switch_to_fiber_no_sync);
#endif
    start_switch(&scheduler.fake_stack, f.stack, Fiber::STACK);
    switch_context(scheduler.context, f.context);
    finish_switch(scheduler.fake_stack, nullptr, nullptr);
    scheduler.current.store(nullptr, std::memory_order_relaxed);
}

// Runs `kernel` over the grid: a fiber per CUDA thread, one block at a time, with
// `shared_bytes` of dynamic shared memory (the launch's). Under AddressSanitizer the rest of
// the buffer is poisoned, so a kernel that reaches past what its launch asked for stops
// the check instead of reading another block's memory, or faulting only on the GPU.
inline void launch(dim3 grid, dim3 threads, const std::function<void()>& kernel,
                   size_t shared_bytes = 0) {
    if (threads.y != 1 || threads.z != 1 || threads.x % WARP != 0 || threads.x == 0) {
        throw std::invalid_argument("the emulator runs 1-D blocks of whole warps");
    }
    if (shared_bytes > sizeof(smem)) {
        throw std::invalid_argument("shared memory larger than the emulator's");
    }
#ifdef EMU_TSAN
    scheduler.tsan = __tsan_get_current_fiber();
#endif
    while (scheduler.fibers.size() < threads.x) {
        scheduler.fibers.push_back(std::make_unique<Fiber>());
    }
    scheduler.kernel = &kernel;
    gridDim = grid;
    blockDim = threads;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b(threads.x);
                block = &b;
                blockIdx = dim3{bx, by, bz};
                ASAN_UNPOISON_MEMORY_REGION(smem, sizeof(smem));
                std::memset(smem, 0xff, shared_bytes);  // NaN garbage, as uninitialised memory
                ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(smem) + shared_bytes,
                                          sizeof(smem) - shared_bytes);
                for (unsigned t = 0; t < threads.x; ++t) {
                    Fiber& f = *scheduler.fibers[t];
                    f.thread_index = dim3{t, 0, 0};
                    f.state.store(Fiber::State::Ready, std::memory_order_relaxed);
                    f.entered = false;
                    f.error = nullptr;
                    f.async_open.clear();
                    f.async_groups.clear();
                    start_context(f.context, f.stack, Fiber::STACK, fiber_main);
                }
                for (;;) {
                    bool ran = false, all_done = true;
                    for (unsigned t = 0; t < threads.x; ++t) {
                        Fiber& f = *scheduler.fibers[t];
                        Fiber::State state = f.state.load(std::memory_order_relaxed);
                        if (state == Fiber::State::Waiting &&
                            static_cast<const Barrier*>(f.waits_on.load(std::memory_order_relaxed))
                                ->ended(f.waits_for.load(std::memory_order_relaxed))) {
                            state = Fiber::State::Ready;
                            f.state.store(state, std::memory_order_relaxed);
                        }
                        if (state == Fiber::State::Ready) {
                            run(f);
                            ran = true;
                        }
                        all_done = all_done &&
                                   f.state.load(std::memory_order_relaxed) == Fiber::State::Done;
                    }
                    if (all_done) {
                        break;
                    }
                    if (!ran) {
                        // Nobody can go on: rethrow what stopped a thread, else a barrier
                        // some thread never reaches.
                        for (unsigned t = 0; t < threads.x; ++t) {
                            if (scheduler.fibers[t]->error) {
                                std::rethrow_exception(scheduler.fibers[t]->error);
                            }
                        }
                        throw std::logic_error(
                            "deadlock: threads wait at a barrier others never reach");
                    }
                }
                for (unsigned t = 0; t < threads.x; ++t) {
                    if (scheduler.fibers[t]->error) {
                        std::rethrow_exception(scheduler.fibers[t]->error);
                    }
                }
                block = nullptr;
            }
        }
    }
}

}  // namespace emu

// The running fiber's index in its block, as kernels read it.
#define threadIdx (::emu::current().thread_index)

// Single-rounding arithmetic (the harness is built with -ffp-contract=off, so no FMA).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline void __syncthreads() { emu::block->sync.arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int offset) {
    if (mask != 0xffffffffu) {
        throw std::logic_error("the emulator only shuffles whole warps");
    }
    static_assert(sizeof(T) <= sizeof(uint64_t));
    uint64_t mine = 0;
    std::memcpy(&mine, &value, sizeof(T));
    return emu::exchange(&mine, 1, [&](uint64_t (*slot)[8]) {
        T other;
        std::memcpy(&other, &slot[emu::lane() ^ static_cast<unsigned>(offset)][0], sizeof(T));
        return other;
    });
}

namespace emu {

inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float to_float(__half x) { return __half2float(x); }
template <typename T>
T from_bits(uint16_t bits);
template <>
inline __nv_bfloat16 from_bits<__nv_bfloat16>(uint16_t bits) { return __ushort_as_bfloat16(bits); }
template <>
inline __half from_bits<__half>(uint16_t bits) { return __ushort_as_half(bits); }

// cp.async in flight. On the GPU a copy may land at any time up to the cp.async.wait_group
// that covers its group; here it lands exactly then, the latest it may. So a kernel that reads
// a tile before waiting for it reads the launch's NaN garbage or an older tile, on every run.
// Each fiber keeps its own copies (Fiber::async_open, Fiber::async_groups).

// cp.async of one 32-bit word (cp.async.ca.shared.global with cp-size 4). Zero-fills when
// `real` is false, and then reads nothing. Both addresses must be 4-byte aligned, as on the
// GPU. The source is read now: the kernels' sources do not change while a copy is in flight.
inline void cp_async4(void* dst, const void* src, bool real) {
    if (reinterpret_cast<uintptr_t>(dst) % 4 != 0 || (real && reinterpret_cast<uintptr_t>(src) % 4 != 0)) {
        throw std::logic_error("cp.async of a misaligned word");
    }
    uint32_t value = 0;
    if (real) {
        std::memcpy(&value, src, 4);
    }
#ifdef EMU_TSAN
    // The GPU may land the copy as early as now: for the race check the destination is
    // written now too (and again when it lands), so a thread still reading that buffer with
    // no barrier since is a race, though here the value only arrives at the wait.
    __tsan_write4(dst);
#endif
    current().async_open.push_back({dst, value});
}

// cp.async.commit_group: the copies issued since the last commit become one group.
inline void cp_async_commit() {
    Fiber& f = current();
    f.async_groups.push_back(std::move(f.async_open));
    f.async_open.clear();
}

// cp.async.wait_group `pending`: every group but the newest `pending` has landed.
inline void cp_async_wait(unsigned pending) {
    auto& async_groups = current().async_groups;
    const size_t done = async_groups.size() > pending ? async_groups.size() - pending : 0;
    for (size_t g = 0; g < done; ++g) {
        for (const AsyncWord& w : async_groups[g]) {
            std::memcpy(w.dst, &w.value, 4);
        }
    }
    async_groups.erase(async_groups.begin(), async_groups.begin() + static_cast<long>(done));
}

// A thread that ends with copies it never waited for: on the GPU they would land after the
// block may have reused the memory.
inline void check_no_async_left() {
    if (!current().async_open.empty() || !current().async_groups.empty()) {
        throw std::logic_error("a thread ended with cp.async copies it never waited for");
    }
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lane 8m + r gives the address of row r of
// matrix m (8 16-bit values, 16-byte aligned); register m of lane l receives, from matrix m,
// row l/4 at columns 2(l%4), 2(l%4)+1, or with `trans` rows 2(l%4), 2(l%4)+1 at column l/4.
template <bool TRANS>
void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
        throw std::logic_error("ldmatrix row address not 16-byte aligned");
    }
    const uint64_t mine = reinterpret_cast<uintptr_t>(row);
    unsigned got[4];
    exchange(&mine, 1, [&](uint64_t (*slot)[8]) {
        const unsigned g = lane() / 4, t = lane() % 4;
        for (unsigned m = 0; m < 4; ++m) {
            auto at = [&](unsigned row_in_matrix, unsigned col) {
                const auto* p = reinterpret_cast<const uint16_t*>(slot[8 * m + row_in_matrix][0]);
                return static_cast<unsigned>(p[col]);
            };
            got[m] = TRANS ? at(2 * t, g) | (at(2 * t + 1, g) << 16)
                           : at(g, 2 * t) | (at(g, 2 * t + 1) << 16);
        }
        return 0;
    });
    std::copy(got, got + 4, r);
}

// D = A B + C for one m16n8k16 tile with the fragment layout of PTX's
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: lane l holds, with g = l / 4 and
// t = l % 4, A rows g and g+8 at columns 2t, 2t+1 (+8), B rows (the k index) 2t, 2t+1 (+8)
// of column g, and C/D rows g and g+8 at columns 2t, 2t+1. Each 32-bit register holds two
// 16-bit values, the lower column or row in its low half.
template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                  const float (&c)[4]) {
    uint64_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const unsigned g = lane() / 4;
    const unsigned t = lane() % 4;
    float out[4];
    exchange(mine, 6, [&](uint64_t (*slot)[8]) {
        auto half = [](uint64_t word, int hi) {
            const uint16_t bits = static_cast<uint16_t>(hi ? word >> 16 : word);
            return to_float(from_bits<T>(bits));
        };
        float A[16][16];
        float B[16][8];
        for (unsigned l = 0; l < WARP; ++l) {
            const unsigned lg = l / 4;
            const unsigned lt = l % 4;
            for (int i = 0; i < 2; ++i) {
                A[lg][2 * lt + i] = half(slot[l][0], i);
                A[lg + 8][2 * lt + i] = half(slot[l][1], i);
                A[lg][2 * lt + 8 + i] = half(slot[l][2], i);
                A[lg + 8][2 * lt + 8 + i] = half(slot[l][3], i);
                B[2 * lt + i][lg] = half(slot[l][4], i);
                B[2 * lt + 8 + i][lg] = half(slot[l][5], i);
            }
        }
        for (int r = 0; r < 4; ++r) {
            const unsigned row = g + (r >= 2 ? 8 : 0);
            const unsigned col = 2 * t + (r % 2);
            double acc = c[r];
            for (int k = 0; k < 16; ++k) {
                acc += static_cast<double>(A[row][k]) * B[k][col];
            }
            out[r] = static_cast<float>(acc);
        }
        return 0;
    });
    std::copy(out, out + 4, d);
}

}  // namespace emu
