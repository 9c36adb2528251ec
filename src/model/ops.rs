//! CPU kernels for the network's hot spots in f32, where candle's generic CPU ops spend more
//! time moving memory than computing: a fused window attention, linear layers and 3x3
//! convolutions that go straight to the GEMM with the bias accumulated, parallel gathers and
//! copies, and softmax / exact GELU with polynomial `exp`/`erf` compiled for the widest vector
//! unit the CPU has. Each kernel returns `None` (or falls back to candle) on other devices and
//! dtypes, and each is tested against candle's graph in f64 below; the golden tests check the
//! whole network.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::bf16::{round_pairs, Epilogue, Isa, PackedA, PackedB};
use super::cache::{RelativeBias, MASK_VALUE};

/// exp(x) for x <= 0: 2^n * p(r) with a Cody-Waite reduction and a degree-6 polynomial;
/// relative error ~2e-7. Inputs below -87 return 0 exactly (no denormals downstream).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and removing 1.5 * 2^23 rounds to nearest without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    // t lies in [2^23, 2^24), where one ulp is 1, so its bits minus ROUND's are n as an
    // integer. Unlike `n as i32` (saturating, NaN-checked) this vectorises.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (max absolute error 1.5e-7), odd-extended.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    if x < 0.0 {
        -y
    } else {
        y
    }
}

/// Elements per parallel task: enough work to amortise scheduling.
pub(super) const CHUNK: usize = 32 << 10;

fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("f32 kernel called on another dtype")
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("kernel called on a strided tensor")
    };
    Ok(&data[start..end])
}

/// Defines `$name` to run `$body` compiled for the widest vector unit the CPU has: the
/// binary targets baseline x86-64 (SSE2), and these element-wise loops are 2-4x faster with
/// 256- or 512-bit vectors. Elsewhere `$body` runs as compiled.
macro_rules! widest_simd {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) = $body:ident) => {
        $(#[$meta])*
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub(super) use widest_simd;

/// Independent accumulators per row: float reductions only vectorise when the compiler is
/// given lanes to keep apart (it may not reassociate a single sum).
pub(super) const LANES: usize = 16;

/// Scores this far below their row's maximum get probability exactly zero. Their true
/// weight (< e^-80 ≈ 2e-35) changes no output, while as numbers they would leave the softmax
/// subnormal (after division by a row sum of up to N) and be multiplied through the slow
/// subnormal path of x86's vector units inside the attention GEMM. With this cutoff every
/// probability is 0 or above 1.8e-35 / 256 ≈ 7e-38, a normal f32, for windows of up to 256
/// tokens; masked pairs (-100) are always exact zeros.
const SOFTMAX_CUTOFF: f32 = -80.0;

/// `exp(x)` of a softmax argument `x <= 0`, or exactly 0 below [`SOFTMAX_CUTOFF`].
#[inline(always)]
fn softmax_exp(x: f32) -> f32 {
    let e = exp_nonpositive(x);
    if x < SOFTMAX_CUTOFF {
        0.0
    } else {
        e
    }
}

/// Softmax of each length-`n` row of `data`, in place.
#[inline(always)]
fn softmax_rows_body(data: &mut [f32], n: usize) {
    for row in data.chunks_exact_mut(n) {
        let mut maxes = [f32::NEG_INFINITY; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for (m, &v) in maxes.iter_mut().zip(c) {
                *m = if v > *m { v } else { *m };
            }
        }
        let max = chunks
            .remainder()
            .iter()
            .chain(&maxes)
            .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
        let mut sums = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (s, v) in sums.iter_mut().zip(c) {
                *v = softmax_exp(*v - max);
                *s += *v;
            }
        }
        let mut sum = 0f32;
        for v in chunks.into_remainder() {
            *v = softmax_exp(*v - max);
            sum += *v;
        }
        let inv = 1.0 / (sum + sums.iter().sum::<f32>());
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

#[inline(always)]
fn attention_probs_body(
    scores: &mut [f32],
    (bias, h): (&RelativeBias, usize),
    labels: Option<&[u8]>,
    n: usize,
    mut rounded: Option<&mut PackedA>,
) {
    // Row by row, so that every pass over a row (and its rounding to bf16) runs in L1.
    for (i, row) in scores.chunks_exact_mut(n).enumerate() {
        // Same order of additions as the reference: (q·k + bias) + mask.
        bias.add_to_row(h, i, row);
        if let Some(labels) = labels {
            let own = labels[i];
            for (s, &l) in row.iter_mut().zip(labels) {
                *s += if l == own { 0.0 } else { MASK_VALUE };
            }
        }
        softmax_rows_body(row, n);
        if let Some(packed) = rounded.as_deref_mut() {
            packed.set_row(i, row);
        }
    }
}

widest_simd! {
    /// Head `h`'s attention probabilities from its `n x n` scores, in place, with the
    /// window's region labels (`labels`) standing for the shift mask; with `rounded`, each
    /// row is also rounded into that bf16 operand as soon as it is final.
    fn attention_probs(
        scores: &mut [f32],
        bias: (&RelativeBias, usize),
        labels: Option<&[u8]>,
        n: usize,
        rounded: Option<&mut PackedA>,
    ) = attention_probs_body
}

#[inline(always)]
fn gelu_body(data: &mut [f32]) {
    data.iter_mut().for_each(|v| {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    });
}

widest_simd! {
    /// The exact GELU, in place.
    fn gelu_in_place(data: &mut [f32]) = gelu_body
}

struct GeluErf;

impl CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "upscale-gelu-erf"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = contiguous_f32(storage, layout)?;
        let mut out = par_copy(data);
        out.par_chunks_mut(CHUNK).for_each(gelu_in_place);
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

pub(super) fn use_kernel(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.is_contiguous()
}

/// The exact (erf) GELU.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        x.apply_op1_no_bwd(&GeluErf)
    } else {
        x.gelu_erf()
    }
}

/// A strided f32 matrix operand for [`gemm_f32`]: element (i, j) is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Strided<P> {
    ptr: P,
    rs: usize,
    cs: usize,
}

fn strided<P>(ptr: P, rs: usize, cs: usize) -> Strided<P> {
    Strided { ptr, rs, cs }
}

/// `dst (+)= lhs · rhs` for an `m x k` lhs and a `k x n` rhs; `accumulate` adds onto dst's
/// contents instead of overwriting them (and only then is dst read).
///
/// # Safety
/// Every element the three strided views address must lie inside live allocations, dst's
/// must not overlap the inputs or be written by anyone else meanwhile, and dst must be
/// initialised where `accumulate` is set.
unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: Strided<*mut f32>,
    accumulate: bool,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr,
            dst.cs as isize,
            dst.rs as isize,
            accumulate,
            lhs.ptr,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.ptr,
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A layer's weights as the products read them: f32 as stored (a `k x n` view through
/// strides), or packed bf16 ([`super::bf16`]).
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(Isa, &'a PackedB),
}

/// `dst (+)= lhs · rhs` for a row-major `m x k` lhs (rows `lda` apart) into a row-major
/// `m x n` dst (rows `ldc` apart), in f32 or bf16 as `rhs` says; `f32_strides` are the
/// strides of an f32 rhs.
///
/// # Safety
/// As [`gemm_f32`] and [`super::bf16::gemm`]: every addressed element inside live
/// allocations, dst not overlapping the inputs, initialised where `accumulate` is set.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    (dst, ldc): (*mut f32, usize),
    accumulate: bool,
    (lhs, lda): (*const f32, usize),
    rhs: Weights,
    f32_strides: (usize, usize),
    parallel: bool,
    then: Option<&Epilogue>,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match rhs {
            Weights::F32(w) => {
                let rhs = strided(w.as_ptr(), f32_strides.0, f32_strides.1);
                let Some(then) = then else {
                    let parallelism = if parallel {
                        gemm::Parallelism::Rayon(0)
                    } else {
                        gemm::Parallelism::None
                    };
                    let (dst, lhs) = (strided(dst, ldc, 1), strided(lhs, lda, 1));
                    return gemm_f32((m, n, k), dst, accumulate, lhs, rhs, parallelism);
                };
                // Row blocks as tasks of their own, each finished by `then` while in cache.
                assert_eq!(ldc, n, "an epilogue needs contiguous output rows");
                let ptrs = SendPtrs { dst, lhs, rhs };
                let block = |b: usize| {
                    let (dst, lhs, rhs) = ptrs.get();
                    let i0 = b * EPILOGUE_ROWS;
                    let rows = EPILOGUE_ROWS.min(m - i0);
                    // SAFETY (inside the caller's unsafe block): rows i0..i0 + rows of dst
                    // and lhs, inside the caller's bounds; each block writes only its own rows.
                    let (dst, lhs) = (dst.add(i0 * ldc), lhs.add(i0 * lda));
                    let (d, l) = (strided(dst, ldc, 1), strided(lhs, lda, 1));
                    gemm_f32((rows, n, k), d, accumulate, l, rhs, gemm::Parallelism::None);
                    then(std::slice::from_raw_parts_mut(dst, rows * n));
                };
                let blocks = m.div_ceil(EPILOGUE_ROWS);
                if parallel {
                    (0..blocks).into_par_iter().for_each(block);
                } else {
                    (0..blocks).for_each(block);
                }
            }
            Weights::Bf16(isa, w) => {
                debug_assert_eq!((w.rows(), w.cols()), (k, n));
                super::bf16::gemm(isa, m, dst, ldc, accumulate, (lhs, lda), w, parallel, then)
            }
        }
    }
}

