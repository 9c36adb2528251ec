//! CPU kernels for the two element-wise hot spots of the network: the attention softmax and
//! the exact GELU. candle's CPU versions call scalar `expf`/`erff` per element; these use
//! polynomial forms the compiler vectorises, with errors far below the model's float32 noise
//! (checked below and by the golden parity tests). Other devices and dtypes use candle's ops.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// exp(x) for x <= 0: 2^n * p(r) with a Cody-Waite reduction and a degree-6 polynomial;
/// relative error ~2e-7. Inputs below -87 return 0 exactly (no denormals downstream).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and removing 1.5 * 2^23 rounds to nearest without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (max absolute error 1.5e-7), odd-extended.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    if x < 0.0 {
        -y
    } else {
        y
    }
}

/// Elements per parallel task: enough work to amortise scheduling.
const CHUNK: usize = 32 << 10;

fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("f32 kernel called on another dtype")
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("kernel called on a strided tensor")
    };
    Ok(&data[start..end])
}

struct SoftmaxLastDim;

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "upscale-softmax-last-dim"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = contiguous_f32(storage, layout)?;
        let n = layout.dims().last().copied().unwrap_or(1).max(1);
        let mut out = data.to_vec();
        let rows = (CHUNK / n).max(1);
        out.par_chunks_mut(rows * n).for_each(|chunk| {
            for row in chunk.chunks_exact_mut(n) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|v| *v = exp_nonpositive(*v - max));
                let inv = 1.0 / row.iter().sum::<f32>();
                row.iter_mut().for_each(|v| *v *= inv);
            }
        });
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

struct GeluErf;

impl CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "upscale-gelu-erf"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = contiguous_f32(storage, layout)?;
        let mut out = data.to_vec();
        out.par_chunks_mut(CHUNK).for_each(|chunk| {
            chunk.iter_mut().for_each(|v| {
                *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
            });
        });
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

fn use_kernel(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.is_contiguous()
}

/// Softmax over the last axis.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        x.apply_op1_no_bwd(&SoftmaxLastDim)
    } else {
        candle_nn::ops::softmax_last_dim(x)
    }
}

/// The exact (erf) GELU.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    if use_kernel(x) {
        x.apply_op1_no_bwd(&GeluErf)
    } else {
        x.gelu_erf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn exp_is_accurate_over_the_softmax_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp_nonpositive(x) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(-1000.0), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn gelu_matches_exact_gelu_and_not_tanh() -> Result<()> {
        let xs: Vec<f32> = (-4000..4000).map(|i| i as f32 / 400.0).collect();
        let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
        let ours = gelu_erf(&x)?;
        let exact = x.to_dtype(DType::F64)?.gelu_erf()?;
        let d = (ours.to_dtype(DType::F64)? - exact)?
            .abs()?
            .max(0)?
            .to_scalar::<f64>()?;
        assert!(d < 1e-6, "max abs error {d}");
        let gap = (ours - x.gelu()?)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(gap > 1e-4, "indistinguishable from tanh GELU: {gap}");
        Ok(())
    }

    #[test]
    fn softmax_matches_candle_with_masked_entries() -> Result<()> {
        let x = Tensor::randn(0f32, 3.0, (5, 7, 64), &Device::Cpu)?;
        let masked = (x.narrow(2, 0, 32)? - 100.0)?;
        let x = Tensor::cat(&[&masked, &x.narrow(2, 32, 32)?], 2)?;
        let ours = softmax_last_dim(&x)?;
        let want = candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F64)?)?;
        let d = (ours.to_dtype(DType::F64)? - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        assert!(d < 1e-6, "max abs error {d}");
        Ok(())
    }
}
