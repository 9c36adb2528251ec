//! Conv3x3's CUDA half, the host side of two row-wise kernels (kernels/rowwise.cu):
//!
//! - [`patches3x3`]: a 3x3 convolution's patch matrix, zero padding included, in one pass;
//! - [`conv3x3_narrow`]: a 3x3 convolution with at most four outputs, with no patch matrix.
//!
//! On other devices (and on CUDA with `UPSCALE_CUDA_OFF=rowwise`) each runs candle's
//! composition of the same ops, which is also what the GPU tests hold the kernels to. The
//! launch helpers are shared with the other row-wise kernels ([`crate::ops::rowwise`]).

use candle_core::{Result, Tensor, D};

use crate::switches::cuda_off::Off;

#[cfg(feature = "cuda")]
use crate::ops::rowwise::ours;

/// The patch matrix of a 3x3 convolution (stride 1, zero padding 1) for map rows
/// `[y0, y0 + rows)` of `x` `(B, H, W, C)`: `(B * rows * W, 9 * C)`, each row the nine taps
/// (dy, dx) in row-major order, zeros where a tap falls outside the map. Our kernel unless
/// `off` names `rowwise`.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn patches3x3(x: &Tensor, y0: usize, rows: usize, off: Off) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    if rows == 0 || y0 + rows > h {
        candle_core::bail!("patches3x3: rows {y0}..{} of {h}", y0 + rows);
    }
    #[cfg(feature = "cuda")]
    if ours(x, off) {
        return launch::patches3x3(&x.contiguous()?, y0, rows);
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
/// returns `(B, H, W, cout)`. Our kernel unless `off` names `rowwise`.
pub fn conv3x3_narrow(x: &Tensor, wt: &Tensor, bias: &Tensor, off: Off) -> Result<Tensor> {
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
    if ours(x, off) {
        return launch::conv3x3_narrow(&x.contiguous()?, &wt.contiguous()?, &bias.contiguous()?);
    }
    let out = patches3x3(x, 0, h, off)?.matmul(wt)?.broadcast_add(bias)?;
    out.reshape((b, h, w, cout))
}

/// Most outputs [`conv3x3_narrow`] takes (kernels/rowwise.cu's `NARROW_MAX`).
pub const NARROW_CONV_MAX: usize = 4;

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Result, Shape, Tensor};

    use crate::ops::rowwise::cuda::{alloc, func, grid, held, with_type, wrap};
    use crate::ops::rowwise::{u32_of, THREADS};

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
}

#[cfg(test)]
mod tests {
    use super::{patches3x3, Off};
    use candle_core::{Device, Result, Tensor};

    /// Each chunk's patch matrix against the definition: out[(m, r, j), (tap, ch)] is
    /// x[m, y0 + r + dy - 1, j + dx - 1, ch], or 0 outside the map.
    #[test]
    fn patches3x3_follows_the_definition_for_every_chunk() -> Result<()> {
        let (b, h, w, c) = (2, 5, 4, 3);
        let x = Tensor::arange(1f32, (b * h * w * c + 1) as f32, &Device::Cpu)?
            .reshape((b, h, w, c))?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        for (y0, rows) in [(0, 5), (0, 2), (2, 1), (3, 2)] {
            let got = patches3x3(&x, y0, rows, Off::default())?;
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
        assert!(patches3x3(&x, 4, 2, Off::default()).is_err());
        assert!(patches3x3(&x, 0, 0, Off::default()).is_err());
        Ok(())
    }

    /// The composition other devices run (and the GPU test holds the kernel to) against the
    /// CPU's own convolution kernel.
    #[test]
    fn conv3x3_narrow_matches_the_cpu_convolution() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (2, 5, 6, 7), &Device::Cpu)?;
        let wt = Tensor::randn(0f32, 0.2, (63, 3), &Device::Cpu)?;
        let bias = Tensor::randn(0f32, 1.0, 3, &Device::Cpu)?;
        let ours = super::conv3x3_narrow(&x, &wt, &bias, Off::default())?;
        let want = super::super::cpu::conv3x3(&x, &wt, &bias, 1 << 20)?
            .expect("the CPU runs f32 3x3 convolutions itself");
        assert_eq!(ours.dims(), [2, 5, 6, 3]);
        let diff = (ours - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let five = Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu)?;
        let wide = Tensor::zeros((63, 5), candle_core::DType::F32, &Device::Cpu)?;
        assert!(super::conv3x3_narrow(&x, &wide, &five, Off::default()).is_err());
        Ok(())
    }
}
