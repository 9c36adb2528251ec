//! LayerNorm on the CPU in f32, fused with the token gathers and the residual add around it.
//!
//! Each Swin block normalises twice, and each time the tokens are also moved (into windows
//! before attention, back out of them after) or summed (the residual). candle's layer norm
//! runs one rayon task per 180-value row with a serial sum, and every neighbouring step is
//! a separate pass over a fresh tensor; here each pair or triple is one parallel pass over
//! rows, with the mean and variance reduced in vector lanes. Each kernel returns `None`
//! where it does not apply (other devices and dtypes), for the caller to use candle's ops.

use std::mem::MaybeUninit;

use candle_core::{DType, Module, Result, Tensor};
use rayon::prelude::*;

use super::Norm;
use crate::ops::cpu::{cpu_slice, use_kernel, widest_simd, CHUNK, LANES};

/// A layer norm's parameters as slices.
#[derive(Clone, Copy)]
struct Params<'a> {
    weight: &'a [f32],
    bias: &'a [f32],
    eps: f32,
    /// The real-channel mask of padded rows ([`Norm`]).
    mask: Option<&'a [f32]>,
    /// What the sums are divided by: the real channels.
    count: f32,
}

impl Params<'_> {
    /// The mean and the inverse standard deviation (with epsilon) over the real channels of
    /// `row`.
    #[inline(always)]
    fn stats(&self, row: &[f32]) -> (f32, f32) {
        let mean = lane_sum(row, row, |v, _| v) / self.count;
        let sum = match self.mask {
            None => lane_sum(row, row, |v, _| (v - mean) * (v - mean)),
            // A padded channel holds 0 and is centred at 0.
            Some(m) => lane_sum(row, m, |v, m| (v - mean * m) * (v - mean * m)),
        };
        let var = sum / self.count;
        (mean, 1.0 / (var + self.eps).sqrt())
    }

    /// `dst = (row - mean) * inv * weight + bias`.
    #[inline(always)]
    fn normalise(&self, row: &[f32], (mean, inv): (f32, f32), dst: &mut [MaybeUninit<f32>]) {
        for (((d, s), w), b) in dst.iter_mut().zip(row).zip(self.weight).zip(self.bias) {
            d.write((s - mean) * inv * w + b);
        }
    }
}

/// The sum of `f(a[i], b[i])` over `a`'s length, in [`LANES`] independent accumulators (lane
/// `l` takes the elements `l`, `l + LANES`, ...) so that it vectorises; then the tail, then
/// the lanes.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let b = &b[..a.len()];
    let mut acc = [0f32; LANES];
    let (a_full, a_tail) = a.as_chunks::<LANES>();
    let (b_full, b_tail) = b.as_chunks::<LANES>();
    for (x, y) in a_full.iter().zip(b_full) {
        for ((acc, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *acc += f(x, y);
        }
    }
    a_tail
        .iter()
        .zip(b_tail)
        .map(|(&x, &y)| f(x, y))
        .sum::<f32>()
        + acc.iter().sum::<f32>()
}

/// Viewed as initialised: every element of `row` has been written.
///
/// # Safety
/// The caller wrote all of `row`.
#[inline(always)]
unsafe fn written(row: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: MaybeUninit<f32> has f32's layout; the caller wrote every element.
    unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<f32>(), row.len()) }
}

/// `dst = LayerNorm(src)` for one row. Two passes (mean, then the variance of the centred
/// values): no cancellation, unlike the one-pass `E[x²] - E[x]²`.
#[inline(always)]
fn norm_row_body(p: &Params, src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    p.normalise(src, p.stats(src), dst);
}

widest_simd! {
    fn norm_row(p: &Params, src: &[f32], dst: &mut [MaybeUninit<f32>]) = norm_row_body
}

/// `sum = x + y` and `dst = LayerNorm(sum)` for one row, the norm read from the sum just
/// written.
#[inline(always)]
fn add_norm_row_body(
    p: &Params,
    x: &[f32],
    y: &[f32],
    sum: &mut [MaybeUninit<f32>],
    dst: &mut [MaybeUninit<f32>],
) {
    let n = x.len();
    let (y, sum) = (&y[..n], &mut sum[..n]);
    for ((s, a), b) in sum.iter_mut().zip(x).zip(y) {
        s.write(a + b);
    }
    // SAFETY: all n values of `sum` were written above.
    let row = unsafe { written(sum) };
    p.normalise(row, p.stats(row), dst);
}

