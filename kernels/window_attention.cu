// Fused forward of one (shifted) window-attention block.
//
// Input `qkv` is (windows, n, 3c) with q | k | v along the last axis, each split into `heads`
// heads of `d` columns (q already scaled by d^-0.5); `bias` is (heads, n, n); the output is
// (windows, n, c) with heads concatenated. Windows are row-major over (batch, H/ws, W/ws),
// tokens row-major inside a window, as the model partitions them.
//
// Per (window, head): softmax(q kᵀ + bias + mask) v, with the scores never leaving the chip.
// The shift mask is not read from memory: a token's region label in the rolled, padded map
// follows from its window index and position, so the (nW, n, n) mask tensor is never built.
//
// Two kernels: the scalar one below (f32 arithmetic throughout, any dtype, any bias), and the
// tensor-core one further down (bf16/f16). Beside each, its variant for HAT's overlapping
// cross-attention (queries from a window, keys and values from a larger window around it).
//
// Work split: blockIdx.x = window * heads + head, blockIdx.y = a slice of query rows. Each
// query row belongs to a group of TPR = DMAX / 32 adjacent threads, each holding 32 of the row's
// (zero-padded) head dims for q and the output accumulator in registers; partial dot products
// meet through warp shuffles. Keys and values stream through shared memory in tiles of
// KEY_TILE keys converted to f32, with the tile's bias rows beside them, and an online softmax
// (running max and sum, rescaled once per tile) keeps everything in f32. Shared memory does
// not grow with n, so 16x16 windows with head dims up to 128 fit in under 48 KiB.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtype.cuh"

// cp.async and mma.m16n8k16 on 16-bit inputs need sm_80. A build for an older GPU
// (CUDA_COMPUTE_CAP=75: a T4) leaves the tensor-core kernels out, so that the module still
// loads there, and the host runs the scalar kernels (src/ops/attention/cuda.rs reads
// the same build setting).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TENSOR_CORE_KERNELS 1
#endif

namespace {

// Keys per shared-memory tile. The host computes the same shared-memory layout: keep in step
// with KEY_TILE and the layout comment in window_attention below.
constexpr int KEY_TILE = 32;
// Columns of the head dim each thread of a row group owns.
constexpr int COLS_PER_THREAD = 32;
// What the official code adds between tokens of different regions (not -inf: it keeps the
// same softmax and fp16 finite).
constexpr float MASK_VALUE = -100.0f;

// Which of the three bands of the rolled map coordinate p falls in: the body, the band that
// stayed at the end, or the band that wrapped round from the start.
__device__ __forceinline__ int region(int p, int size, int ws, int shift) {
    return p + ws < size ? 0 : (p + shift < size ? 1 : 2);
}

// Region label (0..8) of token t of the window at (wy, wx) in window units.
__device__ __forceinline__ int token_label(int t, int wy, int wx, int ws, int shift, int height,
                                           int width) {
    const int y = wy * ws + t / ws;
    const int x = wx * ws + t % ws;
    return 3 * region(y, height, ws, shift) + region(x, width, ws, shift);
}

// One query row of the scalar kernels: a group of TPR threads holds it, each thread
// COLS_PER_THREAD of its columns (part, part + TPR, ...), with the row's running max and sum of
// the online softmax (the same in every thread of the group) and this thread's share of the
// unnormalised output.
template <typename T, int DMAX>
struct ScalarRow {
    static constexpr int TPR = DMAX / COLS_PER_THREAD;
    static_assert(TPR * COLS_PER_THREAD == DMAX && (TPR & (TPR - 1)) == 0 && TPR <= 32,
                  "a row group is a power of two of threads inside one warp");
    int part;
    float q[COLS_PER_THREAD];
    float acc[COLS_PER_THREAD];
    float run_max;
    float run_sum;

    // Reads the query, `src[col]` for the head's d columns; zeros past them and for a row that
    // is not `active` (then `src` is not read).
    __device__ __forceinline__ void start(const T* src, bool active, int d) {
        part = threadIdx.x % TPR;
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            const int col = part + TPR * i;
            q[i] = active && col < d ? to_f32(src[col]) : 0.0f;
            acc[i] = 0.0f;
        }
        run_max = -INFINITY;
        run_sum = 0.0f;
    }

    // q·k for staged key j. A butterfly leaves the same sum, bit for bit, in every thread of the
    // group, so the group agrees on the running max and sum without further exchange.
    __device__ __forceinline__ float dot(const float* s_k, int j) const {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            dot = fmaf(q[i], s_k[j * DMAX + part + TPR * i], dot);
        }
#pragma unroll
        for (int o = TPR / 2; o > 0; o /= 2) {
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        }
        return dot;
    }

    // Takes in a tile's scores `s` (dropped keys -inf), whose largest is `tile_max`, and its
    // staged values. Every tile has at least one real key, so the new max is finite and the
    // first tile's rescale is exp(-inf) = 0 on an empty accumulator.
    __device__ __forceinline__ void take(const float (&s)[KEY_TILE], float tile_max,
                                         const float* s_v) {
        const float new_max = fmaxf(run_max, tile_max);
        const float rescale = expf(run_max - new_max);
        run_sum *= rescale;
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            acc[i] *= rescale;
        }
#pragma unroll
        for (int j = 0; j < KEY_TILE; ++j) {
            const float p = expf(s[j] - new_max);
            run_sum += p;
#pragma unroll
            for (int i = 0; i < COLS_PER_THREAD; ++i) {
                acc[i] = fmaf(p, s_v[j * DMAX + part + TPR * i], acc[i]);
            }
        }
        run_max = new_max;
    }

    // Writes acc / sum to `dst[col]` for the head's d columns.
    __device__ __forceinline__ void store(T* dst, int d) const {
        const float inv = 1.0f / run_sum;
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            const int col = part + TPR * i;
            if (col < d) {
                dst[col] = from_f32<T>(acc[i] * inv);
            }
        }
    }
};

