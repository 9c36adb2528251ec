//! The layer norm's CUDA half, the host side of its row-wise kernels (kernels/rowwise.cu):
//! [`gather_norm`] and [`add_gather_norm`], a window partition (token permutation) fused with
//! the layer norm next to it (the second also with HAT's channel-attention term).
//!
//! On other devices (and on CUDA with `UPSCALE_CUDA_OFF=rowwise`) each runs candle's
//! composition of the same ops, which is also what the GPU tests hold the kernels to; the CPU
//! runs its own kernels ([`super::cpu`]) first. The launch helpers are shared with the other
//! row-wise kernels ([`crate::ops::rowwise`]).

use candle_core::{Module, Result, Tensor};

use super::Norm;
#[cfg(feature = "cuda")]
use crate::ops::rowwise::ours;

/// `ln(x)` with its tokens put in `order`: `x` `(B, T, C)`, `order` `T'` u32 indices below
/// `T`; returns `(B, T', C)`.
pub fn gather_norm(norm: &Norm, x: &Tensor, order: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if ours(x, norm.cuda_off()) {
        return launch::gather_norm(norm, &x.contiguous()?, &order.contiguous()?);
    }
    norm.forward(x)?.index_select(order, 1)
}

/// `sum = x + index_select(y, back, 1)` and `ln(sum)`: `x` `(B, T, C)`, `y` `(B, T', C)`,
/// `back` `T` u32 indices below `T'`. With `scaled` `(z, s)`, `z` `(B, T, C)` and `s`
/// `(B, C)`, the sum is `x + z * s + index_select(y, back, 1)` (HAT's channel attention),
/// in the same kernel unless the norm's plan ([`Norm::with_cuda_off`]) leaves out `cab`.
pub fn add_gather_norm(
    norm: &Norm,
    x: &Tensor,
    scaled: Option<(&Tensor, &Tensor)>,
    y: &Tensor,
    back: &Tensor,
) -> Result<(Tensor, Tensor)> {
    add_gather_dims(x, scaled, y, back)?;
    #[cfg(feature = "cuda")]
    if ours(x, norm.cuda_off()) {
        let (y, back) = (y.contiguous()?, back.contiguous()?);
        if let Some((z, s)) = scaled.filter(|_| !norm.cuda_off().cab) {
            let (z, s) = (z.contiguous()?, s.contiguous()?);
            return launch::add_gather_norm(norm, &x.contiguous()?, Some((&z, &s)), &y, &back);
        }
        let x = plus_scaled(x, scaled)?.contiguous()?;
        return launch::add_gather_norm(norm, &x, None, &y, &back);
    }
    let sum = (plus_scaled(x, scaled)? + y.index_select(back, 1)?)?;
    let normed = norm.forward(&sum)?;
    Ok((sum, normed))
}

/// `x + z * s` with candle's ops, `s` broadcast over the tokens; `x` without `scaled`.
fn plus_scaled(x: &Tensor, scaled: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
    match scaled {
        Some((z, s)) => {
            let (b, c) = s.dims2()?;
            x + z.broadcast_mul(&s.reshape((b, 1, c))?)?
        }
        None => Ok(x.clone()),
    }
}