widest_simd! {
    fn add_norm_row(
        p: &Params,
        x: &[f32],
        y: &[f32],
        sum: &mut [MaybeUninit<f32>],
        dst: &mut [MaybeUninit<f32>],
    ) = add_norm_row_body
}

/// [`add_norm_row_body`] with HAT's channel-attention term: `sum = (x + z * s) + y`, `s` the
/// row's per-channel scale. The product and the first sum are rounded as candle's separate
/// multiply and add round them, so the result is the one the unfused ops give, bit for bit.
#[inline(always)]
fn add_scaled_norm_row_body(
    p: &Params,
    (x, z, s): (&[f32], &[f32], &[f32]),
    y: &[f32],
    sum: &mut [MaybeUninit<f32>],
    dst: &mut [MaybeUninit<f32>],
) {
    let n = x.len();
    let (z, s, y, sum) = (&z[..n], &s[..n], &y[..n], &mut sum[..n]);
    for ((((out, &x), &z), &s), &y) in sum.iter_mut().zip(x).zip(z).zip(s).zip(y) {
        out.write((x + z * s) + y);
    }
    // SAFETY: all n values of `sum` were written above.
    let row = unsafe { written(sum) };
    p.normalise(row, p.stats(row), dst);
}

widest_simd! {
    fn add_scaled_norm_row(
        p: &Params,
        xzs: (&[f32], &[f32], &[f32]),
        y: &[f32],
        sum: &mut [MaybeUninit<f32>],
        dst: &mut [MaybeUninit<f32>],
    ) = add_scaled_norm_row_body
}

/// The layer norm's f32 parameters on the CPU, or `None` (no bias, other device or dtype).
fn params_of(norm: &Norm) -> Option<(Tensor, Tensor, f32)> {
    let ln = &norm.ln;
    let bias = ln.bias()?;
    let mask_ok = norm.real().is_none_or(|(m, _)| use_kernel(m));
    (use_kernel(ln.weight()) && use_kernel(bias) && ln.remove_mean() && mask_ok)
        .then(|| (ln.weight().clone(), bias.clone(), ln.eps() as f32))
}

/// Rows per parallel task for rows of `c` values.
fn rows_per_task(c: usize) -> usize {
    (CHUNK / c.max(1)).max(1)
}

/// `f` with the parameters of a layer norm over `c` channels, or `None` where the kernels do
/// not apply to it ([`params_of`]).
fn with_params<R>(
    norm: &Norm,
    c: usize,
    f: impl FnOnce(&Params) -> Result<R>,
) -> Result<Option<R>> {
    let Some((w, b, eps)) = params_of(norm) else {
        return Ok(None);
    };
    if w.dims() != [c] || b.dims() != [c] {
        candle_core::bail!("layer norm of {c} channels with weight {:?}", w.dims());
    }
    let (wg, wl) = w.storage_and_layout();
    let (bg, bl) = b.storage_and_layout();
    let mask = norm
        .real()
        .map(|(m, count)| (m.storage_and_layout(), count));
    let p = Params {
        weight: cpu_slice(&wg, wl)?,
        bias: cpu_slice(&bg, bl)?,
        eps,
        mask: mask
            .as_ref()
            .map(|((g, l), _)| cpu_slice(g, l))
            .transpose()?,
        count: mask.as_ref().map_or(c, |(_, count)| *count) as f32,
    };
    f(&p).map(Some)
}

/// A layer norm over rows of a fixed width, for kernels that normalise rows as they read them
/// (DAT's spatial-gate convolution): the same arithmetic as [`layer_norm`].
pub(crate) struct RowNorm<'a>(Params<'a>);

