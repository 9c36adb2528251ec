//! LayerNorm on the CPU in f32, fused with the token gathers and the residual add around it.
//!
//! Each Swin block normalises twice, and each time the tokens are also moved (into windows
//! before attention, back out of them after) or summed (the residual). candle's layer norm
//! runs one rayon task per 180-value row with a serial sum, and every neighbouring step is
//! a separate pass over a fresh tensor; here each pair or triple is one parallel pass over
//! rows, with the mean and variance reduced in vector lanes. Each kernel returns `None`
//! where it does not apply (other devices and dtypes), for the caller to use candle's ops.

use std::mem::MaybeUninit;

use candle_core::{DType, Result, Tensor};
use candle_nn::LayerNorm;
use rayon::prelude::*;

use super::ops::{cpu_slice, use_kernel, widest_simd, CHUNK, LANES};

/// A layer norm's parameters as slices.
struct Params<'a> {
    weight: &'a [f32],
    bias: &'a [f32],
    eps: f32,
}

/// Sum of `n` values produced by `f`, in [`LANES`] independent accumulators so that it
/// vectorises.
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let full = n / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(base + l);
        }
    }
    (full..n).map(f).sum::<f32>() + acc.iter().sum::<f32>()
}

/// `dst = LayerNorm(src)` for one row. Two passes (mean, then the variance of the centred
/// values): no cancellation, unlike the one-pass `E[x²] - E[x]²`.
#[inline(always)]
fn norm_row_body(p: &Params, src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    let n = src.len();
    let mean = lane_sum(n, |i| src[i]) / n as f32;
    let var = lane_sum(n, |i| (src[i] - mean) * (src[i] - mean)) / n as f32;
    let inv = 1.0 / (var + p.eps).sqrt();
    for (((d, s), w), b) in dst.iter_mut().zip(src).zip(p.weight).zip(p.bias) {
        d.write((s - mean) * inv * w + b);
    }
}

widest_simd! {
    fn norm_row(p: &Params, src: &[f32], dst: &mut [MaybeUninit<f32>]) = norm_row_body
}

