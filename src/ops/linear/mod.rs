//! Linear layers (`nn.Linear`, and 1x1 convolutions applied to channels-last tokens), with
//! what follows them folded in: a residual sum, the GELU, the dense connection's
//! concatenation.
//!
//! [`Dense`] and its reference are here; its CPU half (f32, and bf16 products) is in
//! [`cpu`], its CUDA half (cuBLASLt with the bias in the epilogue) in [`cuda`], with the
//! row-wise kernels of [`rowwise`] (kernels/rowwise.cu) for what that epilogue cannot do.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod rowwise;

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};

use super::{Backend, LoadPlan};
use crate::ops::cpu as kernels;
use crate::ops::cpu::bf16::{Isa, PackedB};
use crate::ops::cpu::panels::Panels;
use crate::ops::pad::{Channels, Pad};
use crate::switches::cuda_off::Off;
use cpu::After;
use rowwise::Act;

/// `w` with axis 0 spread as `rows` and axis 1 as `cols` ([`Channels::spread`]).
pub(crate) fn spread2(w: &Tensor, rows: &Channels, cols: &Channels) -> Result<Tensor> {
    cols.spread(&rows.spread(w, 0)?, 1)
}

/// A linear layer, in the form its device runs fastest.
pub enum Dense {
    /// f32 weights on the CPU where the panel kernels run: packed once at load (packing them
    /// per call copied every weight on every forward), the bias and what follows folded into
    /// our GEMM ([`cpu::linear_packed`]). The f32 weight is not kept: it would hold the
    /// model's linear layers twice.
    CpuPacked { panels: Panels, bias: Tensor },
    /// f32 weights on the CPU without the panel kernels: our GEMM driver on the weight as
    /// stored ([`cpu::linear`]).
    Cpu(Linear),
    /// bf16 products with f32 sums on the CPU, the weight packed once at load.
    CpuBf16 {
        isa: Isa,
        /// `(k, n)`: the weight transposed and packed.
        weight: PackedB,
        bias: Tensor,
    },
    /// On CUDA: one GEMM over all tokens with the bias in cuBLASLt's epilogue, or our
    /// row-wise kernels after it, less the parts the load plan leaves out.
    Cuda(Linear, Off),
    /// On any other device: candle's layer and ops.
    Candle(Linear),
}

impl Dense {
    /// The layer `x · weightᵀ + bias`, on the weight's device; on the CPU with bf16 products
    /// when `plan` asks for them, the weight packed now and the f32 one dropped.
    pub fn new(weight: Tensor, bias: Tensor, plan: &LoadPlan) -> Result<Self> {
        let backend = Backend::of(weight.device());
        if let (Backend::Cpu, Some(isa)) = (backend, plan.bf16) {
            let (n, k) = weight.dims2()?;
            return Ok(Self::CpuBf16 {
                isa,
                weight: pack_bf16(&weight, (k, n), (1, k))?,
                bias: bias.to_dtype(DType::F32)?,
            });
        }
        if backend == Backend::Cpu {
            if let Some(panels) = cpu::pack(&weight)? {
                // The GEMM reads the bias as f32 values in order.
                let bias = bias.to_dtype(DType::F32)?.contiguous()?;
                return Ok(Self::CpuPacked { panels, bias });
            }
        }
        let linear = Linear::new(weight, Some(bias));
        Ok(match backend {
            Backend::Cpu => Self::Cpu(linear),
            Backend::Cuda => Self::Cuda(linear, plan.switches.cuda_off),
            Backend::Other => Self::Candle(linear),
        })
    }

    /// The `nn.Linear` stored under `vb`, from `cin` to `cout` channels, both spread to
    /// their padded widths.
    pub fn load(cin: &Channels, cout: &Channels, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let w = vb.get((cout.real(), cin.real()), "weight")?;
        Self::new(
            spread2(&w, cout, cin)?,
            cout.spread(&vb.get(cout.real(), "bias")?, 0)?,
            plan,
        )
    }

    /// The `nn.Linear` stored under `vb`, from `cin` to `cout` channels, none padded.
    pub(crate) fn load_unpadded(
        cin: usize,
        cout: usize,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        Self::load(&Pad::OFF.one(cin), &Pad::OFF.one(cout), plan, vb)
    }

