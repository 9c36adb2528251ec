// Row-wise passes over token features, each fusing what candle would run as several kernels.
//
// - bias_act: the epilogue of a linear layer or convolution GEMM, out = act(y + bias) + res.
//   candle adds a bias through its generic broadcast kernel, which recomputes a strided index
//   with 64-bit divisions for every element; here the column is one 32-bit remainder.
// - cat_bias_act: the dense connection of a residual group, out = [prev | act(y + bias)], so
//   the concatenation costs no pass of its own.
// - gather_norm / add_gather_norm: the window partition (a token permutation) fused with the
//   layer norm beside it, one warp per token row; add_scaled_gather_norm also adds HAT's
//   channel-attention branch, scaled per image and channel, to the residual sum.
// - patches3x3: the patch matrix of a 3x3 convolution in one pass, where candle's zero
//   padding, nine strided tap copies and their concatenation took eleven.
// - conv3x3_narrow: a 3x3 convolution with at most four outputs (the RGB output layer at the
//   full output size) computed directly, one warp per pixel, with no patch matrix at all.
//
// Arithmetic is f32 whatever the storage type; every stored value is rounded once. Each
// thread reads and writes its own elements only, so outputs never alias inputs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtype.cuh"

// Named, not anonymous: the CPU check of the kernels compiles every kernel file into one
// translation unit, where anonymous helpers of the same name would collide.
namespace rowwise {

// Activation codes; the host's `Act` uses the same numbers.
constexpr int ACT_NONE = 0;
constexpr int ACT_GELU = 1;
constexpr int ACT_LEAKY = 2;
// `activate` passes every other code through unchanged, so none may take ACT_NONE's.
static_assert(ACT_NONE != ACT_GELU && ACT_NONE != ACT_LEAKY, "distinct activation codes");

__device__ __forceinline__ float activate(float v, int act, float slope) {
    if (act == ACT_GELU) {
        // nn.GELU()'s exact erf form.
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
    if (act == ACT_LEAKY) {
        return v >= 0.0f ? v : v * slope;
    }
    return v;
}

// Four adjacent values, moved as one 8-byte (16-bit types) or 16-byte (f32) access: a warp
// then moves 256 or 512 bytes per instruction instead of 64 or 128, and the column
// arithmetic runs once per four values. Every row width of the released models is a multiple
// of four (180 + 32k channels, their MLP widths, 3x for qkv).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
    T v[4];
};

// Whether every pointer can be read as quads (views may start at any element).
template <typename T>
__device__ __forceinline__ bool quads_fit(const void *a, const void *b, const void *c,
                                          const void *d) {
    const size_t bits = reinterpret_cast<size_t>(a) | reinterpret_cast<size_t>(b) |
                        reinterpret_cast<size_t>(c) | reinterpret_cast<size_t>(d);
    return bits % sizeof(Quad<T>) == 0;
}

// act(y + bias) + res, rounded once.
template <typename T>
__device__ __forceinline__ T epilogue(T y, T bias, const T *res, int act, float slope) {
    float v = activate(to_f32(y) + to_f32(bias), act, slope);
    if (res != nullptr) {
        v += to_f32(*res);
    }
    return from_f32<T>(v);
}

// y, out and res: rows x cols; bias: cols. res is read only when has_res.
template <typename T>
__device__ void bias_act(const T *__restrict__ y, const T *__restrict__ bias,
                         const T *__restrict__ res, T *__restrict__ out, unsigned int n,
                         unsigned int cols, int act, float slope, int has_res) {
    const unsigned int start = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int step = blockDim.x * gridDim.x;
    if (cols % 4 == 0 && quads_fit<T>(y, bias, out, has_res ? res : out)) {
        const Quad<T> *yq = reinterpret_cast<const Quad<T> *>(y);
        const Quad<T> *bq = reinterpret_cast<const Quad<T> *>(bias);
        const Quad<T> *rq = reinterpret_cast<const Quad<T> *>(res);
        Quad<T> *oq = reinterpret_cast<Quad<T> *>(out);
        const unsigned int qcols = cols / 4;
        for (unsigned int i = start; i < n / 4; i += step) {
            const Quad<T> a = yq[i];
            const Quad<T> b = bq[i % qcols];
            Quad<T> r;
            if (has_res) {
                r = rq[i];
            }
            Quad<T> o;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                o.v[k] = epilogue(a.v[k], b.v[k], has_res ? &r.v[k] : nullptr, act, slope);
            }
            oq[i] = o;
        }
        return;
    }
    for (unsigned int i = start; i < n; i += step) {
        out[i] = epilogue(y[i], bias[i % cols], has_res ? &res[i] : nullptr, act, slope);
    }
}

