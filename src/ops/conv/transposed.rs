//! Transposed convolutions (PyTorch's `ConvTranspose2d`, no output padding or dilation) on
//! channels-last features: Real-CUGAN's upsampling ones and FDAT's transpose+conv
//! upsampler.
//!
//! Each is a zero-padded 3x3 convolution to `s²` times the output channels followed by
//! PixelShuffle ([`Deconv`]): it runs on the 3x3 convolution's kernels on every device
//! (Winograd's on the CPU), where candle's own transposed convolution (a dot product per output
//! value) took a quarter of an FDAT model's time on the CPU.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use super::Conv3x3;
use crate::ops::{crop, LoadPlan};

/// A transposed convolution (`k x k`, stride `s`, padding `p`) as a zero-padded 3x3
/// convolution to `s² cout` channels and PixelShuffle by `s`. Output pixel `o` of the
/// transposed convolution sums `w[k] · x[i]` over `o = s i + k - p`; writing `o = s m + a -
/// start`, phase `a` of input pixel `m` reads `x[m + d]` through `w[a + p - start - s d]`
/// for `d` in -1..=1 wherever that index lies in the kernel. `start` is the least offset
/// that fits every tap into those three, and the shuffled map is cropped from it. Inputs
/// outside the map are the convolution's zero padding, as they are the transposed one's.
pub struct Deconv {
    conv: Conv3x3,
    stride: usize,
    /// Where the transposed convolution's output starts in the shuffled map.
    start: usize,
    /// `k - 2p`: the output is `s (n - 1) + k - 2p` pixels from `n`.
    extra: isize,
}

impl Deconv {
    /// The transposed convolution stored under `vb`, `cin` to `cout` channels.
    pub fn new(
        (cin, cout): (usize, usize),
        (k, s, p): (usize, usize, usize),
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let w = vb.get((cin, cout, k, k), "weight")?;
        let bias = vb.get(cout, "bias")?;
        let values: Vec<f32> = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let (start, taps) = phase_taps(k, s, p).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "a {k}x{k} transposed convolution with stride {s} and padding {p} does not fit 3x3 phases"
            ))
        })?;
        // (s² cout, cin, 3, 3), outputs in PixelShuffle's order c s² + ay s + ax.
        let mut conv = vec![0f32; s * s * cout * cin * 9];
        for (ay, dy, ky) in taps.iter().copied() {
            for (ax, dx, kx) in taps.iter().copied() {
                for co in 0..cout {
                    let o = co * s * s + ay * s + ax;
                    for ci in 0..cin {
                        conv[((o * cin + ci) * 3 + dy) * 3 + dx] =
                            values[((ci * cout + co) * k + ky) * k + kx];
                    }
                }
            }
        }
        let conv =
            Tensor::from_vec(conv, (s * s * cout, cin, 3, 3), w.device())?.to_dtype(w.dtype())?;
        let bias = bias
            .reshape((cout, 1))?
            .broadcast_as((cout, s * s))?
            .contiguous()?
            .reshape(s * s * cout)?;
        Ok(Self {
            conv: Conv3x3::shuffled_from(&conv, &bias, (cout, s), plan)?,
            stride: s,
            start,
            extra: k as isize - 2 * p as isize,
        })
    }

    /// `x` `(B, H, W, cin)` to `(B, s (H - 1) + k - 2p, s (W - 1) + k - 2p, cout)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, h, w, _) = x.dims4()?;
        let s = self.stride;
        let len = |n: usize| (s as isize * (n as isize - 1) + self.extra).max(0) as usize;
        let y = self.conv.forward_shuffled(x, s)?;
        let (hy, wy) = (y.dim(1)?, y.dim(2)?);
        // The output is the shuffled map less `start` pixels at the top and left and what is
        // left past its length at the bottom and right.
        if hy - len(h) == 2 * self.start && wy - len(w) == 2 * self.start {
            return crop(&y, self.start);
        }
        y.narrow(1, self.start, len(h))?
            .narrow(2, self.start, len(w))?
            .contiguous()
    }
}

/// One kernel tap of a transposed convolution in its 3x3 phase: (phase, 3x3 tap index,
/// kernel index), along one axis.
type PhaseTap = (usize, usize, usize);

/// For a `k x k` transposed convolution with stride `s` and padding `p`: the least output
/// offset `start` whose phases read at most one input pixel either side of their own, and
/// every kernel tap as (phase, 3x3 tap index, kernel index). `None` where none fits, or the
/// output would not lie within the shuffled map (`start > s + 2p - k`).
fn phase_taps(k: usize, s: usize, p: usize) -> Option<(usize, Vec<PhaseTap>)> {
    let (k, s, p) = (k as isize, s as isize, p as isize);
    (0..=s + 2 * p - k).find_map(|start| {
        let taps: Option<Vec<_>> = (0..k)
            .map(|kk| {
                // The phase whose output this tap reaches, and which input pixel it reads.
                let a = (kk - p + start).rem_euclid(s);
                let d = (a + p - start - kk) / s;
                (-1..=1)
                    .contains(&d)
                    .then_some((a as usize, (d + 1) as usize, kk as usize))
            })
            .collect();
        taps.map(|t| (start as usize, t))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real-CUGAN's two transposed convolutions split into 3x3 phases, every kernel tap
    /// placed once, starting where the derivation in [`Deconv`] says.
    #[test]
    fn transposed_convolutions_split_into_three_by_three_phases() {
        let (start, taps) = phase_taps(4, 2, 3).unwrap();
        assert_eq!(start, 1);
        assert_eq!(taps.len(), 4);
        let (start, taps) = phase_taps(5, 3, 2).unwrap();
        assert_eq!(start, 0);
        assert_eq!(taps.len(), 5);
        assert!(
            phase_taps(9, 2, 0).is_none(),
            "a kernel wider than three phases fit"
        );
    }

    /// Against candle's own transposed convolution, in f64 on the CPU, for Real-CUGAN's two
    /// released shapes, FDAT's two and a 2x2, on odd sizes.
    #[test]
    fn deconv_matches_a_plain_transposed_convolution() {
        use candle_core::Device;
        use std::collections::HashMap;
        let dev = Device::Cpu;
        for (k, s, p) in [(4, 2, 3), (5, 3, 2), (2, 2, 0), (4, 2, 1), (3, 3, 0)] {
            let (cin, cout) = (5, 3);
            let w = Tensor::randn(0f32, 1.0, (cin, cout, k, k), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, cout, &dev).unwrap();
            let x = Tensor::randn(0f32, 1.0, (2, cin, 7, 6), &dev).unwrap();
            let tensors = HashMap::from([
                ("weight".to_string(), w.clone()),
                ("bias".to_string(), b.clone()),
            ]);
            let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
            let d = Deconv::new((cin, cout), (k, s, p), &LoadPlan::default(), vb).unwrap();
            let ours = d
                .forward(&x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap())
                .unwrap()
                .permute((0, 3, 1, 2))
                .unwrap();
            let reference = x
                .to_dtype(DType::F64)
                .unwrap()
                .conv_transpose2d(&w.to_dtype(DType::F64).unwrap(), p, 0, s, 1)
                .unwrap()
                .broadcast_add(
                    &b.to_dtype(DType::F64)
                        .unwrap()
                        .reshape((1, cout, 1, 1))
                        .unwrap(),
                )
                .unwrap();
            assert_eq!(ours.dims(), reference.dims(), "{k}x{k} stride {s}");
            let diff = crate::tests::fixtures::max_abs_diff(&ours, &reference);
            assert!(diff < 1e-4, "{k}x{k} stride {s}: {diff}");
        }
    }
}
