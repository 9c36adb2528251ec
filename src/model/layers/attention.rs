//! Window attention with relative-position bias and shift mask, given the windows' q, k, v:
//! `softmax(q·kᵀ + bias (+ mask))·v` per head.

use candle_core::{Result, Tensor};

use super::Backend;
use crate::model::bf16::Isa;
use crate::model::cache::{relative_position_bias, RelativeBias, WindowCache};
use crate::model::fused::{Attention, FusedWindowAttention, MAX_HEAD_DIM};
use crate::model::ops;

/// The attention of one Swin block, between its qkv and proj layers.
///
/// On the CPU our kernel runs it ([`ops::window_attention`]), reading the bias table and the
/// shift regions directly; on CUDA the fused kernel ([`FusedWindowAttention`]) as `attention`
/// says; otherwise (and for inputs a kernel does not take) candle's graph with the gathered
/// bias and the stored mask.
pub struct Attend {
    heads: usize,
    /// Padded, when the model is ([`crate::model::pad_channels`]).
    head_dim: usize,
    window: usize,
    /// The table, read directly by the CPU kernel.
    table: RelativeBias,
    /// `(heads, N, N)`, gathered from the table at load for the CUDA kernel and candle's
    /// graph; `None` on the CPU, whose kernel never needs it.
    bias: Option<Tensor>,
    attention: Attention,
    /// bf16 products on the CPU, on these instructions.
    bf16: Option<Isa>,
    backend: Backend,
}

impl Attend {
    /// The attention of `heads` heads of `head_dim` (padded) dims over `window`-square
    /// windows, with the `((2w-1)², heads)` relative-position bias `table`.
    pub fn new(
        table: &Tensor,
        heads: usize,
        head_dim: usize,
        window: usize,
        attention: Attention,
    ) -> Result<Self> {
        let backend = Backend::of(table.device());
        let bias = match backend {
            Backend::Cpu => None,
            Backend::Cuda | Backend::Other => Some(relative_position_bias(table, window)?),
        };
        Ok(Self {
            heads,
            head_dim,
            window,
            table: RelativeBias::new(table, window)?,
            bias,
            attention,
            bf16: None,
            backend,
        })
    }

    /// Both products in bf16 with f32 sums from now on (CPU only).
    pub(crate) fn use_bf16(&mut self, isa: Isa) {
        if self.backend == Backend::Cpu {
            self.bf16 = Some(isa);
        }
    }

    /// `qkv`: `(B*nW, N, 3C)` (q pre-scaled) of the windows of `(B, h, w)` maps, partitioned
    /// after a half-window shift when `shifted` (then masked as `windows` says for that
    /// size). Returns `(B*nW, N, C)`, heads concatenated.
    pub fn forward(
        &self,
        qkv: &Tensor,
        (h, w): (usize, usize),
        shifted: bool,
        windows: &WindowCache,
    ) -> Result<Tensor> {
        match self.backend {
            Backend::Cuda if self.attention.is_fused() && self.head_dim <= MAX_HEAD_DIM => {
                self.fused(qkv, (h, w), shifted)
            }
            Backend::Cpu => {
                let regions = shifted.then(|| windows.regions(h, w)).transpose()?;
                match ops::window_attention(qkv, &self.table, regions.as_deref(), self.bf16)? {
                    Some(out) => Ok(out),
                    None => self.graph(qkv, (h, w), shifted, windows),
                }
            }
            _ => self.graph(qkv, (h, w), shifted, windows),
        }
    }

    /// The fused op: the CUDA kernel on a GPU, its scalar twin on the CPU (which tests use to
    /// check the kernel's logic). The shift mask is computed inside.
    pub fn fused(&self, qkv: &Tensor, (h, w): (usize, usize), shifted: bool) -> Result<Tensor> {
        let op = FusedWindowAttention {
            heads: self.heads,
            window: self.window,
            height: h,
            width: w,
            shifted,
            tensor_cores: self.attention == Attention::TensorCore,
        };
        op.apply(qkv, &self.gathered_bias(qkv)?)
    }

    /// The gathered `(heads, N, N)` bias: built at load off the CPU, else now.
    fn gathered_bias(&self, like: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => Ok(b.clone()),
            None => self.table.tensor(like.dtype(), like.device()),
        }
    }

    /// The reference: candle's graph with the stored mask.
    fn graph(
        &self,
        qkv: &Tensor,
        (h, w): (usize, usize),
        shifted: bool,
        windows: &WindowCache,
    ) -> Result<Tensor> {
        let (bw, n, _) = qkv.dims3()?;
        let c = self.heads * self.head_dim;
        let qkv = qkv
            .reshape((bw, n, 3, self.heads, self.head_dim))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let mut attn = q.matmul(&k.t()?)?.broadcast_add(&self.gathered_bias(&q)?)?;
        if shifted {
            let mask = windows.mask(h, w)?;
            let nw = mask.dim(0)?;
            attn = attn
                .reshape((bw / nw, nw, self.heads, n, n))?
                .broadcast_add(&mask.unsqueeze(1)?)?
                .reshape((bw, self.heads, n, n))?;
        }
        let attn = candle_nn::ops::softmax_last_dim(&attn)?;
        attn.matmul(&v)?.transpose(1, 2)?.reshape((bw, n, c))
    }
}