template <typename T, int DMAX>
__device__ __forceinline__ void window_attention(const T* __restrict__ qkv,
                                                 const T* __restrict__ bias,
                                                 T* __restrict__ out, int n, int heads, int d,
                                                 int ws, int height, int width, int shifted) {
    constexpr int TPR = ScalarRow<T, DMAX>::TPR;
    const int rows = blockDim.x / TPR;

    // Layout (floats): k tile [KEY_TILE][DMAX], v tile [KEY_TILE][DMAX], bias tile
    // [rows][KEY_TILE + 1] (the +1 puts the rows of a warp in different banks), then
    // KEY_TILE ints of key labels.
    extern __shared__ float smem[];
    float* s_k = smem;
    float* s_v = s_k + KEY_TILE * DMAX;
    float* s_bias = s_v + KEY_TILE * DMAX;
    int* s_label = reinterpret_cast<int*>(s_bias + rows * (KEY_TILE + 1));

    const int head = blockIdx.x % heads;
    const long long win = blockIdx.x / heads;
    const int c = heads * d;
    const long long row_stride = 3LL * c;
    const T* base = qkv + win * n * row_stride;
    const int row0 = blockIdx.y * rows;
    const int local_row = threadIdx.x / TPR;
    const int row = row0 + local_row;
    const bool active = row < n;

    const int shift = shifted ? ws / 2 : 0;
    const int nwx = width / ws;
    const int w_img = static_cast<int>(win % ((height / ws) * nwx));
    const int wy = w_img / nwx;
    const int wx = w_img % nwx;
    const int my_label = shifted ? token_label(active ? row : 0, wy, wx, ws, shift, height, width) : 0;

    ScalarRow<T, DMAX> me;
    me.start(base + (active ? row : 0) * row_stride + head * d, active, d);

    // Tiles only ever write columns < d, so the head-dim padding stays zero for the whole
    // launch and padded products add nothing. Key slots past n in a short last tile hold
    // zeros or an earlier tile's values: finite either way, and weighted by exp(-inf) = 0.
    for (int i = threadIdx.x; i < 2 * KEY_TILE * DMAX; i += blockDim.x) {
        smem[i] = 0.0f;
    }

    for (int j0 = 0; j0 < n; j0 += KEY_TILE) {
        const int count = min(KEY_TILE, n - j0);
        // Everyone is done with the previous tile (and with the zeroing above).
        __syncthreads();
        for (int i = threadIdx.x; i < count * d; i += blockDim.x) {
            const int key = i / d;
            const int col = i - key * d;
            const T* src = base + (j0 + key) * row_stride + c + head * d + col;
            s_k[key * DMAX + col] = to_f32(src[0]);
            s_v[key * DMAX + col] = to_f32(src[c]);
        }
        for (int i = threadIdx.x; i < rows * KEY_TILE; i += blockDim.x) {
            const int r = i / KEY_TILE;
            const int j = i - r * KEY_TILE;
            float b = 0.0f;
            if (row0 + r < n && j < count) {
                b = to_f32(bias[(static_cast<long long>(head) * n + row0 + r) * n + j0 + j]);
            }
            s_bias[r * (KEY_TILE + 1) + j] = b;
        }
        if (shifted) {
            for (int j = threadIdx.x; j < KEY_TILE; j += blockDim.x) {
                // Slots past n get a label no token has; their scores are dropped anyway.
                s_label[j] = j < count ? token_label(j0 + j, wy, wx, ws, shift, height, width)
                                       : -1;
            }
        }
        __syncthreads();

        float s[KEY_TILE];
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < KEY_TILE; ++j) {
            // (q·k + bias) + mask: the reference's order of additions.
            float score = me.dot(s_k, j) + s_bias[local_row * (KEY_TILE + 1) + j];
            if (shifted && s_label[j] != my_label) {
                score += MASK_VALUE;
            }
            s[j] = j < count ? score : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }

        me.take(s, tile_max, s_v);
    }

    if (active) {
        me.store(out + (win * n + row) * c + head * d, d);
    }
}


