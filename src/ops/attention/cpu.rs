//! The CPU's fused window attention: per window and head, the two products on the GEMM with
//! the position bias and the shift mask applied in the softmax, no score tensor in memory.

use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::ops::attention::cosine::normalise_row;
use crate::ops::cpu::bf16::{Isa, PackedA, PackedB};
use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::{attention_probs, cpu_slice, panels, product, use_kernel, Weights};
use crate::ops::linear::cpu::mlp_rows;
use crate::ops::norm::cpu::RowNorm;
use crate::ops::windows::{rectangle_regions, RelativeBias};

/// Shifted-window multi-head attention on the CPU, fused per window: both matmuls go to the
/// GEMM directly from strided views of the `qkv` projection, and the bias, the mask and the
/// softmax are applied to a score matrix that stays in cache. The unfused graph writes and
/// rereads the `(windows, heads, N, N)` scores four times and copies q, k, v and the output.
///
/// `qkv`: `(B*nW, N, 3C)` (q, k, v, then heads, then head dim, as the official reshape reads
/// it), q already scaled; `bias`: the block's table; `regions`: for shifted windows, the
/// `(nW, N)` region labels of one map's windows ([`crate::ops::windows::shift_regions`]), tokens of
/// different regions being masked as the official mask does. Returns `(B*nW, N, C)` with heads
/// concatenated, or `None` where the kernel does not apply (another device or dtype), so the
/// caller runs the generic graph. With `bf16`, both products take bf16 operands (f32 sums);
/// the softmax stays f32.
pub fn window_attention(
    qkv: &Tensor,
    bias: &RelativeBias,
    regions: Option<&[u8]>,
    bf16: Option<Isa>,
) -> Result<Option<Tensor>> {
    if !use_kernel(qkv) {
        return Ok(None);
    }
    let (bw, n, c3) = qkv.dims3()?;
    let heads = bias.heads();
    let c = c3 / 3;
    let d = c / heads.max(1);
    if c3 != 3 * c || c != heads * d || n != bias.tokens() {
        candle_core::bail!(
            "window attention: qkv {:?} for {heads} heads and windows of {} tokens",
            qkv.dims(),
            bias.tokens()
        );
    }
    let nw = match regions {
        Some(r) if r.is_empty() || r.len() % n != 0 || bw % (r.len() / n) != 0 => {
            candle_core::bail!(
                "window attention: {} region labels for {bw} windows",
                r.len()
            )
        }
        Some(r) => r.len() / n,
        None => 1,
    };
    let (qkv_guard, qkv_layout) = qkv.storage_and_layout();
    let qkv_data = cpu_slice(&qkv_guard, qkv_layout)?;
    let (products, gathered) = products_for(bw, bias, bf16);
    let shape = WindowShape {
        n,
        c,
        heads,
        products,
        gathered: gathered.as_deref(),
        pack_values: packs_values(products, n),
    };
    // Left uninitialised: `attend_window` writes every element (each head its d columns of
    // every row) without reading it.
    let mut out: Vec<f32> = Vec::with_capacity(bw * n * c);
    out.spare_capacity_mut()
        .par_chunks_mut(n * c)
        .enumerate()
        .for_each_init(
            || Scratch {
                scores: vec![0f32; n * n],
                ..Scratch::default()
            },
            |scratch, (win, out)| {
                let qkv = &qkv_data[win * n * 3 * c..(win + 1) * n * 3 * c];
                // A window inside one region (all but the last row and column of windows)
                // masks nothing.
                let labels = regions
                    .map(|r| &r[(win % nw) * n..(win % nw + 1) * n])
                    .filter(|l| l.iter().any(|&v| v != l[0]));
                attend_window(&shape, qkv, bias, labels, scratch, out);
            },
        );
    // SAFETY: `attend_window` wrote all bw * n * c elements.
    unsafe { out.set_len(bw * n * c) };
    drop(qkv_guard);
    Ok(Some(Tensor::from_vec(out, (bw, n, c), qkv.device())?))
}

/// The most bias values (all heads' `n x n` matrices) gathered for scores to start from.
const GATHERED_BIAS: usize = 32 << 10;

/// How `windows` windows' products run, and the `(heads, n, n)` bias gathered for the scores
/// to start from where that pays.
fn products_for(
    windows: usize,
    bias: &RelativeBias,
    bf16: Option<Isa>,
) -> (Products, Option<Vec<f32>>) {
    // Windows are independent: one task each, with a private score matrix. With fewer
    // windows than threads the GEMMs themselves are split instead.
    let inner = if windows >= rayon::current_num_threads() {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(0)
    };
    let products = match bf16 {
        Some(isa) => Products::Bf16(isa),
        None if panels::available() => Products::Panels,
        None => Products::F32(inner),
    };
    // On panels the scores start from the bias: gathered once per call where all heads'
    // `n x n` matrices stay in L2 across windows (the 8x8 windows of SwinIR: 96 KiB for 6
    // heads), else added row by row from the compact table as the softmax reads them.
    let n = bias.tokens();
    let gathered = (matches!(products, Products::Panels) && bias.heads() * n * n <= GATHERED_BIAS)
        .then(|| bias.gathered());
    (products, gathered)
}

