//! 3x3 convolutions (stride 1, zero padding 1) on channels-last features, plain or followed
//! by PixelShuffle.
//!
//! [`Conv3x3`] and its reference (the patch GEMM) are here, its CPU half (f32, and bf16
//! products) in [`cpu`], its CUDA half (the row-wise kernels for the patch matrix and the
//! narrow RGB output, kernels/rowwise.cu) in [`cuda`]; on CUDA it runs the patch GEMM with
//! those and Dense's bias epilogue ([`super::linear::rowwise`]).

pub(crate) mod cpu;
pub(crate) mod cuda;
pub mod depthwise;
pub mod partial;
pub mod transposed;
pub(crate) mod winograd;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::linear::pack_bf16;
use super::linear::rowwise::{bias_act, Act as RowAct};
use super::{Backend, LoadPlan};
use crate::ops::cpu as kernels;
use crate::ops::cpu::bf16::{Isa, PackedB};
use crate::ops::pad::{Channels, Pad};
use crate::ops::rowwise::ours;
use crate::switches::cuda_off::Off;
use winograd::Winograd;

/// Upper bound on the patch matrix of one convolution chunk, in elements (64 MiB in f32):
/// large enough for full-speed matmuls, small enough that a high-resolution upsampler
/// convolution never materialises gigabytes.
const CONV_CHUNK_ELEMS: usize = 16 << 20;

/// The same bound on a GPU (256 MiB in bf16): each chunk costs a dozen kernel launches, so
/// larger chunks keep a batch's upsampler to tens of launches instead of hundreds, and the
/// bound stays far below the 2³¹ elements that candle's CUDA kernels can index.
const CONV_CHUNK_ELEMS_GPU: usize = 128 << 20;

/// The `(9 * cin, cout)` weight, rows ordered (dy, dx, cin) to match the patch matrix, and the
/// bias of the convolution stored under `vb`, its inputs spread as `cin` says.
fn read(cin: &Channels, cout: usize, vb: VarBuilder) -> Result<(Tensor, Tensor)> {
    read_with_bias(cin, cout, true, vb)
}

/// [`read`], with a zero bias for a convolution stored without one when `bias` is false.
fn read_with_bias(
    cin: &Channels,
    cout: usize,
    bias: bool,
    vb: VarBuilder,
) -> Result<(Tensor, Tensor)> {
    let w = cin.spread(&vb.get((cout, cin.real(), 3, 3), "weight")?, 1)?;
    let bias = match bias {
        true => vb.get(cout, "bias")?,
        false => Tensor::zeros(cout, vb.dtype(), vb.device())?,
    };
    Ok((gemm_weight(&w)?, bias))
}

/// A `(cout, cin, 3, 3)` weight as the `(9 * cin, cout)` matrix of the patch GEMM.
fn gemm_weight(w: &Tensor) -> Result<Tensor> {
    let (cout, cin, _, _) = w.dims4()?;
    if kernels::use_kernel(w) {
        let (guard, layout) = w.storage_and_layout();
        let taps = tap_major(kernels::cpu_slice(&guard, layout)?, cout, cin);
        Tensor::from_vec(taps, (9 * cin, cout), w.device())
    } else {
        w.permute((2, 3, 1, 0))?
            .reshape((9 * cin, cout))?
            .contiguous()
    }
}