// prev: rows x pc; y: rows x cols; out: rows x (pc + cols).
template <typename T>
__device__ void cat_bias_act(const T *__restrict__ prev, const T *__restrict__ y,
                             const T *__restrict__ bias, T *__restrict__ out, unsigned int n,
                             unsigned int pc, unsigned int cols, int act, float slope) {
    const unsigned int start = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int step = blockDim.x * gridDim.x;
    if (pc % 4 == 0 && cols % 4 == 0 && quads_fit<T>(prev, y, bias, out)) {
        const Quad<T> *pq = reinterpret_cast<const Quad<T> *>(prev);
        const Quad<T> *yq = reinterpret_cast<const Quad<T> *>(y);
        const Quad<T> *bq = reinterpret_cast<const Quad<T> *>(bias);
        Quad<T> *oq = reinterpret_cast<Quad<T> *>(out);
        const unsigned int qp = pc / 4, qc = cols / 4, width = qp + qc;
        for (unsigned int i = start; i < n / 4; i += step) {
            const unsigned int r = i / width;
            const unsigned int c = i - r * width;
            if (c < qp) {
                oq[i] = pq[r * qp + c];
            } else {
                const Quad<T> a = yq[r * qc + c - qp];
                const Quad<T> b = bq[c - qp];
                Quad<T> o;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    o.v[k] = epilogue(a.v[k], b.v[k], static_cast<const T *>(nullptr), act, slope);
                }
                oq[i] = o;
            }
        }
        return;
    }
    const unsigned int width = pc + cols;
    for (unsigned int i = start; i < n; i += step) {
        const unsigned int r = i / width;
        const unsigned int c = i - r * width;
        out[i] = c < pc ? prev[r * pc + c]
                        : epilogue(y[r * cols + c - pc], bias[c - pc],
                                   static_cast<const T *>(nullptr), act, slope);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// Normalises the row `src` (already rounded to T) into `dst`: two passes for mean and
// variance, as the CPU kernels do, then the affine map. One warp per row. Rows with zero
// padded channels (UPSCALE_PAD_CHANNELS) normalise over their `count` real channels: `mask`
// is 1 on those and 0 on the padded ones, which hold 0 and are centred at 0, so they add
// nothing to either sum; their gamma and beta are 0, so they come out 0. Unpadded rows pass
// `masked` 0, and `mask` is not read.
template <typename T>
__device__ void norm_row(const T *src, const T *__restrict__ gamma, const T *__restrict__ beta,
                         const T *__restrict__ mask, T *__restrict__ dst, unsigned int cols,
                         unsigned int count, int masked, float eps) {
    const unsigned int lane = threadIdx.x % 32;
    float s = 0.0f;
    for (unsigned int c = lane; c < cols; c += 32) {
        s += to_f32(src[c]);
    }
    const float mean = warp_sum(s) / count;
    float q = 0.0f;
    for (unsigned int c = lane; c < cols; c += 32) {
        const float d = to_f32(src[c]) - (masked ? mean * to_f32(mask[c]) : mean);
        q += d * d;
    }
    const float inv = rsqrtf(warp_sum(q) / count + eps);
    for (unsigned int c = lane; c < cols; c += 32) {
        dst[c] = from_f32<T>((to_f32(src[c]) - mean) * inv * to_f32(gamma[c]) + to_f32(beta[c]));
    }
}

// out[b, t] = ln(x[b, order[t]]): x is batch x tokens_in x cols, out batch x tokens x cols.
template <typename T>
__device__ void gather_norm(const T *__restrict__ x, const unsigned int *__restrict__ order,
                            const T *__restrict__ gamma, const T *__restrict__ beta,
                            const T *__restrict__ mask, T *__restrict__ out, unsigned int rows,
                            unsigned int tokens, unsigned int tokens_in, unsigned int cols,
                            unsigned int count, int masked, float eps) {
    const unsigned int warps = blockDim.x / 32;
    for (unsigned int r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += gridDim.x * warps) {
        const unsigned int b = r / tokens;
        const unsigned int src = b * tokens_in + order[r - b * tokens];
        norm_row(x + (size_t)src * cols, gamma, beta, mask, out + (size_t)r * cols, cols, count,
                 masked, eps);
    }
}

// sum[b, t] = x[b, t] + y[b, back[t]] and normed[b, t] = ln(sum[b, t]): x, sum and normed are
// batch x tokens x cols, y batch x tokens_y x cols. With z (batch x tokens x cols) and its
// scale s (batch x cols), HAT's channel attention, the sum is x + z * s[b] + y[b, back[t]],
// in f32 and rounded once: the product and the first sum cost no passes of their own. z and
// s are null without it. The norm reads the rounded sum, which is what the next layers see.
template <typename T>
__device__ void add_gather_norm(const T *__restrict__ x, const T *__restrict__ z,
                                const T *__restrict__ s, const T *__restrict__ y,
                                const unsigned int *__restrict__ back,
                                const T *__restrict__ gamma, const T *__restrict__ beta,
                                const T *__restrict__ mask, T *sum, T *__restrict__ normed,
                                unsigned int rows, unsigned int tokens, unsigned int tokens_y,
                                unsigned int cols, unsigned int count, int masked, float eps) {
    const unsigned int warps = blockDim.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    for (unsigned int r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += gridDim.x * warps) {
        const unsigned int b = r / tokens;
        const T *xr = x + (size_t)r * cols;
        const T *yr = y + ((size_t)b * tokens_y + back[r - b * tokens]) * cols;
        T *sr = sum + (size_t)r * cols;
        if (z != nullptr) {
            const T *zr = z + (size_t)r * cols;
            const T *sb = s + (size_t)b * cols;
            for (unsigned int c = lane; c < cols; c += 32) {
                const float v = to_f32(xr[c]) + to_f32(zr[c]) * to_f32(sb[c]);
                sr[c] = from_f32<T>(v + to_f32(yr[c]));
            }
        } else {
            for (unsigned int c = lane; c < cols; c += 32) {
                sr[c] = from_f32<T>(to_f32(xr[c]) + to_f32(yr[c]));
            }
        }
        // Each lane reads back only the columns it wrote: no synchronisation needed.
        norm_row(sr, gamma, beta, mask, normed + (size_t)r * cols, cols, count, masked, eps);
    }
}

// The patch matrix of a 3x3 convolution (stride 1, zero padding 1) for map rows
// [y0, y0 + rows) of x (maps, h, w, c), channels-last: out row (m * rows + r) * w + j holds
// the nine taps (dy, dx) in row-major order, c values each, zero where a tap falls outside the
// map. Moves groups of G values (G = 4 where c allows, else 1); n = maps*rows*w*9*c/G.
template <typename G>
__device__ void patches3x3_groups(const G *__restrict__ x, G *__restrict__ out, unsigned int n,
                                  unsigned int h, unsigned int w, unsigned int cg,
                                  unsigned int y0, unsigned int rows, G zero) {
    const unsigned int start = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int step = blockDim.x * gridDim.x;
    for (unsigned int i = start; i < n; i += step) {
        const unsigned int t = i / cg;
        const unsigned int ch = i - t * cg;
        const unsigned int p = t / 9;
        const unsigned int tap = t - p * 9;
        const unsigned int q = p / w;
        const unsigned int j = p - q * w;
        const unsigned int m = q / rows;
        const unsigned int r = q - m * rows;
        // Unsigned wrap-around makes the taps above row 0 and left of column 0 fail the test.
        const unsigned int yy = y0 + r + tap / 3 - 1;
        const unsigned int xx = j + tap % 3 - 1;
        out[i] = (yy < h && xx < w) ? x[((size_t)(m * h + yy) * w + xx) * cg + ch] : zero;
    }
}

template <typename T>
__device__ void patches3x3(const T *__restrict__ x, T *__restrict__ out, unsigned int n,
                           unsigned int h, unsigned int w, unsigned int c, unsigned int y0,
                           unsigned int rows) {
    if (c % 4 == 0 && quads_fit<T>(x, out, x, out)) {
        Quad<T> zero;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            zero.v[k] = from_f32<T>(0.0f);
        }
        patches3x3_groups<Quad<T>>(reinterpret_cast<const Quad<T> *>(x),
                                      reinterpret_cast<Quad<T> *>(out), n / 4, h, w, c / 4, y0,
                                      rows, zero);
        return;
    }
    patches3x3_groups<T>(x, out, n, h, w, c, y0, rows, from_f32<T>(0.0f));
}