/// A Swin block's layers on the CPU in f32, each linear layer packed with its bias: what
/// [`swin_block`] runs.
pub(crate) struct BlockLayers<'a> {
    pub norm1: &'a RowNorm<'a>,
    pub qkv: (&'a panels::Panels, &'a [f32]),
    pub proj: (&'a panels::Panels, &'a [f32]),
    pub norm2: &'a RowNorm<'a>,
    pub fc1: (&'a panels::Panels, &'a [f32]),
    pub fc2: (&'a panels::Panels, &'a [f32]),
    /// A SwinV2 block (Swin2SR's): each head's logit scale. Its q and k are normalised
    /// (the scale folded into q) before the attention, and its norms come after the
    /// attention and the MLP: `x + norm1(attn(x))`, then `s + norm2(mlp(s))`.
    pub v2: Option<&'a [f32]>,
}

/// A whole Swin block on the CPU in f32, a window per task: the window's tokens gathered
/// through the first norm, qkv, the attention ([`attend_window`]), proj, the residual sum
/// with the second norm, and the MLP with its residual, each into buffers of the task's own,
/// and the results written back at the tokens' places. The block's intermediate tensors (qkv's
/// alone is 8.8 MB for a 64x64 SwinIR input) never leave the core's cache, and its eight
/// passes over the map are one. The values are those of the steps one after the other over
/// all tokens: each row of a product is computed alike however the rows are grouped, and
/// every other step is row by row with the same functions.
///
/// `x`: `(b, t, c)` tokens in image order; `order`: the `t` token indices in window order
/// (the windows of a map one after the other, `n` tokens each, after the shift if any: a
/// permutation); `extra`: HAT's `(z (b, t, c), s (b, c))`, the sum then `(x + z * s) + y`;
/// `bias` and `regions` as [`window_attention`] takes them. Returns `(b, t, c)`.
pub(crate) fn swin_block(
    x: &[f32],
    (b, t, c): (usize, usize, usize),
    order: &[u32],
    extra: Option<(&[f32], &[f32])>,
    layers: &BlockLayers,
    bias: &RelativeBias,
    regions: Option<&[u8]>,
) -> Result<Vec<f32>> {
    let (n, heads) = (bias.tokens(), bias.heads());
    let h = layers.fc1.0.dims().1;
    let dims_ok = layers.qkv.0.dims() == (c, 3 * c)
        && layers.proj.0.dims() == (c, c)
        && layers.fc1.0.dims() == (c, h)
        && layers.fc2.0.dims() == (h, c)
        && [
            layers.qkv.1.len(),
            layers.proj.1.len(),
            layers.fc1.1.len(),
            layers.fc2.1.len(),
        ] == [3 * c, c, h, c];
    let sizes_ok = n > 0
        && t % n == 0
        && heads > 0
        && c % heads == 0
        && x.len() == b * t * c
        && order.len() == t
        && extra.is_none_or(|(z, s)| z.len() == b * t * c && s.len() == b * c)
        && regions.is_none_or(|r| r.len() == t);
    if !dims_ok || !sizes_ok || !panels::available() {
        candle_core::bail!("Swin block: {b}x{t}x{c} tokens, {n}-token windows, {heads} heads");
    }
    // Each token is written by the one task whose window holds it.
    let mut seen = vec![false; t];
    for &i in order {
        match seen.get_mut(i as usize) {
            Some(s) if !*s => *s = true,
            _ => candle_core::bail!("Swin block: the window order is not a permutation"),
        }
    }
    let windows = t / n;
    let (products, gathered) = products_for(b * windows, bias, None);
    let shape = WindowShape {
        n,
        c,
        heads,
        products,
        gathered: gathered.as_deref(),
        pack_values: packs_values(products, n),
    };
    let mc = panels::task_rows();
    let mut out: Vec<f32> = Vec::with_capacity(b * t * c);
    // SAFETY: the tasks read x, `extra` and the layers, and each writes only the rows of its
    // window's tokens (a permutation: checked above) into `out`, which outlives them.
    let dst = unsafe { Shared::new(out.as_mut_ptr()) };
    // A quarter of a thread's windows per split at least: each split sets up its buffers
    // (a third of a megabyte for SwinIR, 2.4 MB for DRCT's widest blocks, zeroed), which rayon's
    // finer splits repeated many times a block (DRCT held to AVX2 2-3% faster; SwinIR alike).
    let per_split = (b * windows / (4 * rayon::current_num_threads())).max(1);
    let task = |work: &mut BlockScratch, win: usize| {
        let (image, w) = (win / windows, win % windows);
        let tokens = &order[w * n..(w + 1) * n];
        let row = |i: usize| (image * t + tokens[i] as usize) * c;
        let BlockScratch {
            attention,
            normed,
            qkv,
            attended,
            hidden,
        } = work;
        for (i, dst) in normed.chunks_exact_mut(c).enumerate() {
            let src = &x[row(i)..][..c];
            match layers.v2 {
                None => layers.norm1.row(src, uninit(dst)),
                Some(_) => dst.copy_from_slice(src),
            }
        }
        let labels = regions
            .map(|r| &r[w * n..(w + 1) * n])
            .filter(|l| l.iter().any(|&v| v != l[0]));
        let start = |bias: &[f32]| panels::Start {
            init: None,
            bias: Some(bias.as_ptr()),
        };
        // SAFETY (the products): every operand holds the rows and columns its call
        // names: the buffers were sized for n tokens by `BlockScratch::new`, the layers'
        // dims and biases checked above.
        unsafe {
            let (w, bq) = layers.qkv;
            panels::gemm(
                n,
                (normed.as_ptr(), c),
                w.rhs(),
                (qkv.as_mut_ptr(), 3 * c),
                start(bq),
                false,
                None,
            );
        }
        if let Some(scales) = layers.v2 {
            for r in qkv.chunks_exact_mut(3 * c) {
                normalise_row(r, scales, c / heads);
            }
        }
        attend_window(&shape, qkv, bias, labels, attention, uninit(attended));
        // proj's output goes where the normalised tokens were.
        unsafe {
            let (w, bp) = layers.proj;
            panels::gemm(
                n,
                (attended.as_ptr(), c),
                w.rhs(),
                (normed.as_mut_ptr(), c),
                start(bp),
                false,
                None,
            );
        }
        // The residual sums (into qkv's buffer), and their norm (into the attention's):
        // both free now, and the task's memory is what stays in cache.
        let sums = &mut qkv[..n * c];
        if layers.v2.is_some() {
            post_norm_rest(layers, (x, &row), (sums, normed, attended), hidden, mc);
            for (i, out) in normed.chunks_exact(c).enumerate() {
                // SAFETY: this window's token rows of `out` (see `dst` above).
                unsafe {
                    std::ptr::copy_nonoverlapping(out.as_ptr(), dst.get().add(row(i)), c);
                }
            }
            return;
        }
        for (i, (sum, dst)) in sums
            .chunks_exact_mut(c)
            .zip(attended.chunks_exact_mut(c))
            .enumerate()
        {
            let r = row(i);
            let scaled = extra.map(|(z, s)| (&z[r..r + c], &s[image * c..(image + 1) * c]));
            let y = &normed[i * c..(i + 1) * c];
            layers
                .norm2
                .add_row((&x[r..r + c], scaled), y, uninit(sum), uninit(dst));
        }
        // The MLP a block of rows at a time, onto the sums in place.
        let ((w1, b1), (w2, b2)) = (layers.fc1, layers.fc2);
        let mlp = ((w1, b1.as_ptr()), (w2, b2.as_ptr()));
        for r0 in (0..n).step_by(mc) {
            let rows = mc.min(n - r0);
            // SAFETY: rows r0..r0 + rows of the norms (in `attended`) and of the sums, c
            // values each; `hidden` holds mc rows of h; the layers' dims checked above.
            unsafe {
                let a = attended.as_ptr().add(r0 * c);
                let s = sums.as_mut_ptr().add(r0 * c);
                mlp_rows(rows, (a, c), mlp, hidden, (s, s.cast_const(), c));
            }
        }
        for (i, sum) in sums.chunks_exact(c).enumerate() {
            // SAFETY: this window's token rows of `out` (see `dst` above).
            unsafe {
                std::ptr::copy_nonoverlapping(sum.as_ptr(), dst.get().add(row(i)), c);
            }
        }
    };
    (0..b * windows)
        .into_par_iter()
        .with_min_len(per_split)
        .for_each_init(|| BlockScratch::new(n, c, h, mc), task);
    // SAFETY: every token's row was written by its window's task (order is a permutation
    // of all t tokens of each of the b maps).
    unsafe { out.set_len(b * t * c) };
    Ok(out)
}

