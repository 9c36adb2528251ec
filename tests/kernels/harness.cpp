// Checks the CUDA kernels of kernels/ on the CPU (through emulator.h) against plain
// double-precision references written from the model's definition, not from the kernels:
// the shift mask from the reference's slices of the rolled map, the softmax in two passes.
//
//   c++ -std=c++20 -O2 -ffp-contract=off -Itests/kernels/include \
//       -include tests/kernels/emulator.h tests/kernels/harness.cpp -o kernel-check
//
// Prints one line per case and exits non-zero when any case is outside its bound. `--quick`
// leaves out the widest heads' second shapes; `--shard I/N` runs every Nth case from the Ith.
#include "../../kernels/blend.cu"
#include "../../kernels/rowwise.cu"
#include "../../kernels/window_attention.cu"

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>

namespace {

struct Shape {
    int batch, height, width, ws, heads, d;
    bool shifted;
    int n() const { return ws * ws; }
    int windows() const { return batch * (height / ws) * (width / ws); }
    int c() const { return heads * d; }
};

// The region (0..2) of coordinate p of a rolled map along one axis: the reference builds its
// mask from the slices [0, size-ws), [size-ws, size-shift), [size-shift, size).
int slice_of(int p, int size, int ws, int shift) {
    if (p < size - ws) {
        return 0;
    }
    return p < size - shift ? 1 : 2;
}

// softmax(q kᵀ + bias + mask) v for every window and head, in double.
std::vector<double> reference(const Shape& s, const std::vector<float>& qkv,
                              const std::vector<float>& bias, bool mask) {
    const int n = s.n(), c = s.c(), d = s.d, ws = s.ws, shift = ws / 2;
    const int nwx = s.width / ws, per_image = (s.height / ws) * nwx;
    std::vector<double> out(static_cast<size_t>(s.windows()) * n * c);
    std::vector<int> label(n);
    std::vector<double> p(n);
    for (int w = 0; w < s.windows(); ++w) {
        const int wy = (w % per_image) / nwx, wx = (w % per_image) % nwx;
        for (int tok = 0; tok < n; ++tok) {
            const int y = wy * ws + tok / ws, x = wx * ws + tok % ws;
            label[tok] = 3 * slice_of(y, s.height, ws, shift) + slice_of(x, s.width, ws, shift);
        }
        const float* win = &qkv[static_cast<size_t>(w) * n * 3 * c];
        for (int h = 0; h < s.heads; ++h) {
            for (int i = 0; i < n; ++i) {
                double mx = -INFINITY;
                for (int j = 0; j < n; ++j) {
                    double dot = 0;
                    for (int k = 0; k < d; ++k) {
                        dot += static_cast<double>(win[i * 3 * c + h * d + k]) *
                               win[j * 3 * c + c + h * d + k];
                    }
                    dot += bias[(static_cast<size_t>(h) * n + i) * n + j];
                    if (mask && s.shifted && label[i] != label[j]) {
                        dot += MASK_VALUE;
                    }
                    p[j] = dot;
                    mx = std::max(mx, dot);
                }
                double sum = 0;
                for (int j = 0; j < n; ++j) {
                    p[j] = std::exp(p[j] - mx);
                    sum += p[j];
                }
                for (int k = 0; k < d; ++k) {
                    double acc = 0;
                    for (int j = 0; j < n; ++j) {
                        acc += p[j] * win[j * 3 * c + 2 * c + h * d + k];
                    }
                    out[(static_cast<size_t>(w) * n + i) * c + h * d + k] = acc / sum;
                }
            }
        }
    }
    return out;
}

template <typename T>
T convert(float x);
template <>
float convert<float>(float x) { return x; }
template <>
__nv_bfloat16 convert<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__half convert<__half>(float x) { return __float2half_rn(x); }

float widen(float x) { return x; }
float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
float widen(__half x) { return __half2float(x); }

struct Launch {
    unsigned grid_y, threads, shared_bytes;
};

// The launch shape the host uses (src/ops/attention/cuda.rs, `plan` and `mma_plan`).
Launch scalar_launch(int n, int dmax) {
    const int per_row = dmax / COLS_PER_THREAD;
    const int threads = std::min((n * per_row + 31) / 32 * 32, MAX_THREADS);
    const int rows = threads / per_row;
    const int shared = (2 * KEY_TILE * dmax + rows * (KEY_TILE + 1) + KEY_TILE) * 4;
    return {static_cast<unsigned>((n + rows - 1) / rows), static_cast<unsigned>(threads),
            static_cast<unsigned>(shared)};
}

Launch mma_launch(int n, int ws, int dp) {
    const int side = 2 * ws - 1;
    const int shared = 4 * mma_keys(dp) * (dp + 8) * 2 + side * side * 4 + n * 4;
    const int rows = 16 * mma_warps(dp);
    return {static_cast<unsigned>((n + rows - 1) / rows), 32u * mma_warps(dp),
            static_cast<unsigned>(shared)};
}

int failures = 0;

// `--shard I/N`: this process runs the cases whose index is I modulo N (N processes, one per
// core, share a sanitizer run); each top-level case asks as it starts.
int shard = 0, shards = 1, case_index = 0;
bool in_shard() { return case_index++ % shards == shard; }

// Runs one kernel variant on random inputs of `s` and compares with the reference on the
// same (rounded) inputs; `bound` is relative to the largest |v|.
template <typename T, typename F>
void attention_case(const char* name, F kernel, int dmax, bool mma, const Shape& s,
                    double bound, unsigned seed) {
    if (!in_shard()) {
        return;
    }
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int n = s.n(), c = s.c();
    const size_t qkv_len = static_cast<size_t>(s.windows()) * n * 3 * c;
    std::vector<T> qkv(qkv_len), bias(static_cast<size_t>(s.heads) * n * n);
    std::vector<float> qkv_f(qkv_len), bias_f(bias.size());
    double vmax = 0;
    for (size_t i = 0; i < qkv_len; ++i) {
        const int col = static_cast<int>(i % (3 * c));
        // q arrives scaled by d^-0.5; 2x keeps the softmax away from uniform.
        const float scale = col < c ? 2.0f / std::sqrt(static_cast<float>(s.d)) : 1.0f;
        qkv[i] = convert<T>(normal(rng) * scale);
        qkv_f[i] = widen(qkv[i]);
        if (col >= 2 * c) {
            vmax = std::max(vmax, std::fabs(static_cast<double>(qkv_f[i])));
        }
    }
    // The relative-position bias, as the model gathers it from a random table (the
    // tensor-core kernel reads one value per offset).
    const int side = 2 * s.ws - 1;
    std::vector<T> table(static_cast<size_t>(side) * side * s.heads);
    for (T& v : table) v = convert<T>(normal(rng));
    for (int h = 0; h < s.heads; ++h) {
        for (int i = 0; i < n; ++i) {
            for (int j = 0; j < n; ++j) {
                const int dy = i / s.ws - j / s.ws, dx = i % s.ws - j % s.ws;
                const int idx = (dy + s.ws - 1) * side + dx + s.ws - 1;
                const size_t at = (static_cast<size_t>(h) * n + i) * n + j;
                bias[at] = table[static_cast<size_t>(idx) * s.heads + h];
                bias_f[at] = widen(bias[at]);
            }
        }
    }
    std::vector<T> out(static_cast<size_t>(s.windows()) * n * c, convert<T>(NAN));
    const Launch l = mma ? mma_launch(n, s.ws, dmax) : scalar_launch(n, dmax);
    emu::launch(
        dim3{static_cast<unsigned>(s.windows() * s.heads), l.grid_y, 1}, dim3{l.threads, 1, 1},
        [&] {
            kernel(qkv.data(), bias.data(), out.data(), n, s.heads, s.d, s.ws, s.height, s.width,
                   s.shifted ? 1 : 0);
        },
        l.shared_bytes);
    const std::vector<double> want = reference(s, qkv_f, bias_f, true);
    double err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(widen(out[i]) - want[i]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
    }
    // The bound must be able to fail: the same inputs without the shift mask are far off.
    double unmasked = 0;
    if (s.shifted) {
        const std::vector<double> wrong = reference(s, qkv_f, bias_f, false);
        for (size_t i = 0; i < want.size(); ++i) {
            unmasked = std::max(unmasked, std::fabs(wrong[i] - want[i]));
        }
    }
    const double limit = bound * vmax;
    const bool ok = err <= limit && (!s.shifted || unmasked > 10 * limit);
    failures += ok ? 0 : 1;
    std::printf("%s %-32s windows %2d n %3d heads %d d %3d shifted %d: max error %.3g (bound %.3g, "
                "unmasked %.3g)\n",
                ok ? "ok  " : "FAIL", name, s.windows(), n, s.heads, s.d, s.shifted, err, limit,
                unmasked);
}

// ---- Overlapping cross-attention (HAT's OCAB) against the official model's definition.

struct OverlapShape {
    int batch, height, width, ws, ows, heads, d;
    int n() const { return ws * ws; }
    int nk() const { return ows * ows; }
    int windows() const { return batch * (height / ws) * (width / ws); }
    int c() const { return heads * d; }
};

// The official relative-position index of query i (row-major in its ws x ws window) and key j
// (row-major in its ows x ows window): each position in its own window's frame, the key's minus
// the query's, shifted by ws - ows + 1 per axis. It goes negative, and PyTorch's indexing
// wraps negative indices round the table.
int overlap_table_row(int i, int j, int ws, int ows) {
    const int side = ws + ows - 1;
    const int shift = ws - ows + 1;
    const int dy = j / ows - i / ws + shift;
    const int dx = j % ows - i % ws + shift;
    const int rows = side * side;
    return ((dy * side + dx) % rows + rows) % rows;
}

// How the reference treats keys that fall outside the map: zero vectors (the official unfold
// with zero padding), or left out of the softmax (a plausible mistake, to show the check can
// fail); and whether it adds the bias.
enum class Outside { Zero, Dropped };

// softmax(q kᵀ + bias) v per window and head in double, the keys and values unfolded from the
// map around each window with a zero margin of (ows - ws) / 2.
std::vector<double> overlap_reference(const OverlapShape& s, const std::vector<float>& qkv,
                                      const std::vector<float>& table, Outside outside,
                                      bool with_bias) {
    const int n = s.n(), nk = s.nk(), c = s.c(), d = s.d, ws = s.ws;
    const int m = (s.ows - ws) / 2, nwx = s.width / ws, nwy = s.height / ws;
    std::vector<double> out(static_cast<size_t>(s.batch) * s.height * s.width * c);
    std::vector<double> p(nk);
    std::vector<bool> inside(nk);
    auto at = [&](int b, int y, int x) {
        return (static_cast<size_t>(b) * s.height + y) * s.width + x;
    };
    for (int b = 0; b < s.batch; ++b) {
        for (int wy = 0; wy < nwy; ++wy) {
            for (int wx = 0; wx < nwx; ++wx) {
                for (int h = 0; h < s.heads; ++h) {
                    for (int i = 0; i < n; ++i) {
                        const size_t qp = at(b, wy * ws + i / ws, wx * ws + i % ws);
                        double mx = -INFINITY;
                        for (int j = 0; j < nk; ++j) {
                            const int y = wy * ws - m + j / s.ows, x = wx * ws - m + j % s.ows;
                            inside[j] = y >= 0 && y < s.height && x >= 0 && x < s.width;
                            double dot = 0;
                            if (inside[j]) {
                                const size_t kp = at(b, y, x);
                                for (int k = 0; k < d; ++k) {
                                    dot += static_cast<double>(qkv[qp * 3 * c + h * d + k]) *
                                           qkv[kp * 3 * c + c + h * d + k];
                                }
                            }
                            if (with_bias) {
                                dot += table[static_cast<size_t>(overlap_table_row(i, j, ws, s.ows)) *
                                                 s.heads + h];
                            }
                            if (!inside[j] && outside == Outside::Dropped) {
                                dot = -INFINITY;
                            }
                            p[j] = dot;
                            mx = std::max(mx, dot);
                        }
                        double sum = 0;
                        for (int j = 0; j < nk; ++j) {
                            p[j] = std::exp(p[j] - mx);
                            sum += p[j];
                        }
                        for (int k = 0; k < d; ++k) {
                            double acc = 0;
                            for (int j = 0; j < nk; ++j) {
                                if (!inside[j]) continue;  // a zero value row
                                const int y = wy * ws - m + j / s.ows, x = wx * ws - m + j % s.ows;
                                acc += p[j] * qkv[at(b, y, x) * 3 * c + 2 * c + h * d + k];
                            }
                            out[qp * c + h * d + k] = acc / sum;
                        }
                    }
                }
            }
        }
    }
    return out;
}

// The launch the host makes (src/ops/attention/cuda.rs, `overlap_plan`): the scalar
// window kernel's, without the key labels.
Launch overlap_scalar_launch(int n, int dmax) {
    const int per_row = dmax / COLS_PER_THREAD;
    const int threads = std::min((n * per_row + 31) / 32 * 32, MAX_THREADS);
    const int rows = threads / per_row;
    const int shared = (2 * KEY_TILE * dmax + rows * (KEY_TILE + 1)) * 4;
    return {static_cast<unsigned>((n + rows - 1) / rows), static_cast<unsigned>(threads),
            static_cast<unsigned>(shared)};
}

#ifdef TENSOR_CORE_KERNELS
// The tensor-core overlap kernel's launch (src/ops/attention/cuda.rs,
// `overlap_mma_plan`): rows and tiles of window_attention_mma, the bias table (ws + ows - 1)^2
// floats, one int per key.
Launch overlap_mma_launch(const OverlapShape& s, int dp) {
    const int side = s.ws + s.ows - 1;
    const int shared = 4 * mma_keys(dp) * (dp + 8) * 2 + side * side * 4 + s.nk() * 4;
    const int rows = 16 * mma_warps(dp);
    return {static_cast<unsigned>((s.n() + rows - 1) / rows), 32u * mma_warps(dp),
            static_cast<unsigned>(shared)};
}
#endif

// One overlap-attention variant on random inputs of `s` against the reference on the same
// (rounded) inputs; `bound` is relative to the largest |v|.
template <typename T, typename F>
void overlap_case(const char* name, F kernel, Launch l, const OverlapShape& s, double bound,
                  unsigned seed) {
    if (!in_shard()) {
        return;
    }
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int n = s.n(), nk = s.nk(), c = s.c();
    const size_t pixels = static_cast<size_t>(s.batch) * s.height * s.width;
    std::vector<T> qkv(pixels * 3 * c);
    std::vector<float> qkv_f(qkv.size());
    double vmax = 0;
    for (size_t i = 0; i < qkv.size(); ++i) {
        const int col = static_cast<int>(i % (3 * c));
        // q arrives scaled by d^-0.5; 2x keeps the softmax away from uniform.
        const float scale = col < c ? 2.0f / std::sqrt(static_cast<float>(s.d)) : 1.0f;
        qkv[i] = convert<T>(normal(rng) * scale);
        qkv_f[i] = widen(qkv[i]);
        if (col >= 2 * c) {
            vmax = std::max(vmax, std::fabs(static_cast<double>(qkv_f[i])));
        }
    }
    // A random table, gathered into (heads, ws², ows²) as the model does at load.
    const int side = s.ws + s.ows - 1;
    std::vector<T> table(static_cast<size_t>(side) * side * s.heads);
    std::vector<float> table_f(table.size());
    for (size_t i = 0; i < table.size(); ++i) {
        table[i] = convert<T>(normal(rng));
        table_f[i] = widen(table[i]);
    }
    std::vector<T> bias(static_cast<size_t>(s.heads) * n * nk);
    for (int h = 0; h < s.heads; ++h) {
        for (int i = 0; i < n; ++i) {
            for (int j = 0; j < nk; ++j) {
                bias[(static_cast<size_t>(h) * n + i) * nk + j] =
                    table[static_cast<size_t>(overlap_table_row(i, j, s.ws, s.ows)) * s.heads + h];
            }
        }
    }
    std::vector<T> out(pixels * c, convert<T>(NAN));
    emu::launch(
        dim3{static_cast<unsigned>(s.windows() * s.heads), l.grid_y, 1}, dim3{l.threads, 1, 1},
        [&] {
            kernel(qkv.data(), bias.data(), out.data(), s.heads, s.d, s.ws, s.ows, s.height,
                   s.width);
        },
        l.shared_bytes);
    const std::vector<double> want = overlap_reference(s, qkv_f, table_f, Outside::Zero, true);
    double err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(widen(out[i]) - want[i]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
    }
    // The bound must be able to fail: a kernel that dropped the keys outside the map instead
    // of zeroing them, or left the bias out, would be off by these distances, and each is more
    // than twice the bound (in bf16 the neighbourhoods of 576 keys, only some outside, give a
    // margin of about 3).
    auto distance = [&](const std::vector<double>& other) {
        double worst = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            worst = std::max(worst, std::fabs(other[i] - want[i]));
        }
        return worst;
    };
    const double dropped =
        distance(overlap_reference(s, qkv_f, table_f, Outside::Dropped, true));
    const double no_bias = distance(overlap_reference(s, qkv_f, table_f, Outside::Zero, false));
    const double limit = bound * vmax;
    const bool ok = err <= limit && dropped > 2 * limit && no_bias > 2 * limit;
    failures += ok ? 0 : 1;
    std::printf("%s %-32s %d x %2dx%-2d ws %2d ows %2d heads %d d %3d: max error %.3g (bound %.3g, "
                "outside dropped %.3g, no bias %.3g)\n",
                ok ? "ok  " : "FAIL", name, s.batch, s.height, s.width, s.ws, s.ows, s.heads, s.d,
                err, limit, dropped, no_bias);
}