// ---------------------------------------------------------------------------------------------
// Overlapping cross-attention (HAT's OCAB), scalar.
//
// Input `qkv` is the token map (B, height, width, 3c), channels last, q | k | v each head-major
// (q already scaled by d^-0.5); the output is (B, height, width, c), the layout `proj` reads.
// Per (window, head): the queries are the window's ws x ws tokens; the keys and values are the
// ows x ows tokens centred on it (a margin of (ows - ws) / 2 on every side). Keys outside the
// map are zero vectors, as the official code's unfold with zero padding makes them: they stay
// in the softmax (their score is the bias alone) and add nothing to the output. `bias` is
// (heads, ws², ows²), key index row-major over the ows x ows neighbourhood. No mask.
//
// Reading the neighbourhood straight from the map spares the graph's padded copy of k and v
// and its gather of 2.25x their size, and the (windows, heads, ws², ows²) scores never reach
// memory. Same work split, tiles and online softmax as window_attention above; only where
// queries, keys and outputs live differs.
template <typename T, int DMAX>
__device__ __forceinline__ void overlap_attention(const T* __restrict__ qkv,
                                                  const T* __restrict__ bias,
                                                  T* __restrict__ out, int heads, int d, int ws,
                                                  int ows, int height, int width) {
    constexpr int TPR = ScalarRow<T, DMAX>::TPR;
    const int rows = blockDim.x / TPR;

    // Layout (floats): k tile [KEY_TILE][DMAX], v tile [KEY_TILE][DMAX], bias tile
    // [rows][KEY_TILE + 1].
    extern __shared__ float smem[];
    float* s_k = smem;
    float* s_v = s_k + KEY_TILE * DMAX;
    float* s_bias = s_v + KEY_TILE * DMAX;

    const int n = ws * ws;
    const int nk = ows * ows;
    const int margin = (ows - ws) / 2;
    const int head = blockIdx.x % heads;
    const long long win = blockIdx.x / heads;
    const int c = heads * d;
    const long long row_stride = 3LL * c;
    const int nwx = width / ws;
    const int per_image = (height / ws) * nwx;
    const int w_img = static_cast<int>(win % per_image);
    const int wy = w_img / nwx;
    const int wx = w_img % nwx;
    const long long image = (win / per_image) * height * width;
    // Token (y, x) of this image, as an index into the map's pixels.
    auto pixel = [&](int y, int x) { return image + static_cast<long long>(y) * width + x; };
    const int row0 = blockIdx.y * rows;
    const int local_row = threadIdx.x / TPR;
    const int row = row0 + local_row;
    const bool active = row < n;
    // Rows past n (whose results are dropped) read the first row's query.
    const int q_row = active ? row : 0;
    const long long q_pixel = pixel(wy * ws + q_row / ws, wx * ws + q_row % ws);
    // Top-left corner of the key neighbourhood, which may lie outside the map.
    const int ky0 = wy * ws - margin;
    const int kx0 = wx * ws - margin;

    ScalarRow<T, DMAX> me;
    me.start(qkv + q_pixel * row_stride + head * d, active, d);

    // As in window_attention: the head-dim padding of the tiles stays zero for the launch.
    for (int i = threadIdx.x; i < 2 * KEY_TILE * DMAX; i += blockDim.x) {
        smem[i] = 0.0f;
    }

    for (int j0 = 0; j0 < nk; j0 += KEY_TILE) {
        const int count = min(KEY_TILE, nk - j0);
        __syncthreads();
        for (int i = threadIdx.x; i < count * d; i += blockDim.x) {
            const int key = i / d;
            const int col = i - key * d;
            const int y = ky0 + (j0 + key) / ows;
            const int x = kx0 + (j0 + key) % ows;
            float k = 0.0f, v = 0.0f;
            if (y >= 0 && y < height && x >= 0 && x < width) {
                const T* src = qkv + pixel(y, x) * row_stride + c + head * d + col;
                k = to_f32(src[0]);
                v = to_f32(src[c]);
            }
            s_k[key * DMAX + col] = k;
            s_v[key * DMAX + col] = v;
        }
        for (int i = threadIdx.x; i < rows * KEY_TILE; i += blockDim.x) {
            const int r = i / KEY_TILE;
            const int j = i - r * KEY_TILE;
            float b = 0.0f;
            if (row0 + r < n && j < count) {
                b = to_f32(bias[(static_cast<long long>(head) * n + row0 + r) * nk + j0 + j]);
            }
            s_bias[r * (KEY_TILE + 1) + j] = b;
        }
        __syncthreads();

        float s[KEY_TILE];
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < KEY_TILE; ++j) {
            const float score = me.dot(s_k, j) + s_bias[local_row * (KEY_TILE + 1) + j];
            s[j] = j < count ? score : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }

        me.take(s, tile_max, s_v);
    }

    if (active) {
        me.store(out + q_pixel * c + head * d, d);
    }
}

#ifdef TENSOR_CORE_KERNELS
// ---------------------------------------------------------------------------------------------
// Tensor-core variant for bf16 and f16 inputs.
//
// Same inputs, output and arithmetic order as above, but both products run as
// mma.m16n8k16 (16-bit inputs, f32 accumulation). Each warp owns 16 query rows, a block
// mma_warps(DP) warps. Scores stay in registers in the accumulator layout, and the online
// softmax works on them there: a thread holds two rows (g and g+8 of its warp's 16) at two
// adjacent keys per 8-key tile, so a row's max and sum meet across the four threads of a quad.
// The probabilities are rounded to the input type (the A operand of the second product); the
// row sum adds the rounded values, so the normalisation matches the weights actually applied.
//
// Nothing in the key loop waits on device memory:
// - k and v tiles are copied with cp.async into two shared buffers, so the next tile loads
//   while this one is computed. A staged row is the head's values from the even element at or
//   before its first (a head of odd width starts at an odd element in every other head):
//   32-bit copies whatever the parity, and q is placed at the same offset `e` so that the
//   products line up. Words past the head are zero-filled; the one neighbouring value a word
//   may carry meets a zero q (scores) or lands in a column that is not written (outputs).
// - The bias is the relative-position bias, one value per (dy, dx) offset: the (2ws-1)^2
//   distinct values of this head are read once from `bias` into shared memory, and each score
//   looks its value up by the offset of its query and key. (`bias` must be such a gathered
//   table, as the model's always is; the scalar kernel reads any bias.)
// - Each key's table offset and region label sit in shared memory for the whole window.
// The B fragments of both products come from the staged tiles by ldmatrix, v transposed on
// the way, so both tiles keep the row-major layout that cp.async writes.
//
// The host guarantees c even and a 4-byte aligned qkv (else it runs the scalar kernel).

// Warps per block and keys per staged tile by padded head dim: every warp of a block shares
// each staged tile, so more warps stage less per product; the narrow heads (DRCT's 30) take a
// whole 256-token window in one block. Wider heads hold more registers per thread and take
// fewer warps, and a shorter tile keeps both double-buffered tiles under 48 KiB. The host
// computes the same launch: keep in step with `mma_plan` in
// src/ops/attention/cuda.rs.
__host__ __device__ constexpr int mma_warps(int dp) { return dp <= 32 ? 16 : (dp <= 64 ? 8 : 4); }
__host__ __device__ constexpr int mma_keys(int dp) { return dp <= 64 ? 64 : 32; }

__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }

// Two 16-bit values in one register, the first in the low half (the mma operand order).
__device__ __forceinline__ unsigned pack2(unsigned short lo, unsigned short hi) {
    return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}

// acc += A B for one 16x8x16 tile (row-major A, column-major B), per PTX's fragment layout.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]);

#ifdef KERNEL_CPU_EMULATION
template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]) {
    emu::mma_m16n8k16<T>(acc, a, b, acc);
}
// The emulator lands each group of copies at the wait that covers it, the latest the GPU may.
__device__ __forceinline__ void copy_word_async(void* dst, const void* src, bool real) {
    emu::cp_async4(dst, src, real);
}
__device__ __forceinline__ void async_commit() { emu::cp_async_commit(); }
template <int PENDING>
__device__ __forceinline__ void async_wait() {
    emu::cp_async_wait(PENDING);
}
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned short* row) {
    emu::ldmatrix_x4<TRANS>(r, row);
}
#else
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&acc)[4], const unsigned (&a)[4],
                                                         const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&acc)[4], const unsigned (&a)[4],
                                                  const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// One 32-bit word from device to shared memory without passing through registers; zero-filled
// when `real` is false (then `src` is not read).
__device__ __forceinline__ void copy_word_async(void* dst, const void* src, bool real) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
                 "r"(real ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}
// Four 8x8 matrices of 16-bit values from shared memory, one instruction for the warp: lane
// 8m + r gives row r of matrix m (16-byte aligned); register m of lane l receives row l/4,
// columns 2(l%4) and 2(l%4)+1 of matrix m, or with TRANS rows 2(l%4) and 2(l%4)+1 of column
// l/4: the B fragment of mma.m16n8k16 from a row-major k tile (keys x dims) or, transposed, from
// a row-major v tile.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned short* row) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
    }
}
#endif

// The pieces both tensor-core kernels share. A warp holds 16 query rows: thread (g, t) of
// the warp (g = lane / 4, t = lane % 4) holds rows g ("lo") and g + 8 ("hi") of every 16x8
// accumulator, columns 2t and 2t + 1; the four threads of a quad together hold a row.

// The q rows as A fragments, one per 16 staged columns: `q_lo(col)` and `q_hi(col)` give the
// 16-bit value of staged column `col` of each row (zero outside the head or past the rows).
template <int DP, typename QLo, typename QHi>
__device__ __forceinline__ void mma_q_fragments(unsigned (&qa)[DP / 16][4], int t, QLo q_lo,
                                                QHi q_hi) {
#pragma unroll
    for (int ks = 0; ks < DP / 16; ++ks) {
        const int col = ks * 16 + 2 * t;
        qa[ks][0] = pack2(q_lo(col), q_lo(col + 1));
        qa[ks][1] = pack2(q_hi(col), q_hi(col + 1));
        qa[ks][2] = pack2(q_lo(col + 8), q_lo(col + 9));
        qa[ks][3] = pack2(q_hi(col + 8), q_hi(col + 9));
    }
}

// Scores of the warp's 16 rows against the staged k tile's keys, 8 keys per accumulator. One
// ldmatrix gives the B fragments of two 8-key tiles (matrices: keys 0-7 of the pair at dims
// 0-7 and 8-15 of the k step, then keys 8-15 at the same dims).
template <typename T, int DP>
__device__ __forceinline__ void mma_scores(float (&s)[mma_keys(DP) / 8][4],
                                           const unsigned (&qa)[DP / 16][4],
                                           const unsigned short* s_k, int lane) {
    constexpr int KEYS = mma_keys(DP);
    constexpr int KP = DP + 8;
    const int m = lane / 8;
    const int mr = lane % 8;
#pragma unroll
    for (int nt = 0; nt < KEYS / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    }
#pragma unroll
    for (int np = 0; np < KEYS / 16; ++np) {
        const unsigned short* krow = s_k + ((2 * np + m / 2) * 8 + mr) * KP + (m % 2) * 8;
#pragma unroll
        for (int ks = 0; ks < DP / 16; ++ks) {
            unsigned b[4];
            ldmatrix_x4<false>(b, krow + ks * 16);
            mma_16816<T>(s[2 * np], qa[ks], {b[0], b[1]});
            mma_16816<T>(s[2 * np + 1], qa[ks], {b[2], b[3]});
        }
    }
}

// The running state of the online softmax of a thread's two rows: each row's maximum so far
// (the same in the four threads of its quad), this thread's share of its sum of exponentials
// (added across the quad at the end), and its share of the unnormalised output.
template <typename T, int DP>
struct MmaRows {
    float o[DP / 8][4];
    float max_lo, max_hi;
    float sum_lo, sum_hi;

    __device__ __forceinline__ void start() {
#pragma unroll
        for (int dt = 0; dt < DP / 8; ++dt) {
            o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
        }
        max_lo = -INFINITY;
        max_hi = -INFINITY;
        sum_lo = 0.0f;
        sum_hi = 0.0f;
    }

    // Takes in a tile whose largest score in each row of this thread's share is
    // `tile_lo`/`tile_hi`: the quad's maxima become the rows' tile maxima, and the sums and
    // outputs so far are rescaled to the new running maxima. Every tile has a real key, so
    // the new maxima are finite and the first rescale is exp(-inf) = 0 on empty accumulators.
    __device__ __forceinline__ void rescale(float tile_lo, float tile_hi) {
        constexpr unsigned FULL = 0xffffffffu;
#pragma unroll
        for (int o_ = 1; o_ < 4; o_ *= 2) {
            tile_lo = fmaxf(tile_lo, __shfl_xor_sync(FULL, tile_lo, o_));
            tile_hi = fmaxf(tile_hi, __shfl_xor_sync(FULL, tile_hi, o_));
        }
        const float new_lo = fmaxf(max_lo, tile_lo);
        const float new_hi = fmaxf(max_hi, tile_hi);
        const float scale_lo = expf(max_lo - new_lo);
        const float scale_hi = expf(max_hi - new_hi);
        max_lo = new_lo;
        max_hi = new_hi;
        sum_lo *= scale_lo;
        sum_hi *= scale_hi;
#pragma unroll
        for (int dt = 0; dt < DP / 8; ++dt) {
            o[dt][0] *= scale_lo;
            o[dt][1] *= scale_lo;
            o[dt][2] *= scale_hi;
            o[dt][3] *= scale_hi;
        }
    }