/// The rest of a SwinV2 block for one window, after proj: `y` (proj's output, in `normed`)
/// through norm1 onto the tokens' rows of `x` (`row(i)` is token i's offset) into `sums`,
/// the MLP of the sums a block of rows at a time into `attended`, and `sums + norm2(mlp)`
/// into `normed`. The arithmetic of the steps over all tokens: norm1 gathered back, the sum,
/// fc1 with its GELU, fc2, norm2 and the second sum.
fn post_norm_rest(
    layers: &BlockLayers,
    (x, row): (&[f32], &dyn Fn(usize) -> usize),
    (sums, normed, attended): (&mut [f32], &mut [f32], &mut [f32]),
    hidden: &mut [f32],
    mc: usize,
) {
    let c = layers.proj.0.dims().1;
    let n = sums.len() / c;
    for (i, (sum, y)) in sums
        .chunks_exact_mut(c)
        .zip(normed.chunks_exact(c))
        .enumerate()
    {
        let normed_y = &mut attended[i * c..(i + 1) * c];
        layers.norm1.row(y, uninit(normed_y));
        let xr = &x[row(i)..][..c];
        sum.iter_mut()
            .zip(xr.iter().zip(normed_y.iter()))
            .for_each(|(s, (a, b))| *s = a + b);
    }
    let ((w1, b1), (w2, b2)) = (layers.fc1, layers.fc2);
    let mlp = ((w1, b1.as_ptr()), (w2, b2.as_ptr()));
    for r0 in (0..n).step_by(mc) {
        let rows = mc.min(n - r0);
        // SAFETY: rows r0..r0 + rows of the sums and of `attended`, c values each; `hidden`
        // holds mc rows of the hidden width; the layers' dims checked by the caller.
        unsafe {
            let a = sums.as_ptr().add(r0 * c);
            let m = attended.as_mut_ptr().add(r0 * c);
            mlp_rows(rows, (a, c), mlp, hidden, (m, std::ptr::null(), c));
        }
    }
    for ((out, m), sum) in normed
        .chunks_exact_mut(c)
        .zip(attended.chunks_exact(c))
        .zip(sums.chunks_exact(c))
    {
        layers.norm2.row(m, uninit(out));
        out.iter_mut().zip(sum).for_each(|(o, s)| *o += s);
    }
}

