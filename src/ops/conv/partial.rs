//! [`PartialConv`]: a square convolution of odd size (stride 1, zero padding of half the
//! size) on the first channels of a channels-last map, the other channels passed through
//! unchanged: RealPLKSR's partial large kernel (17x17 on a quarter of the channels).
//!
//! On the CPU in f32 it runs on the panel kernels without a patch matrix: the convolved
//! channels are copied once into a zero-bordered map of their own, where the `k` taps of one
//! kernel row under an output pixel are `k · cin` consecutive values, and a run of output
//! pixels reads them `cin` values apart. So each kernel row is one product over rows that
//! overlap in memory, `k · cin` deep, added onto the sums of the rows before it. Elsewhere
//! candle's `conv2d`, which is also its reference.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use crate::ops::cpu::panels::{self, Panels, Start};
use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::{cpu_slice, par_copy, use_kernel};

/// A `k x k` convolution from the first `cin` channels of a map onto themselves.
pub struct PartialConv {
    /// `(cin, cin, k, k)`, as stored.
    weight: Tensor,
    bias: Tensor,
    k: usize,
    cin: usize,
    /// The weight as `(k · k · cin) x cin` panels, rows ordered (dy, dx, input channel), and
    /// the bias, for the CPU kernel; `None` where the layer is not on the CPU in f32 or the
    /// panel kernels do not run on this CPU.
    host: Option<(Panels, Vec<f32>)>,
}

impl PartialConv {
    /// The convolution stored under `vb`: `cin` channels, a `k x k` kernel (`k` odd).
    pub fn new(cin: usize, k: usize, vb: VarBuilder) -> Result<Self> {
        if k.is_multiple_of(2) {
            candle_core::bail!("a partial convolution of even size {k}");
        }
        let weight = vb.get((cin, cin, k, k), "weight")?;
        let bias = vb.get(cin, "bias")?;
        let host = if use_kernel(&weight) && panels::available() {
            let w: Vec<f32> = weight.flatten_all()?.to_vec1()?;
            // Row (dy, dx, ci), column co of the operand is w[co][ci][dy][dx].
            let mut rows = vec![0f32; k * k * cin * cin];
            for co in 0..cin {
                for ci in 0..cin {
                    for t in 0..k * k {
                        rows[(t * cin + ci) * cin + co] = w[(co * cin + ci) * k * k + t];
                    }
                }
            }
            let packed = Panels::new(&rows, (k * k * cin, cin), (cin, 1));
            Some((packed, bias.to_vec1()?))
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            k,
            cin,
            host,
        })
    }

    /// `x` `(B, H, W, C)` with its first `cin` channels convolved, the rest as they are.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, _, c) = x.dims4()?;
        if c < self.cin {
            candle_core::bail!("a partial convolution of {} channels on {c}", self.cin);
        }
        let x = x.contiguous()?;
        match &self.host {
            Some((packed, bias)) if use_kernel(&x) => self.on_cpu(&x, packed, bias),
            _ => self.reference(&x),
        }
    }

    /// candle's `conv2d` on the first channels, concatenated with the rest.
    fn reference(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, _, c) = x.dims4()?;
        let part = x
            .narrow(3, 0, self.cin)?
            .permute((0, 3, 1, 2))?
            .contiguous()?;
        let weight = self.weight.to_dtype(x.dtype())?;
        let bias = self
            .bias
            .to_dtype(x.dtype())?
            .reshape((1, self.cin, 1, 1))?;
        let y = part
            .conv2d(&weight, self.k / 2, 1, 1, 1)?
            .broadcast_add(&bias)?
            .permute((0, 2, 3, 1))?;
        if c == self.cin {
            return y.contiguous();
        }
        Tensor::cat(&[&y, &x.narrow(3, self.cin, c - self.cin)?], 3)?.contiguous()
    }

    /// The panel kernels' convolution (see the module's account), one task per output row.
    fn on_cpu(&self, x: &Tensor, packed: &Panels, bias: &[f32]) -> Result<Tensor> {
        let (batch, h, w, c) = x.dims4()?;
        let (k, p) = (self.k, self.cin);
        let pad = k / 2;
        let (hp, wp) = (h + 2 * pad, w + 2 * pad);
        let (guard, layout) = x.storage_and_layout();
        let xs = cpu_slice(&guard, layout)?;
        // The convolved channels inside a zero border.
        let mut padded = vec![0f32; batch * hp * wp * p];
        padded
            .par_chunks_mut(wp * p)
            .enumerate()
            .for_each(|(row, dst)| {
                let (bi, y) = (row / hp, row % hp);
                if y < pad || y >= pad + h {
                    return;
                }
                let src = &xs[(bi * h + y - pad) * w * c..][..w * c];
                for (d, s) in dst[pad * p..].chunks_exact_mut(p).zip(src.chunks_exact(c)) {
                    d.copy_from_slice(&s[..p]);
                }
            });
        let mut out = par_copy(xs);
        drop(guard);
        if w > 0 {
            // SAFETY: each task writes the first `p` channels of its own output row only,
            // and `out` outlives the tasks.
            let dst = unsafe { Shared::new(out.as_mut_ptr()) };
            (0..batch * h).into_par_iter().for_each(|row| {
                let (bi, y) = (row / h, row % h);
                let d = dst.get().wrapping_add(row * w * c);
                for dy in 0..k {
                    // Output pixel x's taps in kernel row dy: k pixels of p channels from
                    // (y + dy, x) of the padded map, consecutive; pixel x + 1's start p later.
                    let a = padded[(bi * hp + y + dy) * wp * p..].as_ptr();
                    let start = match dy {
                        0 => Start {
                            init: None,
                            bias: Some(bias.as_ptr()),
                        },
                        _ => Start {
                            init: Some((d.cast_const(), c)),
                            bias: None,
                        },
                    };
                    // SAFETY: row j of the lhs, a + j·p, holds k·p values inside `padded`
                    // (j + k <= wp pixels of row y + dy < hp); the rhs is rows dy·k·p.. of
                    // the packed weight, k·p of them; dst holds w rows of p values c apart
                    // inside this task's output row, read (after dy = 0) before written.
                    unsafe {
                        panels::gemm(
                            w,
                            (a, p),
                            packed.rows(dy * k * p, k * p),
                            (d, c),
                            start,
                            false,
                            None,
                        )
                    };
                }
            });
        }
        Tensor::from_vec(out, (batch, h, w, c), x.device())
    }
}