// Most output channels conv3x3_narrow computes.
constexpr unsigned int NARROW_MAX = 4;

// out (maps, h, w, cout) = conv3x3(x (maps, h, w, cin)) + bias, stride 1, zero padding 1;
// wt: (9 * cin, cout), rows ordered (dy, dx, cin); cout <= NARROW_MAX; pixels = maps*h*w.
// One warp per pixel: the lanes split the input channels, so each tap is one coalesced read,
// and the four partial sums meet in a butterfly.
template <typename T>
__device__ void conv3x3_narrow(const T *__restrict__ x, const T *__restrict__ wt,
                               const T *__restrict__ bias, T *__restrict__ out,
                               unsigned int pixels, unsigned int h, unsigned int w,
                               unsigned int cin, unsigned int cout) {
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int warps = blockDim.x * gridDim.x / 32;
    // Every lane of a warp takes the same pixels, so the shuffles below see the whole warp.
    for (unsigned int p = (blockIdx.x * blockDim.x + threadIdx.x) / 32; p < pixels; p += warps) {
        const unsigned int q = p / w;
        const unsigned int j = p - q * w;
        const unsigned int m = q / h;
        const unsigned int y = q - m * h;
        float acc[NARROW_MAX] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (unsigned int tap = 0; tap < 9; ++tap) {
            // Unsigned wrap-around makes the taps above row 0 and left of column 0 fail.
            const unsigned int yy = y + tap / 3 - 1;
            const unsigned int xx = j + tap % 3 - 1;
            if (yy >= h || xx >= w) {
                continue;
            }
            const T *src = x + ((size_t)(m * h + yy) * w + xx) * cin;
            const T *wrow = wt + (size_t)tap * cin * cout;
            for (unsigned int c = lane; c < cin; c += 32) {
                const float v = to_f32(src[c]);
#pragma unroll
                for (unsigned int o = 0; o < NARROW_MAX; ++o) {
                    if (o < cout) {
                        acc[o] += v * to_f32(wrow[c * cout + o]);
                    }
                }
            }
        }
        float mine = 0.0f;
#pragma unroll
        for (unsigned int o = 0; o < NARROW_MAX; ++o) {
            for (int d = 16; d > 0; d /= 2) {
                acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], d);
            }
            mine = lane == o ? acc[o] : mine;
        }
        if (lane < cout) {
            out[(size_t)p * cout + lane] = from_f32<T>(mine + to_f32(bias[lane]));
        }
    }
}

}  // namespace rowwise