/// Rows per task of an f32 product with an epilogue: the block's output (up to 128 x 360
/// values for DRCT's fc1) stays in L2 until the epilogue has run over it.
const EPILOGUE_ROWS: usize = 128;

/// The operands of a product, shared by its row-block tasks.
#[derive(Clone, Copy)]
struct SendPtrs {
    dst: *mut f32,
    lhs: *const f32,
    rhs: Strided<*const f32>,
}

impl SendPtrs {
    /// Through a method, so that closures capture the whole (Sync) struct, not its fields.
    fn get(&self) -> (*mut f32, *const f32, Strided<*const f32>) {
        (self.dst, self.lhs, self.rhs)
    }
}

// SAFETY: the tasks that share these pointers write disjoint row blocks of dst and only
// read lhs and rhs (see `product`).
unsafe impl Send for SendPtrs {}
unsafe impl Sync for SendPtrs {}

/// Shifted-window multi-head attention on the CPU, fused per window: both matmuls go to the
/// GEMM directly from strided views of the `qkv` projection, and the bias, the mask and the
/// softmax are applied to a score matrix that stays in cache. The unfused graph writes and
/// rereads the `(windows, heads, N, N)` scores four times and copies q, k, v and the output.
///
/// `qkv`: `(B*nW, N, 3C)` (q, k, v, then heads, then head dim, as the official reshape reads
/// it), q already scaled; `bias`: the block's table; `regions`: for shifted windows, the
/// `(nW, N)` region labels of one map's windows ([`super::cache::shift_regions`]), tokens of
/// different regions being masked as the official mask does. Returns `(B*nW, N, C)` with heads
/// concatenated, or `None` where the kernel does not apply (another device or dtype), so the
/// caller runs the generic graph. With `bf16`, both products take bf16 operands (f32 sums);
/// the softmax stays f32.
pub fn window_attention(
    qkv: &Tensor,
    bias: &RelativeBias,
    regions: Option<&[u8]>,
    bf16: Option<Isa>,
) -> Result<Option<Tensor>> {
    if !use_kernel(qkv) {
        return Ok(None);
    }
    let (bw, n, c3) = qkv.dims3()?;
    let heads = bias.heads();
    let c = c3 / 3;
    let d = c / heads.max(1);
    let ws = bias.window();
    if c3 != 3 * c || c != heads * d || n != ws * ws {
        candle_core::bail!(
            "window attention: qkv {:?} for {heads} heads and window {ws}",
            qkv.dims()
        );
    }
    let nw = match regions {
        Some(r) if r.is_empty() || r.len() % n != 0 || bw % (r.len() / n) != 0 => {
            candle_core::bail!(
                "window attention: {} region labels for {bw} windows",
                r.len()
            )
        }
        Some(r) => r.len() / n,
        None => 1,
    };
    let (qkv_guard, qkv_layout) = qkv.storage_and_layout();
    let qkv_data = cpu_slice(&qkv_guard, qkv_layout)?;

    // Windows are independent: one task each, with a private score matrix. With fewer
    // windows than threads the GEMMs themselves are split instead.
    let inner = if bw >= rayon::current_num_threads() {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(0)
    };
    let products = match bf16 {
        Some(isa) => Products::Bf16(isa),
        None => Products::F32(inner),
    };
    let shape = WindowShape {
        n,
        c,
        heads,
        products,
    };
    // Left uninitialised: `attend_window` writes every element (each head its d columns of
    // every row) without reading it.
    let mut out: Vec<f32> = Vec::with_capacity(bw * n * c);
    out.spare_capacity_mut()
        .par_chunks_mut(n * c)
        .enumerate()
        .for_each_init(
            || Scratch {
                scores: vec![0f32; n * n],
                ..Scratch::default()
            },
            |scratch, (win, out)| {
                let qkv = &qkv_data[win * n * 3 * c..(win + 1) * n * 3 * c];
                // A window inside one region (all but the last row and column of windows)
                // masks nothing.
                let labels = regions
                    .map(|r| &r[(win % nw) * n..(win % nw + 1) * n])
                    .filter(|l| l.iter().any(|&v| v != l[0]));
                attend_window(&shape, qkv, bias, labels, scratch, out);
            },
        );
    // SAFETY: `attend_window` wrote all bw * n * c elements.
    unsafe { out.set_len(bw * n * c) };
    drop(qkv_guard);
    Ok(Some(Tensor::from_vec(out, (bw, n, c), qkv.device())?))
}

/// The sizes one window's attention needs.
struct WindowShape {
    /// Tokens per window.
    n: usize,
    /// Channels (all heads).
    c: usize,
    heads: usize,
    products: Products,
}

/// How a window's two products run: f32 (split across threads or not), or bf16.
#[derive(Clone, Copy)]
enum Products {
    F32(gemm::Parallelism),
    Bf16(Isa),
}

/// One task's working memory: a window's score matrix, and the bf16 operands kᵀ, v and the
/// probabilities of one head.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    kt: PackedB,
    v: PackedB,
    probs: PackedA,
}

/// Attention of one window: for each head, scores = q · kᵀ straight from the strided `qkv`
/// rows (`n` rows of q | k | v), + bias (+ mask from the region `labels`), softmax in place,
/// then the head's `d` output columns = probabilities · v. Writes every element of `out` (`n`
/// rows of `c`).
fn attend_window(
    s: &WindowShape,
    qkv: &[f32],
    bias: &RelativeBias,
    labels: Option<&[u8]>,
    scratch: &mut Scratch,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    let (n, c) = (s.n, s.c);
    let (c3, d) = (3 * c, c / s.heads);
    let Scratch {
        scores,
        kt,
        v,
        probs,
    } = scratch;
    assert!(qkv.len() >= n * c3 && out.len() >= n * c && scores.len() >= n * n);
    for h in 0..s.heads {
        let q = qkv[h * d..].as_ptr();
        let keys = &qkv[c + h * d..];
        let values = &qkv[2 * c + h * d..];
        let head_out = out[h * d..].as_mut_ptr().cast::<f32>();
        // SAFETY (all products): every access stays inside `qkv` (n rows of c3 starting at
        // the head's column), `scores` (n x n) and `out` (n rows of c), as asserted above; the
        // pointers do not alias and no other task touches this window's `out`. kᵀ is k read
        // through swapped strides.
        unsafe {
            head_product(
                s.products,
                (n, d, n),
                (q, c3),
                (keys, 1, c3),
                kt,
                (scores.as_mut_ptr(), n),
            )
        };
        let scores = &mut scores[..n * n];
        match s.products {
            Products::F32(_) => {
                attention_probs(scores, (bias, h), labels, n, None);
                // SAFETY: as above.
                unsafe {
                    head_product(
                        s.products,
                        (n, n, d),
                        (scores.as_ptr(), n),
                        (values, c3, 1),
                        v,
                        (head_out, c),
                    )
                };
            }
            Products::Bf16(isa) => {
                // The probabilities are rounded into the packed operand row by row as the
                // softmax finishes them, instead of in a pass of their own.
                v.repack(values, (n, d), (c3, 1));
                probs.prepare(isa, n, v);
                attention_probs(scores, (bias, h), labels, n, Some(probs));
                // SAFETY: as above; the caller chose an ISA this CPU has.
                unsafe { super::bf16::gemm_packed(probs, v, head_out, c, false) };
            }
        }
    }
}