// The blend kernel against the host accumulator's arithmetic (products and sums each rounded
// once; compiled without FMA contraction).
void blend_case(unsigned grid_y) {
    if (!in_shard()) {
        return;
    }
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    const unsigned channels = 3, th = 9, tw = 70, out_h = 20, out_w = 90, oy = 5, ox = 11;
    std::vector<float> canvas((channels + 1) * out_h * out_w), tile(channels * th * tw),
        weights(th + tw);
    for (float& v : canvas) v = uni(rng);
    for (float& v : tile) v = uni(rng);
    for (float& v : weights) v = uni(rng);
    weights[2] = 0.0f;        // a zero row weight: those pixels are skipped
    tile[3 * tw + 4] = NAN;   // a non-finite value where the weight is not zero shows up
    weights[th + 4] = 0.0f;   // ...unless its column weight is zero too
    std::vector<float> want = canvas;
    const size_t plane = static_cast<size_t>(out_h) * out_w;
    for (unsigned i = 0; i < th; ++i) {
        for (unsigned j = 0; j < tw; ++j) {
            const float w = weights[i] * weights[th + j];
            if (w == 0.0f) continue;
            const size_t dst = static_cast<size_t>(oy + i) * out_w + ox + j;
            for (unsigned ch = 0; ch < channels; ++ch) {
                want[ch * plane + dst] += w * tile[ch * th * tw + i * tw + j];
            }
            want[channels * plane + dst] += w;
        }
    }
    emu::launch(dim3{(tw + 31) / 32, grid_y, 1}, dim3{32, 1, 1}, [&] {
        blend_add_f32(canvas.data(), tile.data(), weights.data(), channels, th, tw, out_h, out_w,
                      oy, ox);
    });
    size_t diff = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        diff += std::memcmp(&want[i], &canvas[i], sizeof(float)) != 0;
    }
    failures += diff == 0 ? 0 : 1;
    std::printf("%s blend_add_f32 grid.y %u: %zu values differ from the host accumulator\n",
                diff == 0 ? "ok  " : "FAIL", grid_y, diff);
}