/// `(cout, cin, 3, 3)` weights as `(9 cin, cout)`, rows ordered (dy, dx, cin): the
/// `cout x 9 cin` matrix transposed in registers, whose rows come ordered (cin, dy, dx), then
/// its rows copied into tap order. candle's strided copy took a fifth of ESRGAN's load (an
/// index computation per element), and a plain gather across the kernels half of that.
fn tap_major(w: &[f32], cout: usize, cin: usize) -> Vec<f32> {
    assert_eq!(w.len(), cout * cin * 9, "a 3x3 kernel of {cin} x {cout}");
    thread_local! {
        // The transposed kernel, reused from one convolution to the next: fresh memory for
        // each cost its page faults again.
        static BY_CHANNEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BY_CHANNEL.with_borrow_mut(|by_channel| {
        by_channel.resize(w.len(), 0.0);
        kernels::panels::transpose((w, 9 * cin), (cout, 9 * cin), (by_channel, cout));
        let mut out = Vec::with_capacity(w.len());
        for t in 0..9 {
            for ci in 0..cin {
                out.extend_from_slice(&by_channel[(ci * 9 + t) * cout..][..cout]);
            }
        }
        out
    })
}

/// A 3x3 convolution (stride 1, zero padding 1) on channels-last features.
///
/// On the CPU the kernels of [`cpu`] run it. Elsewhere the patch matrix of each chunk of
/// rows ([`cuda::patches3x3`]: one kernel pass on CUDA) is fed to one matmul, with memory
/// bounded by `CONV_CHUNK_ELEMS` (`CONV_CHUNK_ELEMS_GPU` on a GPU) however large the feature
/// map; on CUDA the RGB output layer skips the patch matrix ([`cuda::conv3x3_narrow`]).
pub struct Conv3x3 {
    /// `(9 * cin, cout)`, rows ordered (dy, dx, cin) to match the patch matrix.
    weight: Tensor,
    bias: Tensor,
    cin: usize,
    /// The weight in bf16, for bf16 products on the CPU.
    bf16: Option<(Isa, PackedB)>,
    /// The weight for Winograd's algorithm, for f32 on the CPU ([`winograd`]).
    winograd: Option<Box<Winograd>>,
    backend: Backend,
    /// Our CUDA kernels the load plan leaves out.
    off: Off,
}

impl Conv3x3 {
    /// The convolution stored under `vb`, reading `cin` and writing `cout` channels, both
    /// spread to their padded widths.
    pub fn new(cin: &Channels, cout: &Channels, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (weight, bias) = read(cin, cout.real(), vb)?;
        Self::prepared(
            cout.spread(&weight, 1)?.contiguous()?,
            cout.spread(&bias, 0)?,
            cin.padded(),
            plan,
        )
    }

    /// The convolution stored under `vb` from `cin` to `cout` channels, none padded.
    pub(crate) fn unpadded(
        cin: usize,
        cout: usize,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        Self::new(&Pad::OFF.one(cin), &Pad::OFF.one(cout), plan, vb)
    }

    /// [`Self::unpadded`] of a convolution stored with a bias when `bias` says so, else with
    /// none (a zero one).
    pub(crate) fn load_with_bias(
        cin: usize,
        cout: usize,
        bias: bool,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (weight, bias) = read_with_bias(&Pad::OFF.one(cin), cout, bias, vb)?;
        Self::prepared(weight, bias, cin, plan)
    }

    /// [`Self::shuffled`] over unpadded channels, with a bias when `bias` says so.
    pub(crate) fn shuffled_with_bias(
        cin: usize,
        (c_out, r): (usize, usize),
        bias: bool,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (weight, bias) = read_with_bias(&Pad::OFF.one(cin), r * r * c_out, bias, vb)?;
        let idx = Tensor::from_vec(shuffle_order(c_out, r), r * r * c_out, bias.device())?;
        let (weight, bias) = (weight.index_select(&idx, 1)?, bias.index_select(&idx, 0)?);
        Self::prepared(weight.contiguous()?, bias, cin, plan)
    }

    /// [`Self::shuffled_with_bias`] of a convolution made at load rather than stored:
    /// `weight` `(r² c_out, cin, 3, 3)` and `bias` `(r² c_out)`, outputs in PyTorch's
    /// PixelShuffle order.
    pub(crate) fn shuffled_from(
        weight: &Tensor,
        bias: &Tensor,
        (c_out, r): (usize, usize),
        plan: &LoadPlan,
    ) -> Result<Self> {
        let cin = weight.dim(1)?;
        let weight = gemm_weight(&weight.contiguous()?)?;
        let idx = Tensor::from_vec(shuffle_order(c_out, r), r * r * c_out, bias.device())?;
        let (weight, bias) = (weight.index_select(&idx, 1)?, bias.index_select(&idx, 0)?);
        Self::prepared(weight.contiguous()?, bias, cin, plan)
    }

    /// The convolution stored under `vb` that PixelShuffle by `r` follows, from `cin` to
    /// `r * r * c_out` channels, for [`Self::forward_shuffled`]: its outputs are put in
    /// (i, j, c) order ([`shuffle_order`]), then each of the `r * r` groups of `c_out`
    /// channels that PixelShuffle moves to one pixel is padded on its own as `pad` says.
    pub(crate) fn shuffled(
        cin: &Channels,
        (c_out, r): (usize, usize),
        pad: Pad,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (weight, bias) = read(cin, r * r * c_out, vb)?;
        let idx = Tensor::from_vec(shuffle_order(c_out, r), r * r * c_out, bias.device())?;
        let (weight, bias) = (weight.index_select(&idx, 1)?, bias.index_select(&idx, 0)?);
        let cout = pad.parts(r * r, c_out);
        Self::prepared(
            cout.spread(&weight, 1)?.contiguous()?,
            cout.spread(&bias, 0)?,
            cin.padded(),
            plan,
        )
    }

    /// The layer of `weight` `(9 * cin, cout)` and `bias`, in the form `plan` asks for: on
    /// the CPU with bf16 products, the weight packed now and the f32 one dropped; in f32,
    /// the weight kept for Winograd's algorithm where [`use_winograd`] says so. Narrow
    /// convolutions (the RGB output) keep f32: they are computed directly, not as a GEMM.
    fn prepared(weight: Tensor, bias: Tensor, cin: usize, plan: &LoadPlan) -> Result<Self> {
        let backend = Backend::of(weight.device());
        let (k, cout) = weight.dims2()?;
        let none = || Tensor::zeros(0, DType::F32, weight.device());
        let (weight, bf16, winograd) = match plan.bf16 {
            Some(isa) if backend == Backend::Cpu && cout > cpu::NARROW_CONV => {
                let packed = pack_bf16(&weight, (k, cout), (cout, 1))?;
                (none()?, Some((isa, packed)), None)
            }
            None if backend == Backend::Cpu
                && weight.dtype() == DType::F32
                && use_winograd(cin, cout, plan.switches.winograd) =>
            {
                (
                    none()?,
                    None,
                    Some(Box::new(Winograd::new(weight, cin, cout)?)),
                )
            }
            _ => (weight, None, None),
        };
        Ok(Self {
            weight,
            bias,
            cin,
            bf16,
            winograd,
            backend,
            off: plan.switches.cuda_off,
        })
    }

    /// This convolution followed by PixelShuffle by `r`, its outputs being in (i, j, c)
    /// order ([`Self::shuffled`]). On the CPU the products are
    /// written into the shuffled layout directly.
    pub(crate) fn forward_shuffled(&self, x: &Tensor, r: usize) -> Result<Tensor> {
        let x = x.contiguous()?;
        if self.winograd.is_some() {
            return pixel_shuffle_nhwc_reordered(&self.forward(&x)?, r);
        }
        let fused = match &self.bf16 {
            Some((isa, w)) => {
                cpu::conv3x3_shuffled_bf16(&x, *isa, w, &self.bias, r, CONV_CHUNK_ELEMS)?
            }
            None => cpu::conv3x3_shuffled(&x, &self.weight, &self.bias, r, CONV_CHUNK_ELEMS)?,
        };
        match fused {
            Some(y) => Ok(y),
            None => pixel_shuffle_nhwc_reordered(&self.forward(&x)?, r),
        }
    }

    /// The same convolution with `shift` added to its bias.
    pub(crate) fn add_to_bias(self, shift: &Tensor) -> Result<Self> {
        Ok(Self {
            bias: (&self.bias + shift)?,
            ..self
        })
    }

    /// The convolution as patch matrices of chunks of rows, each fed to one matmul.
    fn patch_gemm(&self, x: &Tensor, chunk: usize) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        debug_assert_eq!(c, self.cin);
        let rows = (chunk / (b * w * 9 * c).max(1)).clamp(1, h);
        let mut outs = Vec::with_capacity(h.div_ceil(rows));
        let mut y = 0;
        while y < h {
            let n = rows.min(h - y);
            let out = cuda::patches3x3(x, y, n, self.off)?.matmul(&self.weight)?;
            let out = bias_act(&out, &self.bias, None, RowAct::None, self.off)?;
            outs.push(out.reshape((b, n, w, ()))?);
            y += n;
        }
        if outs.len() == 1 {
            Ok(outs.remove(0))
        } else {
            Tensor::cat(&outs, 1)
        }
    }
}

