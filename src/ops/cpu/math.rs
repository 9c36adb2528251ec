//! Element-wise math for the CPU kernels: a polynomial `exp` and `erf`, the softmax of the
//! attention rows (with the shift mask from region labels and the bf16 rounding of the
//! probabilities), and the exact GELU, each compiled for the widest vector unit; and the
//! spatial mean of HAT's channel attention.

use super::*;

/// `a · b + c`: one fused multiply-add with `FMA` (for bodies compiled where the vector
/// units have it: `widest_simd!`'s `fused`), a multiply and an add without.
#[inline(always)]
pub(crate) fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// exp(x) for x <= 0: 2^n * p(r) with a Cody-Waite reduction and a degree-6 polynomial;
/// relative error ~2e-7. Inputs below -87 return 0 exactly (no denormals downstream).
///
/// Every step is an [`fmadd`]: Rust never contracts `a * b + c` into an FMA, and separate
/// multiplies and adds took twice the instructions on the polynomials' chains.
#[inline(always)]
pub(super) fn exp_nonpositive<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and removing 1.5 * 2^23 rounds to nearest without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let t = fmadd::<FMA>(xc, LOG2E, ROUND);
    let n = t - ROUND;
    // t lies in [2^23, 2^24), where one ulp is 1, so its bits minus ROUND's are n as an
    // integer. Unlike `n as i32` (saturating, NaN-checked) this vectorises.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = fmadd::<FMA>(-n, LN2_LO, fmadd::<FMA>(-n, LN2_HI, xc));
    let p = [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0]
        .iter()
        .fold(1.0 / 720.0, |acc: f32, &c| fmadd::<FMA>(acc, r, c));
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (max absolute error 1.5e-7), odd-extended.
#[inline(always)]
pub(super) fn erf<const FMA: bool>(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / fmadd::<FMA>(a, 0.327_591_1, 1.0);
    let poly = t * [-1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6]
        .iter()
        .fold(1.061_405_4, |acc: f32, &c| fmadd::<FMA>(acc, t, c));
    let y = fmadd::<FMA>(-poly, exp_nonpositive::<FMA>(-a * a), 1.0);
    if x < 0.0 {
        -y
    } else {
        y
    }
}

/// Scores this far below their row's maximum get probability exactly zero. Their true
/// weight (< e^-80 ≈ 2e-35) changes no output, while as numbers they would leave the softmax
/// subnormal (after division by a row sum of up to N) and be multiplied through the slow
/// subnormal path of x86's vector units inside the attention GEMM. With this cutoff every
/// probability is 0 or above 1.8e-35 / 256 ≈ 7e-38, a normal f32, for windows of up to 256
/// tokens; masked pairs (-100) are always exact zeros.
pub(super) const SOFTMAX_CUTOFF: f32 = -80.0;

/// `exp(x)` of a softmax argument `x <= 0`, or exactly 0 below [`SOFTMAX_CUTOFF`].
#[inline(always)]
pub(super) fn softmax_exp<const FMA: bool>(x: f32) -> f32 {
    let e = exp_nonpositive::<FMA>(x);
    if x < SOFTMAX_CUTOFF {
        0.0
    } else {
        e
    }
}

/// Softmax of each length-`n` row of `data`, in place.
#[cfg(test)]
pub(super) fn softmax_rows_body<const FMA: bool>(data: &mut [f32], n: usize) {
    attention_probs_body::<FMA>(data, None, None, n, None);
}

/// The maximum of a row, the starting point of its softmax.
#[inline(always)]
pub(super) fn row_max(row: &[f32]) -> f32 {
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in maxes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&maxes)
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a })
}

/// A row's exponentials relative to its maximum `max`, in place; returns the reciprocal of
/// their sum.
#[inline(always)]
pub(super) fn row_exp<const FMA: bool>(row: &mut [f32], max: f32) -> f32 {
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, v) in sums.iter_mut().zip(c) {
            *v = softmax_exp::<FMA>(*v - max);
            *s += *v;
        }
    }
    let mut sum = 0f32;
    for v in chunks.into_remainder() {
        *v = softmax_exp::<FMA>(*v - max);
        sum += *v;
    }
    1.0 / (sum + sums.iter().sum::<f32>())
}