// ---- Row-wise kernels (kernels/rowwise.cu) against double references of their definitions.

// Reports a case: `got` against `want`, each within u |want| + abs_bound.
template <typename T>
void report(const std::string& name, const std::vector<T>& got, const std::vector<double>& want,
            double u, double abs_bound) {
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double e = std::fabs(widen(got[i]) - want[i]) - u * std::fabs(want[i]);
        worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
    const bool ok = worst <= abs_bound;
    failures += ok ? 0 : 1;
    std::printf("%s %-40s excess over u|want| %.3g (bound %.3g)\n", ok ? "ok  " : "FAIL",
                name.c_str(), worst, abs_bound);
}

template <typename T>
std::vector<T> random_values(size_t n, unsigned seed, float scale = 1.0f, float offset = 0.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<T> v(n);
    for (T& x : v) x = convert<T>(normal(rng) * scale + offset);
    return v;
}

double activate_ref(double v, int act, double slope) {
    if (act == 1) return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
    if (act == 2) return v >= 0 ? v : v * slope;
    return v;
}

// The launch the host makes (src/ops/rowwise.rs): 256 threads, one element (one warp per
// row for the norms) per thread; `one_block` instead runs the grid-stride loops over one block.
dim3 rowwise_grid(size_t units, unsigned per_block, bool one_block) {
    return dim3{one_block ? 1u : static_cast<unsigned>((units + per_block - 1) / per_block), 1, 1};
}

