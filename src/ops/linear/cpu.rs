//! Linear layers straight onto the GEMM: the bias, a residual or the exact GELU applied as
//! the GEMM writes its rows, in f32 or with bf16 products.

use candle_core::{Result, Tensor};

use crate::ops::cpu::bf16::{Epilogue, Isa, PackedB};
use rayon::prelude::*;

use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::{
    cpu_slice, gelu_in_place, panels, par_rows, product, use_kernel, with_cpu_slices, Weights,
};

/// What a linear layer does besides `x · wᵀ + b`.
#[derive(Clone, Copy)]
pub enum After<'a> {
    Nothing,
    /// Adds this tensor (the output's shape): accumulated by the GEMM, which starts from
    /// residual + bias instead of the bias.
    Residual(&'a Tensor),
    /// The exact GELU, applied to each block of output rows as the GEMM finishes it.
    Gelu,
    /// LeakyReLU with this negative slope, applied the same way.
    Leaky(f32),
}

impl<'a> After<'a> {
    fn residual(self) -> Option<&'a Tensor> {
        match self {
            Self::Residual(r) => Some(r),
            _ => None,
        }
    }

    /// What runs on each block of finished output rows, if anything.
    fn epilogue(self) -> Option<Box<Epilogue>> {
        match self {
            Self::Gelu => Some(Box::new(gelu_rows)),
            Self::Leaky(slope) => Some(Box::new(move |rows: &mut [f32]| {
                rows.iter_mut().for_each(|v| {
                    if *v < 0.0 {
                        *v *= slope
                    }
                })
            })),
            Self::Nothing | Self::Residual(_) => None,
        }
    }
}

/// [`gelu_in_place`] as a product's epilogue.
pub(super) fn gelu_rows(rows: &mut [f32]) {
    gelu_in_place(rows)
}

/// `w` `(n, k)` (f32, on the CPU, contiguous) as the panels' `k x n` operand, where the panel
/// kernels run; `None` elsewhere.
pub(crate) fn pack(w: &Tensor) -> Result<Option<panels::Panels>> {
    if !use_kernel(w) || !panels::available() {
        return Ok(None);
    }
    let (n, k) = w.dims2()?;
    let (guard, layout) = w.storage_and_layout();
    let packed = panels::Panels::new(cpu_slice(&guard, layout)?, (k, n), (1, k));
    Ok(Some(packed))
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
    let y = linear_with(x, (Weights::F32(ws), None), (k, n), (1, k), b, after)?;
    drop(w_guard);
    Ok(Some(y))
}

/// [`linear`] with the weight packed at load ([`pack`]): `x`, `b` and the residual f32 on
/// the CPU, contiguous.
pub fn linear_packed(
    x: &Tensor,
    w: &panels::Panels,
    b: Option<&Tensor>,
    after: After,
) -> Result<Tensor> {
    let (k, n) = w.dims();
    // The f32 weight is not read where the panels are given: the products go through them
    // whenever there is one to compute (panels exist only where their kernels run).
    linear_with(x, (Weights::F32(&[]), Some(w)), (k, n), (1, k), b, after)
}

/// `residual + fc2(gelu(fc1(x)))`, a transformer block's MLP, one block of rows at a time:
/// each parallel task takes [`panels::task_rows`] rows through the first layer and the GELU
/// into a buffer of its own and straight on through the second, so the hidden activations
/// (twice the channels, 5.9 MB for a 64x64 SwinIR input) stay in the core's cache instead of
/// going out to memory and back. Each output row is computed exactly as the two layers one
/// after the other compute it: the same bits. `x` `(.., k)`, the biases and `residual` (the
/// output's shape) f32 on the CPU, contiguous; `None` where the shapes do not chain.
pub fn mlp_packed(
    x: &Tensor,
    (w1, b1): (&panels::Panels, &Tensor),
    (w2, b2): (&panels::Panels, &Tensor),
    residual: &Tensor,
) -> Result<Option<Tensor>> {
    let ((k, h), (h2, n)) = (w1.dims(), w2.dims());
    let dims = x.dims();
    let m = x.elem_count() / k.max(1);
    if h2 != h
        || dims.last() != Some(&k)
        || b1.dims() != [h]
        || b2.dims() != [n]
        || residual.elem_count() != m * n
        || residual.dim(candle_core::D::Minus1).ok() != Some(n)
        || !panels::available()
        || m == 0
        || h == 0
        || n == 0
    {
        return Ok(None);
    }
    let mc = panels::task_rows();
    let out = with_cpu_slices(&[x, b1, b2, residual], |slices| {
        let &[xs, b1s, b2s, rs] = slices else {
            unreachable!("four tensors")
        };
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        // SAFETY: the tasks read x, the weights, biases and residual, and each writes only
        // its own rows of `out`; all outlive them (the storages are held until this returns).
        let shared = unsafe {
            Shared::new((
                xs.as_ptr(),
                b1s.as_ptr(),
                b2s.as_ptr(),
                rs.as_ptr(),
                out.as_mut_ptr(),
            ))
        };
        (0..m.div_ceil(mc)).into_par_iter().for_each_init(
            || vec![0f32; mc * h],
            |hidden, t| {
                let (xs, b1, b2, rs, dst) = shared.get();
                let (r0, rows) = (t * mc, mc.min(m - t * mc));
                // SAFETY: rows r0..r0 + rows of x (k values each), of the residual and the
                // output (n each); `hidden` holds mc >= rows rows of h values.
                unsafe {
                    let x = (xs.add(r0 * k), k);
                    let out = (dst.add(r0 * n), rs.add(r0 * n), n);
                    mlp_rows(rows, x, ((w1, b1), (w2, b2)), hidden, out);
                }
            },
        );
        // SAFETY: the tasks wrote all m x n outputs.
        unsafe { out.set_len(m * n) };
        Ok(out)
    })?;
    let mut shape = dims.to_vec();
    *shape.last_mut().expect("checked above") = n;
    Ok(Some(Tensor::from_vec(out, shape, x.device())?))
}