/// `(B, T, C, T')` of [`add_gather_norm`]'s `x` `(B, T, C)` and `y` `(B, T', C)`, checked
/// against each other, against the `T` indices in `back` and against `scaled`'s `(B, T, C)`
/// and `(B, C)`.
pub(crate) fn add_gather_dims(
    x: &Tensor,
    scaled: Option<(&Tensor, &Tensor)>,
    y: &Tensor,
    back: &Tensor,
) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c) = x.dims3()?;
    let (by, ty, cy) = y.dims3()?;
    let scaled_ok = scaled.is_none_or(|(z, s)| z.dims() == x.dims() && s.dims() == [b, c]);
    if (by, cy) != (b, c) || back.elem_count() != t || !scaled_ok {
        candle_core::bail!(
            "add_gather_norm: x {:?}, y {:?}, back {:?}, scaled {:?}",
            x.dims(),
            y.dims(),
            back.dims(),
            scaled.map(|(z, s)| (z.dims(), s.dims()))
        );
    }
    Ok((b, t, c, ty))
}

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Shape, Tensor};

    use super::Norm;
    use crate::ops::rowwise::cuda::{alloc, func, grid, held, with_type, wrap};
    use crate::ops::rowwise::{u32_of, THREADS};

    /// A layer norm's arguments for the kernels, in `x`'s dtype.
    struct NormArgs {
        gamma: Tensor,
        beta: Tensor,
        /// The real-channel mask of padded rows.
        mask: Option<Tensor>,
        /// The real channels, which the mean and variance divide by.
        count: u32,
        eps: f32,
    }

    /// The arguments of a layer norm over rows of `c` channels.
    fn norm_args(norm: &Norm, x: &Tensor, c: usize) -> Result<NormArgs> {
        let ln = norm.layer_norm();
        let Some(bias) = ln.bias() else {
            candle_core::bail!("rowwise norms: the layer norm has no bias");
        };
        if !ln.remove_mean() || ln.weight().dims() != [c] || bias.dims() != [c] {
            candle_core::bail!("rowwise norms: a layer norm over {c} channels expected");
        }
        let (mask, count) = match norm.real() {
            Some((mask, count)) => (Some(mask.to_dtype(x.dtype())?), count),
            None => (None, c),
        };
        Ok(NormArgs {
            gamma: ln.weight().to_dtype(x.dtype())?,
            beta: bias.to_dtype(x.dtype())?,
            mask,
            count: u32_of(count, "channels")?,
            eps: ln.eps() as f32,
        })
    }

    /// The kernels' 32-bit sizes for `b` maps of `t` tokens read from maps of `t_from`
    /// tokens of `c` channels: rows (`b * t`), `t`, `t_from` and `c`, once every element
    /// index is known to fit.
    fn sizes(b: usize, t: usize, t_from: usize, c: usize) -> Result<[u32; 4]> {
        u32_of(b * t * c, "elements")?;
        Ok([
            u32_of(b * t, "rows")?,
            u32_of(t, "tokens")?,
            u32_of(t_from, "tokens")?,
            u32_of(c, "columns")?,
        ])
    }

    /// The number of indices in `idx`, which must be a u32 vector. Their values are the
    /// caller's promise (the window partition builds them).
    fn index_count(idx: &Tensor, what: &str) -> Result<usize> {
        if idx.dtype() != DType::U32 || idx.rank() != 1 {
            candle_core::bail!(
                "{what}: u32 indices expected, got {:?} {:?}",
                idx.dtype(),
                idx.dims()
            );
        }
        Ok(idx.elem_count())
    }

    pub(super) fn gather_norm(norm: &Norm, x: &Tensor, order: &Tensor) -> Result<Tensor> {
        let (b, t_in, c) = x.dims3()?;
        let t = index_count(order, "gather_norm: order")?;
        let args = norm_args(norm, x, c)?;
        let hx = held(x, "gather_norm: x")?;
        let ho = held(order, "gather_norm: order")?;
        let (hg, hb) = (held(&args.gamma, "gamma")?, held(&args.beta, "beta")?);
        let hm = args.mask.as_ref().map(|m| held(m, "mask")).transpose()?;
        let masked = i32::from(hm.is_some());
        let dev = hx.device()?;
        let [rows, t32, t_in, c32] = sizes(b, t, t_in, c)?;
        with_type!(x.dtype(), T => {
            let (xv, ov) = (hx.view::<T>()?, ho.view::<u32>()?);
            let (gv, bv) = (hg.view::<T>()?, hb.view::<T>()?);
            // Unpadded rows: the kernel never reads the mask argument.
            let mv = hm.as_ref().unwrap_or(&hg).view::<T>()?;
            let out = alloc::<T>(&dev, b * t * c)?;
            let f = func::<T>(&dev, "gather_norm")?;
            let stream = dev.cuda_stream();
            let mut bld = stream.launch_builder(&f);
            bld.arg(&xv).arg(&ov).arg(&gv).arg(&bv).arg(&mv).arg(&out);
            bld.arg(&rows).arg(&t32).arg(&t_in).arg(&c32);
            bld.arg(&args.count).arg(&masked).arg(&args.eps);
            // SAFETY: the arguments follow the kernel's signature; x holds b x t_in x c
            // elements and the order's values index its tokens.
            unsafe { bld.launch(grid(rows as usize, THREADS / 32)) }.w()?;
            Ok(wrap(out, &dev, Shape::from((b, t, c))))
        })
    }

    pub(super) fn add_gather_norm(
        norm: &Norm,
        x: &Tensor,
        scaled: Option<(&Tensor, &Tensor)>,
        y: &Tensor,
        back: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, c, ty) = super::add_gather_dims(x, scaled, y, back)?;
        index_count(back, "add_gather_norm: back")?;
        let args = norm_args(norm, x, c)?;
        let hx = held(x, "add_gather_norm: x")?;
        let hy = held(y, "add_gather_norm: y")?;
        let hi = held(back, "add_gather_norm: back")?;
        let (hg, hb) = (held(&args.gamma, "gamma")?, held(&args.beta, "beta")?);
        let hm = args.mask.as_ref().map(|m| held(m, "mask")).transpose()?;
        let masked = i32::from(hm.is_some());
        let hzs = scaled
            .map(|(z, s)| -> Result<_> {
                Ok((
                    held(z, "add_gather_norm: z")?,
                    held(s, "add_gather_norm: s")?,
                ))
            })
            .transpose()?;
        let dev = hx.device()?;
        let [rows, t32, ty, c32] = sizes(b, t, ty, c)?;
        with_type!(x.dtype(), T => {
            let (xv, yv, iv) = (hx.view::<T>()?, hy.view::<T>()?, hi.view::<u32>()?);
            let (gv, bv) = (hg.view::<T>()?, hb.view::<T>()?);
            // Unpadded rows: the kernel never reads the mask argument.
            let mv = hm.as_ref().unwrap_or(&hg).view::<T>()?;
            let sum = alloc::<T>(&dev, b * t * c)?;
            let normed = alloc::<T>(&dev, b * t * c)?;
            let zs = match &hzs {
                Some((hz, hs)) => Some((hz.view::<T>()?, hs.view::<T>()?)),
                None => None,
            };
            let name = if zs.is_some() { "add_scaled_gather_norm" } else { "add_gather_norm" };
            let f = func::<T>(&dev, name)?;
            let stream = dev.cuda_stream();
            let mut bld = stream.launch_builder(&f);
            bld.arg(&xv);
            if let Some((zv, sv)) = &zs {
                bld.arg(zv).arg(sv);
            }
            bld.arg(&yv).arg(&iv).arg(&gv).arg(&bv).arg(&mv).arg(&sum).arg(&normed);
            bld.arg(&rows).arg(&t32).arg(&ty).arg(&c32);
            bld.arg(&args.count).arg(&masked).arg(&args.eps);
            // SAFETY: the arguments follow the kernel's signature; y holds b x ty x c
            // elements and back's values index its tokens; z holds b x t x c elements and s
            // b x c.
            unsafe { bld.launch(grid(rows as usize, THREADS / 32)) }.w()?;
            let shape = Shape::from((b, t, c));
            Ok((wrap(sum, &dev, shape.clone()), wrap(normed, &dev, shape)))
        })
    }
}