template <typename T>
void bias_act_shape(const char* suffix_in, void (*kernel)(const T*, const T*, const T*, T*,
                                                          unsigned, unsigned, int, float, int),
                    void (*cat)(const T*, const T*, const T*, T*, unsigned, unsigned, unsigned,
                                int, float),
                    double u, unsigned cols, unsigned pc, unsigned offset);

template <typename T>
void bias_act_cases(const char* suffix, void (*kernel)(const T*, const T*, const T*, T*, unsigned,
                                                        unsigned, int, float, int),
                    void (*cat)(const T*, const T*, const T*, T*, unsigned, unsigned, unsigned,
                                int, float),
                    double u) {
    if (!in_shard()) {
        return;
    }
    // Widths of four (the quad path), odd widths, and quad widths at a start that is not a
    // quad (the element path again).
    for (const auto& [cols, pc, offset] : {std::tuple{37u, 45u, 0u}, std::tuple{36u, 44u, 0u},
                                           std::tuple{36u, 44u, 1u}}) {
        bias_act_shape<T>(suffix, kernel, cat, u, cols, pc, offset);
    }
}

template <typename T>
void bias_act_shape(const char* suffix_in, void (*kernel)(const T*, const T*, const T*, T*,
                                                          unsigned, unsigned, int, float, int),
                    void (*cat)(const T*, const T*, const T*, T*, unsigned, unsigned, unsigned,
                                int, float),
                    double u, unsigned cols, unsigned pc, unsigned offset) {
    const std::string suffix = std::string(suffix_in) + " cols " + std::to_string(cols) +
                               (offset ? " offset" : "");
    const unsigned rows = 19;
    // `offset` extra values in front: every pointer then starts `offset` elements in.
    const auto y_all = random_values<T>(rows * cols + offset, 1),
               bias_all = random_values<T>(cols + offset, 2),
               res_all = random_values<T>(rows * cols + offset, 3),
               prev_all = random_values<T>(rows * pc + offset, 4);
    const std::vector<T> y(y_all.begin() + offset, y_all.end()),
        bias(bias_all.begin() + offset, bias_all.end()),
        res(res_all.begin() + offset, res_all.end()),
        prev(prev_all.begin() + offset, prev_all.end());
    for (int act = 0; act < 3; ++act) {
        for (int has_res = 0; has_res < 2; ++has_res) {
            const float slope = 0.2f;
            std::vector<T> out_all(rows * cols + offset, convert<T>(NAN));
            T* out = out_all.data() + offset;
            std::vector<double> want(rows * cols);
            for (unsigned i = 0; i < want.size(); ++i) {
                want[i] = activate_ref(double(widen(y[i])) + widen(bias[i % cols]), act, slope) +
                          (has_res ? widen(res[i]) : 0.0);
            }
            emu::launch(rowwise_grid(rows * cols, 256, has_res), dim3{256, 1, 1}, [&] {
                kernel(y_all.data() + offset, bias_all.data() + offset, res_all.data() + offset,
                       out, rows * cols, cols, act, slope, has_res);
            });
            report(std::string("bias_act_") + suffix + " act " + std::to_string(act) +
                       " residual " + std::to_string(has_res),
                   std::vector<T>(out, out + rows * cols), want, u, 1e-6);
        }
    }
    std::vector<T> out_all(rows * (pc + cols) + offset, convert<T>(NAN));
    T* out = out_all.data() + offset;
    std::vector<double> want(rows * (pc + cols));
    for (unsigned r = 0; r < rows; ++r) {
        for (unsigned c = 0; c < pc + cols; ++c) {
            want[r * (pc + cols) + c] =
                c < pc ? widen(prev[r * pc + c])
                       : activate_ref(double(widen(y[r * cols + c - pc])) + widen(bias[c - pc]), 2,
                                      0.2f);
        }
    }
    for (bool one_block : {false, true}) {
        emu::launch(rowwise_grid(want.size(), 256, one_block), dim3{256, 1, 1}, [&] {
            cat(prev_all.data() + offset, y_all.data() + offset, bias_all.data() + offset, out,
                rows * (pc + cols), pc, cols, 2, 0.2f);
        });
        report(std::string("cat_bias_act_") + suffix + (one_block ? " one block" : ""),
               std::vector<T>(out, out + want.size()), want, u, 1e-6);
    }
}