/// One task's buffers for [`swin_block`]: a window's worth of each step's output.
struct BlockScratch {
    attention: Scratch,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attended: Vec<f32>,
    /// The MLP's hidden activations for a block of rows.
    hidden: Vec<f32>,
}

impl BlockScratch {
    fn new(n: usize, c: usize, h: usize, rows: usize) -> Self {
        Self {
            attention: Scratch {
                scores: vec![0f32; n * n],
                ..Scratch::default()
            },
            normed: vec![0f32; n * c],
            qkv: vec![0f32; n * 3 * c],
            attended: vec![0f32; n * c],
            hidden: vec![0f32; rows * h],
        }
    }
}

/// `values` as memory to write (every f32 is a valid `MaybeUninit<f32>`).
fn uninit(values: &mut [f32]) -> &mut [std::mem::MaybeUninit<f32>] {
    // SAFETY: MaybeUninit<f32> has f32's layout, and the view only allows writing f32s.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

/// Windows of at least this many tokens have their values packed on AVX2 ([`packs_values`]).
const PACKED_VALUES_TOKENS: usize = 128;

/// Whether each head's v is packed into panels before the second product, rather than read
/// in place: on AVX2, for windows of [`PACKED_VALUES_TOKENS`] tokens or more. In place, a
/// strip of v is `n` rows `3c` values apart that start off a cache line (two lines per row,
/// 32 KiB for 256 tokens: all of L1), reread from L2 for every tile of rows; packed, it is
/// contiguous and aligned. DRCT's 256-token windows, held to AVX2, ran 6-9% faster (medians
/// of 21, interleaved; the whole model 4%); SwinIR's 64-token windows and AVX-512 did not
/// gain, nor did DAT as a whole (its rectangles' rows are gathered, 3c/2 apart).
fn packs_values(products: Products, n: usize) -> bool {
    use crate::ops::cpu::isa::{cpu_isa, CpuIsa};
    matches!(products, Products::Panels) && n >= PACKED_VALUES_TOKENS && cpu_isa() == CpuIsa::Avx2
}

/// The sizes one window's attention needs.
pub(super) struct WindowShape<'a> {
    /// Tokens per window.
    n: usize,
    /// Channels (all heads).
    c: usize,
    heads: usize,
    products: Products,
    /// The `(heads, n, n)` position bias, where the scores start from it (panels only).
    gathered: Option<&'a [f32]>,
    /// Each head's v is packed before its product ([`packs_values`]).
    pack_values: bool,
}

/// How a window's two products run: f32 on the `gemm` crate (split across threads or not),
/// f32 on [`panels`], or bf16.
#[derive(Clone, Copy)]
pub(super) enum Products {
    F32(gemm::Parallelism),
    Panels,
    Bf16(Isa),
}

/// One task's working memory: a window's score matrix, the bf16 operands kᵀ, v and the
/// probabilities of one head, and for panels the window's kᵀ (all heads).
#[derive(Default)]
pub(super) struct Scratch {
    scores: Vec<f32>,
    kt: PackedB,
    v: PackedB,
    probs: PackedA,
    keys_t: Vec<f32>,
    /// A head's v packed, for panels ([`WindowShape::pack_values`]): the buffer, reused.
    values: Vec<f32>,
}

