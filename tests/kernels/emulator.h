// Runs the CUDA C++ in kernels/ on the CPU, so that CI (which has no GPU) checks what the
// kernels compute: every CUDA thread of a block is an OS thread, __syncthreads is a barrier
// of the block, warp shuffles and the mma instructions exchange values through a per-warp
// staging area between two barriers of the warp. Blocks run one after another, so one
// static buffer serves as every block's shared memory.
//
// Force-included before a kernel source (`c++ -std=c++20 -include emulator.h`); the kernel
// sources see KERNEL_CPU_EMULATION and take the helpers below instead of inline PTX.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

// The header makes the poisoning macros no-ops unless the build has AddressSanitizer (GCC or
// Clang).
#include <sanitizer/asan_interface.h>

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

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
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

// A reusable barrier that sleeps instead of spinning: a block has far more threads than the
// machine has cores, and spinning waiters would starve the threads they wait for.
class Barrier {
  public:
    explicit Barrier(unsigned count) : count_(count) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        const unsigned long generation = generation_;
        if (++arrived_ == count_) {
            arrived_ = 0;
            ++generation_;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return generation_ != generation; });
        }
    }

  private:
    std::mutex mutex_;
    std::condition_variable cv_;
    unsigned count_;
    unsigned arrived_ = 0;
    unsigned long generation_ = 0;
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

inline thread_local Block* block = nullptr;
inline thread_local unsigned lane = 0;

inline Warp& my_warp() { return block->warps[threadIdx.x / WARP]; }

// Every lane publishes `words` 64-bit values, then reads any lane's.
template <typename F>
auto exchange(const uint64_t* mine, unsigned words, F&& read) {
    Warp& w = my_warp();
    std::memcpy(w.slot[lane], mine, words * sizeof(uint64_t));
    w.sync.arrive_and_wait();
    auto result = read(w.slot);
    w.sync.arrive_and_wait();
    return result;
}

// Runs `kernel` over the grid: one OS thread per CUDA thread, one block at a time, with
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
    gridDim = grid;
    blockDim = threads;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b(threads.x);
                ASAN_UNPOISON_MEMORY_REGION(smem, sizeof(smem));
                std::memset(smem, 0xff, shared_bytes);  // NaN garbage, as uninitialised memory
                ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(smem) + shared_bytes,
                                          sizeof(smem) - shared_bytes);
                std::vector<std::thread> pool;
                pool.reserve(threads.x);
                for (unsigned t = 0; t < threads.x; ++t) {
                    pool.emplace_back([&, t] {
                        threadIdx = dim3{t, 0, 0};
                        blockIdx = dim3{bx, by, bz};
                        block = &b;
                        lane = t % WARP;
                        kernel();
                        check_no_async_left();
                    });
                }
                for (auto& th : pool) {
                    th.join();
                }
            }
        }
    }
}

}  // namespace emu

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
        std::memcpy(&other, &slot[emu::lane ^ static_cast<unsigned>(offset)][0], sizeof(T));
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
struct AsyncWord {
    void* dst;
    uint32_t value;
};
inline thread_local std::vector<AsyncWord> async_open;                  // not yet committed
inline thread_local std::vector<std::vector<AsyncWord>> async_groups;  // committed, oldest first

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
    async_open.push_back({dst, value});
}

// cp.async.commit_group: the copies issued since the last commit become one group.
inline void cp_async_commit() {
    async_groups.push_back(std::move(async_open));
    async_open.clear();
}

// cp.async.wait_group `pending`: every group but the newest `pending` has landed.
inline void cp_async_wait(unsigned pending) {
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
    if (!async_open.empty() || !async_groups.empty()) {
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
        const unsigned g = lane / 4, t = lane % 4;
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
    const unsigned g = lane / 4;
    const unsigned t = lane % 4;
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