// The patch matrix of a 3x3 convolution for rows [y0, y0 + rows) of `maps` maps, against the
// definition; `offset` starts both buffers that many elements in (the element path).
template <typename T>
void patches_case(const char* suffix, void (*kernel)(const T*, T*, unsigned, unsigned, unsigned,
                                                     unsigned, unsigned, unsigned),
                  unsigned maps, unsigned h, unsigned w, unsigned c, unsigned y0, unsigned rows,
                  unsigned offset, bool one_block) {
    const auto x_all = random_values<T>(maps * h * w * c + offset, 5);
    const T* x = x_all.data() + offset;
    const unsigned n = maps * rows * w * 9 * c;
    std::vector<T> out_all(n + offset, convert<T>(NAN));
    T* out = out_all.data() + offset;
    std::vector<double> want(n);
    for (unsigned m = 0; m < maps; ++m)
        for (unsigned r = 0; r < rows; ++r)
            for (unsigned j = 0; j < w; ++j)
                for (unsigned tap = 0; tap < 9; ++tap)
                    for (unsigned ch = 0; ch < c; ++ch) {
                        const int yy = int(y0 + r) + int(tap / 3) - 1;
                        const int xx = int(j) + int(tap % 3) - 1;
                        const bool inside = yy >= 0 && yy < int(h) && xx >= 0 && xx < int(w);
                        want[(((m * rows + r) * w + j) * 9 + tap) * c + ch] =
                            inside ? widen(x[((m * h + yy) * w + xx) * c + ch]) : 0.0;
                    }
    emu::launch(rowwise_grid(c % 4 == 0 && offset == 0 ? n / 4 : n, 256, one_block),
                dim3{256, 1, 1}, [&] { kernel(x, out, n, h, w, c, y0, rows); });
    report(std::string("patches3x3_") + suffix + " c " + std::to_string(c) + " rows " +
               std::to_string(y0) + "+" + std::to_string(rows) + (offset ? " offset" : "") +
               (one_block ? " one block" : ""),
           std::vector<T>(out, out + n), want, 0.0, 0.0);
}

template <typename T>
void patches_cases(const char* suffix, void (*kernel)(const T*, T*, unsigned, unsigned, unsigned,
                                                      unsigned, unsigned, unsigned)) {
    if (!in_shard()) {
        return;
    }
    // The whole map, a chunk of rows in the middle, the last rows (bottom padding), an odd
    // channel count, and quad widths at a start that is not a quad.
    patches_case<T>(suffix, kernel, 2, 5, 7, 8, 0, 5, 0, false);
    patches_case<T>(suffix, kernel, 2, 6, 5, 8, 2, 2, 0, true);
    patches_case<T>(suffix, kernel, 1, 6, 4, 4, 4, 2, 0, false);
    patches_case<T>(suffix, kernel, 1, 4, 6, 3, 1, 3, 0, false);
    patches_case<T>(suffix, kernel, 1, 4, 5, 8, 0, 4, 1, false);
}

// A 3x3 convolution with at most four outputs, against the definition in double.
template <typename T>
void narrow_case(const char* suffix, void (*kernel)(const T*, const T*, const T*, T*, unsigned,
                                                    unsigned, unsigned, unsigned, unsigned),
                 double u, unsigned maps, unsigned h, unsigned w, unsigned cin, unsigned cout,
                 bool one_block) {
    const auto x = random_values<T>(maps * h * w * cin, 6);
    const auto wt = random_values<T>(9 * cin * cout, 7, 0.2f);
    const auto bias = random_values<T>(cout, 8);
    const unsigned pixels = maps * h * w;
    std::vector<T> out(pixels * cout, convert<T>(NAN));
    std::vector<double> want(pixels * cout);
    double scale = 0;  // the largest sum of |terms|: the bound for f32 summation order
    for (unsigned p = 0; p < pixels; ++p) {
        const unsigned j = p % w, y = (p / w) % h, m = p / (w * h);
        for (unsigned o = 0; o < cout; ++o) {
            double sum = widen(bias[o]), mag = std::fabs(sum);
            for (unsigned tap = 0; tap < 9; ++tap) {
                const int yy = int(y + tap / 3) - 1, xx = int(j + tap % 3) - 1;
                if (yy < 0 || yy >= int(h) || xx < 0 || xx >= int(w)) continue;
                for (unsigned c = 0; c < cin; ++c) {
                    const double t = double(widen(x[((m * h + yy) * w + xx) * cin + c])) *
                                     widen(wt[(tap * cin + c) * cout + o]);
                    sum += t;
                    mag += std::fabs(t);
                }
            }
            want[p * cout + o] = sum;
            scale = std::max(scale, mag);
        }
    }
    emu::launch(rowwise_grid(pixels, 256 / 32, one_block), dim3{256, 1, 1}, [&] {
        kernel(x.data(), wt.data(), bias.data(), out.data(), pixels, h, w, cin, cout);
    });
    report(std::string("conv3x3_narrow_") + suffix + " cin " + std::to_string(cin) + " cout " +
               std::to_string(cout) + (one_block ? " one block" : ""),
           out, want, u, 1e-6 * scale);
}

template <typename T>
void narrow_cases(const char* suffix, void (*kernel)(const T*, const T*, const T*, T*, unsigned,
                                                     unsigned, unsigned, unsigned, unsigned),
                  double u) {
    if (!in_shard()) {
        return;
    }
    // The released output layer (64 -> 3), channels fewer than a warp, four outputs, one.
    narrow_case<T>(suffix, kernel, u, 2, 5, 6, 64, 3, false);
    narrow_case<T>(suffix, kernel, u, 1, 4, 7, 20, 4, true);
    narrow_case<T>(suffix, kernel, u, 1, 3, 3, 35, 1, false);
}

// ln(row) in double over the channels `real` marks (all of them when it is empty), with the
// affine parameters; 0 on the other channels.
void norm_ref(const double* row, const std::vector<double>& gamma, const std::vector<double>& beta,
              double eps, double* out, const std::vector<bool>& real = {}) {
    const size_t c = gamma.size();
    const auto is_real = [&](size_t i) { return real.empty() || real[i]; };
    double mean = 0, var = 0;
    size_t n = 0;
    for (size_t i = 0; i < c; ++i) {
        if (is_real(i)) mean += row[i], ++n;
    }
    mean /= n;
    for (size_t i = 0; i < c; ++i) {
        if (is_real(i)) var += (row[i] - mean) * (row[i] - mean);
    }
    var /= n;
    for (size_t i = 0; i < c; ++i) {
        out[i] = is_real(i) ? (row[i] - mean) / std::sqrt(var + eps) * gamma[i] + beta[i] : 0.0;
    }
}