/// `rows` rows of a transformer MLP: `dst = init + fc2(gelu(fc1(x)))` (`fc2(gelu(fc1(x)))`
/// where `init` is null), fc1's output (with its GELU) in `hidden`. The block of rows [`mlp_packed`] and the Swin block's window
/// ([`crate::ops::attention::cpu::swin_block`]) each task runs.
///
/// # Safety
/// `x` holds `rows` rows of fc1's `k` values (`lda` apart); `hidden` at least `rows` rows of
/// fc1's `h`; `dst` and `init` `rows` rows of fc2's `n` values `ldc` apart (`init` may be
/// `dst`: each value is read before it is written); the biases their layers' widths.
pub(crate) unsafe fn mlp_rows(
    rows: usize,
    (x, lda): (*const f32, usize),
    ((w1, b1), (w2, b2)): MlpLayers,
    hidden: &mut [f32],
    (dst, init, ldc): (*mut f32, *const f32, usize),
) {
    let h = w1.dims().1;
    assert!(hidden.len() >= rows * h, "the MLP's hidden buffer");
    let fc1 = panels::Start {
        init: None,
        bias: Some(b1),
    };
    let fc2 = panels::Start {
        init: (!init.is_null()).then_some((init, ldc)),
        bias: Some(b2),
    };
    let gelu = &gelu_rows as &Epilogue;
    // SAFETY: forwarded to the caller.
    unsafe {
        panels::gemm(
            rows,
            (x, lda),
            w1.rhs(),
            (hidden.as_mut_ptr(), h),
            fc1,
            false,
            Some(gelu),
        );
        panels::gemm(
            rows,
            (hidden.as_ptr(), h),
            w2.rhs(),
            (dst, ldc),
            fc2,
            false,
            None,
        );
    }
}

/// An MLP's two packed layers with their biases.
pub(crate) type MlpLayers<'a> = (
    (&'a panels::Panels, *const f32),
    (&'a panels::Panels, *const f32),
);

/// `cat(parts, -1) · wᵀ + b` without the concatenation: each part's product with its rows of
/// the packed weight accumulated onto the output in turn, in the order one product over the
/// concatenation would add them. `parts`: the same leading shape, their channels adding up to
/// `w`'s `k`. `None` where the kernel does not apply.
pub fn linear_of_cat(
    parts: &[&Tensor],
    packed: &panels::Panels,
    b: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    if !parts.iter().copied().chain(b).all(use_kernel) || !panels::available() {
        return Ok(None);
    }
    let (k, n) = packed.dims();
    let lead = &first.dims()[..first.rank().saturating_sub(1)];
    let widths = parts
        .iter()
        .map(|p| match p.dims().split_last() {
            Some((&c, l)) if l == lead => Some(c),
            _ => None,
        })
        .collect::<Option<Vec<_>>>();
    let Some(widths) = widths.filter(|w| w.iter().sum::<usize>() == k) else {
        candle_core::bail!("linear of a concatenation: parts {parts:?} for {k} channels");
    };
    if k == 0 {
        // No product would write the outputs.
        return Ok(None);
    }
    if b.is_some_and(|b| b.dims() != [n]) {
        candle_core::bail!(
            "linear of a concatenation: bias {:?} for {n}",
            b.map(|b| b.dims())
        );
    }
    let m: usize = lead.iter().product();
    let mut shape = lead.to_vec();
    shape.push(n);
    let bias = b.map(|b| b.storage_and_layout());
    let bs = bias.as_ref().map(|(g, l)| cpu_slice(g, l)).transpose()?;
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let dst = out.as_mut_ptr();
    let mut k0 = 0;
    for (part, &kp) in parts.iter().zip(&widths) {
        let (guard, layout) = part.storage_and_layout();
        let xs = cpu_slice(&guard, layout)?;
        // The first product starts from the bias (or zero) and writes every output; the
        // others add onto them.
        let start = match k0 {
            0 => panels::Start {
                init: None,
                bias: bs.map(|b| b.as_ptr()),
            },
            _ => panels::Start {
                init: Some((dst.cast_const(), n)),
                bias: None,
            },
        };
        if m > 0 && n > 0 && kp > 0 {
            // SAFETY: xs is m x kp, the weight rows k0..k0 + kp of k x n, the output m x n
            // (read before written where it is the start), the bias n values.
            unsafe {
                panels::gemm(
                    m,
                    (xs.as_ptr(), kp),
                    packed.rows(k0, kp),
                    (dst, n),
                    start,
                    true,
                    None,
                )
            };
        }
        k0 += kp;
    }
    drop(bias);
    // SAFETY: the first part with channels (k > 0: there is one) wrote all m x n values.
    unsafe { out.set_len(m * n) };
    Ok(Some(Tensor::from_vec(out, shape, first.device())?))
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
        (Weights::Bf16(isa, w), None),
        (w.rows(), w.cols()),
        (0, 0),
        Some(b),
        after,
    )
}

