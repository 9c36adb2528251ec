//! Linear layers straight onto the GEMM: the bias, a residual or the exact GELU applied as
//! the GEMM writes its rows, in f32 or with bf16 products.

use candle_core::{Result, Tensor};

use crate::ops::cpu::bf16::{Epilogue, Isa, PackedB};
use crate::ops::cpu::{cpu_slice, gelu_in_place, panels, par_rows, product, use_kernel, Weights};

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
/// rewritten by separate adds. `x`: `(.., k)`; `w`: `(n, k)` as stored, with its panels
/// when they were packed at load ([`pack`]); `b`: `(n)`; `residual`: the output's shape.
/// `None` where the kernel does not apply.
pub fn linear(
    x: &Tensor,
    (w, packed): (&Tensor, Option<&panels::Panels>),
    b: Option<&Tensor>,
    after: After,
) -> Result<Option<Tensor>> {
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
    let y = linear_with(x, (Weights::F32(ws), packed), (k, n), (1, k), b, after)?;
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
                gelu.then_some(&gelu_rows as &Epilogue),
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
                gelu.then_some(&gelu_rows as &Epilogue),
            );
        }
    }
    drop(x_guard);
    Tensor::from_vec(out, shape, x.device())
}