    // o += p v for the tile's scores `s` (after `rescale`). The probabilities, rounded to T,
    // become the A fragments of p v (the accumulator layout of two adjacent 8-key tiles is
    // the A layout of one 16-key step), and their rounded values are what the sums add. One
    // transposing ldmatrix gives the B fragments of two 8-column tiles of the row-major v tile
    // (matrices: keys 0-7 and 8-15 of the step at the first 8 columns, then at the next).
    __device__ __forceinline__ void add_pv(const float (&s)[mma_keys(DP) / 8][4],
                                           const unsigned short* s_v, int lane) {
        constexpr int KEYS = mma_keys(DP);
        constexpr int KP = DP + 8;
        const int m = lane / 8;
        const int mr = lane % 8;
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {
            unsigned short p[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const T pr = from_f32<T>(expf(s[2 * kk + h][r] - (r < 2 ? max_lo : max_hi)));
                    p[h][r] = bits_of(pr);
                    if (r < 2) {
                        sum_lo += to_f32(pr);
                    } else {
                        sum_hi += to_f32(pr);
                    }
                }
            }
            const unsigned pa[4] = {pack2(p[0][0], p[0][1]), pack2(p[0][2], p[0][3]),
                                    pack2(p[1][0], p[1][1]), pack2(p[1][2], p[1][3])};
            const unsigned short* vrow = s_v + (kk * 16 + (m % 2) * 8 + mr) * KP + (m / 2) * 8;
#pragma unroll
            for (int dp = 0; dp < DP / 16; ++dp) {
                unsigned b[4];
                ldmatrix_x4<true>(b, vrow + dp * 16);
                mma_16816<T>(o[2 * dp], pa, {b[0], b[1]});
                mma_16816<T>(o[2 * dp + 1], pa, {b[2], b[3]});
            }
        }
    }

    // Writes o / sum for each row that is real: head dim `col` of a row goes to `row[col]`,
    // where `out_lo`/`out_hi` point at the row's first value of this head (staged column
    // `raw` holds head dim raw - e).
    __device__ __forceinline__ void store(T* out_lo, T* out_hi, bool real_lo, bool real_hi,
                                          int e, int d, int t) {
        constexpr unsigned FULL = 0xffffffffu;
#pragma unroll
        for (int o_ = 1; o_ < 4; o_ *= 2) {
            sum_lo += __shfl_xor_sync(FULL, sum_lo, o_);
            sum_hi += __shfl_xor_sync(FULL, sum_hi, o_);
        }
        const float inv_lo = 1.0f / sum_lo;
        const float inv_hi = 1.0f / sum_hi;
#pragma unroll
        for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int col = dt * 8 + 2 * t + i - e;
                if (col >= 0 && col < d && real_lo) {
                    out_lo[col] = from_f32<T>(o[dt][i] * inv_lo);
                }
                if (col >= 0 && col < d && real_hi) {
                    out_hi[col] = from_f32<T>(o[dt][2 + i] * inv_hi);
                }
            }
        }
    }
};