/// Attention of one window: for each head, scores = q · kᵀ straight from the strided `qkv`
/// rows (`n` rows of q | k | v), + bias (+ mask from the region `labels`), softmax in place,
/// then the head's `d` output columns = probabilities · v. Writes every element of `out` (`n`
/// rows of `c`).
pub(super) fn attend_window(
    s: &WindowShape,
    qkv: &[f32],
    bias: &RelativeBias,
    labels: Option<&[u8]>,
    scratch: &mut Scratch,
    out: &mut [std::mem::MaybeUninit<f32>],
) {
    let (n, c) = (s.n, s.c);
    let (c3, d) = (3 * c, c / s.heads);
    let Scratch {
        scores,
        kt,
        v,
        probs,
        keys_t,
        values: packed_values,
    } = scratch;
    assert!(qkv.len() >= n * c3 && out.len() >= n * c && scores.len() >= n * n);
    if let Products::Panels = s.products {
        // kᵀ of every head at once: channel-major, n tokens per row. v is read in place.
        keys_t.resize(c * n, 0.0);
        panels::transpose_keys(qkv, (n, c), keys_t);
    }
    for h in 0..s.heads {
        let q = qkv[h * d..].as_ptr();
        let keys = &qkv[c + h * d..];
        let values = &qkv[2 * c + h * d..];
        let head_out = out[h * d..].as_mut_ptr().cast::<f32>();
        if let Products::Panels = s.products {
            let bias_rows = s.gathered.map(|g| &g[h * n * n..(h + 1) * n * n]);
            let scores = &mut scores[..n * n];
            let start = panels::Start {
                init: bias_rows.map(|b| (b.as_ptr(), n)),
                bias: None,
            };
            let kt = panels::Rhs::Strided {
                ptr: keys_t[h * d * n..(h + 1) * d * n].as_ptr(),
                k: d,
                n,
                ld: n,
            };
            // v: n rows of the head's d values, c3 apart in `qkv`; packed, or read there.
            let packed = s.pack_values.then(|| {
                let buffer = std::mem::take(packed_values);
                panels::Panels::reusing(buffer, values, (n, d), (c3, 1))
            });
            let v = match &packed {
                Some(p) => p.rhs(),
                None => panels::Rhs::Strided {
                    ptr: values.as_ptr(),
                    k: n,
                    n: d,
                    ld: c3,
                },
            };
            // SAFETY: q is n rows of d values c3
            // apart inside `qkv`, kᵀ d rows of n in `keys_t`, the bias and the scores n x n;
            // then the probabilities n x n against v (n rows of d inside `qkv`), into the
            // head's d columns of `out`'s n rows of c, which no other task touches.
            unsafe { panels::gemm(n, (q, c3), kt, (scores.as_mut_ptr(), n), start, false, None) };
            let table = bias_rows.is_none().then_some((bias, h));
            attention_probs(scores, table, labels, n, None);
            // SAFETY: as above.
            unsafe {
                let zero = panels::Start::ZERO;
                panels::gemm(n, (scores.as_ptr(), n), v, (head_out, c), zero, false, None)
            };
            if let Some(p) = packed {
                *packed_values = p.into_buffer();
            }
            continue;
        }
        // SAFETY (all products): every access stays inside `qkv` (n rows of c3 starting at
        // the head's column), `scores` (n x n) and `out` (n rows of c), as asserted above; the
        // pointers do not alias and no other task touches this window's `out`. kᵀ is k read
        // through swapped strides.
        unsafe {
            head_product(
                s.products,
                (n, d, n),
                (q, c3),
                (keys, 1, c3),
                kt,
                (scores.as_mut_ptr(), n),
            )
        };
        let scores = &mut scores[..n * n];
        match s.products {
            Products::Panels => unreachable!("handled above"),
            Products::F32(_) => {
                attention_probs(scores, Some((bias, h)), labels, n, None);
                // SAFETY: as above.
                unsafe {
                    head_product(
                        s.products,
                        (n, n, d),
                        (scores.as_ptr(), n),
                        (values, c3, 1),
                        v,
                        (head_out, c),
                    )
                };
            }
            Products::Bf16(isa) => {
                // The probabilities are rounded into the packed operand row by row as the
                // softmax finishes them, instead of in a pass of their own.
                v.repack(values, (n, d), (c3, 1));
                probs.prepare(isa, n, v);
                attention_probs(scores, Some((bias, h)), labels, n, Some(probs));
                // SAFETY: as above; the caller chose an ISA this CPU has.
                unsafe { crate::ops::cpu::bf16::gemm_packed(probs, v, head_out, c, false) };
            }
        }
    }
}

/// HAT's overlapping cross-attention on the CPU, fused per query window: each window's
/// `ows`-square neighbourhood of q | k | v rows is copied once (zero rows outside the map, as
/// the official unfold pads), then per head the scores start from the `(heads, ws², ows²)`
/// bias, take q · kᵀ on the GEMM, go through the softmax in cache, and times v give the
/// head's output columns. candle's graph instead pads the whole map, gathers every
/// neighbourhood, transposes q, k and v and writes the scores out per head, with a scalar
/// `exp`.
///
/// `qkv`: `(B, H, W, 3C)`, q already scaled, H and W multiples of `ws`; `bias` f32. Returns
/// `(B, H, W, C)`, or `None` where the kernel does not apply (another device or dtype).
pub fn overlap_attention(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    (ws, ows): (usize, usize),
    bf16: Option<Isa>,
) -> Result<Option<Tensor>> {
    if !use_kernel(qkv) || !use_kernel(bias) {
        return Ok(None);
    }
    let windows = qkv.dim(0)? * (qkv.dim(1)? / ws.max(1)) * (qkv.dim(2)? / ws.max(1));
    let products = match bf16 {
        Some(isa) => Products::Bf16(isa),
        None if panels::available() => Products::Panels,
        None if windows >= rayon::current_num_threads() => Products::F32(gemm::Parallelism::None),
        None => Products::F32(gemm::Parallelism::Rayon(0)),
    };
    overlap_attention_with(products, qkv, bias, heads, (ws, ows)).map(Some)
}