pub(super) fn linear_with(
    x: &Tensor,
    (w, packed): (Weights, Option<&panels::Panels>),
    (k, n): (usize, usize),
    f32_strides: (usize, usize),
    b: Option<&Tensor>,
    after: After,
) -> Result<Tensor> {
    let (residual, then) = (after.residual(), after.epilogue());
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
    let mut shape = dims.to_vec();
    *shape.last_mut().expect("checked above") = n;
    if let (Weights::F32(ws), true, true) = (w, panels::available(), m > 0 && n > 0) {
        // The bias and the residual go into the accumulators: the output is written once.
        let fresh;
        let packed = match packed {
            Some(p) => p,
            None => {
                fresh = panels::Panels::new(ws, (k, n), f32_strides);
                &fresh
            }
        };
        let bias = b.map(|b| b.storage_and_layout());
        let res = residual.map(|r| r.storage_and_layout());
        let bs = bias.as_ref().map(|(g, l)| cpu_slice(g, l)).transpose()?;
        let rs = res.as_ref().map(|(g, l)| cpu_slice(g, l)).transpose()?;
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        let start = panels::Start {
            init: rs.map(|r| (r.as_ptr(), n)),
            bias: bs.map(|b| b.as_ptr()),
        };
        // SAFETY: xs is m x k, the residual m x n and the bias n
        // values (checked above); every one of the m x n outputs is written by a tile.
        unsafe {
            panels::gemm(
                m,
                (xs.as_ptr(), k),
                packed.rhs(),
                (out.as_mut_ptr(), n),
                start,
                true,
                then.as_deref(),
            );
            out.set_len(m * n);
        }
        drop((bias, res, x_guard));
        return Tensor::from_vec(out, shape, x.device());
    }
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
                then.as_deref(),
            );
        }
    }
    drop(x_guard);
    Tensor::from_vec(out, shape, x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::normal;
    use candle_core::{Device, D};

    /// Every f32 result within 1e-4 (relative, above 1) of its f64 reference.
    fn assert_near(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
        }
    }

    /// The packed layers of an MLP `k -> h -> n`, and their biases.
    fn mlp_layers(
        (k, h, n): (usize, usize, usize),
        dev: &Device,
    ) -> Result<[(Tensor, Tensor, panels::Panels); 2]> {
        let layer = |cin: usize, cout: usize| -> Result<(Tensor, Tensor, panels::Panels)> {
            let w = (normal(0.0, 1.0, (cout, cin), dev)? / (cin as f64).sqrt())?;
            let b = normal(0.0, 1.0, cout, dev)?;
            let packed = panels::Panels::new(&w.flatten_all()?.to_vec1()?, (cin, cout), (1, cin));
            Ok((w, b, packed))
        };
        Ok([layer(k, h)?, layer(h, n)?])
    }

    /// The MLP a block of rows at a time gives the bits of its two layers one after the
    /// other (650 rows: blocks of either ISA's rows and a part-block; 70 -> 150 -> 50
    /// channels: panels and parts of panels on both sides), and both match f64.
    #[test]
    fn the_mlp_by_row_blocks_is_its_two_layers_in_turn() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(|| {
            let dev = Device::Cpu;
            let (k, h, n) = (70, 150, 50);
            let [(w1, b1, p1), (w2, b2, p2)] = mlp_layers((k, h, n), &dev)?;
            let x = normal(0.0, 1.0, (2, 325, k), &dev)?;
            let residual = normal(0.0, 1.0, (2, 325, n), &dev)?;
            let Some(got) = mlp_packed(&x, (&p1, &b1), (&p2, &b2), &residual)? else {
                // Only where the panel kernels do not run (no AVX2).
                assert!(!panels::available());
                return Ok(());
            };
            let hidden = linear_packed(&x, &p1, Some(&b1), After::Gelu)?;
            let two = linear_packed(&hidden, &p2, Some(&b2), After::Residual(&residual))?;
            assert_eq!(got.dims(), two.dims());
            let got = got.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, two.flatten_all()?.to_vec1::<f32>()?);
            let f64 = |t: &Tensor| t.to_dtype(candle_core::DType::F64);
            let hidden = f64(&x)?
                .broadcast_matmul(&f64(&w1)?.t()?)?
                .broadcast_add(&f64(&b1)?)?
                .gelu_erf()?;
            let want = hidden
                .broadcast_matmul(&f64(&w2)?.t()?)?
                .broadcast_add(&f64(&b2)?)?
                .add(&f64(&residual)?)?
                .flatten_all()?
                .to_vec1::<f64>()?;
            assert_near(&got, &want);
            Ok(())
        })
    }

    /// Milliseconds of SwinIR's MLP (180 -> 360 -> 180) over a 64x64 input's 4096 tokens,
    /// a block of rows at a time against the two layers in turn, interleaved, medians of 21,
    /// on each ISA: what keeping the hidden activations in cache is worth.
    /// `cargo test --release --lib mlp_by_row_blocks_rate -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn mlp_by_row_blocks_rate() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(|| {
            if !panels::available() {
                // Packed layers exist only where the panel kernels run.
                return Ok(());
            }
            let dev = Device::Cpu;
            let (m, k, h) = (4096, 180, 360);
            let [(_, b1, p1), (_, b2, p2)] = mlp_layers((k, h, k), &dev)?;
            let x = normal(0.0, 1.0, (m, k), &dev)?;
            let residual = normal(0.0, 1.0, (m, k), &dev)?;
            let fused = || mlp_packed(&x, (&p1, &b1), (&p2, &b2), &residual).map(|_| ());
            let apart = || -> Result<()> {
                let hidden = linear_packed(&x, &p1, Some(&b1), After::Gelu)?;
                linear_packed(&hidden, &p2, Some(&b2), After::Residual(&residual)).map(|_| ())
            };
            let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
                let t = std::time::Instant::now();
                f()?;
                Ok(t.elapsed().as_secs_f64() * 1e3)
            };
            let (mut a, mut b) = (vec![], vec![]);
            for _ in 0..21 {
                a.push(time(&apart)?);
                b.push(time(&fused)?);
            }
            let median = crate::tests::median;
            let (a, b) = (median(&mut a), median(&mut b));
            eprintln!(
                "{:?}: two layers {a:.2} ms, by row blocks {b:.2} ms, ratio {:.3}",
                crate::ops::cpu::isa::cpu_isa(),
                a / b
            );
            Ok(())
        })
    }

    /// The product over parts gives the bits of one product over their concatenation
    /// (channels of 5, 0, 17 and 48: a part inside a vector, an empty one, one across
    /// vectors, a whole panel; 50 outputs: a panel and a part), and both match f64.
    #[test]
    fn linear_of_cat_is_the_linear_of_the_concatenation() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(|| {
            let dev = Device::Cpu;
            let (k, n) = (70, 50);
            let w = normal(0.0, 1.0, (n, k), &dev)?;
            let b = normal(0.0, 1.0, n, &dev)?;
            let parts = [5, 0, 17, 48]
                .map(|c| normal(0.0, 1.0, (2, 7, c), &dev))
                .into_iter()
                .collect::<Result<Vec<_>>>()?;
            let parts: Vec<&Tensor> = parts.iter().collect();
            let cat = Tensor::cat(&parts, D::Minus1)?;
            let packed = panels::Panels::new(&w.flatten_all()?.to_vec1()?, (k, n), (1, k));
            let got = linear_of_cat(&parts, &packed, Some(&b))?;
            let Some(got) = got else {
                // Only where the panel kernels do not run (no AVX2).
                assert!(!panels::available());
                return Ok(());
            };
            let one = linear_packed(&cat, &packed, Some(&b), After::Nothing)?;
            let (got, one) = (got.flatten_all()?.to_vec1::<f32>()?, one.flatten_all()?);
            assert_eq!(got, one.to_vec1::<f32>()?);
            let f64 = |t: &Tensor| t.to_dtype(candle_core::DType::F64);
            let want = f64(&cat)?
                .broadcast_matmul(&f64(&w)?.t()?)?
                .broadcast_add(&f64(&b)?)?
                .flatten_all()?
                .to_vec1::<f64>()?;
            assert_near(&got, &want);
            Ok(())
        })
    }
}
