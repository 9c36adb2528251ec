//! Window attention with relative-position bias and shift mask, given the windows' q, k, v:
//! `softmax(q·kᵀ + bias (+ mask))·v` per head; and HAT's overlapping cross-attention, whose
//! keys and values come from a larger window around each query window.
//!
//! [`Attend`], [`OverlapAttend`] and their reference (candle's graph) are here; the CPU's
//! fused window and overlapping attention (f32, and bf16 products) are in [`cpu`], the CUDA
//! kernels' host code (kernels/window_attention.cu, with their scalar CPU twins) in [`cuda`].

pub(crate) mod channel;
pub(crate) mod cosine;
pub(crate) mod cpu;
pub mod cuda;

pub use cuda::{Attention, MAX_HEAD_DIM};

use candle_core::{Result, Tensor};

use super::{Backend, LoadPlan};
use crate::ops::cpu::bf16::Isa;
use crate::ops::windows::{relative_position_bias, RelativeBias, WindowCache};
use cuda::{FusedOverlapAttention, FusedWindowAttention};

/// The attention of one Swin block, between its qkv and proj layers.
///
/// On the CPU our kernel runs it ([`cpu::window_attention`]), reading the bias table and the
/// shift regions directly; on CUDA the fused kernel ([`FusedWindowAttention`]) as `attention`
/// says; otherwise (and for inputs a kernel does not take) candle's graph with the gathered
/// bias and the stored mask.
pub struct Attend {
    heads: usize,
    /// Padded, when the model is ([`crate::ops::pad`]).
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
    /// windows, with the `((2w-1)², heads)` relative-position bias `table`, run as `plan`
    /// says: on the CPU with bf16 products when it asks for them.
    pub fn new(
        table: &Tensor,
        heads: usize,
        head_dim: usize,
        window: usize,
        plan: &LoadPlan,
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
            attention: plan.attention,
            bf16: plan.bf16.filter(|_| backend == Backend::Cpu),
            backend,
        })
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
                match cpu::window_attention(qkv, &self.table, regions.as_deref(), self.bf16)? {
                    Some(out) => Ok(out),
                    None => self.graph(qkv, (h, w), shifted, windows),
                }
            }
            _ => self.graph(qkv, (h, w), shifted, windows),
        }
    }

    /// The position-bias table, where this attention runs on the CPU in f32 (the kernels of
    /// [`cpu`] take it); `None` elsewhere.
    pub(crate) fn cpu_f32_table(&self) -> Option<&RelativeBias> {
        (self.backend == Backend::Cpu && self.bf16.is_none()).then_some(&self.table)
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

/// HAT's overlapping cross-attention (the OCAB's), between its qkv and proj layers: the
/// queries of each `window`-square window attend to the keys and values of the
/// `overlap`-square window centred on it, zero outside the image, with a relative-position
/// bias.
///
/// On the CPU our kernel runs it ([`cpu::overlap_attention`]); on CUDA with a fused
/// `--attention` choice, one kernel ([`FusedOverlapAttention`]) reads each neighbourhood
/// straight from the token map, unless the load plan's `UPSCALE_CUDA_OCA=0` turns it off (to
/// measure one against the other in a single GPU session, or on a GPU where the kernel
/// fails); elsewhere (and for inputs a kernel does not take) candle's graph runs
/// ([`overlap_attention_graph`]).
pub struct OverlapAttend {
    /// `(heads, ws², ows²)`, gathered from the table at load.
    bias: Tensor,
    heads: usize,
    window: usize,
    overlap: usize,
    attention: Attention,
    /// Whether CUDA may run [`FusedOverlapAttention`].
    kernel: bool,
    /// bf16 products on the CPU, on these instructions.
    bf16: Option<Isa>,
    backend: Backend,
}

impl OverlapAttend {
    /// `heads` heads over `window`-square query windows in `overlap`-square key windows,
    /// with the `((window + overlap - 1)², heads)` bias `table`, run as `plan` says.
    pub fn new(
        table: &Tensor,
        heads: usize,
        (window, overlap): (usize, usize),
        plan: &LoadPlan,
    ) -> Result<Self> {
        let backend = Backend::of(table.device());
        Ok(Self {
            bias: overlap_bias(table, window, overlap)?,
            heads,
            window,
            overlap,
            attention: plan.attention,
            kernel: plan.switches.overlap_kernel,
            bf16: plan.bf16.filter(|_| backend == Backend::Cpu),
            backend,
        })
    }

    /// `qkv`: `(B, H, W, 3C)` (q pre-scaled), H and W multiples of the window; returns
    /// `(B, H, W, C)`.
    pub fn forward(&self, qkv: &Tensor) -> Result<Tensor> {
        let head_dim = qkv.dim(3)? / 3 / self.heads;
        let fused = self.backend == Backend::Cuda
            && self.attention.is_fused()
            && head_dim <= MAX_HEAD_DIM
            && self.kernel;
        if fused {
            let op = FusedOverlapAttention {
                heads: self.heads,
                window: self.window,
                overlap_window: self.overlap,
                tensor_cores: self.attention == Attention::TensorCore,
            };
            return op.apply(qkv, &self.bias);
        }
        if self.backend == Backend::Cpu {
            let shape = (self.window, self.overlap);
            if let Some(out) =
                cpu::overlap_attention(qkv, &self.bias, self.heads, shape, self.bf16)?
            {
                return Ok(out);
            }
        }
        overlap_attention_graph(qkv, &self.bias, self.heads, self.window, self.overlap)
    }
}

/// The OCAB's `(heads, ws², ows²)` bias from its `((ws + ows - 1)², heads)` table, by the
/// official index (see the module's documentation), wrapped as PyTorch wraps it.
pub(crate) fn overlap_bias(table: &Tensor, ws: usize, ows: usize) -> Result<Tensor> {
    let heads = table.dim(1)?;
    let side = (ws + ows - 1) as i64;
    let rows = side * side;
    let shift = ws as i64 - ows as i64 + 1;
    let mut idx = Vec::with_capacity(ws * ws * ows * ows);
    for yi in 0..ws as i64 {
        for xi in 0..ws as i64 {
            for yj in 0..ows as i64 {
                for xj in 0..ows as i64 {
                    let i = (yj - yi + shift) * side + (xj - xi + shift);
                    idx.push(i.rem_euclid(rows) as u32);
                }
            }
        }
    }
    let idx = Tensor::from_vec(idx, ws * ws * ows * ows, table.device())?;
    table
        .index_select(&idx, 0)?
        .reshape((ws * ws, ows * ows, heads))?
        .permute((2, 0, 1))?
        .contiguous()
}

/// The OCAB's attention as candle's graph, on any device: `qkv` `(B, H, W, 3C)` (q pre-scaled)
/// and `bias` `(heads, ws², ows²)` in one dtype; returns `(B, H, W, C)`.
pub(crate) fn overlap_attention_graph(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    ws: usize,
    ows: usize,
) -> Result<Tensor> {
    let (b, h, w, c3) = qkv.dims4()?;
    let c = c3 / 3;
    let (nh, nw) = (h / ws, w / ws);
    let nwin = b * nh * nw;
    let d = c / heads;
    let q = qkv
        .narrow(3, 0, c)?
        .reshape((b, nh, ws, nw, ws, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((nwin, ws * ws, heads, d))?
        .transpose(1, 2)?
        .contiguous()?;
    // Keys and values of each window's overlapping neighbourhood, zero outside the image.
    let m = (ows - ws) / 2;
    let kv = qkv
        .narrow(3, c, 2 * c)?
        .pad_with_zeros(1, m, m)?
        .pad_with_zeros(2, m, m)?;
    let wp = w + 2 * m;
    let mut idx = Vec::with_capacity(nh * nw * ows * ows);
    for r in 0..nh {
        for s in 0..nw {
            for a in 0..ows {
                for t in 0..ows {
                    idx.push(((r * ws + a) * wp + s * ws + t) as u32);
                }
            }
        }
    }
    let n = idx.len();
    let idx = Tensor::from_vec(idx, n, qkv.device())?;
    let kv = kv
        .reshape((b, (h + 2 * m) * wp, 2 * c))?
        .index_select(&idx, 1)?
        .reshape((nwin, ows * ows, 2, heads, d))?;
    let k = kv
        .narrow(2, 0, 1)?
        .squeeze(2)?
        .transpose(1, 2)?
        .contiguous()?;
    let v = kv
        .narrow(2, 1, 1)?
        .squeeze(2)?
        .transpose(1, 2)?
        .contiguous()?;
    let attn = q.matmul(&k.t()?)?.broadcast_add(bias)?;
    let attn = candle_nn::ops::softmax_last_dim(&attn)?;
    attn.matmul(&v)?
        .transpose(1, 2)?
        .reshape((b, nh, nw, ws, ws, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, h, w, c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::normal;
    use candle_core::{DType, Device};

    /// Random `(qkv, bias)` for `b` maps of `h x w`, q scaled by `d^-0.5` as the model scales
    /// it (times 2, so the softmax is far from uniform), the bias gathered from a random table.
    fn inputs(
        (b, h, w): (usize, usize, usize),
        (ws, ows, heads, d): (usize, usize, usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let dev = Device::Cpu;
        let c = heads * d;
        let q = (normal(0.0, 1.0, (b, h, w, c), &dev)? * (2.0 / (d as f64).sqrt()))?;
        let kv = normal(0.0, 1.0, (b, h, w, 2 * c), &dev)?;
        let side = ws + ows - 1;
        let table = normal(0.0, 1.0, (side * side, heads), &dev)?;
        Ok((Tensor::cat(&[q, kv], 3)?, overlap_bias(&table, ws, ows)?))
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()
    }

    /// The fused op's CPU twin, which the GPU tests hold the CUDA kernel to, against the
    /// model's graph ([`OVERLAP_CASES`]).
    #[test]
    fn the_fused_twin_matches_the_graph() -> Result<()> {
        for (map, shape) in OVERLAP_CASES {
            let (ws, ows, heads, _) = shape;
            let (qkv, bias) = inputs(map, shape)?;
            let graph = overlap_attention_graph(&qkv, &bias, heads, ws, ows)?;
            let op = FusedOverlapAttention {
                heads,
                window: ws,
                overlap_window: ows,
                tensor_cores: false,
            };
            let twin = op.apply(&qkv, &bias)?;
            assert_eq!(twin.dims(), graph.dims());
            let diff = max_abs_diff(&twin, &graph)?;
            assert!(diff < 1e-5, "{map:?} {shape:?}: {diff}");
            // The comparison can fail: another map size for the same tokens moves the borders.
            let (b, h, w) = map;
            if h != w {
                let moved =
                    op.apply(&qkv.reshape((b, w, h, ()))?, &bias)?
                        .reshape((b, h, w, ()))?;
                assert!(max_abs_diff(&moved, &graph)? > 1e-2, "{map:?} {shape:?}");
            }
        }
        Ok(())
    }

    /// The shapes the overlap tests run: (batch, height, width) and (window, overlap window,
    /// heads, head dim): HAT's window 16 in 24 on a map of 2x3 windows; margins of 1 and 2
    /// with odd head dims and a batch of two; one window alone, every key of its margin
    /// outside the map.
    type OverlapCase = ((usize, usize, usize), (usize, usize, usize, usize));
    const OVERLAP_CASES: [OverlapCase; 4] = [
        ((1, 32, 48), (16, 24, 2, 30)),
        ((2, 8, 12), (4, 6, 3, 7)),
        ((1, 12, 8), (4, 8, 2, 5)),
        ((1, 4, 4), (4, 6, 2, 16)),
    ];

    /// The CPU kernel's f32 products (the `gemm` crate, on one thread or split, and the
    /// panels on each vector unit the CPU has) against candle's graph in f64.
    #[test]
    fn the_cpu_overlap_kernel_matches_the_graph() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(overlap_kernel_matches_the_graph)
    }

    fn overlap_kernel_matches_the_graph() -> Result<()> {
        let mut kinds = vec![
            cpu::Products::F32(gemm::Parallelism::None),
            cpu::Products::F32(gemm::Parallelism::Rayon(0)),
        ];
        if crate::ops::cpu::panels::available() {
            kinds.push(cpu::Products::Panels);
        }
        for (map, shape) in OVERLAP_CASES {
            let (ws, ows, heads, _) = shape;
            let (qkv, bias) = inputs(map, shape)?;
            let want = overlap_attention_graph(
                &qkv.to_dtype(DType::F64)?,
                &bias.to_dtype(DType::F64)?,
                heads,
                ws,
                ows,
            )?;
            for &kind in &kinds {
                let ours = cpu::overlap_attention_with(kind, &qkv, &bias, heads, (ws, ows))?;
                assert_eq!(ours.dims(), want.dims());
                let diff = max_abs_diff(&ours, &want)?;
                assert!(diff < 1e-5, "{map:?} {shape:?}: max abs error {diff}");
            }
        }
        // The kernel's entry point takes f32 only, and checks the shapes.
        let (qkv, bias) = inputs((1, 8, 8), (4, 6, 2, 3))?;
        let f16 = qkv.to_dtype(DType::F16)?;
        assert!(cpu::overlap_attention(&f16, &bias, 2, (4, 6), None)?.is_none());
        assert!(cpu::overlap_attention(&qkv, &bias, 2, (4, 6), None)?.is_some());
        assert!(cpu::overlap_attention(&qkv, &bias, 3, (4, 6), None).is_err());
        assert!(cpu::overlap_attention(&qkv, &bias, 2, (4, 8), None).is_err());
        assert!(cpu::overlap_attention(&qkv.narrow(1, 0, 6)?, &bias, 2, (4, 6), None).is_err());
        Ok(())
    }

    /// With bf16 products, against candle's graph in f64 on q, k and v rounded to bf16 as the
    /// kernel rounds them. The kernel also rounds each probability to bf16, half a bf16 step
    /// (2^-8 of it) at most; the probabilities of a row sum to 1, so the output moves by at
    /// most 2^-8 max|v|, plus the f32 sums' own error.
    #[test]
    fn the_cpu_overlap_kernel_in_bf16_matches_the_rounded_graph() -> Result<()> {
        let isas = crate::ops::cpu::bf16::available_isas();
        if isas.is_empty() {
            eprintln!("bf16 overlap attention not tested: this CPU has no bf16 arithmetic");
        }
        for isa in isas {
            for (map, shape) in OVERLAP_CASES {
                let (ws, ows, heads, _) = shape;
                let (qkv, bias) = inputs(map, shape)?;
                let rounded = qkv.to_dtype(DType::BF16)?.to_dtype(DType::F64)?;
                let want =
                    overlap_attention_graph(&rounded, &bias.to_dtype(DType::F64)?, heads, ws, ows)?;
                let ours = cpu::overlap_attention(&qkv, &bias, heads, (ws, ows), Some(isa))?
                    .expect("the CPU kernel applies");
                let c = qkv.dim(3)? / 3;
                let v_max = qkv
                    .narrow(3, 2 * c, c)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()? as f64;
                let bound = 2f64.powi(-8) * v_max * (1.0 + 2f64.powi(-7)) + 1e-5;
                let diff = max_abs_diff(&ours, &want)? as f64;
                assert!(
                    diff < bound,
                    "{isa:?} {map:?} {shape:?}: {diff} (bound {bound})"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn bad_overlap_shapes_are_errors() -> Result<()> {
        let (qkv, bias) = inputs((1, 8, 8), (4, 6, 2, 3))?;
        let op = |heads, window, overlap_window| FusedOverlapAttention {
            heads,
            window,
            overlap_window,
            tensor_cores: false,
        };
        op(2, 4, 6).apply(&qkv, &bias)?;
        // Another head count, window or overlap than the bias has; odd margins; a map that
        // is not a window multiple; mixed dtypes.
        assert!(op(3, 4, 6).apply(&qkv, &bias).is_err());
        assert!(op(2, 8, 6).apply(&qkv, &bias).is_err());
        assert!(op(2, 4, 8).apply(&qkv, &bias).is_err());
        assert!(op(2, 4, 5).apply(&qkv, &bias).is_err());
        assert!(op(2, 4, 6).apply(&qkv.narrow(1, 0, 6)?, &bias).is_err());
        let bias16 = bias.to_dtype(DType::F16)?;
        assert!(op(2, 4, 6).apply(&qkv, &bias16).is_err());
        Ok(())
    }
}