/// [`overlap_attention`] with its products chosen by the caller (tests run each kind).
pub(super) fn overlap_attention_with(
    products: Products,
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    (ws, ows): (usize, usize),
) -> Result<Tensor> {
    let (b, h, w, c3) = qkv.dims4()?;
    let c = c3 / 3;
    let d = c / heads.max(1);
    let (n, nk) = (ws * ws, ows * ows);
    if ws == 0 || ows < ws || (ows - ws) % 2 != 0 || c3 != 3 * c || c != heads * d {
        candle_core::bail!(
            "overlap attention: qkv {:?} for {heads} heads, window {ws} in {ows}",
            qkv.dims()
        );
    }
    if h % ws != 0 || w % ws != 0 || bias.dims() != [heads, n, nk] {
        candle_core::bail!(
            "overlap attention: map {h}x{w} and bias {:?} for {heads} heads, window {ws} in {ows}",
            bias.dims()
        );
    }
    let (nwy, nwx) = (h / ws, w / ws);
    let windows = b * nwy * nwx;
    let (qkv_guard, qkv_layout) = qkv.storage_and_layout();
    let qkv_data = cpu_slice(&qkv_guard, qkv_layout)?;
    let (bias_guard, bias_layout) = bias.storage_and_layout();
    let bias_data = cpu_slice(&bias_guard, bias_layout)?;
    let geometry = Neighbourhood {
        map: (h, w),
        c3,
        ws,
        ows,
    };
    // Each window's n output rows, window after window; placed on the map below.
    let mut by_window: Vec<f32> = vec![0f32; windows * n * c];
    by_window.par_chunks_mut(n * c).enumerate().for_each_init(
        OverlapScratch::default,
        |scratch, (win, out)| {
            let (bi, wy, wx) = (win / (nwy * nwx), (win / nwx) % nwy, win % nwx);
            let image = &qkv_data[bi * h * w * c3..(bi + 1) * h * w * c3];
            geometry.gather(image, (wy, wx), scratch);
            attend_overlap(products, (n, nk, c, heads), bias_data, scratch, out);
        },
    );
    drop((qkv_guard, bias_guard));
    let mut out = vec![0f32; b * h * w * c];
    out.par_chunks_mut(w * c).enumerate().for_each(|(r, row)| {
        let (bi, y) = (r / h, r % h);
        let (wy, iy) = (y / ws, y % ws);
        for wx in 0..nwx {
            let win = (bi * nwy + wy) * nwx + wx;
            let src = &by_window[(win * n + iy * ws) * c..][..ws * c];
            row[wx * ws * c..][..ws * c].copy_from_slice(src);
        }
    });
    Tensor::from_vec(out, (b, h, w, c), qkv.device())
}

/// Where one query window's keys come from: the `ows`-square neighbourhood centred on it in
/// an `H x W` map of `c3`-value rows.
struct Neighbourhood {
    map: (usize, usize),
    c3: usize,
    ws: usize,
    ows: usize,
}

impl Neighbourhood {
    /// Copies window `(wy, wx)`'s neighbourhood rows (q | k | v, zero outside the map) into
    /// `scratch.rows` and its own queries into `scratch.q` (`ws²` rows of `c3 / 3`).
    fn gather(&self, image: &[f32], (wy, wx): (usize, usize), scratch: &mut OverlapScratch) {
        let (h, w) = self.map;
        let (c3, ws, ows) = (self.c3, self.ws, self.ows);
        let c = c3 / 3;
        let margin = (ows - ws) / 2;
        scratch.rows.resize(ows * ows * c3, 0.0);
        scratch.q.resize(ws * ws * c, 0.0);
        // Columns of the neighbourhood inside the map: [left, right) of the map, placed from
        // column `skip` of each neighbourhood row.
        let x0 = (wx * ws) as isize - margin as isize;
        let left = x0.max(0) as usize;
        let right = ((x0 + ows as isize) as usize).min(w);
        let skip = (left as isize - x0) as usize;
        for a in 0..ows {
            let dst = &mut scratch.rows[a * ows * c3..(a + 1) * ows * c3];
            let y = (wy * ws + a) as isize - margin as isize;
            if y < 0 || y as usize >= h {
                dst.fill(0.0);
                continue;
            }
            let src = &image[(y as usize * w + left) * c3..(y as usize * w + right) * c3];
            let (before, rest) = dst.split_at_mut(skip * c3);
            let (inside, after) = rest.split_at_mut(src.len());
            before.fill(0.0);
            inside.copy_from_slice(src);
            after.fill(0.0);
        }
        for iy in 0..ws {
            for ix in 0..ws {
                let j = (iy + margin) * ows + ix + margin;
                scratch.q[(iy * ws + ix) * c..][..c].copy_from_slice(&scratch.rows[j * c3..][..c]);
            }
        }
    }
}

/// One task's working memory for the overlapping cross-attention.
#[derive(Default)]
struct OverlapScratch {
    /// The neighbourhood's `ows²` rows of q | k | v.
    rows: Vec<f32>,
    /// The window's `ws²` queries, `c` values each.
    q: Vec<f32>,
    scores: Vec<f32>,
    /// kᵀ of every head (panels): channel-major, `ows²` keys per row.
    keys_t: Vec<f32>,
    kt: PackedB,
    v: PackedB,
    probs: PackedA,
}