/// `dst = lhs · rhs` for one head: `lhs` is `m x k` (rows `lda` apart), `rhs` the `k x cols`
/// view `src[r * rs + c * cs]`, `dst` rows `ldc` apart. In f32 the GEMM reads `rhs` through its
/// strides; in bf16 it is packed into `packed` first.
///
/// # Safety
/// `lhs` and `dst` must hold those rows, `dst` overlapping neither input; with bf16 the CPU
/// must have the instructions.
unsafe fn head_product(
    products: Products,
    (m, k, cols): (usize, usize, usize),
    (lhs, lda): (*const f32, usize),
    (src, rs, cs): (&[f32], usize, usize),
    packed: &mut PackedB,
    (dst, ldc): (*mut f32, usize),
) {
    let (rhs, parallel) = match products {
        Products::F32(inner) => (
            Weights::F32(src),
            matches!(inner, gemm::Parallelism::Rayon(_)),
        ),
        Products::Bf16(isa) => {
            packed.repack(src, (k, cols), (rs, cs));
            (Weights::Bf16(isa, packed), false)
        }
    };
    // SAFETY: forwarded to the caller.
    unsafe {
        product(
            (m, cols, k),
            (dst, ldc),
            false,
            (lhs, lda),
            rhs,
            (rs, cs),
            parallel,
            None,
        )
    }
}

/// What a linear layer does besides `x · wᵀ + b`.
#[derive(Clone, Copy)]
pub enum After<'a> {
    Nothing,
    /// Adds this tensor (the output's shape): accumulated by the GEMM, which starts from
    /// residual + bias instead of the bias.
    Residual(&'a Tensor),
    /// The exact GELU, applied to each block of output rows as the GEMM finishes it.
    Gelu,
}

impl<'a> After<'a> {
    fn residual(self) -> Option<&'a Tensor> {
        match self {
            Self::Residual(r) => Some(r),
            _ => None,
        }
    }
}

/// [`gelu_in_place`] as a product's epilogue.
fn gelu_rows(rows: &mut [f32]) {
    gelu_in_place(rows)
}

/// `x · wᵀ + b (+ residual)` on the CPU with the bias (plus the residual) written first and
/// accumulated by the GEMM, so the output is written once instead of written, reread and
/// rewritten by separate adds. `x`: `(.., k)`; `w`: `(n, k)` as stored; `b`: `(n)`;
/// `residual`: the output's shape. `None` where the kernel does not apply.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, after: After) -> Result<Option<Tensor>> {
    let residual = after.residual();
    if ![Some(x), Some(w), b, residual]
        .into_iter()
        .flatten()
        .all(use_kernel)
    {
        return Ok(None);
    }
    let (n, k) = w.dims2()?;
    let (w_guard, w_layout) = w.storage_and_layout();
    let ws = cpu_slice(&w_guard, w_layout)?;
    // wᵀ is read through w's strides.
    let y = linear_with(x, Weights::F32(ws), (k, n), (1, k), b, after)?;
    drop(w_guard);
    Ok(Some(y))
}

/// [`linear`] with the weights packed in bf16 (`k x n`, already transposed); `x`, `b` and
/// `residual` are f32 on the CPU.
pub fn linear_bf16(x: &Tensor, isa: Isa, w: &PackedB, b: &Tensor, after: After) -> Result<Tensor> {
    let residual = after.residual();
    if ![Some(x), Some(b), residual]
        .into_iter()
        .flatten()
        .all(use_kernel)
    {
        candle_core::bail!("bf16 linear: f32 tensors on the CPU only");
    }
    linear_with(
        x,
        Weights::Bf16(isa, w),
        (w.rows(), w.cols()),
        (0, 0),
        Some(b),
        after,
    )
}

fn linear_with(
    x: &Tensor,
    w: Weights,
    (k, n): (usize, usize),
    f32_strides: (usize, usize),
    b: Option<&Tensor>,
    after: After,
) -> Result<Tensor> {
    let (residual, gelu) = (after.residual(), matches!(after, After::Gelu));
    let dims = x.dims();
    if dims.last() != Some(&k) || b.is_some_and(|b| b.dims() != [n]) {
        candle_core::bail!("linear: input {dims:?}, weight {k}x{n}");
    }
    let m = x.elem_count() / k.max(1);
    if residual
        .is_some_and(|r| r.elem_count() != m * n || r.dim(candle_core::D::Minus1).ok() != Some(n))
    {
        candle_core::bail!(
            "linear: residual {:?} for {m}x{n} outputs",
            residual.map(|r| r.dims())
        );
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    // Every output element is written exactly once before the GEMM (bias, residual + bias, or
    // zero): a zeroed allocation followed by the bias rows would be two passes over the
    // largest tensor.
    let bias = b.map(|b| b.storage_and_layout());
    let res = residual.map(|r| r.storage_and_layout());
    let zeros;
    let first = match &bias {
        Some((guard, layout)) => cpu_slice(guard, layout)?,
        None => {
            zeros = vec![0f32; n];
            &zeros
        }
    };
    let mut out = match &res {
        Some((guard, layout)) => {
            let rs = cpu_slice(guard, layout)?;
            par_rows(m, n, |r, w| w.write_sum(&rs[r * n..(r + 1) * n], first))
        }
        None => par_rows(m, n, |_, w| w.write_row(first)),
    };
    drop((bias, res));
    if m > 0 && n > 0 {
        // SAFETY: dst is m x n row-major in `out`, lhs m x k row-major in `xs`, and the
        // weights k x n (f32 through `f32_strides`, or packed to exactly k x n).
        unsafe {
            product(
                (m, n, k),
                (out.as_mut_ptr(), n),
                b.is_some() || residual.is_some(),
                (xs.as_ptr(), k),
                w,
                f32_strides,
                true,
                gelu.then_some(&gelu_rows as &Epilogue),
            );
        }
    }
    drop(x_guard);
    let mut shape = dims.to_vec();
    *shape.last_mut().expect("checked above") = n;
    Tensor::from_vec(out, shape, x.device())
}

/// A 3x3 convolution (stride 1, zero padding 1) on channels-last features, on the CPU: the
/// patch matrix of a band of rows is gathered in one pass straight from the input (zeros
/// outside it) and multiplied into an output prefilled with the bias. The patch matrix never
/// exceeds `chunk_elems` elements, however large the image.
///
/// `x`: `(B, H, W, cin)`; `w`: `(9 cin, cout)` with rows ordered (dy, dx, cin); `b`: `(cout)`.
/// `None` where the kernel does not apply.
pub fn conv3x3(x: &Tensor, w: &Tensor, b: &Tensor, chunk_elems: usize) -> Result<Option<Tensor>> {
    if ![x, w, b].into_iter().all(use_kernel) {
        return Ok(None);
    }
    let (batch, h, wd, cin) = x.dims4()?;
    let (k, cout) = w.dims2()?;
    if k != 9 * cin || b.dims() != [cout] {
        candle_core::bail!("conv3x3: input {:?}, weight {:?}", x.dims(), w.dims());
    }
    let (w_guard, w_layout) = w.storage_and_layout();
    let ws = cpu_slice(&w_guard, w_layout)?;
    if cout > NARROW_CONV {
        let y = conv3x3_with(x, Weights::F32(ws), (k, cout), b, chunk_elems)?;
        drop(w_guard);
        return Ok(Some(y));
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;
    let mut out = par_rows(batch * h * wd, cout, |_, w| w.write_row(bs));
    let wt = transpose(ws, k, cout);
    out.par_chunks_mut(wd * cout)
        .enumerate()
        .for_each(|(row, dst)| {
            let (bi, y) = (row / h, row % h);
            let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
            conv_row_narrow(image, &wt, dst, y, h, wd, cin);
        });
    drop((x_guard, w_guard, b_guard));
    Ok(Some(Tensor::from_vec(
        out,
        (batch, h, wd, cout),
        x.device(),
    )?))
}

/// [`conv3x3`] with the weights packed in bf16 (`9 cin x cout`); `x` and `b` are f32 on the
/// CPU.
pub fn conv3x3_bf16(
    x: &Tensor,
    isa: Isa,
    w: &PackedB,
    b: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    if !use_kernel(x) || !use_kernel(b) {
        candle_core::bail!("bf16 conv3x3: f32 tensors on the CPU only");
    }
    let k = w.rows();
    if k != 9 * x.dim(3)? || b.dims() != [w.cols()] {
        candle_core::bail!("conv3x3: input {:?}, weight {k}x{}", x.dims(), w.cols());
    }
    conv3x3_with(x, Weights::Bf16(isa, w), (k, w.cols()), b, chunk_elems)
}

/// The patch-matrix GEMM of [`conv3x3`], for f32 (`k x cout` row-major) or bf16 weights.
fn conv3x3_with(
    x: &Tensor,
    w: Weights,
    (k, cout): (usize, usize),
    b: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    let (batch, h, wd, cin) = x.dims4()?;
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;

    let pixels = batch * h * wd;
    let mut out = par_rows(pixels, cout, |_, w| w.write_row(bs));

    if let (Weights::Bf16(isa, w), true) = (w, cin.is_multiple_of(2)) {
        let dst = OutRows(out.as_mut_ptr());
        let blocks = (h * wd).div_ceil(PATCH_ROWS);
        (0..batch * blocks)
            .into_par_iter()
            .for_each_init(PackedA::default, |pack, task| {
                let (bi, p0) = (task / blocks, task % blocks * PATCH_ROWS);
                let rows = PATCH_ROWS.min(h * wd - p0);
                let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
                pack_patches(pack, (isa, w), image, (h, wd, cin), p0, rows);
                // SAFETY: output rows p0..p0 + rows of image bi, cout values each, lie in
                // `out` and are written by this task only; `pack` holds their patches.
                unsafe {
                    let dst = dst.at((bi * h * wd + p0) * cout);
                    super::bf16::gemm_packed(pack, w, dst, cout, true)
                };
            });
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h, wd, cout), x.device());
    }

    let row_elems = wd * k;
    let rows = (chunk_elems / row_elems.max(1)).clamp(1, h.max(1));
    let mut cols = vec![0f32; rows * row_elems];
    for bi in 0..batch {
        let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
        let mut y0 = 0;
        while y0 < h {
            let n = rows.min(h - y0);
            let cols = &mut cols[..n * row_elems];
            gather_patches(image, (h, wd, cin), y0, cols);
            let dst = &mut out[((bi * h + y0) * wd) * cout..((bi * h + y0 + n) * wd) * cout];
            // SAFETY: dst is (n*wd) x cout row-major, cols (n*wd) x k row-major, and the
            // weights k x cout (row-major f32, or packed to exactly that).
            unsafe {
                product(
                    (n * wd, cout, k),
                    (dst.as_mut_ptr(), cout),
                    true,
                    (cols.as_ptr(), k),
                    w,
                    (cout, 1),
                    true,
                    None,
                );
            }
            y0 += n;
        }
    }
    drop((x_guard, b_guard));
    Tensor::from_vec(out, (batch, h, wd, cout), x.device())
}

