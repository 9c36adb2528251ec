//! Dense's row-wise epilogues on CUDA (kernels/rowwise.cu), one pass after a GEMM for what
//! cuBLASLt's epilogue cannot do:
//!
//! - [`bias_act`]: `act(y + bias) + residual` (also a 3x3 convolution's bias);
//! - [`cat_bias_act`]: the dense connection, `cat([prev, act(y + bias)], -1)`.
//!
//! On other devices (and on CUDA with `UPSCALE_CUDA_OFF=rowwise`) each runs candle's
//! composition of the same ops, which is also what the GPU tests hold the kernels to. The
//! launch helpers are shared with the other row-wise kernels ([`crate::ops::rowwise`]).

use candle_core::{Result, Tensor, D};

use crate::switches::cuda_off::Off;

#[cfg(feature = "cuda")]
use crate::ops::rowwise::ours;

/// The activation a GEMM's epilogue applies after the bias.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    None,
    /// The exact (erf) GELU of `nn.GELU()`.
    Gelu,
    /// LeakyReLU with this negative slope.
    Leaky(f32),
}

impl Act {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::None => Ok(x.clone()),
            Self::Gelu => x.gelu_erf(),
            Self::Leaky(slope) => candle_nn::ops::leaky_relu(x, f64::from(slope)),
        }
    }
}

/// `act(y + bias) + residual` for `y` `(.., C)`, `bias` `(C)` and `residual` `y`'s shape.
/// On CUDA strided inputs are made contiguous first (a copy), as for every op here; our
/// kernel runs unless `off` names `rowwise`.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn bias_act(
    y: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    act: Act,
    off: Off,
) -> Result<Tensor> {
    let c = y.dim(D::Minus1)?;
    if bias.dims() != [c] {
        candle_core::bail!("bias_act: y {:?}, bias {:?}", y.dims(), bias.dims());
    }
    if let Some(r) = residual {
        if r.dims() != y.dims() {
            candle_core::bail!("bias_act: y {:?}, residual {:?}", y.dims(), r.dims());
        }
    }
    #[cfg(feature = "cuda")]
    if ours(y, off) {
        let residual = residual.map(Tensor::contiguous).transpose()?;
        return cuda::bias_act(
            &y.contiguous()?,
            &bias.contiguous()?,
            residual.as_ref(),
            act,
        );
    }
    let out = act.apply(&y.broadcast_add(bias)?)?;
    match residual {
        Some(r) => out + r,
        None => Ok(out),
    }
}

/// `cat([prev, act(y + bias)], -1)` for `prev` `(.., Cp)`, `y` `(.., C)`, `bias` `(C)`; our
/// kernel unless `off` names `rowwise`.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn cat_bias_act(
    prev: &Tensor,
    y: &Tensor,
    bias: &Tensor,
    act: Act,
    off: Off,
) -> Result<Tensor> {
    let (dp, dy) = (prev.dims(), y.dims());
    let c = y.dim(D::Minus1)?;
    if dp.len() != dy.len() || dp[..dp.len() - 1] != dy[..dy.len() - 1] || bias.dims() != [c] {
        candle_core::bail!(
            "cat_bias_act: prev {dp:?}, y {dy:?}, bias {:?}",
            bias.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if ours(y, off) {
        let (prev, y, bias) = (prev.contiguous()?, y.contiguous()?, bias.contiguous()?);
        return cuda::cat_bias_act(&prev, &y, &bias, act);
    }
    Tensor::cat(&[prev, &act.apply(&y.broadcast_add(bias)?)?], D::Minus1)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Result, Shape, Tensor};

    use super::Act;
    use crate::ops::rowwise::cuda::{alloc, func, grid, held, with_type, wrap};
    use crate::ops::rowwise::{u32_of, THREADS};

    fn act_args(act: Act) -> (i32, f32) {
        match act {
            Act::None => (0, 0.0),
            Act::Gelu => (1, 0.0),
            Act::Leaky(slope) => (2, slope),
        }
    }

    pub(super) fn bias_act(
        y: &Tensor,
        bias: &Tensor,
        residual: Option<&Tensor>,
        act: Act,
    ) -> Result<Tensor> {
        let hy = held(y, "bias_act: y")?;
        let hb = held(bias, "bias_act: bias")?;
        let hr = residual
            .map(|r| held(r, "bias_act: residual"))
            .transpose()?;
        let dev = hy.device()?;
        let n = u32_of(y.elem_count(), "elements")?;
        let cols = u32_of(bias.elem_count(), "columns")?;
        let (code, slope) = act_args(act);
        let has_res = i32::from(hr.is_some());
        with_type!(y.dtype(), T => {
            let (yv, bv) = (hy.view::<T>()?, hb.view::<T>()?);
            // Without a residual the kernel never reads this argument.
            let rv = hr.as_ref().unwrap_or(&hy).view::<T>()?;
            let out = alloc::<T>(&dev, n as usize)?;
            let f = func::<T>(&dev, "bias_act")?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&yv).arg(&bv).arg(&rv).arg(&out);
            b.arg(&n).arg(&cols).arg(&code).arg(&slope).arg(&has_res);
            // SAFETY: the arguments follow the kernel's signature; the buffers hold n
            // elements (bias: cols), as the kernel reads them.
            unsafe { b.launch(grid(n as usize, THREADS)) }.w()?;
            Ok(wrap(out, &dev, y.shape().clone()))
        })
    }

    pub(super) fn cat_bias_act(
        prev: &Tensor,
        y: &Tensor,
        bias: &Tensor,
        act: Act,
    ) -> Result<Tensor> {
        let hp = held(prev, "cat_bias_act: prev")?;
        let hy = held(y, "cat_bias_act: y")?;
        let hb = held(bias, "cat_bias_act: bias")?;
        let dev = hy.device()?;
        let pc = prev.dims().last().copied().unwrap_or(0);
        let cols = bias.elem_count();
        let mut dims = y.dims().to_vec();
        *dims.last_mut().expect("checked by the caller") = pc + cols;
        let shape = Shape::from(dims);
        let n = u32_of(shape.elem_count(), "elements")?;
        let (pc, cols) = (u32_of(pc, "columns")?, u32_of(cols, "columns")?);
        let (code, slope) = act_args(act);
        with_type!(y.dtype(), T => {
            let (pv, yv, bv) = (hp.view::<T>()?, hy.view::<T>()?, hb.view::<T>()?);
            let out = alloc::<T>(&dev, n as usize)?;
            let f = func::<T>(&dev, "cat_bias_act")?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&pv).arg(&yv).arg(&bv).arg(&out);
            b.arg(&n).arg(&pc).arg(&cols).arg(&code).arg(&slope);
            // SAFETY: as in bias_act; prev holds rows x pc elements, y rows x cols.
            unsafe { b.launch(grid(n as usize, THREADS)) }.w()?;
            Ok(wrap(out, &dev, shape))
        })
    }
}