/// An activation after a convolution ([`Conv3x3::forward_act`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Act<'a> {
    Relu,
    /// LeakyReLU with this negative slope.
    Leaky(f32),
    /// PReLU: a negative slope per channel, `(cout)`.
    PRelu(&'a Tensor),
    /// SiLU, `v · sigmoid(v)`.
    Silu,
    /// SPAN's attention with this tensor (shaped as the output): `(v + x) · (sigmoid(v) -
    /// 0.5)`.
    Gate(&'a Tensor),
    /// Mish, `v · tanh(softplus(v))`.
    Mish,
    /// The exact (erf) GELU of `nn.GELU()`.
    Gelu,
    /// RealPLKSR's element-wise attention with this tensor (shaped as the output):
    /// `x · sigmoid(v)`.
    Modulate(&'a Tensor),
}

impl Act<'_> {
    /// This activation of `y`, as an operation of its own.
    pub(crate) fn apply(self, y: &Tensor) -> Result<Tensor> {
        match self {
            Act::Relu => y.relu(),
            Act::Leaky(slope) => match kernels::leaky(y, slope)? {
                Some(y) => Ok(y),
                None => candle_nn::ops::leaky_relu(y, f64::from(slope)),
            },
            // Exactly PyTorch's `x if x > 0 else slope·x`: one of the two terms is zero.
            Act::PRelu(slope) => y.relu()? + y.minimum(0.0)?.broadcast_mul(slope)?,
            Act::Silu => kernels::silu(y),
            Act::Gate(x) => kernels::sigmoid_gate(y, x),
            Act::Mish => kernels::mish(y),
            Act::Gelu => kernels::gelu_erf(y),
            Act::Modulate(x) => kernels::modulate(y, x),
        }
    }
}

impl Conv3x3 {
    /// `act` of this convolution: applied as the outputs are written where the convolution
    /// runs by Winograd, else as its own operation (the same values either way).
    pub(crate) fn forward_act(&self, x: &Tensor, act: Act) -> Result<Tensor> {
        if let Some(w) = &self.winograd {
            return winograd::forward(w, &x.contiguous()?, &self.bias, Some(act), None);
        }
        act.apply(&self.forward(x)?)
    }

    /// `scale · conv(x) + residual`, `residual` shaped as the output: in the output's writing
    /// where the convolution runs by Winograd, else as operations of their own (the same
    /// values either way).
    pub(crate) fn forward_residual(
        &self,
        x: &Tensor,
        scale: f32,
        residual: &Tensor,
    ) -> Result<Tensor> {
        if let Some(w) = &self.winograd {
            let x = x.contiguous()?;
            return winograd::forward(w, &x, &self.bias, None, Some((scale, residual)));
        }
        super::add(&self.forward(x)?.affine(f64::from(scale), 0.0)?, residual)
    }
}

/// A residual dense block of `convs` (ESRGAN's): each convolution reads the block's input
/// and every earlier convolution's output, concatenated on channels; each but the last is
/// followed by LeakyReLU with `slope`; the block returns `scale · last + x`. Where every
/// convolution runs by Winograd, each part of the concatenation is transformed once and
/// the concatenation is never built ([`winograd::dense_block`]); `None` elsewhere, for the
/// caller to run the layers one by one. With `outer` `(s, r)` it returns `s · block + r`.
pub(crate) fn dense_block(
    convs: &[Conv3x3],
    x: &Tensor,
    (slope, scale): (f32, f32),
    outer: Option<(f32, &Tensor)>,
) -> Result<Option<Tensor>> {
    let Some(ws) = convs
        .iter()
        .map(|c| c.winograd.as_deref())
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    if ws.is_empty() || !kernels::use_kernel(x) {
        return Ok(None);
    }
    let (batch, h, w, _) = x.dims4()?;
    let biases = convs
        .iter()
        .map(|c| c.bias.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = biases.iter().map(|b| b.storage_and_layout()).collect();
    let bias_slices = guards
        .iter()
        .map(|(g, l)| kernels::cpu_slice(g, l))
        .collect::<Result<Vec<_>>>()?;
    let layers: Vec<_> = ws.into_iter().zip(bias_slices).collect();
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = kernels::cpu_slice(&x_guard, x_layout)?;
    if layers[0].0.cin() != xs.len() / (batch * h * w).max(1) {
        candle_core::bail!("dense block: input {:?}", x.dims());
    }
    let outer = match outer {
        Some((s, r)) if kernels::use_kernel(r) && r.dims() == x.dims() => Some((s, r)),
        Some(_) => return Ok(None),
        None => None,
    };
    let r_guard = outer.map(|(_, r)| r.storage_and_layout());
    let outer = match (&r_guard, outer) {
        (Some((g, l)), Some((s, _))) => Some((s, kernels::cpu_slice(g, l)?)),
        _ => None,
    };
    let out = winograd::dense_block(&layers, xs, (batch, h, w), (slope, scale), outer);
    let cout = out.len() / (batch * h * w).max(1);
    drop(r_guard);
    drop(x_guard);
    drop(guards);
    Ok(Some(Tensor::from_vec(
        out,
        (batch, h, w, cout),
        x.device(),
    )?))
}

impl Module for Conv3x3 {
    /// `x`: `(B, H, W, cin)`; returns `(B, H, W, cout)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = &x.contiguous()?;
        if let Some(w) = &self.winograd {
            return winograd::forward(w, x, &self.bias, None, None);
        }
        match (&self.bf16, self.backend) {
            (Some((isa, w)), _) => cpu::conv3x3_bf16(x, *isa, w, &self.bias, CONV_CHUNK_ELEMS),
            (None, Backend::Cpu) => {
                match cpu::conv3x3(x, &self.weight, &self.bias, CONV_CHUNK_ELEMS)? {
                    Some(y) => Ok(y),
                    None => self.patch_gemm(x, CONV_CHUNK_ELEMS),
                }
            }
            (None, Backend::Cuda) => {
                if ours(x, self.off) && self.bias.dim(0)? <= cuda::NARROW_CONV_MAX {
                    return cuda::conv3x3_narrow(x, &self.weight, &self.bias, self.off);
                }
                self.patch_gemm(x, CONV_CHUNK_ELEMS_GPU)
            }
            (None, Backend::Other) => self.patch_gemm(x, CONV_CHUNK_ELEMS),
        }
    }
}

/// Fewer input or output channels than this and the direct convolution is as fast: the
/// transforms' cost per channel is fixed, the products' saving grows with the other side.
const WINOGRAD_MIN_CHANNELS: usize = 16;

/// Whether an f32 convolution from `cin` to `cout` channels on the CPU runs by Winograd's
/// F(4x4, 3x3): where the panel kernels run, as `switch` (`UPSCALE_CPU_WINOGRAD`) says, by
/// default where both sides have [`WINOGRAD_MIN_CHANNELS`].
fn use_winograd(cin: usize, cout: usize, switch: Option<bool>) -> bool {
    kernels::panels::available() && switch.unwrap_or(cin.min(cout) >= WINOGRAD_MIN_CHANNELS)
}

/// PyTorch's PixelShuffle moves channel `c*r*r + i*r + j` of pixel (y, x) to pixel
/// (y*r + i, x*r + j), channel c. Feeding it a convolution whose output channels were put in
/// (i, j, c) order instead ([`shuffle_order`]) makes every moved run of channels contiguous,
/// so the shuffle copies blocks of `r * c` values rather than single elements.
pub(crate) fn pixel_shuffle_nhwc_reordered(x: &Tensor, r: usize) -> Result<Tensor> {
    if let Some(y) = kernels::pixel_shuffle_reordered(x, r)? {
        return Ok(y);
    }
    let (b, h, w, c) = x.dims4()?;
    let c_out = c / (r * r);
    x.reshape((b, h, w, r, r, c_out))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, h * r, w * r, c_out))
}

/// For output channel `(i*r + j)*c_out + c` of the reordered convolution, the official
/// channel `c*r*r + i*r + j` it takes its weights from.
pub(crate) fn shuffle_order(c_out: usize, r: usize) -> Vec<u32> {
    let mut order = Vec::with_capacity(c_out * r * r);
    for ij in 0..r * r {
        for c in 0..c_out {
            order.push((c * r * r + ij) as u32);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host permutation gives candle's `permute((2, 3, 1, 0))` exactly, for widths that
    /// leave partial transpose blocks, on every instruction set.
    #[test]
    fn tap_major_is_the_permuted_kernel() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(|| {
            for (cout, cin) in [(5, 7), (64, 32), (3, 64), (33, 17)] {
                let w =
                    crate::tests::normal(0.0, 1.0, (cout, cin, 3, 3), &candle_core::Device::Cpu)?;
                let want = w.permute((2, 3, 1, 0))?.flatten_all()?.to_vec1::<f32>()?;
                let got = tap_major(&w.flatten_all()?.to_vec1::<f32>()?, cout, cin);
                assert_eq!(got, want, "{cout} x {cin}");
            }
            Ok(())
        })
    }
}