/// Rows of scores the softmax takes a step at a time: at most this many, and at most 16 KiB
/// of them, so that they stay in L1 between its steps.
const SOFTMAX_ROWS: usize = 64;

#[inline(always)]
pub(super) fn attention_probs_body<const FMA: bool>(
    scores: &mut [f32],
    bias: Option<(&RelativeBias, usize)>,
    labels: Option<&[u8]>,
    n: usize,
    mut rounded: Option<&mut PackedA>,
) {
    // Each step over a block of rows before the next: a row's maximum, sum and reciprocal
    // are chains of dependent instructions, which row after row left the vector units
    // waiting (held to AVX2, 64 keys with bias and mask: 1.05x; bare rows 1.15x). Each
    // row's arithmetic is unchanged.
    if n == 0 {
        return;
    }
    let rows = (4096 / n).clamp(1, SOFTMAX_ROWS);
    let (mut max, mut inv) = ([0f32; SOFTMAX_ROWS], [0f32; SOFTMAX_ROWS]);
    for (b, block) in scores.chunks_mut(rows * n).enumerate() {
        let first = b * rows;
        for (k, (row, max)) in block.chunks_exact_mut(n).zip(&mut max).enumerate() {
            // Same order of additions as the reference: (q·k + bias) + mask.
            if let Some((bias, h)) = bias {
                bias.add_to_row(h, first + k, row);
            }
            if let Some(labels) = labels {
                let own = labels[first + k];
                for (s, &l) in row.iter_mut().zip(labels) {
                    *s += if l == own { 0.0 } else { MASK_VALUE };
                }
            }
            *max = row_max(row);
        }
        for ((row, &max), inv) in block.chunks_exact_mut(n).zip(&max).zip(&mut inv) {
            *inv = row_exp::<FMA>(row, max);
        }
        for (k, (row, &inv)) in block.chunks_exact_mut(n).zip(&inv).enumerate() {
            row.iter_mut().for_each(|v| *v *= inv);
            if let Some(packed) = rounded.as_deref_mut() {
                packed.set_row(first + k, row);
            }
        }
    }
}

widest_simd! {
    /// A head's attention probabilities from its `n x n` scores, in place: its position
    /// bias added (`bias`: the table and the head; `None` where the scores start from it),
    /// the window's region labels (`labels`) standing for the shift mask; with `rounded`,
    /// each row is also rounded into that bf16 operand as soon as it is final.
    pub(crate) fn attention_probs(
        scores: &mut [f32],
        bias: Option<(&RelativeBias, usize)>,
        labels: Option<&[u8]>,
        n: usize,
        rounded: Option<&mut PackedA>,
    ) = fused attention_probs_body
}

#[inline(always)]
pub(crate) fn gelu_body<const FMA: bool>(data: &mut [f32]) {
    data.iter_mut().for_each(|v| {
        let half = 0.5 * *v;
        *v = fmadd::<FMA>(half, erf::<FMA>(*v * std::f32::consts::FRAC_1_SQRT_2), half);
    });
}

widest_simd! {
    /// The exact GELU, in place.
    pub(crate) fn gelu_in_place(data: &mut [f32]) = fused gelu_body
}

pub(super) struct GeluErf;

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

/// The exact (erf) GELU.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        x.apply_op1_no_bwd(&GeluErf)
    } else {
        x.gelu_erf()
    }
}

/// The mean over height and width of `(B, H, W, C)`, as `(B, 1, 1, C)`: HAT's channel
/// attention pools every block's convolution output so. candle reduces a middle axis value
/// by value through its strides; the kernel adds whole rows of `C` in parallel over row blocks,
/// in f64, so that the order of the additions moves the result far below f32's precision.
pub fn mean_hw(x: &Tensor) -> Result<Tensor> {
    centre_mean(x, 0)
}

