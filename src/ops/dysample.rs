//! [`DySample`] (Liu et al., 2023, "Learning to Upsample by Learning to Sample"): an
//! upsampler that reads each output pixel from a learned point near its source pixel.
//!
//! For a channels-last map `y` of `C` channels in `G` groups and scale `s`, each input pixel
//! has `2 G s²` offsets, `offset(y) · sigmoid(scope(y)) · 0.5 + init_pos` (two 1x1
//! convolutions; `init_pos` places the `s x s` sub-pixels). Output pixel `(y·s + i, x·s + j)`
//! takes group `g`'s channels from point `(x + dx, y + dy)` of the input, with `(dx, dy)` the
//! offsets `g s² + i s + j` (x) and `G s² + g s² + i s + j` (y), by bilinear interpolation
//! between the four nearest pixels, the point first clamped into the map: exactly
//! `grid_sample(bilinear, align_corners=False, padding_mode="border")` of the reference,
//! whose grid it builds from the same sums. A 1x1 convolution (`end_conv`) then maps the `C`
//! channels to the image's.
//!
//! On the CPU in f32 one pass samples every output pixel in place; elsewhere candle's
//! operations gather the four corners one at a time.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use crate::ops::cpu::{cpu_slice, use_kernel};
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::LoadPlan;

/// DySample, as stored under `vb` (`offset`, `scope`, `init_pos`, `end_conv`).
pub struct DySample {
    /// `(C, 2 G s²)`: the offset convolution transposed, and its bias.
    offset: (Tensor, Tensor),
    /// `(C, 2 G s²)`: the scope convolution transposed (no bias).
    scope: Tensor,
    /// `(2 G s²)`.
    init_pos: Tensor,
    end: Option<Dense>,
    groups: usize,
    scale: usize,
}

impl DySample {
    /// DySample from `channels` to `out` channels (no `end_conv` when `end` is false: the
    /// sampled `channels` are the output), at scale `scale` in `groups` groups.
    pub fn new(
        (channels, out): (usize, usize),
        (scale, groups): (usize, usize),
        end: bool,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let oc = 2 * groups * scale * scale;
        if groups == 0 || !channels.is_multiple_of(groups) {
            candle_core::bail!("DySample: {channels} channels in {groups} groups");
        }
        let f32 = |t: Tensor| t.to_dtype(DType::F32);
        let w = |name: &str| -> Result<Tensor> {
            f32(vb
                .get((oc, channels, 1, 1), name)?
                .reshape((oc, channels))?
                .t()?
                .contiguous()?)
        };
        Ok(Self {
            offset: (w("offset.weight")?, f32(vb.get(oc, "offset.bias")?)?),
            scope: w("scope.weight")?,
            init_pos: f32(vb.get((1, oc, 1, 1), "init_pos")?.flatten_all()?)?,
            end: end
                .then(|| pointwise_with(channels, out, plan, vb.pp("end_conv")))
                .transpose()?,
            groups,
            scale,
        })
    }

    /// `y` `(B, H, W, C)` upsampled to `(B, sH, sW, out)`.
    pub fn forward(&self, y: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = y.dims4()?;
        let dtype = y.dtype();
        let y = y.to_dtype(DType::F32)?.contiguous()?;
        let rows = y.reshape((b * h * w, c))?;
        let (weight, bias) = &self.offset;
        let offsets = rows.matmul(weight)?.broadcast_add(bias)?;
        let gates = candle_nn::ops::sigmoid(&rows.matmul(&self.scope)?)?;
        let offsets = ((offsets * gates)? * 0.5)?
            .broadcast_add(&self.init_pos)?
            .reshape((b, h, w, ()))?
            .contiguous()?;
        let sampled = if use_kernel(&y) && use_kernel(&offsets) {
            self.sample_on_cpu(&y, &offsets)?
        } else {
            self.sample(&y, &offsets)?
        };
        let sampled = sampled.to_dtype(dtype)?;
        match &self.end {
            Some(end) => end.forward(&sampled),
            None => Ok(sampled),
        }
    }

    /// The sampling as one pass over the output rows, on the CPU in f32.
    fn sample_on_cpu(&self, y: &Tensor, offsets: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = y.dims4()?;
        let (g, s) = (self.groups, self.scale);
        let (cg, per) = (c / g, g * s * s);
        let (y_guard, y_layout) = y.storage_and_layout();
        let (o_guard, o_layout) = offsets.storage_and_layout();
        let (ys, os) = (
            cpu_slice(&y_guard, y_layout)?,
            cpu_slice(&o_guard, o_layout)?,
        );
        let (sh, sw) = (h * s, w * s);
        let mut out = vec![0f32; b * sh * sw * c];
        out.par_chunks_mut(sw * c)
            .enumerate()
            .for_each(|(row, dst)| {
                let (bi, oy) = (row / sh, row % sh);
                let (y, i) = (oy / s, oy % s);
                let image = &ys[bi * h * w * c..][..h * w * c];
                for (ox, px) in dst.chunks_exact_mut(c).enumerate() {
                    let (x, j) = (ox / s, ox % s);
                    let off = &os[((bi * h + y) * w + x) * 2 * per..][..2 * per];
                    for (gi, part) in px.chunks_exact_mut(cg).enumerate() {
                        let k = gi * s * s + i * s + j;
                        let (x0, x1, fx) = corners(x as f32 + off[k], w);
                        let (y0, y1, fy) = corners(y as f32 + off[per + k], h);
                        let at = |yy: usize, xx: usize| &image[(yy * w + xx) * c + gi * cg..][..cg];
                        let (a, bb, cc, d) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
                        for (ch, o) in part.iter_mut().enumerate() {
                            let top = a[ch] * (1.0 - fx) + bb[ch] * fx;
                            let bottom = cc[ch] * (1.0 - fx) + d[ch] * fx;
                            *o = top * (1.0 - fy) + bottom * fy;
                        }
                    }
                }
            });
        drop((y_guard, o_guard));
        Tensor::from_vec(out, (b, sh, sw, c), y.device())
    }