    /// `(K, N)` of the layer's GEMM.
    #[cfg(test)]
    pub(crate) fn gemm_dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::CpuPacked { panels, .. } => Ok(panels.dims()),
            Self::Cpu(l) | Self::Cuda(l, _) | Self::Candle(l) => {
                let (n, k) = l.weight().dims2()?;
                Ok((k, n))
            }
            Self::CpuBf16 { weight, .. } => Ok((weight.rows(), weight.cols())),
        }
    }

    /// `residual + self(x)`; on the CPU the GEMM accumulates onto the residual, so the sum
    /// costs no pass of its own.
    pub(crate) fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Residual(residual))
    }

    /// `gelu(self(x))`, the exact (erf) GELU of `nn.GELU()`; on the CPU each block of output
    /// rows goes through the GELU as soon as the GEMM has finished it, while it is in cache.
    pub(crate) fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Gelu)
    }

    /// `leaky_relu(self(x), slope)`; on the CPU each block of output rows goes through it as
    /// soon as the GEMM has finished it.
    pub(crate) fn forward_leaky(&self, x: &Tensor, slope: f32) -> Result<Tensor> {
        self.forward_then(x, After::Leaky(slope))
    }

    /// `cat([prev, leaky_relu(self(x), slope)], -1)`: a dense connection. On CUDA the bias,
    /// activation and concatenation are one kernel pass.
    pub(crate) fn forward_cat_leaky(
        &self,
        x: &Tensor,
        prev: &Tensor,
        slope: f64,
    ) -> Result<Tensor> {
        if let Self::Cuda(inner, off) = self {
            let y = unrows(&token_gemm(inner, x)?, prev)?;
            let act = Act::Leaky(slope as f32);
            return rowwise::cat_bias_act(prev, &y, dense_bias(inner)?, act, *off);
        }
        let y = self.forward(x)?;
        match kernels::cat_leaky(prev, &y, slope as f32)? {
            Some(out) => Ok(out),
            None => Tensor::cat(&[prev, &candle_nn::ops::leaky_relu(&y, slope)?], D::Minus1),
        }
    }

    /// `acc + self(x)` written into `acc`'s buffer, on CUDA in bf16 and f16 (see
    /// [`epilogue`]); `None` elsewhere. The caller gives `acc` up: every tensor that shares
    /// its storage sees the sum.
    pub(crate) fn accumulate_onto(&self, x: &Tensor, acc: Tensor) -> Result<Option<Tensor>> {
        let Self::Cuda(inner, off) = self else {
            return Ok(None);
        };
        let acc2 = rows(&acc)?;
        let (w, b) = (inner.weight(), dense_bias(inner)?);
        let done = cuda::accumulate_linear_bias(&acc2, &rows(x)?, w, b, *off)?;
        done.then(|| acc2.reshape(acc.shape())).transpose()
    }

    fn forward_then(&self, x: &Tensor, after: After) -> Result<Tensor> {
        match self {
            Self::CpuPacked { panels, bias } => {
                // The panels take f32 rows in order: anything else is made so first.
                let residual;
                let after = match after {
                    After::Residual(r) => {
                        residual = r.to_dtype(DType::F32)?.contiguous()?;
                        After::Residual(&residual)
                    }
                    other => other,
                };
                let x = x.to_dtype(DType::F32)?.contiguous()?;
                cpu::linear_packed(&x, panels, Some(bias), after)
            }
            Self::Cpu(inner) => match cpu::linear(x, inner.weight(), inner.bias(), after)? {
                Some(y) => Ok(y),
                None => reference(inner, x, after),
            },
            Self::CpuBf16 { isa, weight, bias } => {
                let residual;
                let after = match after {
                    After::Residual(r) => {
                        residual = r.contiguous()?;
                        After::Residual(&residual)
                    }
                    other => other,
                };
                cpu::linear_bf16(&x.contiguous()?, *isa, weight, bias, after)
            }
            Self::Cuda(inner, off) => forward_cuda(inner, x, after, *off),
            Self::Candle(inner) => reference(inner, x, after),
        }
    }

    /// `self(cat(parts, -1))`; on the CPU in f32 without the concatenation
    /// ([`cpu::linear_of_cat`]), the same values.
    pub(crate) fn forward_cat(&self, parts: &[&Tensor]) -> Result<Tensor> {
        if let Self::CpuPacked { panels, bias } = self {
            if let Some(y) = cpu::linear_of_cat(parts, panels, Some(bias))? {
                return Ok(y);
            }
        }
        self.forward(&Tensor::cat(parts, D::Minus1)?)
    }
}

/// `residual + fc2(gelu(fc1(x)))` on the CPU in f32, both layers packed: one pass over
/// blocks of rows ([`cpu::mlp_packed`]), the same values as the two layers one after the
/// other. `None` elsewhere.
pub(crate) fn mlp_residual(
    (fc1, fc2): (&Dense, &Dense),
    x: &Tensor,
    residual: &Tensor,
) -> Result<Option<Tensor>> {
    let (
        Dense::CpuPacked {
            panels: w1,
            bias: b1,
        },
        Dense::CpuPacked {
            panels: w2,
            bias: b2,
        },
    ) = (fc1, fc2)
    else {
        return Ok(None);
    };
    let x = x.to_dtype(DType::F32)?.contiguous()?;
    let residual = residual.to_dtype(DType::F32)?.contiguous()?;
    cpu::mlp_packed(&x, (w1, b1), (w2, b2), &residual)
}

impl Module for Dense {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Nothing)
    }
}

