//! Channel padding (`UPSCALE_PAD_CHANNELS`, [`crate::switches`]): zero-padding every channel width of the network to a multiple of
//! 8, 16 or 64 at load time, so that every activation row is 16-byte aligned and every
//! linear layer's and convolution's K and N are multiples of 8. cuBLASLt then picks Hopper's
//! kernels instead of Ampere's 2-element-aligned ones for DRCT's widths (180 + 32k).
//!
//! The padding is exact: padded weights and biases are zero, so the padded channels of every
//! activation stay exactly zero, and the layer norms count only the real channels. Without
//! the variable, [`Pad::choose`] pads to 16 on a GPU in bf16 and fp16, the one place a GPU
//! run has measured it to pay; on the CPU it only adds work.

use candle_core::{DType, Device, Result, Tensor};

use crate::switches::{EnvError, PAD_MULTIPLES, PAD_VAR};

/// The multiple every channel width is rounded up to; 1 when off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pad(usize);

impl Default for Pad {
    fn default() -> Self {
        Self::OFF
    }
}

impl Pad {
    pub const OFF: Pad = Pad(1);

    /// Padding to `multiple`, one of 8, 16 and 64.
    pub fn to(multiple: usize) -> std::result::Result<Pad, EnvError> {
        if PAD_MULTIPLES.contains(&multiple) {
            Ok(Pad(multiple))
        } else {
            Err(EnvError::NotAMultiple {
                var: PAD_VAR,
                value: multiple,
            })
        }
    }

    /// The padding the switch's multiple asks for (0: none).
    pub fn from_switch(multiple: usize) -> std::result::Result<Pad, EnvError> {
        match multiple {
            0 => Ok(Pad::OFF),
            m => Pad::to(m),
        }
    }

    /// The padding a model gets without `UPSCALE_PAD_CHANNELS`: 16 on CUDA in bf16 and f16,
    /// none elsewhere. On an H200 (bf16, tile 256, batch 4) 16 made DRCT-L 1.51x and DRCT
    /// 1.30x faster, 8 1.46x and 1.25x, 64 1.31x and 1.14x (docs/performance-history.md).
    /// f32 rows are 16-byte aligned already and its GEMMs were not measured padded.
    pub fn choose(device: &Device, dtype: DType) -> Pad {
        if device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) {
            Pad(16)
        } else {
            Pad::OFF
        }
    }

    pub fn is_off(self) -> bool {
        self.0 == 1
    }

    /// The multiple, 0 when off (as the variable writes it).
    pub fn multiple(self) -> usize {
        if self.is_off() {
            0
        } else {
            self.0
        }
    }

    /// `n` rounded up to the multiple.
    pub fn width(self, n: usize) -> usize {
        n.next_multiple_of(self.0)
    }

    /// One part of `n` channels, padded.
    pub fn one(self, n: usize) -> Channels {
        Channels(vec![(n, self.width(n))])
    }

    /// `count` parts of `n` channels each, each padded on its own (the heads of q, k or v).
    pub fn parts(self, count: usize, n: usize) -> Channels {
        Channels(vec![(n, self.width(n)); count])
    }
}

/// Where the real channels of a padded axis lie: consecutive parts, each `(real, padded)`,
/// its real channels first and its zero channels after. The dense connections concatenate
/// parts, so a block's input has one part per concatenated tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Channels(Vec<(usize, usize)>);

impl Channels {
    /// Real channels in all.
    pub fn real(&self) -> usize {
        self.0.iter().map(|p| p.0).sum()
    }

    /// Channels in all, padding included.
    pub fn padded(&self) -> usize {
        self.0.iter().map(|p| p.1).sum()
    }

    pub fn is_padded(&self) -> bool {
        self.real() != self.padded()
    }

    /// These parts followed by `other`'s.
    pub fn then(&self, other: &Channels) -> Channels {
        Channels([&self.0[..], &other.0[..]].concat())
    }

    /// `t` with axis `dim` (`real()` long) spread to `padded()`: each part's values at its
    /// padded offset, zeros between.
    pub fn spread(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        if t.dim(dim)? != self.real() {
            candle_core::bail!(
                "padding {:?} along axis {dim}: {} real channels expected",
                t.dims(),
                self.real()
            );
        }
        if !self.is_padded() {
            return Ok(t.clone());
        }
        let mut at = 0;
        let mut pieces = Vec::with_capacity(self.0.len());
        for &(real, padded) in &self.0 {
            pieces.push(
                t.narrow(dim, at, real)?
                    .pad_with_zeros(dim, 0, padded - real)?,
            );
            at += real;
        }
        Tensor::cat(&pieces, dim)
    }

    /// 1 on real channels, 0 on padded ones: `(padded())`.
    pub fn mask(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let ones = Tensor::ones(self.real(), dtype, device)?;
        self.spread(&ones, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `spec` as the switch reads it.
    fn parse(spec: &str) -> std::result::Result<Pad, EnvError> {
        let on = |n| (n == PAD_VAR).then(|| Ok(spec.to_string()));
        Pad::from_switch(
            crate::switches::Switches::parse(on)?
                .pad_channels
                .unwrap_or(0),
        )
    }

    #[test]
    fn parses_the_multiples_and_refuses_the_rest_by_name() {
        assert_eq!(parse(""), Ok(Pad::OFF));
        assert_eq!(parse("0"), Ok(Pad::OFF));
        assert_eq!(parse(" 16 ").map(Pad::multiple), Ok(16));
        for m in [8, 64] {
            assert_eq!(parse(&m.to_string()).map(Pad::multiple), Ok(m));
        }
        for bad in ["4", "32", "eight", "-8", "8,16"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(PAD_VAR) && e.contains(bad.trim()), "{e}");
        }
        assert_eq!(Pad::OFF.width(180), 180);
        assert_eq!(parse("8").unwrap().width(180), 184);
        assert_eq!(parse("64").unwrap().width(180), 192);
        assert_eq!(parse("8").unwrap().width(32), 32);
    }

    #[test]
    fn the_cpu_never_pads_by_default() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(Pad::choose(&Device::Cpu, dtype), Pad::OFF);
        }
    }

    #[test]
    fn spreads_each_part_to_its_padded_offset() -> Result<()> {
        let pad = Pad::to(8).unwrap();
        let ch = pad.one(5).then(&pad.parts(2, 3));
        assert_eq!((ch.real(), ch.padded()), (11, 24));
        let t = Tensor::arange(1f32, 12., &Device::Cpu)?.reshape((1, 11))?;
        let got = ch.spread(&t, 1)?.flatten_all()?.to_vec1::<f32>()?;
        let mut want = vec![0f32; 24];
        want[..5].copy_from_slice(&[1., 2., 3., 4., 5.]);
        want[8..11].copy_from_slice(&[6., 7., 8.]);
        want[16..19].copy_from_slice(&[9., 10., 11.]);
        assert_eq!(got, want);
        let mask = ch.mask(DType::F32, &Device::Cpu)?.to_vec1::<f32>()?;
        assert_eq!(
            mask,
            want.iter().map(|&v| f32::from(v != 0.)).collect::<Vec<_>>()
        );
        assert!(ch.spread(&t, 0).is_err());
        Ok(())
    }
}