impl RowNorm<'_> {
    /// `dst = LayerNorm(src)`, both one row; writes every value of `dst`.
    pub(crate) fn row(&self, src: &[f32], dst: &mut [MaybeUninit<f32>]) {
        norm_row(&self.0, src, dst)
    }

    /// `sum = x + y` (with HAT's term `(z, s)`: `(x + z * s) + y`) and `dst = LayerNorm(sum)`,
    /// one row each: the arithmetic of [`add_gather_norm`].
    pub(crate) fn add_row(
        &self,
        (x, scaled): (&[f32], Option<ScaledRow>),
        y: &[f32],
        sum: &mut [MaybeUninit<f32>],
        dst: &mut [MaybeUninit<f32>],
    ) {
        match scaled {
            Some((z, s)) => add_scaled_norm_row(&self.0, (x, z, s), y, sum, dst),
            None => add_norm_row(&self.0, x, y, sum, dst),
        }
    }
}

/// HAT's term for one row of a residual sum: `z`'s row and the image's scale `s`.
pub(crate) type ScaledRow<'a> = (&'a [f32], &'a [f32]);

/// `f` with `norm` as a [`RowNorm`] over rows of `c` values, or `None` where the kernels do
/// not apply to it.
pub(crate) fn with_row_norm<R>(
    norm: &Norm,
    c: usize,
    f: impl FnOnce(&RowNorm) -> R,
) -> Result<Option<R>> {
    with_params(norm, c, |p| Ok(f(&RowNorm(*p))))
}

/// Runs `f(params, row, out_row)` for every output row of `rows` rows of `c` values, in
/// parallel, into a new buffer. `f` must write every element of its row.
fn map_rows(
    norm: &Norm,
    rows: usize,
    c: usize,
    f: impl Fn(&Params, usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Result<Option<Vec<f32>>> {
    with_params(norm, c, |p| {
        let mut out: Vec<f32> = Vec::with_capacity(rows * c);
        let per = rows_per_task(c);
        if c > 0 {
            out.spare_capacity_mut()
                .par_chunks_mut(per * c)
                .enumerate()
                .for_each(|(t, chunk)| {
                    for (k, row) in chunk.chunks_exact_mut(c).enumerate() {
                        f(p, t * per + k, row);
                    }
                });
        }
        // SAFETY: every row was handed to `f`, which writes all of it.
        unsafe { out.set_len(rows * c) };
        Ok(out)
    })
}

/// The u32 indices of a CPU tensor, checked against `bound`.
fn indices(order: &Tensor, bound: usize) -> Result<Option<Vec<u32>>> {
    if !order.device().is_cpu() || order.dtype() != DType::U32 {
        return Ok(None);
    }
    let idx = order.flatten_all()?.to_vec1::<u32>()?;
    if idx.iter().any(|&i| i as usize >= bound) {
        candle_core::bail!("token index out of range for {bound} tokens");
    }
    Ok(Some(idx))
}

/// `ln(x)` for `x` of shape `(.., C)`.
pub fn layer_norm(norm: &Norm, x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        let c = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / c.max(1);
        let (g, l) = x.storage_and_layout();
        let xs = cpu_slice(&g, l)?;
        let out = map_rows(norm, rows, c, |p, r, dst| {
            norm_row(p, &xs[r * c..(r + 1) * c], dst)
        })?;
        drop(g);
        if let Some(out) = out {
            return Tensor::from_vec(out, x.dims(), x.device());
        }
    }
    norm.forward(x)
}

/// `ln(x)` with its tokens put in `order`: `x` is `(B, T, C)`, `order` holds `T'` token
/// indices; returns `(B, T', C)`, i.e. `index_select(ln(x), order, 1)`.
pub fn norm_gather(norm: &Norm, x: &Tensor, order: &Tensor) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    if use_kernel(x) {
        if let Some(idx) = indices(order, t)? {
            let n = idx.len();
            let (g, l) = x.storage_and_layout();
            let xs = cpu_slice(&g, l)?;
            let out = map_rows(norm, b * n, c, |p, r, dst| {
                let src = (r / n * t + idx[r % n] as usize) * c;
                norm_row(p, &xs[src..src + c], dst)
            })?;
            drop(g);
            if let Some(out) = out {
                return Tensor::from_vec(out, (b, n, c), x.device());
            }
        }
    }
    super::cuda::gather_norm(norm, x, order)
}