// Counts a failure for every value of `out` on a padded channel that is not exactly 0.
template <typename T>
void check_padding_zero(const std::string& name, const std::vector<T>& out,
                        const std::vector<bool>& real) {
    if (real.empty()) return;
    size_t bad = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        if (!real[i % real.size()] && widen(out[i]) != 0.0) ++bad;
    }
    failures += bad ? 1 : 0;
    std::printf("%s %-40s %zu padded values not 0\n", bad ? "FAIL" : "ok  ", name.c_str(), bad);
}

// The three norm kernels of one type.
template <typename T>
struct NormKernels {
    void (*gather)(const T*, const unsigned*, const T*, const T*, const T*, T*, unsigned,
                   unsigned, unsigned, unsigned, unsigned, int, float);
    void (*add_gather)(const T*, const T*, const unsigned*, const T*, const T*, const T*, T*, T*,
                       unsigned, unsigned, unsigned, unsigned, unsigned, int, float);
    void (*add_scaled)(const T*, const T*, const T*, const T*, const unsigned*, const T*,
                       const T*, const T*, T*, T*, unsigned, unsigned, unsigned, unsigned,
                       unsigned, int, float);
};

// The norm kernels against the references; `wide` rows (330 channels) span more than ten
// warp strides.
template <typename T>
void norm_cases(const char* suffix_in, NormKernels<T> kernels, double u, bool padded,
                bool wide = false) {
    if (!in_shard()) {
        return;
    }
    const auto gather = kernels.gather;
    const auto add_gather = kernels.add_gather;
    const auto add_scaled = kernels.add_scaled;
    // Two maps; 70 channels (two warp strides and a remainder); an order that permutes and
    // drops tokens; inputs offset from zero, as residual streams are. Padded rows (as
    // UPSCALE_PAD_CHANNELS lays out a dense block's input): 80 channels holding parts of 45,
    // 13 and 13 real ones, each followed by zeros up to a multiple of 16, so that the mean
    // and the variance must skip zeros in the middle of the row.
    const std::string suffix =
        std::string(suffix_in) + (padded ? " padded" : "") + (wide ? " wide" : "");
    std::vector<bool> real;
    if (padded) {
        for (const auto& [n, width] : {std::pair{45u, 48u}, std::pair{13u, 16u}, std::pair{13u, 16u}}) {
            for (unsigned i = 0; i < width; ++i) real.push_back(i < n);
        }
    }
    const unsigned batch = 2, tokens_in = 13, tokens = 11;
    const unsigned cols = padded ? real.size() : wide ? 330 : 70;
    unsigned count = 0;
    for (unsigned i = 0; i < cols; ++i) count += real.empty() || real[i];
    const int masked = padded ? 1 : 0;
    // Zero on the padded channels, as the model's zero weights leave them.
    const auto zero_padding = [&](std::vector<T>& v) {
        for (size_t i = 0; i < v.size() && padded; ++i) {
            if (!real[i % cols]) v[i] = convert<T>(0.0f);
        }
    };
    std::vector<T> mask(cols);
    for (unsigned i = 0; i < cols; ++i) mask[i] = convert<T>(real.empty() || real[i] ? 1.0f : 0.0f);
    const float eps = 1e-5f;
    auto x = random_values<T>(batch * tokens_in * cols, 5, 3.0f, 1.5f);
    auto g = random_values<T>(cols, 6), b = random_values<T>(cols, 7);
    zero_padding(x), zero_padding(g), zero_padding(b);
    // Unpadded, the host passes gamma where the mask goes, and the kernel must not read it.
    const T* mask_arg = padded ? mask.data() : g.data();
    std::vector<double> gamma(cols), beta(cols);
    for (unsigned i = 0; i < cols; ++i) gamma[i] = widen(g[i]), beta[i] = widen(b[i]);
    std::vector<unsigned> order(tokens);
    for (unsigned t = 0; t < tokens; ++t) order[t] = (t * 5 + 3) % tokens_in;
    const unsigned rows = batch * tokens;
    std::vector<double> want(rows * cols), row(cols);
    for (unsigned r = 0; r < rows; ++r) {
        const unsigned src = (r / tokens) * tokens_in + order[r % tokens];
        for (unsigned i = 0; i < cols; ++i) row[i] = widen(x[src * cols + i]);
        norm_ref(row.data(), gamma, beta, eps, &want[r * cols], real);
    }
    for (bool one_block : {false, true}) {
        std::vector<T> out(rows * cols, convert<T>(NAN));
        emu::launch(rowwise_grid(rows, 8, one_block), dim3{256, 1, 1}, [&] {
            gather(x.data(), order.data(), g.data(), b.data(), mask_arg, out.data(), rows, tokens,
                   tokens_in, cols, count, masked, eps);
        });
        const std::string at = suffix + (one_block ? " one block" : "");
        report("gather_norm_" + at, out, want, u, 1e-5);
        check_padding_zero("gather_norm_" + at, out, real);
    }

    // add_gather_norm: x (batch, tokens, cols) + y (batch, tokens_in, cols) gathered by back.
    auto xs = random_values<T>(batch * tokens * cols, 8, 3.0f, 1.5f);
    zero_padding(xs);
    std::vector<double> want_sum(rows * cols), want_norm(rows * cols);
    for (unsigned r = 0; r < rows; ++r) {
        const unsigned src = (r / tokens) * tokens_in + order[r % tokens];
        for (unsigned i = 0; i < cols; ++i) {
            // The residual stream is stored in T: the norm reads the stored sum.
            const float s = widen(xs[r * cols + i]) + widen(x[src * cols + i]);
            want_sum[r * cols + i] = s;
            row[i] = widen(convert<T>(s));
        }
        norm_ref(row.data(), gamma, beta, eps, &want_norm[r * cols], real);
    }
    std::vector<T> sum(rows * cols, convert<T>(NAN)), normed(rows * cols, convert<T>(NAN));
    emu::launch(rowwise_grid(rows, 8, false), dim3{256, 1, 1}, [&] {
        add_gather(xs.data(), x.data(), order.data(), g.data(), b.data(), mask_arg, sum.data(),
                   normed.data(), rows, tokens, tokens_in, cols, count, masked, eps);
    });
    report("add_gather_norm_" + suffix + " sum", sum, want_sum, u, 1e-6);
    report("add_gather_norm_" + suffix + " normed", normed, want_norm, u, 1e-5);
    check_padding_zero("add_gather_norm_" + suffix + " normed", normed, real);

    // add_scaled_gather_norm: the same step with HAT's channel-attention term z * s[b] added,
    // z (batch, tokens, cols) and s (batch, cols), against the exact sum in double. The kernel
    // rounds the product and each sum in f32, then the sum once to T: u |want| plus f32 noise
    // on the terms' magnitudes. s of about 1, so that a scale read from the wrong image or
    // channel, or a missing term, shows.
    auto z = random_values<T>(batch * tokens * cols, 9, 2.0f);
    auto sc = random_values<T>(batch * cols, 10);
    zero_padding(z);
    double magnitude = 0, without = 0;
    for (unsigned r = 0; r < rows; ++r) {
        const unsigned b = r / tokens, src = b * tokens_in + order[r % tokens];
        for (unsigned i = 0; i < cols; ++i) {
            const double xv = widen(xs[r * cols + i]), yv = widen(x[src * cols + i]);
            const double term = double(widen(z[r * cols + i])) * widen(sc[b * cols + i]);
            const double v = xv + term + yv;
            want_sum[r * cols + i] = v;
            row[i] = widen(convert<T>(static_cast<float>(v)));
            magnitude = std::max(magnitude, std::fabs(xv) + std::fabs(term) + std::fabs(yv));
            without = std::max(without, std::fabs(term));
        }
        norm_ref(row.data(), gamma, beta, eps, &want_norm[r * cols], real);
    }
    std::fill(sum.begin(), sum.end(), convert<T>(NAN));
    std::fill(normed.begin(), normed.end(), convert<T>(NAN));
    emu::launch(rowwise_grid(rows, 8, padded), dim3{256, 1, 1}, [&] {
        add_scaled(xs.data(), z.data(), sc.data(), x.data(), order.data(), g.data(), b.data(),
                   mask_arg, sum.data(), normed.data(), rows, tokens, tokens_in, cols, count,
                   masked, eps);
    });
    const double noise = 1e-6 * magnitude;
    // The bound must be able to fail: the term alone is far larger than it.
    if (without < 100 * (noise + u * magnitude)) {
        ++failures;
        std::printf("FAIL add_scaled_gather_norm_%s: term %.3g too small for its bound\n",
                    suffix.c_str(), without);
    }
    report("add_scaled_gather_norm_" + suffix + " sum", sum, want_sum, u, noise);
    report("add_scaled_gather_norm_" + suffix + " normed", normed, want_norm, u, 1e-5);
    check_padding_zero("add_scaled_gather_norm_" + suffix + " normed", normed, real);
}

}  // namespace