// The three norm kernels of type T.
#define NORMS(T, SUFFIX)                                                                       \
    extern "C" __global__ void gather_norm_##SUFFIX(                                           \
        const T *x, const unsigned int *order, const T *gamma, const T *beta, const T *mask,   \
        T *out, unsigned int rows, unsigned int tokens, unsigned int tokens_in,                \
        unsigned int cols, unsigned int count, int masked, float eps) {                        \
        rowwise::gather_norm(x, order, gamma, beta, mask, out, rows, tokens, tokens_in, cols,  \
                             count, masked, eps);                                              \
    }                                                                                          \
    extern "C" __global__ void add_gather_norm_##SUFFIX(                                       \
        const T *x, const T *y, const unsigned int *back, const T *gamma, const T *beta,       \
        const T *mask, T *sum, T *normed, unsigned int rows, unsigned int tokens,              \
        unsigned int tokens_y, unsigned int cols, unsigned int count, int masked, float eps) { \
        rowwise::add_gather_norm<T>(x, nullptr, nullptr, y, back, gamma, beta, mask, sum,      \
                                    normed, rows, tokens, tokens_y, cols, count, masked, eps); \
    }                                                                                          \
    extern "C" __global__ void add_scaled_gather_norm_##SUFFIX(                                \
        const T *x, const T *z, const T *s, const T *y, const unsigned int *back,              \
        const T *gamma, const T *beta, const T *mask, T *sum, T *normed, unsigned int rows,    \
        unsigned int tokens, unsigned int tokens_y, unsigned int cols, unsigned int count,     \
        int masked, float eps) {                                                               \
        rowwise::add_gather_norm(x, z, s, y, back, gamma, beta, mask, sum, normed, rows,       \
                                 tokens, tokens_y, cols, count, masked, eps);                  \
    }

#define ROWWISE(T, SUFFIX)                                                                     \
    extern "C" __global__ void bias_act_##SUFFIX(const T *y, const T *bias, const T *res,      \
                                                 T *out, unsigned int n, unsigned int cols,    \
                                                 int act, float slope, int has_res) {          \
        rowwise::bias_act(y, bias, res, out, n, cols, act, slope, has_res);                    \
    }                                                                                          \
    extern "C" __global__ void cat_bias_act_##SUFFIX(const T *prev, const T *y, const T *bias, \
                                                     T *out, unsigned int n, unsigned int pc,  \
                                                     unsigned int cols, int act,               \
                                                     float slope) {                            \
        rowwise::cat_bias_act(prev, y, bias, out, n, pc, cols, act, slope);                    \
    }                                                                                          \
    NORMS(T, SUFFIX)                                                                           \
    extern "C" __global__ void patches3x3_##SUFFIX(const T *x, T *out, unsigned int n,         \
                                                   unsigned int h, unsigned int w,             \
                                                   unsigned int c, unsigned int y0,            \
                                                   unsigned int rows) {                        \
        rowwise::patches3x3(x, out, n, h, w, c, y0, rows);                                     \
    }                                                                                          \
    extern "C" __global__ void conv3x3_narrow_##SUFFIX(                                        \
        const T *x, const T *wt, const T *bias, T *out, unsigned int pixels, unsigned int h,   \
        unsigned int w, unsigned int cin, unsigned int cout) {                                 \
        rowwise::conv3x3_narrow(x, wt, bias, out, pixels, h, w, cin, cout);                    \
    }

ROWWISE(float, f32)
ROWWISE(__nv_bfloat16, bf16)
ROWWISE(__half, f16)