/// The residual step after window attention: `sum = x + index_select(y, back, 1)` and
/// `ln(sum)`. `x` is `(B, T, C)`, `y` `(B, T', C)`, `back` `T` indices into `T'`. With
/// `scaled` `(z, s)` (HAT's channel-attention branch, `z` `(B, T, C)` and `s` `(B, C)` its
/// scale per image and channel) the sum is `x + z * s + index_select(y, back, 1)`, in the
/// same pass: neither the product nor its sum with `x` costs a pass over the map of its own.
pub fn add_gather_norm(
    norm: &Norm,
    x: &Tensor,
    scaled: Option<(&Tensor, &Tensor)>,
    y: &Tensor,
    back: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t, c, ty) = super::cuda::add_gather_dims(x, scaled, y, back)?;
    let kernel = use_kernel(x)
        && use_kernel(y)
        && scaled.is_none_or(|(z, s)| use_kernel(z) && use_kernel(s));
    if kernel {
        if let Some(idx) = indices(back, ty)? {
            let (xg, xl) = x.storage_and_layout();
            let (yg, yl) = y.storage_and_layout();
            let (xs, ys) = (cpu_slice(&xg, xl)?, cpu_slice(&yg, yl)?);
            let zs_held = scaled.map(|(z, s)| (z.storage_and_layout(), s.storage_and_layout()));
            let zs = match &zs_held {
                Some(((zg, zl), (sg, sl))) => Some((cpu_slice(zg, zl)?, cpu_slice(sg, sl)?)),
                None => None,
            };
            let buffers = with_params(norm, c, |p| {
                let mut sum: Vec<f32> = Vec::with_capacity(b * t * c);
                let mut normed: Vec<f32> = Vec::with_capacity(b * t * c);
                let per = rows_per_task(c) * c;
                if c > 0 {
                    sum.spare_capacity_mut()
                        .par_chunks_mut(per)
                        .zip(normed.spare_capacity_mut().par_chunks_mut(per))
                        .enumerate()
                        .for_each(|(task, (s_chunk, n_chunk))| {
                            let rows = s_chunk.chunks_exact_mut(c).zip(n_chunk.chunks_exact_mut(c));
                            for (k, (s, d)) in rows.enumerate() {
                                let r = task * per / c + k;
                                let src = (r / t * ty + idx[r % t] as usize) * c;
                                let (xr, yr) = (&xs[r * c..(r + 1) * c], &ys[src..src + c]);
                                match zs {
                                    Some((zs, ss)) => {
                                        let (zr, sr) = (&zs[r * c..(r + 1) * c], &ss[r / t * c..]);
                                        add_scaled_norm_row(p, (xr, zr, sr), yr, s, d)
                                    }
                                    None => add_norm_row(p, xr, yr, s, d),
                                }
                            }
                        });
                }
                // SAFETY: both buffers were cut into the same rows, and every row of each was
                // written by `add_norm_row` or `add_scaled_norm_row`.
                unsafe {
                    sum.set_len(b * t * c);
                    normed.set_len(b * t * c);
                }
                Ok((sum, normed))
            })?;
            drop((xg, yg, zs_held));
            if let Some((sum, normed)) = buffers {
                let dev = x.device();
                return Ok((
                    Tensor::from_vec(sum, (b, t, c), dev)?,
                    Tensor::from_vec(normed, (b, t, c), dev)?,
                ));
            }
        }
    }
    super::cuda::add_gather_norm(norm, x, scaled, y, back)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    use crate::ops::pad::{Channels, Pad};
    use crate::tests::fixtures::max_abs_diff;
    use crate::tests::normal;

    /// The layer norm in f64, written out (candle's fused op has no f64 kernel).
    struct Reference {
        weight: Tensor,
        bias: Tensor,
    }

    impl Reference {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let x = x.to_dtype(DType::F64)?;
            let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
            let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
            centred
                .broadcast_div(&(var + 1e-5)?.sqrt()?)?
                .broadcast_mul(&self.weight)?
                .broadcast_add(&self.bias)
        }
    }

    /// A layer norm over the real channels of `channels` with random affine parameters, and
    /// its float64 reference over the real channels.
    fn padded_norms(channels: &Channels) -> Result<(Norm, Reference)> {
        let dev = Device::Cpu;
        let c = channels.real();
        let w = normal(1.0, 0.5, c, &dev)?;
        let b = normal(0.0, 0.5, c, &dev)?;
        Ok((
            Norm::new(channels, w.clone(), b.clone(), 1e-5)?,
            Reference {
                weight: w.to_dtype(DType::F64)?,
                bias: b.to_dtype(DType::F64)?,
            },
        ))
    }

    fn norms(c: usize) -> Result<(Norm, Reference)> {
        padded_norms(&Pad::OFF.one(c))
    }

    /// Tokens far from zero with a small spread: a one-pass variance (E[x²] - E[x]²) in f32
    /// loses it to cancellation, the two-pass one keeps it.
    fn tokens(shape: (usize, usize, usize), offset: f64) -> Result<Tensor> {
        (normal(0.0, 1.0, shape, &Device::Cpu)? + offset)?.contiguous()
    }

    #[test]
    fn layer_norm_matches_float64() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(layer_norm_matches_float64_on_one_isa)
    }

    fn layer_norm_matches_float64_on_one_isa() -> Result<()> {
        // Channel counts below, at and off the vector width, and DRCT's 180.
        for c in [1usize, 16, 37, 180] {
            for offset in [0.0, 1000.0] {
                let (ln, ln64) = norms(c)?;
                let x = tokens((2, 9, c), offset)?;
                let ours = layer_norm(&ln, &x)?;
                let want = ln64.forward(&x)?;
                let diff = max_abs_diff(&ours, &want);
                // At 1000 the inputs' own spacing is 6e-5; the one-pass variance would be
                // off by percents there (errors ~1e-1).
                let tolerance = if offset == 0.0 { 1e-5 } else { 1e-3 };
                assert!(diff < tolerance, "c {c} offset {offset}: {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn norm_gather_matches_gathered_float64_norm() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(norm_gather_matches_gathered_float64_norm_on_one_isa)
    }

    fn norm_gather_matches_gathered_float64_norm_on_one_isa() -> Result<()> {
        let dev = Device::Cpu;
        let (ln, ln64) = norms(37)?;
        let x = tokens((2, 6, 37), 3.0)?;
        let order = Tensor::new(&[5u32, 0, 3, 3, 1], &dev)?;
        let ours = norm_gather(&ln, &x, &order)?;
        let want = ln64
            .forward(&x.to_dtype(DType::F64)?)?
            .index_select(&order, 1)?;
        assert_eq!(ours.dims(), want.dims());
        let diff = max_abs_diff(&ours, &want);
        assert!(diff < 1e-5, "{diff}");
        let bad = Tensor::new(&[6u32], &dev)?;
        assert!(norm_gather(&ln, &x, &bad).is_err());
        Ok(())
    }

    #[test]
    fn add_gather_norm_matches_float64() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(add_gather_norm_matches_float64_on_one_isa)
    }

    fn add_gather_norm_matches_float64_on_one_isa() -> Result<()> {
        let dev = Device::Cpu;
        let (ln, ln64) = norms(19)?;
        let x = tokens((2, 5, 19), 0.0)?;
        let y = tokens((2, 4, 19), 2.0)?;
        let back = Tensor::new(&[3u32, 0, 2, 1, 3], &dev)?;
        let (sum, normed) = add_gather_norm(&ln, &x, None, &y, &back)?;
        // The sum is the same f32 addition candle makes: bit for bit.
        let want_sum = (&x + y.index_select(&back, 1)?)?;
        assert_eq!(
            sum.flatten_all()?.to_vec1::<f32>()?,
            want_sum.flatten_all()?.to_vec1::<f32>()?
        );
        let want = ln64.forward(&want_sum)?;
        let diff = max_abs_diff(&normed, &want);
        assert!(diff < 1e-5, "{diff}");
        let short = Tensor::new(&[0u32, 1], &dev)?;
        assert!(add_gather_norm(&ln, &x, None, &y, &short).is_err());
        let out_of_range = Tensor::new(&[4u32, 0, 0, 0, 0], &dev)?;
        assert!(add_gather_norm(&ln, &x, None, &y, &out_of_range).is_err());
        Ok(())
    }

    /// HAT's channel-attention term folded into the residual step: the kernel's sum and norm
    /// are those of the unfused ops (`x + z * s` with candle, then the plain step) bit for
    /// bit, since both round the product and each sum in f32 in the same order; and near the
    /// float64 norm of the exact sum. Channel counts below, at and off the vector width, and
    /// HAT's 180.
    #[test]
    fn add_gather_norm_with_a_scaled_term_matches_the_unfused_ops() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(
            add_gather_norm_with_a_scaled_term_matches_the_unfused_ops_on_one_isa,
        )
    }

    fn add_gather_norm_with_a_scaled_term_matches_the_unfused_ops_on_one_isa() -> Result<()> {
        let dev = Device::Cpu;
        for c in [5usize, 16, 37, 180] {
            let (ln, ln64) = norms(c)?;
            let x = tokens((2, 7, c), 3.0)?;
            let z = tokens((2, 7, c), 0.0)?;
            // Larger than CONV_SCALE's sigmoids, so that a wrong scale index shows.
            let s = normal(0.0, 1.0, (2, c), &dev)?;
            let y = tokens((2, 5, c), 1.0)?;
            let back = Tensor::new(&[3u32, 0, 2, 1, 4, 4, 1], &dev)?;
            let (sum, normed) = add_gather_norm(&ln, &x, Some((&z, &s)), &y, &back)?;
            let plus = (&x + z.broadcast_mul(&s.reshape((2, 1, c))?)?)?;
            let (want_sum, want_normed) = add_gather_norm(&ln, &plus, None, &y, &back)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> { Ok(crate::tests::fixtures::f32_bits(t)) };
            assert_eq!(bits(&sum)?, bits(&want_sum)?, "c {c}: sum");
            assert_eq!(bits(&normed)?, bits(&want_normed)?, "c {c}: normed");
            let f64_of = |t: &Tensor| t.to_dtype(DType::F64);
            let (s64, z64) = (f64_of(&s)?.reshape((2, 1, c))?, f64_of(&z)?);
            let exact = (f64_of(&x)? + z64.broadcast_mul(&s64)?)?
                .add(&f64_of(&y)?.index_select(&back, 1)?)?;
            let diff = max_abs_diff(&normed, &ln64.forward(&exact)?);
            assert!(diff < 1e-5, "c {c}: {diff}");
            // The term is there: without it the sum is off by about its own size.
            let (plain, _) = add_gather_norm(&ln, &x, None, &y, &back)?;
            assert!(
                max_abs_diff(&plain, &sum) > 0.5,
                "c {c}: the scaled term is missing"
            );
        }
        Ok(())
    }

    /// Where the kernel does not apply (a strided `z`, bf16 rows), candle's composition runs:
    /// a strided `z` gives the kernel's result within f32 noise, bf16 rows within bf16's
    /// rounding of each step; shapes that do not fit are refused.
    #[test]
    fn add_gather_norm_with_a_scaled_term_falls_back_to_candle() -> Result<()> {
        let dev = Device::Cpu;
        let c = 24;
        let (ln, _) = norms(c)?;
        let x = tokens((2, 6, c), 3.0)?;
        let z = tokens((2, 6, c), 0.0)?;
        let s = normal(0.0, 1.0, (2, c), &dev)?;
        let y = tokens((2, 6, c), 1.0)?;
        let back = Tensor::new(&[5u32, 0, 3, 2, 1, 4], &dev)?;
        let (sum, normed) = add_gather_norm(&ln, &x, Some((&z, &s)), &y, &back)?;
        // The same values, laid out transposed: not contiguous, so not the kernel's.
        let zt = z.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
        assert!(!zt.is_contiguous());
        let (sum_t, normed_t) = add_gather_norm(&ln, &x, Some((&zt, &s)), &y, &back)?;
        assert!(max_abs_diff(&sum_t, &sum) < 1e-6);
        assert!(max_abs_diff(&normed_t, &normed) < 1e-5);
        // bf16 rows on the inputs rounded to bf16, against the kernel on the same values:
        // each of the three sums and the product rounds to 8 bits (|sum| < 16: 2^-4 apart).
        let b16 = |t: &Tensor| t.to_dtype(DType::BF16);
        let (xb, zb, sb, yb) = (b16(&x)?, b16(&z)?, b16(&s)?, b16(&y)?);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let (sum32, normed32) = add_gather_norm(
            &ln,
            &f32_of(&xb)?,
            Some((&f32_of(&zb)?, &f32_of(&sb)?)),
            &f32_of(&yb)?,
            &back,
        )?;
        let lnb = Norm::new(
            &Pad::OFF.one(c),
            b16(ln.layer_norm().weight())?,
            b16(ln.layer_norm().bias().unwrap())?,
            1e-5,
        )?;
        let (sum16, normed16) = add_gather_norm(&lnb, &xb, Some((&zb, &sb)), &yb, &back)?;
        assert_eq!(sum16.dtype(), DType::BF16);
        let big = sum32.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(big < 16.0, "{big}");
        let d_sum = max_abs_diff(&sum16, &sum32);
        assert!(d_sum <= 3.0 * 0.0625, "{d_sum}");
        let d_norm = max_abs_diff(&normed16, &normed32);
        assert!(d_norm < 0.2, "{d_norm}");
        // z of another shape, s per token instead of per image: refused.
        let z_short = z.narrow(1, 0, 5)?;
        assert!(add_gather_norm(&ln, &x, Some((&z_short, &s)), &y, &back).is_err());
        let s_tokens = Tensor::ones((2, 6, c), DType::F32, &dev)?;
        assert!(add_gather_norm(&ln, &x, Some((&z, &s_tokens)), &y, &back).is_err());
        Ok(())
    }

    /// Rows padded as a dense block's input (three parts, each with zero channels after it):
    /// every path normalises over the real channels only, far from zero too (the padded zeros
    /// must not enter the variance as `(0 - mean)²`), and writes exact zeros on the padding.
    #[test]
    fn padded_rows_normalise_over_their_real_channels() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(padded_rows_normalise_over_their_real_channels_on_one_isa)
    }

    fn padded_rows_normalise_over_their_real_channels_on_one_isa() -> Result<()> {
        let dev = Device::Cpu;
        let pad = Pad::to(8).unwrap();
        let ch = pad.one(13).then(&pad.parts(2, 5));
        let spread = |t: &Tensor| ch.spread(&t.to_dtype(DType::F32)?, 2);
        let padding = (1.0 - ch.mask(DType::F32, &dev)?)?;
        let padding_is_zero = |t: &Tensor| -> Result<bool> {
            let v = t
                .broadcast_mul(&padding)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            Ok(v == 0.0)
        };
        for offset in [0.0, 1000.0] {
            let (norm, ln64) = padded_norms(&ch)?;
            let x = tokens((2, 6, ch.real()), offset)?;
            let y = tokens((2, 4, ch.real()), 1.0)?;
            let (xp, yp) = (spread(&x)?, spread(&y)?);
            let order = Tensor::new(&[5u32, 0, 3, 3, 1], &dev)?;
            let back = Tensor::new(&[3u32, 0, 2, 1, 3, 1], &dev)?;
            let sum = (&x + y.index_select(&back, 1)?)?;
            let (sum_p, normed_p) = add_gather_norm(&norm, &xp, None, &yp, &back)?;
            let cases = [
                ("layer_norm", layer_norm(&norm, &xp)?, ln64.forward(&x)?),
                ("candle", norm.forward(&xp)?, ln64.forward(&x)?),
                (
                    "norm_gather",
                    norm_gather(&norm, &xp, &order)?,
                    ln64.forward(&x)?.index_select(&order, 1)?,
                ),
                ("add_gather_norm", normed_p, ln64.forward(&sum)?),
            ];
            assert_eq!(max_abs_diff(&sum_p, &spread(&sum)?), 0.0);
            for (name, got, want) in cases {
                let diff = max_abs_diff(&got, &spread(&want)?);
                let tolerance = if offset == 0.0 { 1e-5 } else { 1e-3 };
                assert!(diff < tolerance, "{name}, offset {offset}: {diff}");
                assert!(padding_is_zero(&got)?, "{name}: padded channels not zero");
            }
        }
        Ok(())
    }
}