int main(int argc, char** argv) {
    bool quick = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--quick") {
            quick = true;
        } else if (arg == "--shard" && i + 1 < argc &&
                   std::sscanf(argv[i + 1], "%d/%d", &shard, &shards) == 2 && shards > 0 &&
                   shard >= 0 && shard < shards) {
            ++i;
        } else {
            std::fprintf(stderr, "usage: %s [--quick] [--shard I/N]\n", argv[0]);
            return 2;
        }
    }
    // Shapes: the released window (16, n 256) with DRCT's head dims, plus windows whose token
    // count is not a multiple of the 16-row and 64-key tiles, and batches of two maps. Heads of
    // odd width (53, 77, 7) start at an odd element in every other head.
    const Shape official{1, 32, 32, 16, 2, 30, true};
    const Shape wide{1, 32, 16, 16, 1, 122, true};
    const Shape odd{2, 12, 18, 6, 2, 53, true};
    const Shape small{2, 8, 8, 4, 3, 7, false};
    const Shape small_even{2, 8, 8, 4, 2, 7, true};
    const Shape plain{1, 16, 8, 8, 2, 53, false};
    const Shape small_shifted{1, 8, 12, 4, 2, 46, true};
    const Shape wide_odd{1, 16, 32, 16, 2, 77, true};
    // An odd token count (window 5): the bias is read one value at a time.
    const Shape odd_window{1, 10, 15, 5, 2, 30, true};
    const double f32_bound = 1e-5, bf16_bound = 4.0 / 512, f16_bound = 4.0 / 4096;

#define RUN(T, NAME, DMAX, MMA, SHAPE, BOUND)                                                  \
    attention_case<T>(#NAME, [](const void* a, const void* b, void* o, int n, int h, int d,    \
                                int ws, int hh, int ww, int sh) {                              \
        NAME(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(o), n, h, d,  \
             ws, hh, ww, sh);                                                                  \
    }, DMAX, MMA, SHAPE, BOUND, __LINE__)

    RUN(float, window_attention_f32_d32, 32, false, official, f32_bound);
    RUN(float, window_attention_f32_d64, 64, false, odd, f32_bound);
    RUN(float, window_attention_f32_d32, 32, false, small, f32_bound);
    RUN(float, window_attention_f32_d64, 64, false, small_shifted, f32_bound);
    RUN(__nv_bfloat16, window_attention_bf16_d32, 32, false, official, bf16_bound);
    RUN(__half, window_attention_f16_d64, 64, false, odd, f16_bound);
    // The tensor-core kernel takes head dims padded to 16 (c even: the host's condition).
    RUN(__nv_bfloat16, window_attention_mma_bf16_d32, 32, true, official, bf16_bound);
    RUN(__half, window_attention_mma_f16_d32, 32, true, official, f16_bound);
    RUN(__nv_bfloat16, window_attention_mma_bf16_d64, 64, true, odd, bf16_bound);
    RUN(__half, window_attention_mma_f16_d48, 48, true, small_shifted, f16_bound);
    RUN(__nv_bfloat16, window_attention_mma_bf16_d16, 16, true, small_even, bf16_bound);
    RUN(__half, window_attention_mma_f16_d32, 32, true, odd_window, f16_bound);
    if (!quick) {
        RUN(float, window_attention_f32_d128, 128, false, wide, f32_bound);
        RUN(__nv_bfloat16, window_attention_mma_bf16_d128, 128, true, wide, bf16_bound);
        RUN(__half, window_attention_mma_f16_d80, 80, true, wide_odd, f16_bound);
        RUN(__nv_bfloat16, window_attention_mma_bf16_d64, 64, true, small_even, bf16_bound);
        RUN(__nv_bfloat16, window_attention_mma_bf16_d64, 64, true, plain, bf16_bound);
    }

    // Overlapping cross-attention: HAT (window 16 in 24, heads of 30) and HAT-S (heads of 24)
    // on maps of 1x2 and 2x1 windows, where the neighbourhoods reach outside the map; a small
    // window with a margin of 1 and odd head dims on a batch of two maps; 3x3 windows, the
    // middle one's neighbourhood wholly inside; an overlap ratio of 1 (margin 2) on maps of
    // 3x2 and 2x1 windows; an odd window (5 in 7: 25 queries, 49 keys, not a multiple of the
    // key tiles); one window alone, every neighbour outside.
    const OverlapShape hat{1, 16, 32, 16, 24, 2, 30};
    const OverlapShape hat_s{1, 32, 16, 16, 24, 1, 24};
    const OverlapShape oca_small{2, 8, 12, 4, 6, 3, 7};
    const OverlapShape oca_middle{1, 12, 12, 4, 6, 1, 8};
    const OverlapShape oca_ratio1{1, 12, 8, 4, 8, 2, 5};
    const OverlapShape oca_odd{1, 10, 10, 5, 7, 2, 53};
    const OverlapShape oca_alone{1, 4, 4, 4, 6, 2, 16};
    const OverlapShape oca_wide{1, 16, 8, 8, 12, 1, 100};