/// The 3x3 patch matrix of image rows `y0..` (as many as `cols` holds: `wd` patches of
/// `9 cin` values per row, taps ordered (dy, dx, cin)), zeros outside the image.
fn gather_patches(image: &[f32], (h, wd, cin): (usize, usize, usize), y0: usize, cols: &mut [f32]) {
    cols.par_chunks_mut(9 * cin)
        .enumerate()
        .for_each(|(p, patch)| {
            let (y, x) = (y0 + p / wd, p % wd);
            for (tap, dst) in patch.chunks_exact_mut(cin).enumerate() {
                match tap_source(image, (h, wd, cin), (y, x), tap) {
                    Some(src) => dst.copy_from_slice(src),
                    None => dst.fill(0.0),
                }
            }
        });
}

/// The `cin` input values under 3x3 tap `tap` (ordered (dy, dx)) of output pixel `(y, x)`,
/// or `None` where the tap falls outside the image (zero padding).
#[inline(always)]
fn tap_source(
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    (y, x): (usize, usize),
    tap: usize,
) -> Option<&[f32]> {
    let (sy, sx) = ((y + tap / 3).wrapping_sub(1), (x + tap % 3).wrapping_sub(1));
    (sy < h && sx < wd).then(|| &image[(sy * wd + sx) * cin..][..cin])
}

/// Pixels per task of the bf16 convolutions, whose patches are packed in blocks this size.
const PATCH_ROWS: usize = 96;

/// The patches of pixels `p0..p0 + rows` (row-major over the image; taps ordered (dy, dx,
/// cin), zeros outside the image) rounded straight into `pack`, laid out for products with
/// `b`: the f32 patch matrix, 9x the input, is never written and read back, and each value is
/// rounded once however many weight blocks use it. `cin` must be even, so that no bf16 pair
/// straddles two taps.
fn pack_patches(
    pack: &mut PackedA,
    (isa, b): (Isa, &PackedB),
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    p0: usize,
    rows: usize,
) {
    pack.prepare(isa, rows, b);
    for r in 0..rows {
        let (y, x) = ((p0 + r) / wd, (p0 + r) % wd);
        for (tap, out) in pack.row_pairs_mut(r).chunks_exact_mut(cin / 2).enumerate() {
            match tap_source(image, (h, wd, cin), (y, x), tap) {
                Some(src) => round_pairs(src, out),
                None => out.fill(0),
            }
        }
    }
}