    /// The sampling in candle's operations: for each of the four corners, the source pixels
    /// gathered by index and weighted, all in f32.
    fn sample(&self, y: &Tensor, offsets: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = y.dims4()?;
        let (g, s) = (self.groups, self.scale);
        let (cg, per) = (c / g, g * s * s);
        let (sh, sw) = (h * s, w * s);
        let dev = y.device();
        // Each group's channels as rows of one table: row (image, group, pixel).
        let table = y
            .reshape((b, h * w, g, cg))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * g * h * w, cg))?;
        // An offset per (image, group, output row, output column).
        let per_output = |first: usize| -> Result<Tensor> {
            offsets
                .narrow(3, first, per)?
                .reshape((b, h, w, g, s, s))?
                .permute((0, 3, 1, 4, 2, 5))?
                .reshape((b * g, sh, sw))
        };
        let source = |n: usize, along: usize| -> Result<Tensor> {
            let v: Vec<f32> = (0..n).map(|k| (k / s) as f32).collect();
            Tensor::from_vec(v, n, dev)?.reshape(if along == 0 { (n, 1) } else { (1, n) })
        };
        let clamped = |t: Tensor, len: usize| t.clamp(0f32, (len - 1) as f32);
        let sx = clamped(per_output(0)?.broadcast_add(&source(sw, 1)?)?, w)?;
        let sy = clamped(per_output(per)?.broadcast_add(&source(sh, 0)?)?, h)?;
        let (x0, y0) = (sx.floor()?, sy.floor()?);
        let (fx, fy) = ((&sx - &x0)?, (&sy - &y0)?);
        let x1 = (&x0 + 1.0)?.minimum((w - 1) as f32)?;
        let y1 = (&y0 + 1.0)?.minimum((h - 1) as f32)?;
        let u32s = |t: &Tensor| t.to_dtype(DType::U32);
        let planes: Vec<u32> = (0..b * g).map(|p| (p * h * w) as u32).collect();
        let planes = Tensor::from_vec(planes, (b * g, 1, 1), dev)?;
        let width = Tensor::new(w as u32, dev)?;
        let mut acc: Option<Tensor> = None;
        for (yy, wy) in [(&y0, (1.0 - &fy)?), (&y1, fy.clone())] {
            for (xx, wx) in [(&x0, (1.0 - &fx)?), (&x1, fx.clone())] {
                let index = u32s(yy)?
                    .broadcast_mul(&width)?
                    .add(&u32s(xx)?)?
                    .broadcast_add(&planes)?
                    .flatten_all()?;
                let weight = (&wy * &wx)?.flatten_all()?.unsqueeze(1)?;
                let part = table.index_select(&index, 0)?.broadcast_mul(&weight)?;
                acc = Some(match acc {
                    Some(a) => (a + part)?,
                    None => part,
                });
            }
        }
        let Some(acc) = acc else {
            candle_core::bail!("DySample: no corners");
        };
        acc.reshape((b, g, sh * sw, cg))?
            .transpose(1, 2)?
            .reshape((b, sh, sw, c))
    }
}

/// The two neighbouring indices of coordinate `v` clamped into `0..len`, and the weight of
/// the second: the point on the border takes the border pixel.
#[inline]
fn corners(v: f32, len: usize) -> (usize, usize, f32) {
    let v = v.clamp(0.0, (len - 1) as f32);
    let lo = v.floor();
    let i = lo as usize;
    (i, (i + 1).min(len - 1), v - lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The CPU pass and candle's gathers give the same samples, offsets reaching past
    /// every border included.
    #[test]
    fn cpu_sampling_is_candles_gathers() -> Result<()> {
        let dev = Device::Cpu;
        for (b, h, w, c, g, s) in [(1, 5, 7, 12, 4, 2), (2, 4, 3, 27, 3, 3), (1, 3, 3, 8, 4, 1)] {
            let y = crate::tests::normal(0.0, 1.0, (b, h, w, c), &dev)?;
            let offsets = crate::tests::normal(0.0, 2.0, (b, h, w, 2 * g * s * s), &dev)?;
            let vb = VarBuilder::zeros(DType::F32, &dev);
            let d = DySample::new((c, 3), (s, g), false, &LoadPlan::default(), vb)?;
            let fast = d.sample_on_cpu(&y, &offsets)?;
            let slow = d.sample(&y, &offsets)?;
            let diff = (fast - slow)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{b}x{h}x{w}x{c}, {g} groups, x{s}: {diff}");
        }
        Ok(())
    }
}