#define RUN_OVERLAP(T, NAME, LAUNCH, SHAPE, BOUND)                                              \
    overlap_case<T>(#NAME, [](const void* a, const void* b, void* o, int h, int d, int ws,      \
                              int ows, int hh, int ww) {                                        \
        NAME(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(o), h, d, ws,  \
             ows, hh, ww);                                                                      \
    }, LAUNCH, SHAPE, BOUND, __LINE__)
#define SCALAR_OVERLAP(T, NAME, DMAX, SHAPE, BOUND) \
    RUN_OVERLAP(T, NAME, overlap_scalar_launch((SHAPE).n(), DMAX), SHAPE, BOUND)

    // Blocks of the tensor-core kernel have 512 threads whatever the window, and every mma is
    // a warp exchange between barriers: the cases are few and small, so that the sanitizer
    // runs stay short.
    SCALAR_OVERLAP(float, overlap_attention_f32_d32, 32, hat, f32_bound);
    SCALAR_OVERLAP(__nv_bfloat16, overlap_attention_bf16_d32, 32, hat_s, bf16_bound);
    SCALAR_OVERLAP(float, overlap_attention_f32_d32, 32, oca_small, f32_bound);
    SCALAR_OVERLAP(float, overlap_attention_f32_d32, 32, oca_middle, f32_bound);
    SCALAR_OVERLAP(float, overlap_attention_f32_d32, 32, oca_ratio1, f32_bound);
    SCALAR_OVERLAP(__half, overlap_attention_f16_d64, 64, oca_odd, f16_bound);
    SCALAR_OVERLAP(__nv_bfloat16, overlap_attention_bf16_d32, 32, oca_alone, bf16_bound);
    // The tensor-core kernel (c even: the host's condition), heads of odd width starting at
    // an odd element in every other head (5, 53).
    const OverlapShape oca_ratio1_narrow{1, 8, 4, 4, 8, 2, 5};
#define MMA_OVERLAP(T, NAME, DP, SHAPE, BOUND) \
    RUN_OVERLAP(T, NAME, overlap_mma_launch(SHAPE, DP), SHAPE, BOUND)
    MMA_OVERLAP(__nv_bfloat16, overlap_attention_mma_bf16_d32, 32, hat, bf16_bound);
    MMA_OVERLAP(__half, overlap_attention_mma_f16_d32, 32, hat_s, f16_bound);
    MMA_OVERLAP(__half, overlap_attention_mma_f16_d64, 64, oca_odd, f16_bound);
    MMA_OVERLAP(__half, overlap_attention_mma_f16_d16, 16, oca_ratio1_narrow, f16_bound);
    MMA_OVERLAP(__nv_bfloat16, overlap_attention_mma_bf16_d16, 16, oca_alone, bf16_bound);
    if (!quick) {
        MMA_OVERLAP(__half, overlap_attention_mma_f16_d112, 112, oca_wide, f16_bound);
        SCALAR_OVERLAP(float, overlap_attention_f32_d128, 128, oca_wide, f32_bound);
    }
    blend_case(1);
    blend_case(4);
    bias_act_cases<float>("f32", bias_act_f32, cat_bias_act_f32, 0.0);
    bias_act_cases<__nv_bfloat16>("bf16", bias_act_bf16, cat_bias_act_bf16, 1.0 / 256);
    bias_act_cases<__half>("f16", bias_act_f16, cat_bias_act_f16, 1.0 / 2048);
    const NormKernels<float> f32{gather_norm_f32, add_gather_norm_f32, add_scaled_gather_norm_f32};
    const NormKernels<__nv_bfloat16> bf16{gather_norm_bf16, add_gather_norm_bf16,
                                          add_scaled_gather_norm_bf16};
    const NormKernels<__half> f16{gather_norm_f16, add_gather_norm_f16, add_scaled_gather_norm_f16};
    for (bool padded : {false, true}) {
        norm_cases<float>("f32", f32, 0.0, padded);
        norm_cases<__nv_bfloat16>("bf16", bf16, 1.0 / 256, padded);
        norm_cases<__half>("f16", f16, 1.0 / 2048, padded);
    }
    norm_cases<__nv_bfloat16>("bf16", bf16, 1.0 / 256, false, true);
    patches_cases<float>("f32", patches3x3_f32);
    patches_cases<__nv_bfloat16>("bf16", patches3x3_bf16);
    patches_cases<__half>("f16", patches3x3_f16);
    narrow_cases<float>("f32", conv3x3_narrow_f32, 0.0);
    narrow_cases<__nv_bfloat16>("bf16", conv3x3_narrow_bf16, 1.0 / 256);
    narrow_cases<__half>("f16", conv3x3_narrow_f16, 1.0 / 2048);
    if (failures != 0) {
        std::printf("%d case(s) failed\n", failures);
        return 1;
    }
    return 0;
}