/// [`mean_hw`] over the centre of `x` less `t` pixels on every side (Real-CUGAN's gates
/// pool a map they crop), read in place.
pub fn centre_mean(x: &Tensor, t: usize) -> Result<Tensor> {
    let (_, h, w, _) = x.dims4()?;
    if 2 * t >= h.min(w) {
        candle_core::bail!("centre_mean: {:?} less {t} a side", x.dims());
    }
    if use_kernel(x) && x.elem_count() > 0 {
        x.apply_op1_no_bwd(&MeanHw { t })
    } else {
        x.narrow(1, t, h - 2 * t)?
            .narrow(2, t, w - 2 * t)?
            .mean_keepdim(1)?
            .mean_keepdim(2)
    }
}

struct MeanHw {
    /// Pixels left out on every side.
    t: usize,
}

impl CustomOp1 for MeanHw {
    fn name(&self) -> &'static str {
        "upscale-mean-hw"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = contiguous_f32(storage, layout)?;
        let (b, h, w, c) = layout.shape().dims4()?;
        let t = self.t;
        let (oh, ow) = (h - 2 * t, w - 2 * t);
        let mut out = Vec::with_capacity(b * c);
        for image in data.chunks_exact(h * w * c.max(1)).take(b) {
            // Each image row's centre is `ow` whole pixels in a row; blocks of rows big
            // enough to amortise a task, summed apart, then together.
            let block = (CHUNK / (ow * c).max(1)).max(1);
            let rows: Vec<usize> = (t..h - t).collect();
            let sums = rows
                .par_chunks(block)
                .map(|ys| {
                    let mut acc = vec![0f64; c];
                    for &y in ys {
                        let row = &image[(y * w + t) * c..(y * w + t + ow) * c];
                        for px in row.chunks_exact(c) {
                            acc.iter_mut().zip(px).for_each(|(a, &v)| *a += v as f64);
                        }
                    }
                    acc
                })
                .reduce(
                    || vec![0f64; c],
                    |mut a, b| {
                        a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                        a
                    },
                );
            out.extend(sums.iter().map(|&s| (s / (oh * ow) as f64) as f32));
        }
        Ok((CpuStorage::F32(out), Shape::from((b, 1, 1, c))))
    }
}

/// sigmoid(x) = 1 / (1 + e^-x), from `e = exp(-|x|)` so that the exponential never
/// overflows: `1 / (1 + e)` for x >= 0, `e / (1 + e)` below.
#[inline(always)]
pub(crate) fn sigmoid<const FMA: bool>(x: f32) -> f32 {
    let e = exp_nonpositive::<FMA>(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x < 0.0 {
        e * s
    } else {
        s
    }
}

#[inline(always)]
fn silu_body<const FMA: bool>(out: &mut [f32], x: &[f32]) {
    out.iter_mut()
        .zip(x)
        .for_each(|(o, &v)| *o = v * sigmoid::<FMA>(v));
}

widest_simd! {
    /// `x · sigmoid(x)` of each element of `x`, into `out`.
    fn silu_into(out: &mut [f32], x: &[f32]) = fused silu_body
}

/// `(o + x) · (sigmoid(o) - 0.5)`. The centred sigmoid is `±(1 - e) / (2 (1 + e))` with
/// `e = exp(-|o|)`, which is exactly `sigmoid(o) - 0.5` without its cancellation near 0.
#[inline(always)]
fn sigmoid_gate_body<const FMA: bool>(out: &mut [f32], o: &[f32], x: &[f32]) {
    for ((out, &o), &x) in out.iter_mut().zip(o).zip(x) {
        *out = sigmoid_gate_of::<FMA>(o, x);
    }
}

/// SPAN's attention of one element, `(o + x) · (sigmoid(o) - 0.5)`.
#[inline(always)]
pub(crate) fn sigmoid_gate_of<const FMA: bool>(o: f32, x: f32) -> f32 {
    let e = exp_nonpositive::<FMA>(-o.abs());
    let h = 0.5 * (1.0 - e) / (1.0 + e);
    (o + x) * if o < 0.0 { -h } else { h }
}

widest_simd! {
    /// SPAN's parameter-free attention on each element, into `out`.
    fn sigmoid_gate_into(out: &mut [f32], o: &[f32], x: &[f32]) = fused sigmoid_gate_body
}

/// SiLU (`x · sigmoid(x)`, `nn.SiLU`): one parallel pass on the CPU in f32, candle's op
/// elsewhere.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !use_kernel(x) {
        return x.silu();
    }
    let (guard, layout) = x.storage_and_layout();
    let xs = cpu_slice(&guard, layout)?;
    let mut out = vec![0f32; xs.len()];
    out.par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .for_each(|(out, x)| silu_into(out, x));
    drop(guard);
    Tensor::from_vec(out, x.dims(), x.device())
}

