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
// Work split: blockIdx.x = window * heads + head, blockIdx.y = a slice of query rows. Each
// query row belongs to a group of TPR = DMAX / 32 adjacent threads, each holding 32 of the row's
// (zero-padded) head dims for q and the output accumulator in registers; partial dot products
// meet through warp shuffles. Keys and values stream through shared memory in tiles of
// KEY_TILE keys converted to f32, with the tile's bias rows beside them, and an online softmax
// (running max and sum, rescaled once per tile) keeps everything in f32. Shared memory does
// not grow with n, so 16x16 windows with head dims up to 128 fit in under 48 KiB.
//
// The key-tile loop is the place for tensor cores later: the two inner products per tile
// map onto mma tiles once q/k/v are staged in bf16 and the head dim padded to 16.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

// Keys per shared-memory tile. The host computes the same shared-memory layout: keep in step
// with KEY_TILE and the layout comment in window_attention below.
constexpr int KEY_TILE = 32;
// Columns of the head dim each thread of a row group owns.
constexpr int COLS_PER_THREAD = 32;
// What the official code adds between tokens of different regions (not -inf: it keeps the
// same softmax and fp16 finite).
constexpr float MASK_VALUE = -100.0f;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}

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

template <typename T, int DMAX>
__device__ __forceinline__ void window_attention(const T* __restrict__ qkv,
                                                 const T* __restrict__ bias,
                                                 T* __restrict__ out, int n, int heads, int d,
                                                 int ws, int height, int width, int shifted) {
    constexpr int TPR = DMAX / COLS_PER_THREAD;
    static_assert(TPR * COLS_PER_THREAD == DMAX && (TPR & (TPR - 1)) == 0 && TPR <= 32,
                  "a row group is a power of two of threads inside one warp");
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
    const int part = threadIdx.x % TPR;
    const int row = row0 + local_row;
    const bool active = row < n;

    const int shift = shifted ? ws / 2 : 0;
    const int nwx = width / ws;
    const int w_img = static_cast<int>(win % ((height / ws) * nwx));
    const int wy = w_img / nwx;
    const int wx = w_img % nwx;
    const int my_label = shifted ? token_label(active ? row : 0, wy, wx, ws, shift, height, width) : 0;

    float q[COLS_PER_THREAD];
    float acc[COLS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < COLS_PER_THREAD; ++i) {
        const int col = part + TPR * i;
        q[i] = active && col < d ? to_f32(base[row * row_stride + head * d + col]) : 0.0f;
        acc[i] = 0.0f;
    }
    float run_max = -INFINITY;
    float run_sum = 0.0f;

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
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < COLS_PER_THREAD; ++i) {
                dot = fmaf(q[i], s_k[j * DMAX + part + TPR * i], dot);
            }
            // A butterfly leaves the same sum, bit for bit, in every thread of the group, so
            // the group agrees on the running max and sum without further exchange.
#pragma unroll
            for (int o = TPR / 2; o > 0; o /= 2) {
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            }
            // (q·k + bias) + mask: the reference's order of additions.
            float score = dot + s_bias[local_row * (KEY_TILE + 1) + j];
            if (shifted && s_label[j] != my_label) {
                score += MASK_VALUE;
            }
            s[j] = j < count ? score : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }

        // Every tile has at least one real key, so new_max is finite and the first tile's
        // rescale is exp(-inf) = 0 on an empty accumulator.
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

    if (active) {
        const float inv = 1.0f / run_sum;
        T* dst = out + (win * n + row) * c + head * d;
#pragma unroll
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            const int col = part + TPR * i;
            if (col < d) {
                dst[col] = from_f32<T>(acc[i] * inv);
            }
        }
    }
}

}  // namespace

// The most threads a block is launched with; the host uses the same bound.
#define MAX_THREADS 128

#define WINDOW_ATTENTION(NAME, T, DMAX)                                                       \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                 \
        NAME(const T* qkv, const T* bias, T* out, int n, int heads, int d, int ws,            \
             int height, int width, int shifted) {                                            \
        window_attention<T, DMAX>(qkv, bias, out, n, heads, d, ws, height, width, shifted);   \
    }

WINDOW_ATTENTION(window_attention_f32_d32, float, 32)
WINDOW_ATTENTION(window_attention_f32_d64, float, 64)
WINDOW_ATTENTION(window_attention_f32_d128, float, 128)
WINDOW_ATTENTION(window_attention_bf16_d32, __nv_bfloat16, 32)
WINDOW_ATTENTION(window_attention_bf16_d64, __nv_bfloat16, 64)
WINDOW_ATTENTION(window_attention_bf16_d128, __nv_bfloat16, 128)
WINDOW_ATTENTION(window_attention_f16_d32, __half, 32)
WINDOW_ATTENTION(window_attention_f16_d64, __half, 64)
WINDOW_ATTENTION(window_attention_f16_d128, __half, 128)