/// [`conv3x3`] followed by PixelShuffle by `r`, for a convolution whose output channels are
/// in (i, j, c) order (see [`pixel_shuffle_reordered`]): the products of each input row are
/// written straight into the `r` output rows they become (column block i of the weights
/// gives output row `y*r + i`, where each pixel's `r*c` values are already contiguous), so
/// the unshuffled map, as large as the output, is never allocated nor copied.
/// `None` where the kernel does not apply.
pub fn conv3x3_shuffled(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Option<Tensor>> {
    if ![x, w, b].into_iter().all(use_kernel) {
        return Ok(None);
    }
    let (k, cout) = w.dims2()?;
    let (w_guard, w_layout) = w.storage_and_layout();
    let ws = cpu_slice(&w_guard, w_layout)?;
    let c = cout / (r * r).max(1);
    let blocks: Vec<Weights> = (0..r).map(|i| Weights::F32(&ws[i * r * c..])).collect();
    let y = conv3x3_shuffled_with(x, &blocks, (k, cout), (cout, 1), b, r, chunk_elems)?;
    drop(w_guard);
    Ok(Some(y))
}

/// [`conv3x3_shuffled`] with the weights packed in bf16; `None` where a column block does
/// not start a packed panel (`r * c` not a multiple of 32), so the caller shuffles after.
pub fn conv3x3_shuffled_bf16(
    x: &Tensor,
    isa: Isa,
    w: &PackedB,
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Option<Tensor>> {
    if !use_kernel(x) || !use_kernel(b) {
        candle_core::bail!("bf16 conv3x3: f32 tensors on the CPU only");
    }
    let (k, cout) = (w.rows(), w.cols());
    let c = cout / (r * r).max(1);
    let Some(owned) = (0..r)
        .map(|i| w.column_block(i * r * c, r * c))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let blocks: Vec<Weights> = owned.iter().map(|p| Weights::Bf16(isa, p)).collect();
    conv3x3_shuffled_with(x, &blocks, (k, cout), (0, 0), b, r, chunk_elems).map(Some)
}

/// `dst` rows shared by the parallel row tasks of [`conv3x3_shuffled_with`].
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: each task writes only the output rows of its own input row.
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

impl OutRows {
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// The body of both shuffled convolutions; `blocks[i]` is the weights' column block i
/// (`k x r*c`), for f32 read through `f32_strides`.
fn conv3x3_shuffled_with(
    x: &Tensor,
    blocks: &[Weights],
    (k, cout): (usize, usize),
    f32_strides: (usize, usize),
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Tensor> {
    let (batch, h, wd, cin) = x.dims4()?;
    let c = cout / (r * r).max(1);
    if k != 9 * cin || c * r * r != cout || b.dims() != [cout] || blocks.len() != r {
        candle_core::bail!(
            "conv3x3 shuffled: input {:?}, weight {k}x{cout}, r {r}",
            x.dims()
        );
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;
    let block = r * c;
    // Output row y*r + i holds, for every input pixel, bias block i then its products.
    let out_row = wd * block;
    let mut out = par_rows(batch * h * r, out_row, |row, w| {
        let i = row % r;
        for _ in 0..wd {
            w.write_row(&bs[i * block..(i + 1) * block]);
        }
    });
    let dst = OutRows(out.as_mut_ptr());
    let packed: Option<Vec<(Isa, &PackedB)>> = blocks
        .iter()
        .map(|w| match w {
            Weights::Bf16(isa, p) => Some((*isa, *p)),
            Weights::F32(_) => None,
        })
        .collect();
    if let (Some(packed), true) = (packed, cin.is_multiple_of(2)) {
        // Each block of an input row's pixels is packed once for all r column blocks.
        let per_row = wd.div_ceil(PATCH_ROWS);
        (0..batch * h * per_row)
            .into_par_iter()
            .for_each_init(PackedA::default, |pack, task| {
                let (image_row, x0) = (task / per_row, task % per_row * PATCH_ROWS);
                let (bi, y) = (image_row / h, image_row % h);
                let rows = PATCH_ROWS.min(wd - x0);
                let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
                pack_patches(pack, packed[0], image, (h, wd, cin), y * wd + x0, rows);
                for (i, &(_, w)) in packed.iter().enumerate() {
                    let row = image_row * r + i;
                    // SAFETY: pixels x0..x0 + rows of output row `row` (`block` values
                    // each) lie in `out` and are written by this task only; `pack` holds
                    // their patches, packed for this k.
                    unsafe {
                        let dst = dst.at(row * out_row + x0 * block);
                        super::bf16::gemm_packed(pack, w, dst, block, true)
                    };
                }
            });
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h * r, wd * r, c), x.device());
    }
    let rows = (chunk_elems / (wd * k).max(1)).clamp(1, h.max(1));
    let mut cols = vec![0f32; rows * wd * k];
    for bi in 0..batch {
        let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
        let mut y0 = 0;
        while y0 < h {
            let n = rows.min(h - y0);
            let cols = &mut cols[..n * wd * k];
            gather_patches(image, (h, wd, cin), y0, cols);
            let cols = &*cols;
            (0..n).into_par_iter().for_each(|yy| {
                for (i, w) in blocks.iter().enumerate() {
                    let row = (bi * h + y0 + yy) * r + i;
                    // SAFETY: output row `row` (wd pixels of `block` values, each pixel's
                    // values contiguous) lies in `out` and is written by this task only; the
                    // patches of input row yy are wd rows of k in `cols`; the block's
                    // weights are k x block.
                    unsafe {
                        product(
                            (wd, block, k),
                            (dst.at(row * out_row), block),
                            true,
                            (cols[yy * wd * k..].as_ptr(), k),
                            *w,
                            f32_strides,
                            false,
                            None,
                        );
                    }
                }
            });
            y0 += n;
        }
    }
    drop((x_guard, b_guard));
    Tensor::from_vec(out, (batch, h * r, wd * r, c), x.device())
}

/// Up to this many output channels (the final RGB convolution) a 3x3 convolution is computed
/// directly: a patch matrix would be 9x the input for a GEMM the width of a few columns, which
/// only streams memory.
pub(crate) const NARROW_CONV: usize = 4;

fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

/// One output row of a narrow 3x3 convolution, accumulated onto `dst` (prefilled with the
/// bias). `wt`: `(cout, 9 cin)`, taps ordered (dy, dx, cin), `cout` at most [`NARROW_CONV`].
#[inline(always)]
fn conv_row_narrow_body(
    image: &[f32],
    wt: &[f32],
    dst: &mut [f32],
    y: usize,
    h: usize,
    wd: usize,
    cin: usize,
) {
    let shape = (y, h, wd, cin);
    match wt.len() / (9 * cin) {
        1 => narrow_row::<1>(image, wt, dst, shape),
        2 => narrow_row::<2>(image, wt, dst, shape),
        3 => narrow_row::<3>(image, wt, dst, shape),
        4 => narrow_row::<4>(image, wt, dst, shape),
        cout => unreachable!("{cout} output channels is not a narrow convolution"),
    }
}

/// Output pixels computed together by [`narrow_row`].
const NARROW_PIXELS: usize = 4;

/// [`conv_row_narrow_body`] for `C` output channels, [`NARROW_PIXELS`] pixels at a time. Taps
/// outside the image read a row of zeros, so every pixel runs the same loop.
#[inline(always)]
fn narrow_row<const C: usize>(
    image: &[f32],
    wt: &[f32],
    dst: &mut [f32],
    (y, h, wd, cin): (usize, usize, usize, usize),
) {
    let zeros = vec![0f32; cin];
    let taps = |x: usize| -> [&[f32]; 9] {
        std::array::from_fn(|tap| tap_source(image, (h, wd, cin), (y, x), tap).unwrap_or(&zeros))
    };
    let mut x = 0;
    let mut groups = dst.chunks_exact_mut(NARROW_PIXELS * C);
    for group in &mut groups {
        let pixels: [[&[f32]; 9]; NARROW_PIXELS] = std::array::from_fn(|p| taps(x + p));
        narrow_pixels::<C, NARROW_PIXELS>(&pixels, wt, cin, group);
        x += NARROW_PIXELS;
    }
    for out in groups.into_remainder().chunks_exact_mut(C) {
        narrow_pixels::<C, 1>(&[taps(x)], wt, cin, out);
        x += 1;
    }
}

/// `P` neighbouring output pixels of `C` channels: `P * C` independent vector sums, so the
/// adds do not wait on each other (one sum at a time made the adds' latency the bound), and
/// each chunk of input and weights is loaded once for all the sums that use it.
/// `pixels[p][tap]`: the `cin` input values under that tap; `out`: `P * C` values, added to.
#[inline(always)]
fn narrow_pixels<const C: usize, const P: usize>(
    pixels: &[[&[f32]; 9]; P],
    wt: &[f32],
    cin: usize,
    out: &mut [f32],
) {
    let k = 9 * cin;
    let whole = cin / LANES;
    let mut acc = [[[0f32; LANES]; C]; P];
    let mut tail = [[0f32; C]; P];
    for tap in 0..9 {
        let w: [&[f32]; C] = std::array::from_fn(|c| &wt[c * k + tap * cin..][..cin]);
        let wv: [&[[f32; LANES]]; C] = std::array::from_fn(|c| &w[c].as_chunks().0[..whole]);
        let av: [&[[f32; LANES]]; P] =
            std::array::from_fn(|p| &pixels[p][tap].as_chunks().0[..whole]);
        for j in 0..whole {
            for c in 0..C {
                let wj = &wv[c][j];
                for p in 0..P {
                    let aj = &av[p][j];
                    for l in 0..LANES {
                        acc[p][c][l] += aj[l] * wj[l];
                    }
                }
            }
        }
        for j in whole * LANES..cin {
            for c in 0..C {
                for p in 0..P {
                    tail[p][c] += pixels[p][tap][j] * w[c][j];
                }
            }
        }
    }
    for p in 0..P {
        for c in 0..C {
            out[p * C + c] += tail[p][c] + acc[p][c].iter().sum::<f32>();
        }
    }
}

widest_simd! {
    fn conv_row_narrow(
        image: &[f32],
        wt: &[f32],
        dst: &mut [f32],
        y: usize,
        h: usize,
        wd: usize,
        cin: usize,
    ) = conv_row_narrow_body
}

/// A new buffer of `rows` rows of `row_len` values, each row produced in parallel by `fill`
/// from its index. `fill` hands every row to [`write_row`] pieces that cover it exactly, which
/// is what makes the final `set_len` sound; the pieces are checked to fit.
fn par_rows(rows: usize, row_len: usize, fill: impl Fn(usize, &mut RowWriter) + Sync) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(rows * row_len);
    if let Some(per_task) = CHUNK.checked_div(row_len) {
        let per_task = per_task.max(1);
        out.spare_capacity_mut()
            .par_chunks_mut(per_task * row_len)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (k, row) in chunk.chunks_exact_mut(row_len).enumerate() {
                    let mut w = RowWriter { row, at: 0 };
                    fill(t * per_task + k, &mut w);
                    assert_eq!(
                        w.at,
                        row_len,
                        "row {} left partly unwritten",
                        t * per_task + k
                    );
                }
            });
    }
    // SAFETY: every row was written in full (asserted above).
    unsafe { out.set_len(rows * row_len) };
    out
}