// Per (window, head) and 16 * mma_warps(DP) query rows: softmax(q kᵀ + bias + mask) v on tensor
// cores. DP is the head dim (plus its offset e) padded to a multiple of 16 (the k of the first
// product).
template <typename T, int DP>
__device__ __forceinline__ void window_attention_mma(const T* __restrict__ qkv,
                                                     const T* __restrict__ bias,
                                                     T* __restrict__ out, int n, int heads,
                                                     int d, int ws, int height, int width,
                                                     int shifted) {
    static_assert(DP % 16 == 0, "the head dim is padded to whole k steps");
    constexpr int KEYS = mma_keys(DP);
    // Row pitch in 16-bit elements: 16-byte rows for ldmatrix, and the +8 makes the pitch an odd
    // number of 16-byte units, so the eight rows of each matrix fall in different banks.
    constexpr int KP = DP + 8;
    constexpr int TILE = KEYS * KP;
    constexpr int WORDS = DP / 2;

    // Layout: buffer 0 (k tile, v tile), buffer 1 (k tile, v tile), each tile KEYS rows of KP
    // 16-bit values, row-major; then this head's bias table (f32, side x side); then, per key
    // of the window, 16 x its table offset + its region label.
    extern __shared__ float smem[];
    unsigned short* s_kv = reinterpret_cast<unsigned short*>(smem);
    const int side = 2 * ws - 1;
    float* s_table = reinterpret_cast<float*>(s_kv + 4 * TILE);
    int* s_key = reinterpret_cast<int*>(s_table + side * side);

    const int head = blockIdx.x % heads;
    const long long win = blockIdx.x / heads;
    const int c = heads * d;
    const long long row_stride = 3LL * c;
    const T* base = qkv + win * n * row_stride;
    // Rows are even (c is), so a head's parity is the same in every row and in q, k and v.
    const int e = (head * d) & 1;
    const int words = (e + d + 1) / 2;
    const T* k_base = base + c + head * d - e;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    // The two query rows whose scores and outputs this thread holds.
    const int r_lo = blockIdx.y * (16 * mma_warps(DP)) + warp * 16 + g;
    const int r_hi = r_lo + 8;

    // Tile `tile` of k and v into buffer `buf`, every word of it: keys past n and words past
    // the head are zeros, so padded products add nothing and dropped keys' v rows are finite.
    auto issue = [&](int tile, int buf) {
        unsigned short* s_k = s_kv + buf * 2 * TILE;
        const int j0 = tile * KEYS;
        for (int i = threadIdx.x; i < KEYS * WORDS; i += blockDim.x) {
            const int key = i / WORDS;
            const int w = i - key * WORDS;
            const bool real = j0 + key < n && w < words;
            const T* src = real ? k_base + (j0 + key) * row_stride + 2 * w : qkv;
            copy_word_async(s_k + key * KP + 2 * w, src, real);
            copy_word_async(s_k + TILE + key * KP + 2 * w, real ? src + c : qkv, real);
        }
        async_commit();
    };
    issue(0, 0);

    const int shift = shifted ? ws / 2 : 0;
    const int nwx = width / ws;
    const int w_img = static_cast<int>(win % ((height / ws) * nwx));
    const int wy = w_img / nwx;
    const int wx = w_img % nwx;
    // The bias of offset (dy, dx) is that of a query at (max(dy, 0), max(dx, 0)) and the key
    // (dy, dx) before it.
    const long long head_rows = static_cast<long long>(head) * n;
    for (int i = threadIdx.x; i < side * side; i += blockDim.x) {
        const int dy = i / side - (ws - 1);
        const int dx = i % side - (ws - 1);
        const int yi = max(dy, 0);
        const int xi = max(dx, 0);
        s_table[i] = to_f32(bias[(head_rows + yi * ws + xi) * n + (yi - dy) * ws + (xi - dx)]);
    }
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int label = shifted ? token_label(j, wy, wx, ws, shift, height, width) : 0;
        s_key[j] = ((j / ws) * side + j % ws) * 16 + label;
    }
    // A query's part of the table index (its key's part is subtracted); rows past n, whose
    // results are dropped, take the last row's.
    auto row_offset = [&](int r) {
        r = min(r, n - 1);
        return (r / ws + ws - 1) * side + r % ws + ws - 1;
    };
    const int a_lo = row_offset(r_lo);
    const int a_hi = row_offset(r_hi);
    const int label_lo = shifted && r_lo < n ? token_label(r_lo, wy, wx, ws, shift, height, width) : 0;
    const int label_hi = shifted && r_hi < n ? token_label(r_hi, wy, wx, ws, shift, height, width) : 0;

    // q as A fragments, one per 16 staged columns (column `raw` holds head dim raw - e); rows
    // past n and columns outside the head are zero.
    auto q_at = [&](int row, int raw) -> unsigned short {
        const int col = raw - e;
        return row < n && col >= 0 && col < d ? bits_of(base[row * row_stride + head * d + col])
                                              : 0;
    };
    unsigned qa[DP / 16][4];
    mma_q_fragments<DP>(
        qa, t, [&](int raw) { return q_at(r_lo, raw); }, [&](int raw) { return q_at(r_hi, raw); });
    MmaRows<T, DP> rows;
    rows.start();

    const int tiles = (n + KEYS - 1) / KEYS;
    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + 1 < tiles) {
            issue(tile + 1, (tile + 1) & 1);
            async_wait<1>();
        } else {
            async_wait<0>();
        }
        // This tile (and, the first time, the table and key offsets) is in place for everyone.
        __syncthreads();
        const int j0 = tile * KEYS;
        const int count = min(KEYS, n - j0);
        const unsigned short* s_k = s_kv + (tile & 1) * 2 * TILE;
        const unsigned short* s_v = s_k + TILE;

        float s[KEYS / 8][4];
        mma_scores<T, DP>(s, qa, s_k, lane);

        // (q·k + bias) + mask, as the reference adds them; keys past n drop out.
        float tile_lo = -INFINITY, tile_hi = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < KEYS / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int j = nt * 8 + 2 * t + i;
                float lo = -INFINITY, hi = -INFINITY;
                if (j < count) {
                    const int key = s_key[j0 + j];
                    lo = s[nt][i] + s_table[a_lo - (key >> 4)];
                    hi = s[nt][2 + i] + s_table[a_hi - (key >> 4)];
                    if (shifted && (key & 15) != label_lo) {
                        lo += MASK_VALUE;
                    }
                    if (shifted && (key & 15) != label_hi) {
                        hi += MASK_VALUE;
                    }
                }
                s[nt][i] = lo;
                s[nt][2 + i] = hi;
                tile_lo = fmaxf(tile_lo, lo);
                tile_hi = fmaxf(tile_hi, hi);
            }
        }
        rows.rescale(tile_lo, tile_hi);
        rows.add_pv(s, s_v, lane);
        // Everyone is done with this buffer before the next issue refills it.
        __syncthreads();
    }

    // Rows past n are not written (their pointers are never dereferenced).
    rows.store(out + (win * n + r_lo) * c + head * d, out + (win * n + r_hi) * c + head * d,
               r_lo < n, r_hi < n, e, d, t);
}

