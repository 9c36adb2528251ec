//! [`GroupNorm`] on channels-last maps, with a residual added after it: RealPLKSR's block
//! ends in one. Each image's channels fall into `groups` runs of equal width; every run is
//! normalised by the mean and (biased) variance of all its values over the whole map, then
//! scaled and shifted per channel. The statistics of the whole map make a tiled image's
//! output depend on its tiles: that is the model's, not this layer's.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use crate::ops::cpu::{cpu_slice, use_kernel};

/// PyTorch's `nn.GroupNorm` default.
pub const GROUP_NORM_EPS: f64 = 1e-5;

/// Pixels per task of the statistics pass.
const STATS_PIXELS: usize = 256;

/// `nn.GroupNorm(groups, channels)` on `(B, H, W, C)` maps.
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
    /// The weight and bias on the host, where the layer is on the CPU in f32.
    host: Option<(Vec<f32>, Vec<f32>)>,
}

impl GroupNorm {
    /// The norm stored under `vb`: `channels` in `groups` groups.
    pub fn new(channels: usize, groups: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            candle_core::bail!("a group norm of {channels} channels in {groups} groups");
        }
        let weight = vb.get(channels, "weight")?;
        let bias = vb.get(channels, "bias")?;
        let host = if use_kernel(&weight) {
            Some((weight.to_vec1()?, bias.to_vec1()?))
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            groups,
            eps,
            host,
        })
    }

    /// `norm(x) + skip`, both `(B, H, W, C)`.
    pub fn forward_residual(&self, x: &Tensor, skip: &Tensor) -> Result<Tensor> {
        if x.dims() != skip.dims() || x.dim(3)? != self.weight.dim(0)? {
            candle_core::bail!("group norm of {:?} plus {:?}", x.dims(), skip.dims());
        }
        let (x, skip) = (x.contiguous()?, skip.contiguous()?);
        match &self.host {
            Some((w, b)) if use_kernel(&x) && use_kernel(&skip) => self.on_cpu(&x, &skip, w, b),
            _ => self.reference(&x)? + skip,
        }
    }

    /// candle's ops, in f32.
    fn reference(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (g, cg) = (self.groups, c / self.groups);
        let v = x
            .to_dtype(DType::F32)?
            .reshape((b, h * w, g, cg))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, g, h * w * cg))?;
        let d = v.broadcast_sub(&v.mean_keepdim(2)?)?;
        let rstd = (d.sqr()?.mean_keepdim(2)? + self.eps)?.sqrt()?.recip()?;
        let n = d
            .broadcast_mul(&rstd)?
            .reshape((b, g, h * w, cg))?
            .transpose(1, 2)?
            .reshape((b, h, w, c))?;
        let weight = self.weight.to_dtype(DType::F32)?;
        let bias = self.bias.to_dtype(DType::F32)?;
        n.broadcast_mul(&weight)?
            .broadcast_add(&bias)?
            .to_dtype(x.dtype())
    }

    /// Two passes: each image's group sums in f64 over tasks of pixels, then every value
    /// normalised, scaled, shifted and added to the residual in one write.
    fn on_cpu(&self, x: &Tensor, skip: &Tensor, weight: &[f32], bias: &[f32]) -> Result<Tensor> {
        let (batch, h, w, c) = x.dims4()?;
        let (g, cg) = (self.groups, c / self.groups);
        let pixels = h * w;
        let (x_guard, x_layout) = x.storage_and_layout();
        let (s_guard, s_layout) = skip.storage_and_layout();
        let (xs, ss) = (
            cpu_slice(&x_guard, x_layout)?,
            cpu_slice(&s_guard, s_layout)?,
        );
        // Per image and channel: (mean of its group, rstd of its group · weight).
        let mut norms = Vec::with_capacity(batch);
        for image in xs.chunks_exact(pixels * c) {
            let sums = image
                .par_chunks(STATS_PIXELS * c)
                .map(|chunk| {
                    let mut s = vec![(0f64, 0f64); g];
                    for px in chunk.chunks_exact(c) {
                        for (s, run) in s.iter_mut().zip(px.chunks_exact(cg)) {
                            for &v in run {
                                let v = f64::from(v);
                                s.0 += v;
                                s.1 += v * v;
                            }
                        }
                    }
                    s
                })
                .reduce(
                    || vec![(0f64, 0f64); g],
                    |a, b| {
                        a.iter()
                            .zip(&b)
                            .map(|(a, b)| (a.0 + b.0, a.1 + b.1))
                            .collect()
                    },
                );
            let n = (pixels * cg) as f64;
            let per_channel: Vec<(f32, f32)> = (0..c)
                .map(|ch| {
                    let (sum, sq) = sums[ch / cg];
                    let mean = sum / n;
                    let var = (sq / n - mean * mean).max(0.0);
                    let scale = f64::from(weight[ch]) / (var + self.eps).sqrt();
                    (mean as f32, scale as f32)
                })
                .collect();
            norms.push(per_channel);
        }
        let mut out = vec![0f32; xs.len()];
        out.par_chunks_mut(STATS_PIXELS * c)
            .zip(xs.par_chunks(STATS_PIXELS * c))
            .zip(ss.par_chunks(STATS_PIXELS * c))
            .enumerate()
            .for_each(|(task, ((out, x), s))| {
                let first = task * STATS_PIXELS;
                for (p, ((o, x), s)) in out
                    .chunks_exact_mut(c)
                    .zip(x.chunks_exact(c))
                    .zip(s.chunks_exact(c))
                    .enumerate()
                {
                    let norm = &norms[(first + p) / pixels];
                    for ch in 0..c {
                        let (mean, scale) = norm[ch];
                        o[ch] = (x[ch] - mean) * scale + bias[ch] + s[ch];
                    }
                }
            });
        drop((x_guard, s_guard));
        Tensor::from_vec(out, (batch, h, w, c), x.device())
    }
}