/// `data.to_vec()`, copied by all threads (a single-threaded copy of a large activation is
/// a serial step the other cores wait through).
fn par_copy(data: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(data.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK))
        .for_each(|(row, src)| RowWriter { row, at: 0 }.write_row(src));
    // SAFETY: both sides are cut into the same CHUNK-sized pieces, so every element of `out`
    // received one of `data`.
    unsafe { out.set_len(data.len()) };
    out
}

/// Appends values to one uninitialised output row, front to back.
struct RowWriter<'a> {
    row: &'a mut [std::mem::MaybeUninit<f32>],
    at: usize,
}

impl RowWriter<'_> {
    fn write_row(&mut self, src: &[f32]) {
        let dst = &mut self.row[self.at..self.at + src.len()];
        for (d, s) in dst.iter_mut().zip(src) {
            d.write(*s);
        }
        self.at += src.len();
    }

    /// Appends `leaky_relu(src, slope)`.
    fn write_leaky(&mut self, src: &[f32], slope: f32) {
        let dst = &mut self.row[self.at..self.at + src.len()];
        for (d, &v) in dst.iter_mut().zip(src) {
            d.write(if v >= 0.0 { v } else { v * slope });
        }
        self.at += src.len();
    }

    /// Appends `a + b`, element by element.
    fn write_sum(&mut self, a: &[f32], b: &[f32]) {
        let dst = &mut self.row[self.at..self.at + a.len()];
        for ((d, x), y) in dst.iter_mut().zip(a).zip(&b[..a.len()]) {
            d.write(x + y);
        }
        self.at += a.len();
    }
}

/// `cat([x, leaky_relu(y, slope)], -1)` for channels-last `x` `(.., Cx)` and `y` `(.., Cy)`:
/// the dense connection of a residual dense group in one parallel pass, where candle would
/// run the activation as two element-wise ops and the concatenation as a third pass. `None`
/// where the kernel does not apply.
pub fn cat_leaky(x: &Tensor, y: &Tensor, slope: f32) -> Result<Option<Tensor>> {
    if !use_kernel(x) || !use_kernel(y) {
        return Ok(None);
    }
    let (dx, dy) = (x.dims(), y.dims());
    let (Some((&cx, lead_x)), Some((&cy, lead_y))) = (dx.split_last(), dy.split_last()) else {
        candle_core::bail!("cat_leaky: scalar input");
    };
    if lead_x != lead_y {
        candle_core::bail!("cat_leaky: x {dx:?}, y {dy:?}");
    }
    let rows = lead_x.iter().product::<usize>();
    let (x_guard, x_layout) = x.storage_and_layout();
    let (y_guard, y_layout) = y.storage_and_layout();
    let (xs, ys) = (
        cpu_slice(&x_guard, x_layout)?,
        cpu_slice(&y_guard, y_layout)?,
    );
    let out = par_rows(rows, cx + cy, |r, w| {
        w.write_row(&xs[r * cx..(r + 1) * cx]);
        w.write_leaky(&ys[r * cy..(r + 1) * cy], slope);
    });
    drop((x_guard, y_guard));
    let mut shape = dx.to_vec();
    *shape.last_mut().expect("checked above") = cx + cy;
    Ok(Some(Tensor::from_vec(out, shape, x.device())?))
}