/// The overlapping cross-attention of one gathered window (`n` queries, `nk` keys, `c`
/// channels in `heads` heads) into `out` (`n` rows of `c`); `bias` is `(heads, n, nk)`.
fn attend_overlap(
    products: Products,
    (n, nk, c, heads): (usize, usize, usize, usize),
    bias: &[f32],
    scratch: &mut OverlapScratch,
    out: &mut [f32],
) {
    let (c3, d) = (3 * c, c / heads);
    let OverlapScratch {
        rows,
        q,
        scores,
        keys_t,
        kt,
        v,
        probs,
    } = scratch;
    assert!(rows.len() >= nk * c3 && q.len() >= n * c && out.len() >= n * c);
    assert!(bias.len() >= heads * n * nk);
    scores.resize(n * nk, 0.0);
    if let Products::Panels = products {
        keys_t.resize(c * nk, 0.0);
        panels::transpose_keys(rows, (nk, c), keys_t);
    }
    for hd in 0..heads {
        let q_head = q[hd * d..].as_ptr();
        let keys = &rows[c + hd * d..];
        let values = &rows[2 * c + hd * d..];
        let bias = &bias[hd * n * nk..(hd + 1) * n * nk];
        let head_out = out[hd * d..].as_mut_ptr();
        match products {
            Products::Panels => {
                let kt = panels::Rhs::Strided {
                    ptr: keys_t[hd * d * nk..(hd + 1) * d * nk].as_ptr(),
                    k: d,
                    n: nk,
                    ld: nk,
                };
                let v = panels::Rhs::Strided {
                    ptr: values.as_ptr(),
                    k: nk,
                    n: d,
                    ld: c3,
                };
                let start = panels::Start {
                    init: Some((bias.as_ptr(), nk)),
                    bias: None,
                };
                // SAFETY: q is n rows of d values c apart in
                // `q`, kᵀ d rows of nk in `keys_t`, the bias and the scores n x nk; then the
                // probabilities against v (nk rows of d, c3 apart in `rows`) into the head's
                // d columns of `out`'s n rows of c. Nothing overlaps.
                unsafe {
                    panels::gemm(
                        n,
                        (q_head, c),
                        kt,
                        (scores.as_mut_ptr(), nk),
                        start,
                        false,
                        None,
                    );
                    attention_probs(scores, None, None, nk, None);
                    let zero = panels::Start::ZERO;
                    panels::gemm(
                        n,
                        (scores.as_ptr(), nk),
                        v,
                        (head_out, c),
                        zero,
                        false,
                        None,
                    );
                }
            }
            Products::F32(_) | Products::Bf16(_) => {
                // SAFETY: q is n rows of d values c apart, kᵀ the view of nk key rows c3 apart
                // with unit channel stride, the scores n x nk; nothing overlaps.
                unsafe {
                    head_product(
                        products,
                        (n, d, nk),
                        (q_head, c),
                        (keys, 1, c3),
                        kt,
                        (scores.as_mut_ptr(), nk),
                    )
                };
                // The graph's order: q·kᵀ, then + bias.
                scores.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
                if let Products::Bf16(isa) = products {
                    v.repack(values, (nk, d), (c3, 1));
                    probs.prepare(isa, n, v);
                    attention_probs(scores, None, None, nk, Some(probs));
                    // SAFETY: the caller chose an ISA this CPU has; `out` holds n rows of c.
                    unsafe { crate::ops::cpu::bf16::gemm_packed(probs, v, head_out, c, false) };
                } else {
                    attention_probs(scores, None, None, nk, None);
                    // SAFETY: the probabilities n x nk against v (nk rows of d, c3 apart)
                    // into the head's columns of `out`.
                    unsafe {
                        head_product(
                            products,
                            (n, nk, d),
                            (scores.as_ptr(), nk),
                            (values, c3, 1),
                            v,
                            (head_out, c),
                        )
                    };
                }
            }
        }
    }
}

/// `dst = lhs · rhs` for one head: `lhs` is `m x k` (rows `lda` apart), `rhs` the `k x cols`
/// view `src[r * rs + c * cs]`, `dst` rows `ldc` apart. In f32 the GEMM reads `rhs` through its
/// strides; in bf16 it is packed into `packed` first.
///
/// # Safety
/// `lhs` and `dst` must hold those rows, `dst` overlapping neither input; with bf16 the CPU
/// must have the instructions.
pub(super) unsafe fn head_product(
    products: Products,
    (m, k, cols): (usize, usize, usize),
    (lhs, lda): (*const f32, usize),
    (src, rs, cs): (&[f32], usize, usize),
    packed: &mut PackedB,
    (dst, ldc): (*mut f32, usize),
) {
    let (rhs, parallel) = match products {
        Products::F32(inner) => (
            Weights::F32(src),
            matches!(inner, gemm::Parallelism::Rayon(_)),
        ),
        Products::Panels => unreachable!("panel products are run by `attend_window`"),
        Products::Bf16(isa) => {
            packed.repack(src, (k, cols), (rs, cs));
            (Weights::Bf16(isa, packed), false)
        }
    };
    // SAFETY: forwarded to the caller.
    unsafe {
        product(
            (m, cols, k),
            (dst, ldc),
            false,
            (lhs, lda),
            rhs,
            (rs, cs),
            parallel,
            None,
        )
    }
}