/// SPAN's attention, `(o + x) · (sigmoid(o) - 0.5)`: one parallel pass on the CPU in f32
/// where candle's ops make four, candle's ops elsewhere.
pub fn sigmoid_gate(o: &Tensor, x: &Tensor) -> Result<Tensor> {
    if !use_kernel(o) || !use_kernel(x) {
        let centred = candle_nn::ops::sigmoid(o)?.affine(1.0, -0.5)?;
        return (o + x)?.mul(&centred);
    }
    zip_map("sigmoid gate", o, x, sigmoid_gate_into)
}

/// `f` over matching chunks of `o` and `x` (f32 on the CPU, contiguous, the same shape),
/// in parallel, into a new tensor of their shape; `what` names the operation in an error.
fn zip_map(
    what: &str,
    o: &Tensor,
    x: &Tensor,
    f: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> Result<Tensor> {
    if o.dims() != x.dims() {
        candle_core::bail!("{what}: {:?} and {:?}", o.dims(), x.dims());
    }
    let (o_guard, o_layout) = o.storage_and_layout();
    let (x_guard, x_layout) = x.storage_and_layout();
    let (os, xs) = (
        cpu_slice(&o_guard, o_layout)?,
        cpu_slice(&x_guard, x_layout)?,
    );
    let mut out = vec![0f32; os.len()];
    out.par_chunks_mut(CHUNK)
        .zip(os.par_chunks(CHUNK).zip(xs.par_chunks(CHUNK)))
        .for_each(|(out, (o, x))| f(out, o, x));
    drop((o_guard, x_guard));
    Tensor::from_vec(out, o.dims(), o.device())
}

/// Mish of one element, `v · tanh(softplus(v))`. With `t = exp(-|v|)`, `tanh(softplus(v))`
/// is `t (t + 2) / (t (t + 2) + 2)` for `v <= 0` and `(1 + 2t) / (1 + 2t + 2t²)` above: the
/// same quantity, `(e^2v + 2e^v) / (e^2v + 2e^v + 2)`, with no exponential that overflows.
#[inline(always)]
pub(crate) fn mish_of<const FMA: bool>(v: f32) -> f32 {
    let t = exp_nonpositive::<FMA>(-v.abs());
    let ratio = if v <= 0.0 {
        let n = t * (t + 2.0);
        n / (n + 2.0)
    } else {
        let n = fmadd::<FMA>(2.0, t, 1.0);
        n / fmadd::<FMA>(2.0 * t, t, n)
    };
    v * ratio
}

#[inline(always)]
fn mish_body<const FMA: bool>(out: &mut [f32], x: &[f32]) {
    out.iter_mut()
        .zip(x)
        .for_each(|(o, &v)| *o = mish_of::<FMA>(v));
}

widest_simd! {
    /// Mish of each element of `x`, into `out`.
    fn mish_into(out: &mut [f32], x: &[f32]) = fused mish_body
}

/// Mish (`x · tanh(softplus(x))`, `nn.Mish`): one parallel pass on the CPU in f32, candle's
/// ops elsewhere (computed in f32 there too).
pub fn mish(x: &Tensor) -> Result<Tensor> {
    if !use_kernel(x) {
        let v = x.to_dtype(DType::F32)?;
        // tanh(softplus(v)) = n / (n + 2) with n = e^v (e^v + 2); above 20 it is 1 in f32.
        let e = v.minimum(20.0)?.exp()?;
        let n = (&e * (&e + 2.0)?)?;
        return (&v * (&n / (&n + 2.0)?)?)?.to_dtype(x.dtype());
    }
    let (guard, layout) = x.storage_and_layout();
    let xs = cpu_slice(&guard, layout)?;
    let mut out = vec![0f32; xs.len()];
    out.par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .for_each(|(out, x)| mish_into(out, x));
    drop(guard);
    Tensor::from_vec(out, x.dims(), x.device())
}

#[inline(always)]
fn mish_gate_body<const FMA: bool>(out: &mut [f32], y: &[f32], tail: &[f32]) {
    let (h, k) = (out.len(), tail.len());
    let (first, last) = out.split_at_mut(h - k);
    for ((o, &g), &i) in first.iter_mut().zip(&y[..h - k]).zip(&y[h..2 * h - k]) {
        *o = mish_of::<FMA>(g) * i;
    }
    for ((o, &g), &c) in last.iter_mut().zip(&y[h - k..h]).zip(tail) {
        *o = mish_of::<FMA>(g) * c;
    }
}

widest_simd! {
    /// One token of [`mish_gate`]: `out` its `h` channels, `y` its `2h`, `tail` its `k`.
    fn mish_gate_into(out: &mut [f32], y: &[f32], tail: &[f32]) = fused mish_gate_body
}

/// MambaOut's gate, `mish(g) · cat(i, c)` (MoSR), in one parallel pass on the CPU in f32:
/// `y` `(.., 2h)` holds g (its first `h` channels) and i (the next `h - k`), `tail` `(.., k)`
/// is c (made from `y`'s last `k`). The values of Mish, the concatenation and the product
/// one after the other. `None` where the kernel does not apply.
pub fn mish_gate(y: &Tensor, h: usize, tail: &Tensor) -> Result<Option<Tensor>> {
    if !use_kernel(y) || !use_kernel(tail) {
        return Ok(None);
    }
    let minus1 = candle_core::D::Minus1;
    let (n, k) = (y.dim(minus1)?, tail.dim(minus1)?);
    let tokens = y.elem_count() / n.max(1);
    if n != 2 * h || k > h || tail.elem_count() != tokens * k {
        candle_core::bail!(
            "mish gate: {:?} and {:?} for {h} channels",
            y.dims(),
            tail.dims()
        );
    }
    let mut shape = y.dims().to_vec();
    *shape.last_mut().expect("a channel axis") = h;
    if tokens * h == 0 {
        return Ok(Some(Tensor::zeros(shape, DType::F32, y.device())?));
    }
    let (yg, yl) = y.storage_and_layout();
    let (tg, tl) = tail.storage_and_layout();
    let (ys, ts) = (cpu_slice(&yg, yl)?, cpu_slice(&tg, tl)?);
    let mut out = vec![0f32; tokens * h];
    let per = (CHUNK / h).max(1);
    out.par_chunks_mut(per * h)
        .enumerate()
        .for_each(|(task, out)| {
            for (i, row) in out.chunks_exact_mut(h).enumerate() {
                let t = task * per + i;
                mish_gate_into(row, &ys[t * n..][..n], &ts[t * k..][..k]);
            }
        });
    drop((yg, tg));
    Ok(Some(Tensor::from_vec(out, shape, y.device())?))
}

#[inline(always)]
fn modulate_body<const FMA: bool>(out: &mut [f32], o: &[f32], x: &[f32]) {
    for ((out, &o), &x) in out.iter_mut().zip(o).zip(x) {
        *out = x * sigmoid::<FMA>(o);
    }
}

widest_simd! {
    /// `x · sigmoid(o)` of each element, into `out`.
    fn modulate_into(out: &mut [f32], o: &[f32], x: &[f32]) = fused modulate_body
}

/// `x · sigmoid(o)` (RealPLKSR's element-wise attention, `o` a convolution of `x`): one
/// parallel pass on the CPU in f32, candle's ops elsewhere.
pub fn modulate(o: &Tensor, x: &Tensor) -> Result<Tensor> {
    if !use_kernel(o) || !use_kernel(x) {
        return x.mul(&candle_nn::ops::sigmoid(o)?);
    }
    zip_map("modulate", o, x, modulate_into)
}

#[inline(always)]
fn gelu_gate_body<const FMA: bool>(out: &mut [f32], rows: &[f32], c: usize) {
    for (out, row) in out.chunks_exact_mut(c).zip(rows.chunks_exact(2 * c)) {
        let (a, b) = row.split_at(c);
        out.copy_from_slice(a);
        gelu_body::<FMA>(out);
        out.iter_mut().zip(b).for_each(|(o, &b)| *o *= b);
    }
}

widest_simd! {
    /// `gelu(a) · b` of each row `a | b` of `rows` (two halves of `c`), into `out`'s rows.
    fn gelu_gate_into(out: &mut [f32], rows: &[f32], c: usize) = fused gelu_gate_body
}

/// `gelu(h[..., :C]) · h[..., C:]` of `h` `(..., 2C)`, with the exact GELU: the gated
/// feed-forward's gate, one parallel pass on the CPU in f32, candle's ops elsewhere.
pub fn gelu_gate(h: &Tensor) -> Result<Tensor> {
    let last = h.rank().saturating_sub(1);
    let c = h.dim(last)? / 2;
    if !use_kernel(h) || c == 0 {
        return gelu_erf(&h.narrow(last, 0, c)?)? * h.narrow(last, c, c)?;
    }
    let (guard, layout) = h.storage_and_layout();
    let hs = cpu_slice(&guard, layout)?;
    let mut out = vec![0f32; hs.len() / 2];
    // Whole rows a task: a chunk of about CHUNK outputs.
    let rows = (CHUNK / c).max(1);
    out.par_chunks_mut(rows * c)
        .zip(hs.par_chunks(rows * 2 * c))
        .for_each(|(out, h)| gelu_gate_into(out, h, c));
    drop(guard);
    let mut dims = h.dims().to_vec();
    dims[last] = c;
    Tensor::from_vec(out, dims, h.device())
}

#[inline(always)]
fn gemm_f64_body(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize), c: &mut [f64]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    // Blocks of 4 rows by 16 columns with their sums in registers through all of k (each
    // value of b loaded once per 4 rows, each of c once); the rest along rows, as before.
    // Every sum adds its k products in order either way, so both give the same bits.
    const R: usize = 4;
    const W: usize = 16;
    let (m4, n16) = (m - m % R, n - n % W);
    for i0 in (0..m4).step_by(R) {
        for j0 in (0..n16).step_by(W) {
            let mut acc: [[f64; W]; R] =
                std::array::from_fn(|r| c[(i0 + r) * n + j0..][..W].try_into().expect("W values"));
            for p in 0..k {
                let bp: &[f64; W] = b[p * n + j0..][..W].try_into().expect("W values");
                for (r, acc) in acc.iter_mut().enumerate() {
                    let s = a[(i0 + r) * k + p];
                    for (acc, &bv) in acc.iter_mut().zip(bp) {
                        *acc += s * bv;
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                c[(i0 + r) * n + j0..][..W].copy_from_slice(acc);
            }
        }
    }
    let axpy = |i: usize, cols: std::ops::Range<usize>, c: &mut [f64]| {
        let row = &a[i * k..][..k];
        for (p, &s) in row.iter().enumerate() {
            let bp = &b[p * n..][cols.clone()];
            c[i * n..][cols.clone()]
                .iter_mut()
                .zip(bp)
                .for_each(|(c, b)| *c += s * b);
        }
    };
    for i in 0..m4 {
        if n16 < n {
            axpy(i, n16..n, c);
        }
    }
    for i in m4..m {
        axpy(i, 0..n, c);
    }
}

widest_simd! {
    /// `c += a · b` in f64 for row-major `a` (`m x k`), `b` (`k x n`) and `c` (`m x n`),
    /// along contiguous rows of `b` and `c`: the load-time folds of weights.
    pub(crate) fn gemm_f64(a: &[f64], b: &[f64], dims: (usize, usize, usize), c: &mut [f64]) = gemm_f64_body
}