/// The CUDA half: cuBLASLt with the bias in its epilogue where it takes the shapes, else one
/// GEMM over all tokens and our row-wise kernel (the bias and the exact GELU) after it.
fn forward_cuda(inner: &Linear, x: &Tensor, after: After, off: Off) -> Result<Tensor> {
    let bias = dense_bias(inner)?;
    let fused = match after {
        After::Nothing => cuda::linear_bias(&rows(x)?, inner.weight(), bias, off)?,
        _ => None,
    };
    if let Some(y) = fused {
        return unrows(&y, x);
    }
    let y = token_gemm(inner, x)?;
    let (residual, act) = match after {
        After::Nothing => (None, Act::None),
        After::Residual(r) => (Some(r.reshape(y.shape())?.contiguous()?), Act::None),
        After::Gelu => (None, Act::Gelu),
        After::Leaky(slope) => (None, Act::Leaky(slope)),
    };
    let y = rowwise::bias_act(&y, bias, residual.as_ref(), act, off)?;
    unrows(&y, x)
}

/// The reference: candle's layer, then what follows as separate ops.
fn reference(inner: &Linear, x: &Tensor, after: After) -> Result<Tensor> {
    let y = inner.forward(x)?;
    match after {
        After::Nothing => Ok(y),
        After::Residual(r) => r + y,
        // The official models use nn.GELU(): the exact erf form.
        After::Gelu => kernels::gelu_erf(&y),
        After::Leaky(slope) => candle_nn::ops::leaky_relu(&y, f64::from(slope)),
    }
}

/// `t` `(.., c)` as the 2-D `(tokens, c)` its linear layers multiply.
fn rows(t: &Tensor) -> Result<Tensor> {
    let c = t.dim(D::Minus1)?;
    t.reshape((t.elem_count() / c.max(1), c))
}

/// `y` `(tokens, n)` back in the leading axes of `like` `(.., c)`: `(.., n)`.
fn unrows(y: &Tensor, like: &Tensor) -> Result<Tensor> {
    let mut dims = like.dims().to_vec();
    match dims.last_mut() {
        Some(last) => *last = y.dim(1)?,
        None => candle_core::bail!("a linear layer's input has a channel axis"),
    }
    y.reshape(dims)
}

/// `x · wᵀ` over all tokens of `x` `(.., cin)` as one 2-D GEMM: `(tokens, cout)`, without
/// the bias. candle's `Linear` would broadcast the weight over the leading axes (a batched
/// GEMM) and add the bias with its strided broadcast kernel.
fn token_gemm(inner: &Linear, x: &Tensor) -> Result<Tensor> {
    rows(x)?.matmul(&inner.weight().t()?)
}

fn dense_bias(inner: &Linear) -> Result<&Tensor> {
    match inner.bias() {
        Some(b) => Ok(b),
        None => candle_core::bail!("linear layers here always have a bias"),
    }
}

/// The `k x n` view `w[r * rs + c * cs]` of a CPU weight, packed for bf16 products; read in
/// place, without copying the weight out first.
pub(crate) fn pack_bf16(
    w: &Tensor,
    kn: (usize, usize),
    strides: (usize, usize),
) -> Result<PackedB> {
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    let (guard, layout) = w.storage_and_layout();
    let values = kernels::cpu_slice(&guard, layout)?;
    Ok(PackedB::new(values, kn, strides))
}

/// A 1x1 convolution applied to channels-last tokens is a linear layer (unpadded channels),
/// computed as its weights were read, without bf16 products whatever the plan: HAT's channel
/// attention, which runs on one token per image.
pub(crate) fn pointwise(cin: usize, cout: usize, vb: VarBuilder) -> Result<Dense> {
    pointwise_with(cin, cout, &LoadPlan::default(), vb)
}

/// A 1x1 convolution applied to channels-last tokens is a linear layer (unpadded channels),
/// in the form `plan` asks for.
pub(crate) fn pointwise_with(
    cin: usize,
    cout: usize,
    plan: &LoadPlan,
    vb: VarBuilder,
) -> Result<Dense> {
    pointwise_padded(&Pad::OFF.one(cin), &Pad::OFF.one(cout), 1.0, plan, vb)
}

/// A 1x1 convolution applied to channels-last tokens is a linear layer; its output is
/// multiplied by `scale` (weights and bias scaled at load).
pub(crate) fn pointwise_padded(
    cin: &Channels,
    cout: &Channels,
    scale: f64,
    plan: &LoadPlan,
    vb: VarBuilder,
) -> Result<Dense> {
    let (ci, co) = (cin.real(), cout.real());
    let w = vb.get((co, ci, 1, 1), "weight")?.reshape((co, ci))?;
    let b = vb.get(co, "bias")?;
    let (w, b) = if scale == 1.0 {
        (w, b)
    } else {
        ((w * scale)?, (b * scale)?)
    };
    Dense::new(spread2(&w, cout, cin)?, cout.spread(&b, 0)?, plan)
}