// Overlapping cross-attention on tensor cores: window_attention_mma's products, softmax and
// staging, with overlap_attention's geometry. The keys of a window are its ows x ows
// neighbourhood: a staged key row outside the map is zero-filled by the copy itself (cp.async
// with a source size of 0), so the key loop has no branch for the border. The bias depends on
// the query and key only through their offset (key minus query, each in its own window's
// frame: -(ws-1)..ows-1 per axis), so this head's (ws + ows - 1)^2 values are read once into
// shared memory, as in window_attention_mma; the wrap of the official index is already in the
// gathered `bias`. No mask.
template <typename T, int DP>
__device__ __forceinline__ void overlap_attention_mma(const T* __restrict__ qkv,
                                                      const T* __restrict__ bias,
                                                      T* __restrict__ out, int heads, int d,
                                                      int ws, int ows, int height, int width) {
    static_assert(DP % 16 == 0, "the head dim is padded to whole k steps");
    constexpr int KEYS = mma_keys(DP);
    constexpr int KP = DP + 8;
    constexpr int TILE = KEYS * KP;
    constexpr int WORDS = DP / 2;

    // Layout: buffer 0 (k tile, v tile), buffer 1 (k tile, v tile), each tile KEYS rows of KP
    // 16-bit values, row-major; then this head's bias by offset (f32, side x side); then, per
    // key of the neighbourhood, its part of the table index.
    extern __shared__ float smem[];
    unsigned short* s_kv = reinterpret_cast<unsigned short*>(smem);
    const int side = ws + ows - 1;
    float* s_table = reinterpret_cast<float*>(s_kv + 4 * TILE);
    int* s_key = reinterpret_cast<int*>(s_table + side * side);

    const int n = ws * ws;
    const int nk = ows * ows;
    const int margin = (ows - ws) / 2;
    const int head = blockIdx.x % heads;
    const long long win = blockIdx.x / heads;
    const int c = heads * d;
    const long long row_stride = 3LL * c;
    const int nwx = width / ws;
    const int per_image = (height / ws) * nwx;
    const int w_img = static_cast<int>(win % per_image);
    const int wy = w_img / nwx;
    const int wx = w_img % nwx;
    const long long image = (win / per_image) * height * width;
    const int ky0 = wy * ws - margin;
    const int kx0 = wx * ws - margin;
    // Rows are even (c is), so a head's parity is the same in every row and in q, k and v.
    const int e = (head * d) & 1;
    const int words = (e + d + 1) / 2;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int r_lo = blockIdx.y * (16 * mma_warps(DP)) + warp * 16 + g;
    const int r_hi = r_lo + 8;
    // The map pixel of query row r (rows past n, whose results are dropped, take row 0's).
    auto q_pixel = [&](int r) {
        r = r < n ? r : 0;
        return image + static_cast<long long>(wy * ws + r / ws) * width + wx * ws + r % ws;
    };

    // Tile `tile` of the neighbourhood's k and v into buffer `buf`, every word of it: keys
    // past nk or outside the map, and words past the head, are zeros.
    auto issue = [&](int tile, int buf) {
        unsigned short* s_k = s_kv + buf * 2 * TILE;
        const int j0 = tile * KEYS;
        for (int i = threadIdx.x; i < KEYS * WORDS; i += blockDim.x) {
            const int key = i / WORDS;
            const int w = i - key * WORDS;
            const int y = ky0 + (j0 + key) / ows;
            const int x = kx0 + (j0 + key) % ows;
            const bool real = j0 + key < nk && w < words && y >= 0 && y < height && x >= 0 &&
                              x < width;
            const T* src = real ? qkv + (image + static_cast<long long>(y) * width + x) *
                                            row_stride +
                                      c + head * d - e + 2 * w
                                : qkv;
            copy_word_async(s_k + key * KP + 2 * w, src, real);
            copy_word_async(s_k + TILE + key * KP + 2 * w, real ? src + c : qkv, real);
        }
        async_commit();
    };
    issue(0, 0);

    // Offset (dy, dx), key minus query, is that of the query at (max(-dy, 0), max(-dx, 0))
    // and the key dy, dx from it.
    const long long head_rows = static_cast<long long>(head) * n;
    for (int i = threadIdx.x; i < side * side; i += blockDim.x) {
        const int dy = i / side - (ws - 1);
        const int dx = i % side - (ws - 1);
        const int yi = max(-dy, 0);
        const int xi = max(-dx, 0);
        s_table[i] = to_f32(bias[(head_rows + yi * ws + xi) * nk + (yi + dy) * ows + xi + dx]);
    }
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        s_key[j] = (j / ows) * side + j % ows;
    }
    // A query's part of the table index, (ws-1 - y) * side + (ws-1 - x); the key's is added.
    auto row_offset = [&](int r) {
        r = min(r, n - 1);
        return (ws - 1 - r / ws) * side + ws - 1 - r % ws;
    };
    const int a_lo = row_offset(r_lo);
    const int a_hi = row_offset(r_hi);

    // q as A fragments (column `raw` holds head dim raw - e); rows past n and columns outside
    // the head are zero.
    const long long p_lo = q_pixel(r_lo);
    const long long p_hi = q_pixel(r_hi);
    auto q_at = [&](int row, long long p, int raw) -> unsigned short {
        const int col = raw - e;
        return row < n && col >= 0 && col < d ? bits_of(qkv[p * row_stride + head * d + col]) : 0;
    };
    unsigned qa[DP / 16][4];
    mma_q_fragments<DP>(
        qa, t, [&](int raw) { return q_at(r_lo, p_lo, raw); },
        [&](int raw) { return q_at(r_hi, p_hi, raw); });
    MmaRows<T, DP> rows;
    rows.start();

    const int tiles = (nk + KEYS - 1) / KEYS;
    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + 1 < tiles) {
            issue(tile + 1, (tile + 1) & 1);
            async_wait<1>();
        } else {
            async_wait<0>();
        }
        __syncthreads();
        const int j0 = tile * KEYS;
        const int count = min(KEYS, nk - j0);
        const unsigned short* s_k = s_kv + (tile & 1) * 2 * TILE;
        const unsigned short* s_v = s_k + TILE;

        float s[KEYS / 8][4];
        mma_scores<T, DP>(s, qa, s_k, lane);

        // q·k + bias; keys past nk drop out (those outside the map stay, with q·k = 0).
        float tile_lo = -INFINITY, tile_hi = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < KEYS / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int j = nt * 8 + 2 * t + i;
                float lo = -INFINITY, hi = -INFINITY;
                if (j < count) {
                    const int key = s_key[j0 + j];
                    lo = s[nt][i] + s_table[a_lo + key];
                    hi = s[nt][2 + i] + s_table[a_hi + key];
                }
                s[nt][i] = lo;
                s[nt][2 + i] = hi;
                tile_lo = fmaxf(tile_lo, lo);
                tile_hi = fmaxf(tile_hi, hi);
            }
        }
        rows.rescale(tile_lo, tile_hi);
        rows.add_pv(s, s_v, lane);
        __syncthreads();
    }

    rows.store(out + p_lo * c + head * d, out + p_hi * c + head * d, r_lo < n, r_hi < n, e, d, t);
}
#endif  // TENSOR_CORE_KERNELS

}  // namespace