/// PixelShuffle by `r` of channels-last features whose channels are in (i, j, c) order (see
/// `drct::shuffle_order`): output row `y*r + i` takes, for each x, channels
/// `[i*r*c, (i+1)*r*c)` of input pixel (y, x), which are output pixels `x*r .. x*r + r`.
pub fn pixel_shuffle_reordered(x: &Tensor, r: usize) -> Result<Option<Tensor>> {
    if !use_kernel(x) {
        return Ok(None);
    }
    let (b, h, w, cc) = x.dims4()?;
    let c = cc / (r * r);
    if c * r * r != cc {
        candle_core::bail!("pixel shuffle: {cc} channels for factor {r}");
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let out = par_rows(b * h * r, w * r * c, |row, dst| {
        let (bi, yy) = (row / (h * r), row % (h * r));
        let (y, i) = (yy / r, yy % r);
        for px in 0..w {
            let src = ((bi * h + y) * w + px) * cc + i * r * c;
            dst.write_row(&xs[src..src + r * c]);
        }
    });
    drop(x_guard);
    Ok(Some(Tensor::from_vec(
        out,
        (b, h * r, w * r, c),
        x.device(),
    )?))
}

pub(super) fn cpu_slice<'a>(
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) => contiguous_f32(cpu, layout),
        _ => candle_core::bail!("CPU kernel called on a device tensor"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Largest absolute difference, in f64, between a result and its reference.
    fn max_abs_diff(ours: &Tensor, want: &Tensor) -> Result<f64> {
        (ours.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()
    }

    /// No probability leaves the softmax subnormal: a full window of equal scores plus one
    /// 86 below them would give e^-86 / 257 ≈ 1.6e-40 without the cutoff.
    #[test]
    fn softmax_never_outputs_subnormals() {
        for offset in [-79.0f32, -80.5, -84.0, -86.0, -90.0, -100.0] {
            let mut row = vec![0f32; 257];
            row[100] = offset;
            softmax_rows_body(&mut row, 257);
            for &p in &row {
                assert!(p == 0.0 || p.is_normal(), "offset {offset}: {p:e}");
            }
            assert_eq!(row[100] == 0.0, offset < SOFTMAX_CUTOFF, "offset {offset}");
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "{sum}");
        }
    }

    #[test]
    fn exp_is_accurate_over_the_softmax_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp_nonpositive(x) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(-1000.0), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn gelu_matches_exact_gelu_and_not_tanh() -> Result<()> {
        let xs: Vec<f32> = (-4000..4000).map(|i| i as f32 / 400.0).collect();
        let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
        let ours = gelu_erf(&x)?;
        let exact = x.to_dtype(DType::F64)?.gelu_erf()?;
        let d = max_abs_diff(&ours, &exact)?;
        assert!(d < 1e-6, "max abs error {d}");
        let gap = (ours - x.gelu()?)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(gap > 1e-4, "indistinguishable from tanh GELU: {gap}");
        Ok(())
    }

    #[test]
    fn softmax_rows_match_candle_with_masked_entries() -> Result<()> {
        // Rows of 70: four full lanes of 16 and a remainder of 6.
        let x = Tensor::randn(0f32, 3.0, (5, 7, 70), &Device::Cpu)?;
        let masked = (x.narrow(2, 0, 32)? - 100.0)?;
        let x = Tensor::cat(&[&masked, &x.narrow(2, 32, 38)?], 2)?;
        let mut ours = x.flatten_all()?.to_vec1::<f32>()?;
        softmax_rows_body(&mut ours, 70);
        let ours = Tensor::from_vec(ours, (5, 7, 70), &Device::Cpu)?;
        let want = candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F64)?)?;
        let d = max_abs_diff(&ours, &want)?;
        assert!(d < 1e-6, "max abs error {d}");
        Ok(())
    }

    /// The unfused graph, in f64: scores, bias, mask, softmax, weighted sum, heads concatenated.
    /// With `bf16`, q, k, v and the probabilities are first rounded to bf16, as the bf16
    /// products take them.
    fn attention_reference(
        qkv: &Tensor,
        bias: &Tensor,
        mask: Option<&Tensor>,
        heads: usize,
        bf16: bool,
    ) -> Result<Tensor> {
        let round = |t: Tensor| -> Result<Tensor> {
            if bf16 {
                t.to_dtype(DType::BF16)?.to_dtype(DType::F64)
            } else {
                Ok(t)
            }
        };
        let (bw, n, c3) = qkv.dims3()?;
        let d = c3 / 3 / heads;
        let qkv = round(qkv.to_dtype(DType::F64)?)?
            .reshape((bw, n, 3, heads, d))?
            .permute((2, 0, 3, 1, 4))?;
        let (q, k, v) = (
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        );
        let mut attn = q
            .matmul(&k.t()?)?
            .broadcast_add(&bias.to_dtype(DType::F64)?)?;
        if let Some(mask) = mask {
            let nw = mask.dim(0)?;
            attn = attn
                .reshape((bw / nw, nw, heads, n, n))?
                .broadcast_add(&mask.to_dtype(DType::F64)?.unsqueeze(1)?)?
                .reshape((bw, heads, n, n))?;
        }
        round(candle_nn::ops::softmax_last_dim(&attn)?)?
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((bw, n, heads * d))
    }

    /// Random attention inputs for `bw` windows of `ws x ws` tokens: qkv, a bias table, and
    /// for shifted windows (`nw > 0`) the region labels of a `ws x nw*ws` map (whose windows
    /// all straddle regions). Also the gathered bias and the stored mask the reference takes.
    #[allow(clippy::type_complexity)]
    fn attention_inputs(
        (bw, ws, heads, d, nw): (usize, usize, usize, usize, usize),
    ) -> Result<(
        Tensor,
        RelativeBias,
        Option<Vec<u8>>,
        Tensor,
        Option<Tensor>,
    )> {
        let dev = Device::Cpu;
        let n = ws * ws;
        let qkv = Tensor::randn(0f32, 1.0, (bw, n, 3 * heads * d), &dev)?;
        let side = 2 * ws - 1;
        let table = Tensor::randn(0f32, 1.0, (side * side, heads), &dev)?;
        let (regions, mask) = if nw > 0 {
            let mask = super::super::cache::shift_mask(ws, nw * ws, ws);
            (
                Some(super::super::cache::shift_regions(ws, nw * ws, ws)),
                Some(Tensor::from_vec(mask, (nw, n, n), &dev)?),
            )
        } else {
            (None, None)
        };
        Ok((
            qkv,
            RelativeBias::new(&table, ws)?,
            regions,
            super::super::cache::relative_position_bias(&table, ws)?,
            mask,
        ))
    }

    #[test]
    fn bf16_window_attention_matches_the_rounded_graph() -> Result<()> {
        let isas = super::super::bf16::available_isas();
        if isas.is_empty() {
            eprintln!("bf16 attention not tested: this CPU has no bf16 arithmetic");
        }
        for isa in isas {
            // (windows, window, heads, head dim, mask windows). Windows whose token count
            // leaves partial row groups, tiles and panels (49), pads the probabilities' pairs
            // (16, 49), odd head dims, and the official window.
            for shape in [
                (4, 4, 3, 5, 2),
                (2, 7, 2, 7, 0),
                (3, 8, 2, 6, 1),
                (2, 16, 2, 6, 2),
            ] {
                let (qkv, bias, regions, gathered, mask) = attention_inputs(shape)?;
                let ours = window_attention(&qkv, &bias, regions.as_deref(), Some(isa))?
                    .expect("the CPU kernel applies");
                let want = attention_reference(&qkv, &gathered, mask.as_ref(), shape.2, true)?;
                // Only a probability whose f32 and f64 values round to different bf16
                // neighbours differs, by one bf16 step of it (at most 2^-7 p) times a value;
                // the probabilities of a row sum to 1, so the output moves by at most
                // 2^-7 max|v|. The inputs are random each run: a fixed bound failed
                // on rare draws with large values.
                let (_, _, c3) = qkv.dims3()?;
                let v_max = qkv
                    .narrow(2, 2 * c3 / 3, c3 / 3)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()? as f64;
                let bound = 2f64.powi(-7) * v_max * (1.0 + 2f64.powi(-8)) + 1e-5;
                let diff = max_abs_diff(&ours, &want)?;
                assert!(
                    diff < bound,
                    "{isa:?} {shape:?}: max abs error {diff} (bound {bound})"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn fused_window_attention_matches_the_graph() -> Result<()> {
        // (windows, window, heads, head dim, mask windows): a batch of two images with a
        // shift mask, odd head dims, a single window (the GEMMs split across threads), and
        // the official window with a mask.
        for shape in [
            (8, 4, 3, 5, 4),
            (3, 8, 2, 7, 0),
            (1, 8, 4, 6, 1),
            (4, 16, 2, 5, 2),
        ] {
            let (qkv, bias, regions, gathered, mask) = attention_inputs(shape)?;
            let ours = window_attention(&qkv, &bias, regions.as_deref(), None)?
                .expect("the CPU f32 kernel applies");
            let want = attention_reference(&qkv, &gathered, mask.as_ref(), shape.2, false)?;
            let diff = max_abs_diff(&ours, &want)?;
            assert!(diff < 1e-5, "{shape:?}: max abs error {diff}");
        }
        Ok(())
    }

    #[test]
    fn window_attention_declines_other_dtypes_and_checks_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let table = Tensor::zeros((9, 1), DType::F32, &dev)?;
        let bias = RelativeBias::new(&table, 2)?;
        let qkv = Tensor::zeros((2, 4, 6), DType::F16, &dev)?;
        assert!(window_attention(&qkv, &bias, None, None)?.is_none());
        let qkv = qkv.to_dtype(DType::F32)?;
        assert!(window_attention(&qkv, &bias, None, None)?.is_some());
        // Tokens that are not the window's, labels for 3 windows of a batch of 2.
        let wrong = Tensor::zeros((2, 9, 6), DType::F32, &dev)?;
        assert!(window_attention(&wrong, &bias, None, None).is_err());
        assert!(window_attention(&qkv, &bias, Some(&[0; 12]), None).is_err());
        Ok(())
    }

    #[test]
    fn linear_matches_matmul_plus_bias() -> Result<()> {
        let dev = Device::Cpu;
        for dims in [vec![2usize, 3, 5, 7], vec![4, 7], vec![1, 7]] {
            let x = Tensor::randn(0f32, 1.0, dims.as_slice(), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (11, 7), &dev)?;
            let b = Tensor::randn(0f32, 1.0, 11, &dev)?;
            let want = x
                .to_dtype(DType::F64)?
                .broadcast_matmul(&w.to_dtype(DType::F64)?.t()?)?;
            let mut out_dims = dims.clone();
            *out_dims.last_mut().expect("non-empty") = 11;
            let r = Tensor::randn(0f32, 1.0, out_dims.as_slice(), &dev)?;
            for (bias, residual) in [
                (None, None),
                (Some(&b), None),
                (None, Some(&r)),
                (Some(&b), Some(&r)),
            ] {
                let ours = linear(
                    &x,
                    &w,
                    bias,
                    residual.map_or(After::Nothing, After::Residual),
                )?
                .expect("the CPU f32 kernel applies");
                let mut want = want.clone();
                if let Some(b) = bias {
                    want = want.broadcast_add(&b.to_dtype(DType::F64)?)?;
                }
                if let Some(r) = residual {
                    want = (want + r.to_dtype(DType::F64)?)?;
                }
                assert_eq!(ours.dims(), want.dims());
                let diff = max_abs_diff(&ours, &want)?;
                let case = (bias.is_some(), residual.is_some());
                assert!(diff < 1e-5, "{dims:?} (bias, residual) {case:?}: {diff}");
            }
            let wrong = Tensor::zeros(3, DType::F32, &dev)?;
            assert!(linear(&x, &w, Some(&b), After::Residual(&wrong)).is_err());
        }
        Ok(())
    }

    /// The GELU epilogue equals the GELU of the plain product (float64 GELU), in f32 and on
    /// every bf16 ISA this CPU has, over several row blocks and a partial one.
    #[test]
    fn linear_gelu_epilogue_matches_gelu_of_the_product() -> Result<()> {
        let dev = Device::Cpu;
        let (m, k, n) = (2 * EPILOGUE_ROWS + 45, 40, 37);
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 0.3, (n, k), &dev)?;
        let b = Tensor::randn(0f32, 1.0, n, &dev)?;
        let check = |ours: &Tensor, plain: &Tensor, what: &str| -> Result<()> {
            let want = plain.to_dtype(DType::F64)?.gelu_erf()?;
            let diff = max_abs_diff(ours, &want)?;
            assert!(diff < 1e-6, "{what}: {diff}");
            Ok(())
        };
        let gelu = linear(&x, &w, Some(&b), After::Gelu)?.expect("the CPU f32 kernel applies");
        let plain = linear(&x, &w, Some(&b), After::Nothing)?.expect("as above");
        check(&gelu, &plain, "f32")?;
        let wt = w.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let packed = PackedB::new(&wt, (k, n), (n, 1));
        let isas = super::super::bf16::available_isas();
        if isas.is_empty() {
            eprintln!("bf16 epilogue not tested: this CPU has no bf16 arithmetic");
        }
        for isa in isas {
            let gelu = linear_bf16(&x, isa, &packed, &b, After::Gelu)?;
            let plain = linear_bf16(&x, isa, &packed, &b, After::Nothing)?;
            check(&gelu, &plain, &format!("{isa:?}"))?;
        }
        Ok(())
    }

    #[test]
    fn conv3x3_matches_candle_conv2d() -> Result<()> {
        let dev = Device::Cpu;
        for (b, h, w, cin, cout, chunk) in [
            (2, 5, 7, 4, 6, 1 << 20),
            (1, 9, 4, 3, 5, 40),
            (1, 1, 1, 2, 3, 1),
            (2, 6, 5, 37, 3, 1 << 20),
            // The narrow kernel with every channel count, image widths around its pixel
            // groups, and 64 channels as the models' last convolution has.
            (1, 3, 9, 64, 3, 1 << 20),
            (1, 4, 4, 16, 1, 1 << 20),
            (2, 2, 11, 33, 2, 1 << 20),
            (1, 5, 3, 64, 4, 1 << 20),
        ] {
            let x = Tensor::randn(0f32, 1.0, (b, h, w, cin), &dev)?;
            let weight = Tensor::randn(0f32, 1.0, (cout, cin, 3, 3), &dev)?;
            let bias = Tensor::randn(0f32, 1.0, cout, &dev)?;
            let w9 = weight
                .permute((2, 3, 1, 0))?
                .reshape((9 * cin, cout))?
                .contiguous()?;
            let ours = conv3x3(&x, &w9, &bias, chunk)?.expect("the CPU f32 kernel applies");
            let want = x
                .to_dtype(DType::F64)?
                .permute((0, 3, 1, 2))?
                .conv2d(&weight.to_dtype(DType::F64)?, 1, 1, 1, 1)?
                .broadcast_add(&bias.to_dtype(DType::F64)?.reshape((1, cout, 1, 1))?)?
                .permute((0, 2, 3, 1))?;
            // f32 sums of 9 * cin unit-variance products: the rounding error grows with the
            // number of terms (1.1e-5 seen at 333 terms), a misplaced tap costs O(1).
            let diff = max_abs_diff(&ours, &want)?;
            let tolerance = 1e-6 * (9 * cin) as f64;
            assert!(diff < tolerance, "{b}x{h}x{w}x{cin} chunk {chunk}: {diff}");
        }
        Ok(())
    }

    /// The bf16 convolution against a float64 convolution of the bf16-rounded input and
    /// weights, on every bf16 kernel this CPU has: patches packed straight from the image
    /// (even `cin`, rows wider than a block of pixels, several images) and through the f32
    /// patch matrix (odd `cin`).
    #[test]
    fn bf16_conv_matches_the_rounded_convolution() -> Result<()> {
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F64);
        for isa in super::super::bf16::available_isas() {
            for (b, h, w, cin, cout) in [
                (2, 5, 7, 6, 40),
                (1, 3, 100, 8, 33),
                (1, 4, 5, 5, 32),
                (1, 2, 3, 64, 64),
            ] {
                let x = Tensor::randn(0f32, 1.0, (b, h, w, cin), &dev)?;
                let weight = Tensor::randn(0f32, 1.0, (cout, cin, 3, 3), &dev)?;
                let bias = Tensor::randn(0f32, 1.0, cout, &dev)?;
                let w9 = weight.permute((2, 3, 1, 0))?.reshape((9 * cin, cout))?;
                let ws = w9.flatten_all()?.to_vec1::<f32>()?;
                let packed = PackedB::new(&ws, (9 * cin, cout), (cout, 1));
                let ours = conv3x3_bf16(&x, isa, &packed, &bias, 1 << 20)?;
                let want = round(&x)?
                    .permute((0, 3, 1, 2))?
                    .conv2d(&round(&weight)?, 1, 1, 1, 1)?
                    .broadcast_add(&bias.to_dtype(DType::F64)?.reshape((1, cout, 1, 1))?)?
                    .permute((0, 2, 3, 1))?;
                let diff = max_abs_diff(&ours, &want)?;
                let tolerance = 1e-6 * (9 * cin) as f64;
                assert!(
                    diff < tolerance,
                    "{isa:?} {b}x{h}x{w}x{cin} -> {cout}: {diff}"
                );
            }
        }
        Ok(())
    }

    /// The shuffled convolution against the convolution followed by the shuffle, in f32 and
    /// (where the CPU has it) bf16, for both factors and bands of one and several rows.
    #[test]
    fn shuffled_conv_matches_conv_then_shuffle() -> Result<()> {
        let dev = Device::Cpu;
        for (b, h, w, cin, c, r, chunk) in [
            (2, 5, 7, 6, 16, 2, 1 << 20),
            (1, 4, 3, 5, 32, 3, 1),
            (1, 3, 9, 8, 16, 2, 200),
            // A row wider than one packed block of pixels.
            (1, 2, 100, 8, 16, 2, 1 << 20),
        ] {
            let cout = r * r * c;
            let x = Tensor::randn(0f32, 1.0, (b, h, w, cin), &dev)?;
            let w9 = Tensor::randn(0f32, 0.3, (9 * cin, cout), &dev)?;
            let bias = Tensor::randn(0f32, 1.0, cout, &dev)?;
            let plain = conv3x3(&x, &w9, &bias, chunk)?.expect("f32 kernel");
            let want = pixel_shuffle_reordered(&plain, r)?.expect("f32 kernel");
            let ours = conv3x3_shuffled(&x, &w9, &bias, r, chunk)?.expect("f32 kernel");
            assert_eq!(ours.dims(), [b, h * r, w * r, c]);
            let diff = max_abs_diff(&ours, &want)?;
            assert!(diff < 1e-5, "f32 {b}x{h}x{w}x{cin} r {r}: {diff}");
            if let Some(isa) = super::super::bf16::isa() {
                let ws = w9.flatten_all()?.to_vec1::<f32>()?;
                let packed = PackedB::new(&ws, (9 * cin, cout), (cout, 1));
                let plain = conv3x3_bf16(&x, isa, &packed, &bias, chunk)?;
                let want = pixel_shuffle_reordered(&plain, r)?.expect("f32 kernel");
                let ours = conv3x3_shuffled_bf16(&x, isa, &packed, &bias, r, chunk)?
                    .expect("blocks of 32 and 96 columns start panels");
                let diff = max_abs_diff(&ours, &want)?;
                assert!(diff < 1e-5, "bf16 {b}x{h}x{w}x{cin} r {r}: {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn dense_concatenation_and_shuffle_match_candle() -> Result<()> {
        let dev = Device::Cpu;
        // Channel counts off the vector width, and a negative zero and exact zeros in y.
        let x = Tensor::randn(0f32, 1.0, (2, 3, 37), &dev)?;
        let y = Tensor::randn(0f32, 1.0, (2, 3, 19), &dev)?;
        let y = y.slice_assign(
            &[0..1, 0..1, 0..2],
            &Tensor::new(&[[[-0.0f32, 0.0]]], &dev)?,
        )?;
        let ours = cat_leaky(&x, &y, 0.2)?.expect("the CPU f32 kernel applies");
        let want = Tensor::cat(&[&x, &candle_nn::ops::leaky_relu(&y, 0.2)?], 2)?;
        assert_eq!(ours.dims(), want.dims());
        assert_eq!(
            ours.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
        assert!(cat_leaky(&x, &y.narrow(1, 0, 2)?.contiguous()?, 0.2).is_err());

        for r in [2, 3] {
            let (b, h, w, c) = (2, 3, 4, 5);
            let x = Tensor::randn(0f32, 1.0, (b, h, w, r * r * c), &dev)?;
            let ours = pixel_shuffle_reordered(&x, r)?.expect("the CPU f32 kernel applies");
            let want = x
                .reshape((b, h, w, r, r, c))?
                .permute((0, 1, 3, 2, 4, 5))?
                .reshape((b, h * r, w * r, c))?;
            assert_eq!(
                ours.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
                "r {r}"
            );
        }
        Ok(())
    }
}