/// `sum = x + y` and `dst = LayerNorm(sum)` for one row; the sum is recomputed rather than
/// read back from the uninitialised output.
#[inline(always)]
fn add_norm_row_body(
    p: &Params,
    x: &[f32],
    y: &[f32],
    sum: &mut [MaybeUninit<f32>],
    dst: &mut [MaybeUninit<f32>],
) {
    let n = x.len();
    let y = &y[..n];
    for ((s, a), b) in sum.iter_mut().zip(x).zip(y) {
        s.write(a + b);
    }
    let mean = lane_sum(n, |i| x[i] + y[i]) / n as f32;
    let var = lane_sum(n, |i| (x[i] + y[i] - mean) * (x[i] + y[i] - mean)) / n as f32;
    let inv = 1.0 / (var + p.eps).sqrt();
    for ((((d, a), b), w), bias) in dst.iter_mut().zip(x).zip(y).zip(p.weight).zip(p.bias) {
        d.write((a + b - mean) * inv * w + bias);
    }
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

/// The layer norm's f32 parameters on the CPU, or `None` (no bias, other device or dtype).
fn params_of(ln: &LayerNorm) -> Option<(Tensor, Tensor, f32)> {
    let bias = ln.bias()?;
    (use_kernel(ln.weight()) && use_kernel(bias) && ln.remove_mean())
        .then(|| (ln.weight().clone(), bias.clone(), ln.eps() as f32))
}

/// Rows per parallel task for rows of `c` values.
fn rows_per_task(c: usize) -> usize {
    (CHUNK / c.max(1)).max(1)
}

/// `f` with the parameters of a layer norm over `c` channels, or `None` where the kernels do
/// not apply to it ([`params_of`]).
fn with_params<R>(
    ln: &LayerNorm,
    c: usize,
    f: impl FnOnce(&Params) -> Result<R>,
) -> Result<Option<R>> {
    let Some((w, b, eps)) = params_of(ln) else {
        return Ok(None);
    };
    if w.dims() != [c] || b.dims() != [c] {
        candle_core::bail!("layer norm of {c} channels with weight {:?}", w.dims());
    }
    let (wg, wl) = w.storage_and_layout();
    let (bg, bl) = b.storage_and_layout();
    let p = Params {
        weight: cpu_slice(&wg, wl)?,
        bias: cpu_slice(&bg, bl)?,
        eps,
    };
    f(&p).map(Some)
}

/// Runs `f(params, row, out_row)` for every output row of `rows` rows of `c` values, in
/// parallel, into a new buffer. `f` must write every element of its row.
fn map_rows(
    ln: &LayerNorm,
    rows: usize,
    c: usize,
    f: impl Fn(&Params, usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Result<Option<Vec<f32>>> {
    with_params(ln, c, |p| {
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
pub fn layer_norm(ln: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        let c = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / c.max(1);
        let (g, l) = x.storage_and_layout();
        let xs = cpu_slice(&g, l)?;
        let out = map_rows(ln, rows, c, |p, r, dst| {
            norm_row(p, &xs[r * c..(r + 1) * c], dst)
        })?;
        drop(g);
        if let Some(out) = out {
            return Tensor::from_vec(out, x.dims(), x.device());
        }
    }
    candle_core::Module::forward(ln, x)
}

/// `ln(x)` with its tokens put in `order`: `x` is `(B, T, C)`, `order` holds `T'` token
/// indices; returns `(B, T', C)`, i.e. `index_select(ln(x), order, 1)`.
pub fn norm_gather(ln: &LayerNorm, x: &Tensor, order: &Tensor) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    if use_kernel(x) {
        if let Some(idx) = indices(order, t)? {
            let n = idx.len();
            let (g, l) = x.storage_and_layout();
            let xs = cpu_slice(&g, l)?;
            let out = map_rows(ln, b * n, c, |p, r, dst| {
                let src = (r / n * t + idx[r % n] as usize) * c;
                norm_row(p, &xs[src..src + c], dst)
            })?;
            drop(g);
            if let Some(out) = out {
                return Tensor::from_vec(out, (b, n, c), x.device());
            }
        }
    }
    super::rowwise::gather_norm(ln, x, order)
}

/// The residual step after window attention: `sum = x + index_select(y, back, 1)` and
/// `ln(sum)`. `x` is `(B, T, C)`, `y` `(B, T', C)`, `back` `T` indices into `T'`.
pub fn add_gather_norm(
    ln: &LayerNorm,
    x: &Tensor,
    y: &Tensor,
    back: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t, c, ty) = super::rowwise::add_gather_dims(x, y, back)?;
    if use_kernel(x) && use_kernel(y) {
        if let Some(idx) = indices(back, ty)? {
            let (xg, xl) = x.storage_and_layout();
            let (yg, yl) = y.storage_and_layout();
            let (xs, ys) = (cpu_slice(&xg, xl)?, cpu_slice(&yg, yl)?);
            let buffers = with_params(ln, c, |p| {
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
                                add_norm_row(p, &xs[r * c..(r + 1) * c], &ys[src..src + c], s, d);
                            }
                        });
                }
                // SAFETY: both buffers were cut into the same rows, and every row of each was
                // written by `add_norm_row`.
                unsafe {
                    sum.set_len(b * t * c);
                    normed.set_len(b * t * c);
                }
                Ok((sum, normed))
            })?;
            drop((xg, yg));
            if let Some((sum, normed)) = buffers {
                let dev = x.device();
                return Ok((
                    Tensor::from_vec(sum, (b, t, c), dev)?,
                    Tensor::from_vec(normed, (b, t, c), dev)?,
                ));
            }
        }
    }
    super::rowwise::add_gather_norm(ln, x, y, back)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    use crate::tests::fixtures::max_abs_diff;

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

    /// A layer norm with random affine parameters, and its float64 reference.
    fn norms(c: usize) -> Result<(LayerNorm, Reference)> {
        let dev = Device::Cpu;
        let w = Tensor::randn(1f32, 0.5, c, &dev)?;
        let b = Tensor::randn(0f32, 0.5, c, &dev)?;
        Ok((
            LayerNorm::new(w.clone(), b.clone(), 1e-5),
            Reference {
                weight: w.to_dtype(DType::F64)?,
                bias: b.to_dtype(DType::F64)?,
            },
        ))
    }

    /// Tokens far from zero with a small spread: a one-pass variance (E[x²] - E[x]²) in f32
    /// loses it to cancellation, the two-pass one keeps it.
    fn tokens(shape: (usize, usize, usize), offset: f64) -> Result<Tensor> {
        (Tensor::randn(0f32, 1.0, shape, &Device::Cpu)? + offset)?.contiguous()
    }

    #[test]
    fn layer_norm_matches_float64() -> Result<()> {
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
        let dev = Device::Cpu;
        let (ln, ln64) = norms(19)?;
        let x = tokens((2, 5, 19), 0.0)?;
        let y = tokens((2, 4, 19), 2.0)?;
        let back = Tensor::new(&[3u32, 0, 2, 1, 3], &dev)?;
        let (sum, normed) = add_gather_norm(&ln, &x, &y, &back)?;
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
        assert!(add_gather_norm(&ln, &x, &y, &short).is_err());
        let out_of_range = Tensor::new(&[4u32, 0, 0, 0, 0], &dev)?;
        assert!(add_gather_norm(&ln, &x, &y, &out_of_range).is_err());
        Ok(())
    }
}