// The most threads a block is launched with; the host uses the same bound.
#define MAX_THREADS 128

// One entry point: the template FN<T, D> launched with at most THREADS threads per block, of
// which the registers must leave room for MIN_BLOCKS blocks per multiprocessor.
#define ENTRY(NAME, FN, THREADS, MIN_BLOCKS, T, D)                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                         \
        NAME(const T* qkv, const T* bias, T* out, int n, int heads, int d, int ws,            \
             int height, int width, int shifted) {                                            \
        FN<T, D>(qkv, bias, out, n, heads, d, ws, height, width, shifted);                    \
    }
#define WINDOW_ATTENTION(NAME, T, DMAX) ENTRY(NAME, window_attention, MAX_THREADS, 1, T, DMAX)

WINDOW_ATTENTION(window_attention_f32_d32, float, 32)
WINDOW_ATTENTION(window_attention_f32_d64, float, 64)
WINDOW_ATTENTION(window_attention_f32_d128, float, 128)
WINDOW_ATTENTION(window_attention_bf16_d32, __nv_bfloat16, 32)
WINDOW_ATTENTION(window_attention_bf16_d64, __nv_bfloat16, 64)
WINDOW_ATTENTION(window_attention_bf16_d128, __nv_bfloat16, 128)
WINDOW_ATTENTION(window_attention_f16_d32, __half, 32)
WINDOW_ATTENTION(window_attention_f16_d64, __half, 64)
WINDOW_ATTENTION(window_attention_f16_d128, __half, 128)

// The overlapping cross-attention's entry points: the same launch bound, other arguments.
#define OVERLAP_ENTRY(NAME, FN, THREADS, MIN_BLOCKS, T, D)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                         \
        NAME(const T* qkv, const T* bias, T* out, int heads, int d, int ws, int ows,          \
             int height, int width) {                                                         \
        FN<T, D>(qkv, bias, out, heads, d, ws, ows, height, width);                           \
    }
#define OVERLAP_ATTENTION(NAME, T, DMAX) OVERLAP_ENTRY(NAME, overlap_attention, MAX_THREADS, 1, T, DMAX)

OVERLAP_ATTENTION(overlap_attention_f32_d32, float, 32)
OVERLAP_ATTENTION(overlap_attention_f32_d64, float, 64)
OVERLAP_ATTENTION(overlap_attention_f32_d128, float, 128)
OVERLAP_ATTENTION(overlap_attention_bf16_d32, __nv_bfloat16, 32)
OVERLAP_ATTENTION(overlap_attention_bf16_d64, __nv_bfloat16, 64)
OVERLAP_ATTENTION(overlap_attention_bf16_d128, __nv_bfloat16, 128)
OVERLAP_ATTENTION(overlap_attention_f16_d32, __half, 32)
OVERLAP_ATTENTION(overlap_attention_f16_d64, __half, 64)
OVERLAP_ATTENTION(overlap_attention_f16_d128, __half, 128)

#ifdef TENSOR_CORE_KERNELS
// Blocks per multiprocessor the registers must allow: 16 resident warps (at most 128 registers
// per thread) up to head dim 112, at a spill of 8 bytes at most; left free, ptxas took up to
// 177 for some of them. Head dim 128 needs about 170 and takes three blocks.
__host__ __device__ constexpr int mma_min_blocks(int dp) {
    return dp <= 64 ? 16 / mma_warps(dp) : (dp == 128 ? 3 : 4);
}
#define WINDOW_ATTENTION_MMA(NAME, T, DP)                                                     \
    ENTRY(NAME, window_attention_mma, 32 * mma_warps(DP), mma_min_blocks(DP), T, DP)

WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d16, __nv_bfloat16, 16)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d32, __nv_bfloat16, 32)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d48, __nv_bfloat16, 48)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d64, __nv_bfloat16, 64)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d80, __nv_bfloat16, 80)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d96, __nv_bfloat16, 96)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d112, __nv_bfloat16, 112)
WINDOW_ATTENTION_MMA(window_attention_mma_bf16_d128, __nv_bfloat16, 128)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d16, __half, 16)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d32, __half, 32)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d48, __half, 48)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d64, __half, 64)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d80, __half, 80)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d96, __half, 96)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d112, __half, 112)
WINDOW_ATTENTION_MMA(window_attention_mma_f16_d128, __half, 128)

#define OVERLAP_ATTENTION_MMA(NAME, T, DP)                                                    \
    OVERLAP_ENTRY(NAME, overlap_attention_mma, 32 * mma_warps(DP), mma_min_blocks(DP), T, DP)

OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d16, __nv_bfloat16, 16)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d32, __nv_bfloat16, 32)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d48, __nv_bfloat16, 48)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d64, __nv_bfloat16, 64)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d80, __nv_bfloat16, 80)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d96, __nv_bfloat16, 96)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d112, __nv_bfloat16, 112)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_bf16_d128, __nv_bfloat16, 128)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d16, __half, 16)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d32, __half, 32)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d48, __half, 48)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d64, __half, 64)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d80, __half, 80)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d96, __half, 96)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d112, __half, 112)
OVERLAP_ATTENTION_MMA(overlap_attention_mma_f16_d128, __half, 128)
#endif