/// One channel group's attention in rectangular windows of a token map, as DAT's spatial
/// branches run it: the group's q, k and v channels of `qkv` `(b, h, w, 3c)` (q pre-scaled),
/// zero-padded to `hp x wp` (multiples of the window), rolled back by half a window when
/// `shifted` (then masked by region), are attended in `bias`'s windows by
/// [`window_attention`], and the results land, rolled forward again and cropped, in the
/// group's channels of `out` `(b, h, w, c)`. The gather and the scatter are one copy each,
/// where candle's graph pads, rolls (two concatenations each way), partitions and reverses.
pub(crate) fn rectangle_attention(
    (qkv, (b, h, w, c)): (&[f32], (usize, usize, usize, usize)),
    (first, count): (usize, usize),
    bias: &RelativeBias,
    (hp, wp): (usize, usize),
    shifted: bool,
    bf16: Option<Isa>,
    out: &mut [f32],
) -> Result<()> {
    let (hs, ws) = (bias.tokens() / bias.window(), bias.window());
    let n = hs * ws;
    if hp % hs != 0 || wp % ws != 0 || hp < h || wp < w || first + count > c {
        candle_core::bail!(
            "rectangle attention: {h}x{w} padded to {hp}x{wp} for windows {hs}x{ws}"
        );
    }
    assert!(qkv.len() == b * h * w * 3 * c && out.len() == b * h * w * c);
    let (sy, sx) = if shifted { (hs / 2, ws / 2) } else { (0, 0) };
    let (nwy, nwx) = (hp / hs, wp / ws);
    // Window token (y, x) of the rolled map is token ((y + sy) mod hp, (x + sx) mod wp) of
    // the padded one, which lies in the image or in the zero padding.
    let source = |bi: usize, win: usize, t: usize| -> Option<usize> {
        let (wy, wx) = (win / nwx, win % nwx);
        let y = (wy * hs + t / ws + sy) % hp;
        let x = (wx * ws + t % ws + sx) % wp;
        (y < h && x < w).then(|| (bi * h + y) * w + x)
    };
    let windows = b * nwy * nwx;
    let heads = bias.heads();
    if count % heads.max(1) != 0 {
        candle_core::bail!("rectangle attention: {count} channels for {heads} heads");
    }
    let regions = shifted.then(|| rectangle_regions((hp, wp), (hs, ws)));
    let (products, gathered) = products_for(windows, bias, bf16);
    let shape = WindowShape {
        n,
        c: count,
        heads,
        products,
        gathered: gathered.as_deref(),
        pack_values: packs_values(products, n),
    };
    // Each task gathers its window's q | k | v rows into its own buffer (zeros for padding
    // tokens), attends, and scatters the output rows to their tokens, so that a window's
    // operands are in cache when attended. (Gathering every window into one map first cost a
    // fresh, zeroed map and a pass over it per call, 20% of the attention's time.)
    let nw = nwy * nwx;
    // SAFETY: every window token maps to a distinct token of the padded map, so each output
    // token's group channels are written by one task only; `out` outlives the tasks.
    let shared = unsafe { crate::ops::cpu::shared::Shared::new(out.as_mut_ptr()) };
    (0..windows).into_par_iter().for_each_init(
        || {
            let scratch = Scratch {
                scores: vec![0f32; n * n],
                ..Scratch::default()
            };
            (
                scratch,
                vec![0f32; n * 3 * count],
                Vec::with_capacity(n * count),
            )
        },
        |(scratch, rows, attended): &mut (Scratch, Vec<f32>, Vec<f32>), win| {
            let (bi, wi) = (win / nw, win % nw);
            for (t, row) in rows.chunks_exact_mut(3 * count).enumerate() {
                match source(bi, wi, t) {
                    Some(token) => {
                        let src = &qkv[token * 3 * c..][..3 * c];
                        for (part, dst) in row.chunks_exact_mut(count).enumerate() {
                            dst.copy_from_slice(&src[part * c + first..][..count]);
                        }
                    }
                    None => row.fill(0.0),
                }
            }
            // A window inside one region masks nothing.
            let labels = regions
                .as_deref()
                .map(|r| &r[wi * n..(wi + 1) * n])
                .filter(|l| l.iter().any(|&v| v != l[0]));
            attended.clear();
            attend_window(
                &shape,
                rows,
                bias,
                labels,
                scratch,
                &mut attended.spare_capacity_mut()[..n * count],
            );
            // SAFETY: `attend_window` wrote all n * count values.
            unsafe { attended.set_len(n * count) };
            for (t, row) in attended.chunks_exact(count).enumerate() {
                if let Some(token) = source(bi, wi, t) {
                    // SAFETY: as above; token * c + first + count <= b * h * w * c.
                    unsafe {
                        let dst = shared.get().add(token * c + first);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), dst, count);
                    }
                }
            }
        },
    );
    Ok(())
}
