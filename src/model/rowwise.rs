//! Row-wise passes over channels-last token features that the CUDA path runs as one kernel
//! each (kernels/rowwise.cu) instead of candle's chain of element-wise kernels:
//!
//! - [`bias_act`]: a GEMM's epilogue, `act(y + bias) + residual`;
//! - [`cat_bias_act`]: the dense connection, `cat([prev, act(y + bias)], -1)`;
//! - [`gather_norm`] and [`add_gather_norm`]: a window partition (token permutation) fused
//!   with the layer norm next to it (the second also with HAT's channel-attention term);
//! - [`patches3x3`]: a 3x3 convolution's patch matrix, zero padding included, in one pass;
//! - [`conv3x3_narrow`]: a 3x3 convolution with at most four outputs, with no patch matrix.
//!
//! On other devices (and on CUDA with `UPSCALE_CUDA_OFF=rowwise`) each runs candle's
//! composition of the same ops, which is also what the GPU tests hold the kernels to. The CPU
//! model has its own fused kernels ([`super::ops`], [`super::norm`]) and does not come here.

use candle_core::{Module, Result, Tensor, D};

use super::norm::Norm;

/// Whether `t`'s op runs our kernel: on CUDA, unless `UPSCALE_CUDA_OFF` names `rowwise`.
pub fn ours(t: &Tensor) -> bool {
    t.device().is_cuda() && !super::cuda_off::current().rowwise
}

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
/// On CUDA strided inputs are made contiguous first (a copy), as for every op here.
pub fn bias_act(y: &Tensor, bias: &Tensor, residual: Option<&Tensor>, act: Act) -> Result<Tensor> {
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
    if ours(y) {
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

/// `cat([prev, act(y + bias)], -1)` for `prev` `(.., Cp)`, `y` `(.., C)`, `bias` `(C)`.
pub fn cat_bias_act(prev: &Tensor, y: &Tensor, bias: &Tensor, act: Act) -> Result<Tensor> {
    let (dp, dy) = (prev.dims(), y.dims());
    let c = y.dim(D::Minus1)?;
    if dp.len() != dy.len() || dp[..dp.len() - 1] != dy[..dy.len() - 1] || bias.dims() != [c] {
        candle_core::bail!(
            "cat_bias_act: prev {dp:?}, y {dy:?}, bias {:?}",
            bias.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if ours(y) {
        let (prev, y, bias) = (prev.contiguous()?, y.contiguous()?, bias.contiguous()?);
        return cuda::cat_bias_act(&prev, &y, &bias, act);
    }
    Tensor::cat(&[prev, &act.apply(&y.broadcast_add(bias)?)?], D::Minus1)
}

/// The patch matrix of a 3x3 convolution (stride 1, zero padding 1) for map rows
/// `[y0, y0 + rows)` of `x` `(B, H, W, C)`: `(B * rows * W, 9 * C)`, each row the nine taps
/// (dy, dx) in row-major order, zeros where a tap falls outside the map.
pub fn patches3x3(x: &Tensor, y0: usize, rows: usize) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    if rows == 0 || y0 + rows > h {
        candle_core::bail!("patches3x3: rows {y0}..{} of {h}", y0 + rows);
    }
    #[cfg(feature = "cuda")]
    if ours(x) {
        return cuda::patches3x3(&x.contiguous()?, y0, rows);
    }
    // The rows the taps read, with zero rows where they run off the map.
    let top = y0.saturating_sub(1);
    let bottom = (y0 + rows + 1).min(h);
    let padded = x
        .narrow(1, top, bottom - top)?
        .pad_with_zeros(1, usize::from(y0 == 0), usize::from(y0 + rows == h))?
        .pad_with_zeros(2, 1, 1)?;
    let mut taps = Vec::with_capacity(9);
    for dy in 0..3 {
        for dx in 0..3 {
            // Contiguous taps let the concatenation run as block copies; candle's cat of
            // strided views falls back to element-wise copying.
            taps.push(padded.narrow(1, dy, rows)?.narrow(2, dx, w)?.contiguous()?);
        }
    }
    Tensor::cat(&taps, D::Minus1)?.reshape((b * rows * w, 9 * c))
}

/// A 3x3 convolution (stride 1, zero padding 1) with at most four outputs, computed directly
/// on CUDA (no patch matrix: the RGB output layer runs at the full output size): `x`
/// `(B, H, W, cin)`, `wt` `(9 * cin, cout)` with rows ordered (dy, dx, cin), `bias` `(cout)`;
/// returns `(B, H, W, cout)`.
pub fn conv3x3_narrow(x: &Tensor, wt: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (b, h, w, cin) = x.dims4()?;
    let (k, cout) = wt.dims2()?;
    if k != 9 * cin || bias.dims() != [cout] || cout == 0 || cout > NARROW_CONV_MAX {
        candle_core::bail!(
            "conv3x3_narrow: x {:?}, wt {:?}, bias {:?}",
            x.dims(),
            wt.dims(),
            bias.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if ours(x) {
        return cuda::conv3x3_narrow(&x.contiguous()?, &wt.contiguous()?, &bias.contiguous()?);
    }
    let out = patches3x3(x, 0, h)?.matmul(wt)?.broadcast_add(bias)?;
    out.reshape((b, h, w, cout))
}

/// Most outputs [`conv3x3_narrow`] takes (kernels/rowwise.cu's `NARROW_MAX`).
pub const NARROW_CONV_MAX: usize = 4;

/// `ln(x)` with its tokens put in `order`: `x` `(B, T, C)`, `order` `T'` u32 indices below
/// `T`; returns `(B, T', C)`.
pub fn gather_norm(norm: &Norm, x: &Tensor, order: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if ours(x) {
        return cuda::gather_norm(norm, &x.contiguous()?, &order.contiguous()?);
    }
    norm.forward(x)?.index_select(order, 1)
}

/// `sum = x + index_select(y, back, 1)` and `ln(sum)`: `x` `(B, T, C)`, `y` `(B, T', C)`,
/// `back` `T` u32 indices below `T'`. With `scaled` `(z, s)`, `z` `(B, T, C)` and `s`
/// `(B, C)`, the sum is `x + z * s + index_select(y, back, 1)` (HAT's channel attention),
/// in the same kernel unless `UPSCALE_CUDA_OFF` names `cab`.
pub fn add_gather_norm(
    norm: &Norm,
    x: &Tensor,
    scaled: Option<(&Tensor, &Tensor)>,
    y: &Tensor,
    back: &Tensor,
) -> Result<(Tensor, Tensor)> {
    add_gather_dims(x, scaled, y, back)?;
    #[cfg(feature = "cuda")]
    if ours(x) {
        let (y, back) = (y.contiguous()?, back.contiguous()?);
        if let Some((z, s)) = scaled.filter(|_| !super::cuda_off::current().cab) {
            let (z, s) = (z.contiguous()?, s.contiguous()?);
            return cuda::add_gather_norm(norm, &x.contiguous()?, Some((&z, &s)), &y, &back);
        }
        let x = plus_scaled(x, scaled)?.contiguous()?;
        return cuda::add_gather_norm(norm, &x, None, &y, &back);
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
pub(super) fn add_gather_dims(
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

/// Threads per block of the CUDA kernels: whole warps; the norms give each row one warp.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const THREADS: usize = 256;
/// Grid cap: the kernels' loops stride over the rest.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MAX_BLOCKS: usize = 1 << 16;
/// The largest count the kernels take. They index in 32 bits and stride by up to a whole
/// grid of threads, so a count within one grid's stride of 2³² would wrap the index
/// (`i += step` back below `n`) and the loop would never end.
const COUNT_MAX: usize = (1 << 32) - THREADS * MAX_BLOCKS;

/// `v` as a kernel's 32-bit count, or an error naming `what` where it is too large.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn u32_of(v: usize, what: &str) -> Result<u32> {
    if v > COUNT_MAX {
        candle_core::bail!("rowwise kernels: {what} {v} exceeds {COUNT_MAX}");
    }
    Ok(v as u32)
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ops::Deref;

    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Result, Shape, Storage, Tensor, WithDType};
    use half::{bf16, f16};

    use super::{Act, Norm};

    use super::{u32_of, MAX_BLOCKS, THREADS};

    /// A tensor's storage held for a launch, with its contiguous element range.
    struct Held<G> {
        guard: G,
        range: (usize, usize),
    }

    fn held<'a>(t: &'a Tensor, what: &str) -> Result<Held<impl Deref<Target = Storage> + 'a>> {
        let (guard, layout) = t.storage_and_layout();
        let Some(range) = layout.contiguous_offsets() else {
            candle_core::bail!("{what} must be contiguous");
        };
        Ok(Held { guard, range })
    }

    impl<G: Deref<Target = Storage>> Held<G> {
        fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
            match &*self.guard {
                Storage::Cuda(s) => Ok(s.as_cuda_slice::<T>()?.slice(self.range.0..self.range.1)),
                _ => candle_core::bail!("rowwise kernels take CUDA tensors"),
            }
        }

        fn device(&self) -> Result<CudaDevice> {
            match &*self.guard {
                Storage::Cuda(s) => Ok(s.device.clone()),
                _ => candle_core::bail!("rowwise kernels take CUDA tensors"),
            }
        }
    }

    fn act_args(act: Act) -> (i32, f32) {
        match act {
            Act::None => (0, 0.0),
            Act::Gelu => (1, 0.0),
            Act::Leaky(slope) => (2, slope),
        }
    }

    /// Enough blocks of `per_block` work units for `units`, capped.
    fn grid(units: usize, per_block: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (units.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Kernel `name` for element type `T`.
    fn func<T: WithDType>(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
        let suffix = match T::DTYPE {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => candle_core::bail!("rowwise kernels: dtype {other:?} (f32, bf16, f16)"),
        };
        crate::gpu::function(
            dev,
            &crate::gpu::kernels::ROWWISE,
            &format!("{name}_{suffix}"),
        )
    }

    /// An output buffer of `n` elements, which the kernel writes in full.
    fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every kernel here writes each element of its outputs before anything reads
        // them.
        unsafe { dev.alloc::<T>(n) }
    }

    fn wrap<T: CudaDType>(out: CudaSlice<T>, dev: &CudaDevice, shape: Shape) -> Tensor {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        Tensor::from_storage(storage, shape, BackpropOp::none(), false)
    }

    /// Runs `$body` with `$t` the element type of `$dtype`.
    macro_rules! with_type {
        ($dtype:expr, $t:ident => $body:block) => {
            match $dtype {
                DType::F32 => {
                    type $t = f32;
                    $body
                }
                DType::BF16 => {
                    type $t = bf16;
                    $body
                }
                DType::F16 => {
                    type $t = f16;
                    $body
                }
                other => candle_core::bail!("rowwise kernels: dtype {other:?} (f32, bf16, f16)"),
            }
        };
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

    pub(super) fn patches3x3(x: &Tensor, y0: usize, rows: usize) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let hx = held(x, "patches3x3: x")?;
        let dev = hx.device()?;
        u32_of(b * h * w * c, "elements")?;
        let len = b * rows * w * 9 * c;
        let n = u32_of(len, "patch elements")?;
        let (h32, w32, c32) = (
            u32_of(h, "rows")?,
            u32_of(w, "columns")?,
            u32_of(c, "channels")?,
        );
        let (y0, rows32) = (u32_of(y0, "first row")?, u32_of(rows, "rows")?);
        with_type!(x.dtype(), T => {
            let xv = hx.view::<T>()?;
            let out = alloc::<T>(&dev, len)?;
            let f = func::<T>(&dev, "patches3x3")?;
            let stream = dev.cuda_stream();
            let mut bld = stream.launch_builder(&f);
            bld.arg(&xv).arg(&out).arg(&n);
            bld.arg(&h32).arg(&w32).arg(&c32).arg(&y0).arg(&rows32);
            // Four values per thread where the channels allow; the loop covers the rest.
            let units = if c % 4 == 0 { len / 4 } else { len };
            // SAFETY: the arguments follow the kernel's signature; x holds b x h x w x c
            // elements and out the n the kernel writes, every one of them.
            unsafe { bld.launch(grid(units, THREADS)) }.w()?;
            Ok(wrap(out, &dev, Shape::from((b * rows * w, 9 * c))))
        })
    }

    pub(super) fn conv3x3_narrow(x: &Tensor, wt: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (b, h, w, cin) = x.dims4()?;
        let cout = bias.elem_count();
        let hx = held(x, "conv3x3_narrow: x")?;
        let hw = held(wt, "conv3x3_narrow: weight")?;
        let hb = held(bias, "conv3x3_narrow: bias")?;
        let dev = hx.device()?;
        u32_of(b * h * w * cin, "elements")?;
        let pixels = u32_of(b * h * w, "pixels")?;
        u32_of(b * h * w * cout, "outputs")?;
        let (h32, w32) = (u32_of(h, "rows")?, u32_of(w, "columns")?);
        let (cin32, cout32) = (u32_of(cin, "channels")?, u32_of(cout, "outputs")?);
        with_type!(x.dtype(), T => {
            let (xv, wv, bv) = (hx.view::<T>()?, hw.view::<T>()?, hb.view::<T>()?);
            let out = alloc::<T>(&dev, b * h * w * cout)?;
            let f = func::<T>(&dev, "conv3x3_narrow")?;
            let stream = dev.cuda_stream();
            let mut bld = stream.launch_builder(&f);
            bld.arg(&xv).arg(&wv).arg(&bv).arg(&out).arg(&pixels);
            bld.arg(&h32).arg(&w32).arg(&cin32).arg(&cout32);
            // SAFETY: the arguments follow the kernel's signature; x holds b x h x w x cin
            // elements, wt 9 cin x cout, bias cout, and out the b x h x w x cout the kernel
            // writes, every one of them.
            unsafe { bld.launch(grid(pixels as usize, THREADS / 32)) }.w()?;
            Ok(wrap(out, &dev, Shape::from((b, h, w, cout))))
        })
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
        u32_of(b * t * c, "elements")?;
        let rows = u32_of(b * t, "rows")?;
        let (t32, t_in, c32) = (
            u32_of(t, "tokens")?,
            u32_of(t_in, "tokens")?,
            u32_of(c, "columns")?,
        );
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
        u32_of(b * t * c, "elements")?;
        let rows = u32_of(b * t, "rows")?;
        let (t32, ty, c32) = (
            u32_of(t, "tokens")?,
            u32_of(ty, "tokens")?,
            u32_of(c, "columns")?,
        );
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

#[cfg(test)]
mod tests {
    use super::{patches3x3, u32_of, MAX_BLOCKS, THREADS};
    use candle_core::{Device, Result, Tensor};

    /// Every count a kernel takes leaves room for one more grid stride below 2³², so its
    /// index cannot wrap; a larger count is an error, not a kernel that never ends.
    #[test]
    fn kernel_counts_leave_room_for_a_grid_stride() {
        let stride = (THREADS * MAX_BLOCKS) as u32;
        let mut largest = 0;
        for v in [
            0,
            1 << 31,
            (1 << 32) - (1 << 25),
            (1 << 32) - (1 << 24),
            (1 << 32) - 1,
            1 << 32,
        ] {
            match u32_of(v, "elements") {
                Ok(n) => {
                    assert!((n.max(1) - 1).checked_add(stride).is_some(), "{v}");
                    largest = v;
                }
                Err(e) => assert!(e.to_string().contains("elements"), "{e}"),
            }
        }
        assert!(largest >= (1 << 32) - (1 << 25), "{largest}");
    }

    /// Each chunk's patch matrix against the definition: out[(m, r, j), (tap, ch)] is
    /// x[m, y0 + r + dy - 1, j + dx - 1, ch], or 0 outside the map.
    #[test]
    fn patches3x3_follows_the_definition_for_every_chunk() -> Result<()> {
        let (b, h, w, c) = (2, 5, 4, 3);
        let x = Tensor::arange(1f32, (b * h * w * c + 1) as f32, &Device::Cpu)?
            .reshape((b, h, w, c))?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        for (y0, rows) in [(0, 5), (0, 2), (2, 1), (3, 2)] {
            let got = patches3x3(&x, y0, rows)?;
            assert_eq!(got.dims(), [b * rows * w, 9 * c]);
            let got = got.flatten_all()?.to_vec1::<f32>()?;
            for (i, v) in got.iter().enumerate() {
                let (ch, tap, p) = (i % c, (i / c) % 9, i / (9 * c));
                let (j, r, m) = (p % w, (p / w) % rows, p / (w * rows));
                let yy = (y0 + r + tap / 3) as isize - 1;
                let xx = (j + tap % 3) as isize - 1;
                let want = if (0..h as isize).contains(&yy) && (0..w as isize).contains(&xx) {
                    xs[((m * h + yy as usize) * w + xx as usize) * c + ch]
                } else {
                    0.0
                };
                assert_eq!(*v, want, "rows {y0}+{rows}, element {i}");
            }
        }
        assert!(patches3x3(&x, 4, 2).is_err());
        assert!(patches3x3(&x, 0, 0).is_err());
        Ok(())
    }

    /// The composition other devices run (and the GPU test holds the kernel to) against the
    /// CPU's own convolution kernel.
    #[test]
    fn conv3x3_narrow_matches_the_cpu_convolution() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (2, 5, 6, 7), &Device::Cpu)?;
        let wt = Tensor::randn(0f32, 0.2, (63, 3), &Device::Cpu)?;
        let bias = Tensor::randn(0f32, 1.0, 3, &Device::Cpu)?;
        let ours = super::conv3x3_narrow(&x, &wt, &bias)?;
        let want = crate::model::ops::conv3x3(&x, &wt, &bias, 1 << 20)?
            .expect("the CPU runs f32 3x3 convolutions itself");
        assert_eq!(ours.dims(), [2, 5, 6, 3]);
        let diff = (ours - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let five = Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu)?;
        let wide = Tensor::zeros((63, 5), candle_core::DType::F32, &Device::Cpu)?;
        assert!(super::conv3x3_narrow(&x, &wide, &five).is_err());
        Ok(())
    }
}
