//! 3x3 convolutions (stride 1, zero padding 1) by Winograd's minimal filtering F(4x4, 3x3)
//! on channels-last f32 features, on the CPU.
//!
//! Each 4x4 block of outputs is computed from the 6x6 block of inputs around it: the input
//! block is transformed (`Bᵀ d B`), multiplied element by element with the transformed
//! kernel (`G g Gᵀ`, done per call: see [`Winograd`]) and summed over the input channels, and the 6x6 sums
//! transformed back (`Aᵀ m A`). Summed over channels, the 36 element-wise products are 36
//! GEMMs of (blocks x cin) by (cin x cout), on the same panel kernels as the direct
//! convolution: 36 multiplications per block and channel pair instead of 144, a quarter.
//! The price is rounding: the transforms mix values of up to 8 times a sample's size, so
//! the result is some ten times further from the exact one than the direct sum's (measured
//! in the tests; far inside the float64 fixtures' bounds).
//!
//! The transforms are those of Lavin and Gray (2016) with the interpolation points 0, ±1,
//! ±2 and infinity.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use candle_core::{Result, Tensor};
use rayon::prelude::*;

use super::Act;
use crate::ops::cpu::panels::{self, prefetch_rows, Panels, Start};
use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::widest_simd;
use crate::ops::cpu::{cpu_slice, fmadd, gelu_body, mish_of, sigmoid, sigmoid_gate_of, use_kernel};

/// Output blocks per task, about: their transformed inputs (36 x `BLOCKS` x cin) and products
/// (36 x `BLOCKS` x cout) stay in the core's L2 cache while the 36 products run.
const BLOCKS: usize = 16;

/// Output blocks per task: [`BLOCKS`] rounded up to whole tiles of the panel kernels (18 on
/// AVX2, whose tiles are 6 rows: 16 left the third tile a third empty).
fn blocks_per_task() -> usize {
    let mr = panels::tile_rows();
    BLOCKS.div_ceil(mr) * mr
}

/// Channels transformed at a time: one AVX-512 vector, two AVX2 ones.
const CH: usize = 16;

thread_local! {
    /// Each worker's transformed inputs, products and output block, kept between calls:
    /// allocating and zeroing them per task cost a twentieth of the time.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `G`, the kernel's transform (6x3).
const G: [[f64; 3]; 6] = [
    [1.0 / 4.0, 0.0, 0.0],
    [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
    [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
    [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
    [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
    [0.0, 0.0, 1.0],
];

/// A 3x3 convolution's kernel, kept as its nine taps and moved to the Winograd domain
/// ([`Winograd::panels`]) when it first runs, into buffers that the next convolution reuses;
/// from its second call on, the moved kernel is kept. The moved kernel is four times the size
/// (36 positions for 9 taps): building all of them at load cost ESRGAN a quarter of a small
/// image's whole run in allocation and page faults, and a run of one small image uses each
/// once; doing it on every call cost a folder of small images a tenth of its time.
pub(crate) struct Winograd {
    cin: usize,
    cout: usize,
    /// The taps, `9 cin x cout` row-major with rows ordered (dy, dx, cin): f32, contiguous,
    /// on the CPU (checked in [`Self::new`]), kept as loaded rather than copied out.
    taps: Tensor,
    /// The calls so far.
    calls: AtomicUsize,
    /// The moved kernel, from the second call on.
    kept: OnceLock<Vec<Panels>>,
}

impl Winograd {
    /// From `taps`, `(9 cin, cout)` with rows ordered (dy, dx, cin), f32 on the CPU.
    pub(crate) fn new(taps: Tensor, cin: usize, cout: usize) -> Result<Self> {
        if taps.dims() != [9 * cin, cout] || !use_kernel(&taps) {
            candle_core::bail!(
                "a 3x3 kernel of {cin} x {cout}: {:?} {:?} on {:?}",
                taps.dims(),
                taps.dtype(),
                taps.device()
            );
        }
        Ok(Self {
            cin,
            cout,
            taps,
            calls: AtomicUsize::new(0),
            kept: OnceLock::new(),
        })
    }

    /// The kernel in the Winograd domain: for each of the 36 positions `e = 6r + s` of the
    /// 6x6 block, `G g Gᵀ` at (r, s) as a `cin x cout` matrix, packed for the panel kernels.
    /// The transform is taken in f64 and rounded once. A task per row `r`: `t = G g` (its
    /// three columns, over every channel pair at once), then the row's six positions.
    /// The packings are made in `buffers` (36 of them, kept by the caller from one call to
    /// the next: in fresh memory each call paid its page faults again).
    fn panels(&self, buffers: Vec<Vec<f32>>) -> Vec<Panels> {
        let (cin, cout) = (self.cin, self.cout);
        let n = cin * cout;
        let (guard, layout) = self.taps.storage_and_layout();
        let taps = cpu_slice(&guard, layout).expect("f32 on the CPU, as `new` checked");
        let tap = |j: usize, k: usize| &taps[(j * 3 + k) * n..][..n];
        let mut buffers = buffers.into_iter();
        let rows: Vec<(usize, Vec<Vec<f32>>)> = (0..6)
            .map(|r| (r, buffers.by_ref().take(6).collect()))
            .collect();
        let rows: Vec<Vec<Panels>> = rows
            .into_par_iter()
            .map(|(r, buffers)| {
                KERNEL.with_borrow_mut(|(t, u)| {
                    t.resize(3 * n, 0.0);
                    u.resize(n, 0.0);
                    for (k, t) in t.chunks_exact_mut(n).enumerate() {
                        kernel_column(t, G[r], [tap(0, k), tap(1, k), tap(2, k)]);
                    }
                    let mut buffers = buffers.into_iter();
                    (0..6)
                        .map(|s| {
                            kernel_row(u, G[s], t);
                            let buffer = buffers.next().unwrap_or_default();
                            Panels::reusing(buffer, u, (cin, cout), (cout, 1))
                        })
                        .collect()
                })
            })
            .collect();
        rows.into_iter().flatten().collect()
    }

    /// The input channels.
    pub(crate) fn cin(&self) -> usize {
        self.cin
    }

    /// The convolution of `x` (`batch x h x w x cin`) plus `bias` (`cout`), finished as
    /// `finish` says, `batch x h x w x cout`. Needs the panel kernels ([`panels::available`]).
    pub(crate) fn forward(
        &self,
        x: &[f32],
        (batch, h, w): (usize, usize, usize),
        bias: &[f32],
        finish: Finish,
    ) -> Vec<f32> {
        assert_eq!(x.len(), batch * h * w * self.cin);
        self.convolve((batch, h, w), bias, finish, Source::Image(x))
    }

    /// The convolution of inputs already transformed: `v` holds, for each position `e` and
    /// each of the `blocks` 4x4 blocks of a `batch x h x w` image (row-major), `ld` values
    /// (from `v[(e * blocks + block) * ld]`) whose first `cin` are this convolution's input.
    fn on_transformed(
        &self,
        v: &[f32],
        ld: usize,
        (batch, h, w): (usize, usize, usize),
        bias: &[f32],
        finish: Finish,
    ) -> Vec<f32> {
        let blocks = batch * h.div_ceil(4) * w.div_ceil(4);
        assert!(ld >= self.cin && v.len() >= 36 * blocks * ld);
        self.convolve((batch, h, w), bias, finish, Source::Transformed { v, ld })
    }

    fn convolve(
        &self,
        (batch, h, w): (usize, usize, usize),
        bias: &[f32],
        finish: Finish,
        source: Source,
    ) -> Vec<f32> {
        let (cin, cout) = (self.cin, self.cout);
        assert_eq!(bias.len(), cout);
        match finish {
            Finish::PRelu(slopes) => assert_eq!(slopes.len(), cout),
            Finish::Residual(_, res) => assert_eq!(res.len(), batch * h * w * cout),
            Finish::Residuals(_, r1, _, r2) => {
                assert!(r1.len() == batch * h * w * cout && r2.len() == r1.len())
            }
            Finish::Gate(x) | Finish::Modulate(x) => assert_eq!(x.len(), batch * h * w * cout),
            _ => {}
        }
        let (bh, bw) = (h.div_ceil(4), w.div_ceil(4));
        let blocks = batch * bh * bw;
        let mut out: Vec<f32> = Vec::with_capacity(batch * h * w * cout);
        // SAFETY: each task writes the output pixels of its own blocks only (blocks do not
        // overlap), and `out` outlives the tasks.
        let dst = unsafe { Shared::new(out.as_mut_ptr()) };
        let zeros = vec![0f32; cin];
        let per_task = blocks_per_task();
        let tasks = blocks.div_ceil(per_task);
        let first = self.kept.get().is_none() && self.calls.fetch_add(1, Ordering::Relaxed) == 0;
        // The calling thread's buffers, taken for this call (a worker that waits in it may
        // run another convolution's task, which then finds none).
        let fresh = first.then(|| self.panels(PANEL_BUFFERS.with(std::cell::RefCell::take)));
        let panels: &[Panels] = match &fresh {
            Some(fresh) => fresh,
            None => self.kept.get_or_init(|| self.panels(Vec::new())),
        };
        (0..tasks).into_par_iter().for_each(|task| {
            SCRATCH.with_borrow_mut(|scratch| {
                let need = 36 * per_task * (cin + cout) + 16 * cout;
                if scratch.len() < need {
                    scratch.resize(need, 0.0);
                }
                let (v, rest) = scratch.split_at_mut(36 * per_task * cin);
                let (m, y) = rest.split_at_mut(36 * per_task * cout);
                let b0 = task * per_task;
                let n = per_task.min(blocks - b0);
                // Where position e's rows of this task's blocks start, and how far apart.
                let (rows, lda) = match source {
                    Source::Image(x) => {
                        for i in 0..n {
                            let pixels = block_pixels(x, (h, w, cin), &zeros, b0 + i);
                            if i + 1 < n {
                                prefetch(&block_pixels(x, (h, w, cin), &zeros, b0 + i + 1));
                            }
                            let mut chunks = v.chunks_exact_mut(per_task * cin);
                            let mut dst: [&mut [f32]; 36] = std::array::from_fn(|_| {
                                &mut chunks.next().unwrap()[i * cin..(i + 1) * cin]
                            });
                            transform_input(&pixels, &mut dst);
                        }
                        let v: &[f32] = v;
                        (
                            std::array::from_fn::<_, 36, _>(|e| v[e * per_task * cin..].as_ptr()),
                            cin,
                        )
                    }
                    Source::Transformed { v, ld } => (
                        std::array::from_fn(|e| v[(e * blocks + b0) * ld..].as_ptr()),
                        ld,
                    ),
                };
                for (e, rows) in rows.into_iter().enumerate() {
                    // SAFETY: rows holds n rows of at least cin values lda apart for position
                    // e, m n rows of cout, and the panels are cin x cout.
                    unsafe {
                        panels::gemm(
                            n,
                            (rows, lda),
                            panels[e].rhs(),
                            (m[e * per_task * cout..].as_mut_ptr(), cout),
                            Start::ZERO,
                            false,
                            None,
                        )
                    };
                }
                let place = |block: usize| {
                    let (bi, rest) = (block / (bh * bw), block % (bh * bw));
                    let (y0, x0) = (4 * (rest / bw), 4 * (rest % bw));
                    let (rows, cols) = ((h - y0).min(4), (w - x0).min(4));
                    ((bi * h + y0) * w + x0, rows, cols)
                };
                for i in 0..n {
                    let (base, rows, cols) = place(b0 + i);
                    // The next block's output lines, asked for while this one is finished:
                    // the output is fresh memory, out of cache, and each line is read before
                    // its first store. Compact held to AVX2 ran 11-15% faster, ESRGAN 6-7%
                    // (natively and held to AVX2); SPAN did not change.
                    if i + 1 < n {
                        let (base, rows, cols) = place(b0 + i + 1);
                        prefetch_rows(
                            dst.get().wrapping_add(base * cout).cast_const(),
                            w * cout,
                            (rows, cols * cout),
                        );
                    }
                    transform_output(m, i * cout, per_task * cout, bias, y);
                    for r in 0..rows {
                        let at = (base + r * w) * cout;
                        let row = &mut y[r * 4 * cout..][..cols * cout];
                        match finish {
                            Finish::Plain => {}
                            Finish::Residual(scale, res) => {
                                scaled_add(row, scale, &res[at..at + cols * cout])
                            }
                            Finish::Residuals(s1, r1, s2, r2) => {
                                scaled_add(row, s1, &r1[at..at + cols * cout]);
                                scaled_add(row, s2, &r2[at..at + cols * cout]);
                            }
                            Finish::Gate(x) => gate(row, &x[at..at + cols * cout]),
                            Finish::Modulate(x) => modulate(row, &x[at..at + cols * cout]),
                            act => activate(row, act, cout),
                        }
                        // SAFETY: the block's output pixels (rows x cols from (y0, x0) of
                        // image bi, cout values each) lie in `out` and belong to this task
                        // alone; `y` holds 16 pixels of cout values.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                row.as_ptr(),
                                dst.get().add(at),
                                cols * cout,
                            )
                        };
                    }
                }
            })
        });
        // SAFETY: the blocks cover every output pixel of every image, cout values each.
        unsafe { out.set_len(batch * h * w * cout) };
        if let Some(fresh) = fresh {
            PANEL_BUFFERS.with_borrow_mut(|b| {
                if b.is_empty() {
                    *b = fresh.into_iter().map(Panels::into_buffer).collect();
                }
            });
        }
        out
    }
}

/// Where a convolution's transformed inputs come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Transformed block by block as the products need them.
    Image(&'a [f32]),
    /// Already transformed ([`Winograd::on_transformed`]).
    Transformed { v: &'a [f32], ld: usize },
}

thread_local! {
    /// The allocations of the last convolution's 36 packed kernels on this thread, for the
    /// next one to pack into ([`Winograd::panels`]).
    static PANEL_BUFFERS: std::cell::RefCell<Vec<Vec<f32>>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// [`Winograd::panels`]' scratch per worker: `G g`'s three columns (f64) and one
    /// position's matrix before packing.
    static KERNEL: std::cell::RefCell<(Vec<f64>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

widest_simd! {
    /// `t = Σ_j g_row[j] · taps[j]` over every channel pair: one row of `G` times a column
    /// of the kernel's taps, in f64.
    fn kernel_column(t: &mut [f64], g_row: [f64; 3], taps: [&[f32]; 3]) = kernel_column_body
}

#[inline(always)]
fn kernel_column_body(t: &mut [f64], g: [f64; 3], [a, b, c]: [&[f32]; 3]) {
    for (((t, a), b), c) in t.iter_mut().zip(a).zip(b).zip(c) {
        *t = g[0] * f64::from(*a) + g[1] * f64::from(*b) + g[2] * f64::from(*c);
    }
}

widest_simd! {
    /// `u = Σ_k t[k] · g_row[k]` rounded to f32, with `t` three columns of `u.len()`.
    fn kernel_row(u: &mut [f32], g_row: [f64; 3], t: &[f64]) = kernel_row_body
}

#[inline(always)]
fn kernel_row_body(u: &mut [f32], g: [f64; 3], t: &[f64]) {
    let n = u.len();
    let (t0, rest) = t.split_at(n);
    let (t1, t2) = rest.split_at(n);
    for (((u, a), b), c) in u.iter_mut().zip(t0).zip(t1).zip(t2) {
        *u = (a * g[0] + b * g[1] + c * g[2]) as f32;
    }
}

/// The 6x6 input block around output block `block` (row-major over a `batch x h x w` image
/// of `c` channels): each position's channels, `zeros` outside the image.
fn block_pixels<'a>(
    x: &'a [f32],
    (h, w, c): (usize, usize, usize),
    zeros: &'a [f32],
    block: usize,
) -> [&'a [f32]; 36] {
    let (bh, bw) = (h.div_ceil(4), w.div_ceil(4));
    let (bi, rest) = (block / (bh * bw), block % (bh * bw));
    let (y0, x0) = (4 * (rest / bw), 4 * (rest % bw));
    let image = &x[bi * h * w * c..(bi + 1) * h * w * c];
    std::array::from_fn(|e| {
        let (y, xx) = ((y0 + e / 6).wrapping_sub(1), (x0 + e % 6).wrapping_sub(1));
        if y < h && xx < w {
            &image[(y * w + xx) * c..][..c]
        } else {
            &zeros[..c]
        }
    })
}

/// Asks for the next block's input pixels while this one is transformed: its 36 short runs
/// (a pixel's channels each) are too short for the hardware's stream prefetcher, and the
/// transform otherwise waits on each.
#[inline(always)]
fn prefetch(pixels: &[&[f32]; 36]) {
    // Elsewhere the hint is left to the hardware.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = pixels;
    #[cfg(target_arch = "x86_64")]
    for p in pixels {
        for line in (0..p.len()).step_by(16) {
            // SAFETY: a prefetch reads nothing architecturally; the address is inside `p`.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(p.as_ptr().add(line).cast());
            }
        }
    }
}

/// The `(batch, h, w, c)` features `x` transformed into channels `c0..c0 + c` of `v`, laid
/// out as [`Winograd::on_transformed`] reads it (`ld` values per position and block).
fn transform_into(
    x: &[f32],
    (batch, h, w, c): (usize, usize, usize, usize),
    v: &mut [f32],
    (ld, c0): (usize, usize),
) {
    let blocks = batch * h.div_ceil(4) * w.div_ceil(4);
    assert!(x.len() == batch * h * w * c && c0 + c <= ld && v.len() >= 36 * blocks * ld);
    let zeros = vec![0f32; c];
    // SAFETY: each task writes channels c0..c0 + c of its own blocks, at every position;
    // no two tasks write the same values, and `v` outlives them.
    let base = unsafe { Shared::new(v.as_mut_ptr()) };
    (0..blocks)
        .into_par_iter()
        .with_min_len(BLOCKS)
        .for_each(|b| {
            let pixels = block_pixels(x, (h, w, c), &zeros, b);
            // SAFETY: as above; each slice is c values inside v.
            let mut dst: [&mut [f32]; 36] = std::array::from_fn(|e| unsafe {
                std::slice::from_raw_parts_mut(base.get().add((e * blocks + b) * ld + c0), c)
            });
            transform_input(&pixels, &mut dst);
        });
}

/// A residual dense block (ESRGAN's RDB) by Winograd: `convs[k]` (with its bias) reads the
/// block's input and the outputs of the convolutions before it, concatenated; each of those
/// is LeakyReLU'd with `slope`; the block returns `scale · last + x`. Each part of the
/// concatenation is transformed once, when it is made, instead of once per convolution that
/// reads it, and the concatenation itself is never built.
/// With `outer` `(s, r)`, `s · block + r` is returned instead (ESRGAN's RRDB closing over
/// its third dense block).
pub(crate) fn dense_block(
    convs: &[(&Winograd, &[f32])],
    x: &[f32],
    (batch, h, w): (usize, usize, usize),
    (slope, scale): (f32, f32),
    outer: Option<(f32, &[f32])>,
) -> Vec<f32> {
    let nf = convs[0].0.cin;
    let ld = convs.last().map_or(nf, |(c, _)| c.cin);
    let blocks = batch * h.div_ceil(4) * w.div_ceil(4);
    DENSE.with_borrow_mut(|v| {
        // Every value a convolution reads is written first (its channels, every block and
        // position): the buffer is kept from one block to the next, not zeroed, since
        // allocating it afresh cost a tenth of ESRGAN's time in page faults.
        if v.len() < 36 * blocks * ld {
            v.resize(36 * blocks * ld, 0.0);
        }
        transform_into(x, (batch, h, w, nf), v, (ld, 0));
        let mut have = nf;
        for (k, (conv, bias)) in convs.iter().enumerate() {
            assert_eq!(
                conv.cin, have,
                "dense convolution {k} reads {have} channels"
            );
            if k + 1 == convs.len() {
                let finish = match outer {
                    None => Finish::Residual(scale, x),
                    Some((s, r)) => Finish::Residuals(scale, x, s, r),
                };
                return conv.on_transformed(v, ld, (batch, h, w), bias, finish);
            }
            let y = conv.on_transformed(v, ld, (batch, h, w), bias, Finish::Leaky(slope));
            transform_into(&y, (batch, h, w, conv.cout), v, (ld, have));
            have += conv.cout;
        }
        x.to_vec()
    })
}

thread_local! {
    /// [`dense_block`]'s transformed concatenation, kept for the next block.
    static DENSE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// What is done to a convolution's outputs (bias added) as they are written: the same
/// arithmetic as the separate operations it replaces, so the result is unchanged.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Finish<'a> {
    Plain,
    /// `max(v, 0)`.
    Relu,
    /// `v` where positive, else `slope · v`.
    Leaky(f32),
    /// `v` where positive, else `slope[c] · v` (PReLU, a slope per channel).
    PRelu(&'a [f32]),
    /// `scale · v + residual` (the residual shaped as the output).
    Residual(f32, &'a [f32]),
    /// `s2 · (s1 · v + r1) + r2`.
    Residuals(f32, &'a [f32], f32, &'a [f32]),
    /// `v · sigmoid(v)` (SiLU).
    Silu,
    /// `(v + x) · (sigmoid(v) - 0.5)`, `x` shaped as the output: SPAN's attention.
    Gate(&'a [f32]),
    /// `v · tanh(softplus(v))` (Mish).
    Mish,
    /// The exact (erf) GELU.
    Gelu,
    /// `x · sigmoid(v)`, `x` shaped as the output: RealPLKSR's element-wise attention.
    Modulate(&'a [f32]),
}

/// [`Winograd::forward`] on tensors: `x` `(B, H, W, cin)` f32 on the CPU, contiguous; `b`
/// `(cout)`; the tensors `finish` names (`slopes` for [`Finish::PRelu`], `residual` for
/// [`Finish::Residual`]) f32 on the CPU, contiguous, passed beside it.
pub(crate) fn forward(
    w: &Winograd,
    x: &Tensor,
    b: &Tensor,
    act: Option<Act>,
    residual: Option<(f32, &Tensor)>,
) -> Result<Tensor> {
    let (batch, h, wd, cin) = x.dims4()?;
    if cin != w.cin || b.dims() != [w.cout] {
        candle_core::bail!("conv3x3: input {:?} for {} -> {}", x.dims(), w.cin, w.cout);
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;
    let out = match (act, residual) {
        (None, None) => w.forward(xs, (batch, h, wd), bs, Finish::Plain),
        (Some(Act::Relu), None) => w.forward(xs, (batch, h, wd), bs, Finish::Relu),
        (Some(Act::Leaky(s)), None) => w.forward(xs, (batch, h, wd), bs, Finish::Leaky(s)),
        (Some(Act::Silu), None) => w.forward(xs, (batch, h, wd), bs, Finish::Silu),
        (Some(Act::Mish), None) => w.forward(xs, (batch, h, wd), bs, Finish::Mish),
        (Some(Act::Gelu), None) => w.forward(xs, (batch, h, wd), bs, Finish::Gelu),
        (Some(Act::Gate(other) | Act::Modulate(other)), None) => {
            if other.dims() != [batch, h, wd, w.cout] {
                candle_core::bail!("conv3x3: gate input {:?} for {:?}", other.dims(), x.dims());
            }
            let other = other.contiguous()?;
            let (g, l) = other.storage_and_layout();
            let other = cpu_slice(&g, l)?;
            let finish = match act {
                Some(Act::Gate(_)) => Finish::Gate(other),
                _ => Finish::Modulate(other),
            };
            let out = w.forward(xs, (batch, h, wd), bs, finish);
            drop(g);
            out
        }
        (Some(Act::PRelu(slopes)), None) => {
            let slopes = slopes.contiguous()?;
            let (g, l) = slopes.storage_and_layout();
            let out = w.forward(xs, (batch, h, wd), bs, Finish::PRelu(cpu_slice(&g, l)?));
            drop(g);
            out
        }
        (None, Some((scale, r))) => {
            if r.dims() != [batch, h, wd, w.cout] {
                candle_core::bail!("conv3x3: residual {:?} for {:?}", r.dims(), x.dims());
            }
            let r = r.contiguous()?;
            let (g, l) = r.storage_and_layout();
            let out = w.forward(
                xs,
                (batch, h, wd),
                bs,
                Finish::Residual(scale, cpu_slice(&g, l)?),
            );
            drop(g);
            out
        }
        (Some(_), Some(_)) => candle_core::bail!("conv3x3: an activation and a residual"),
    };
    drop((x_guard, b_guard));
    Tensor::from_vec(out, (batch, h, wd, w.cout), x.device())
}

widest_simd! {
    /// `row = scale · row + residual`, element by element.
    fn scaled_add(row: &mut [f32], scale: f32, residual: &[f32]) = scaled_add_body
}

#[inline(always)]
fn scaled_add_body(row: &mut [f32], scale: f32, residual: &[f32]) {
    for (v, r) in row.iter_mut().zip(residual) {
        *v = *v * scale + r;
    }
}

widest_simd! {
    /// `act` on each value of `row`, pixels of `cout` channels.
    fn activate(row: &mut [f32], act: Finish, cout: usize) = fused activate_body
}

#[inline(always)]
fn activate_body<const FMA: bool>(row: &mut [f32], act: Finish, cout: usize) {
    match act {
        Finish::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
        Finish::Leaky(slope) => row
            .iter_mut()
            .for_each(|v| *v = if *v < 0.0 { *v * slope } else { *v }),
        Finish::PRelu(slopes) => {
            for px in row.chunks_exact_mut(cout) {
                for (v, s) in px.iter_mut().zip(slopes) {
                    *v = if *v < 0.0 { *v * s } else { *v };
                }
            }
        }
        Finish::Silu => row.iter_mut().for_each(|v| *v *= sigmoid::<FMA>(*v)),
        Finish::Mish => row.iter_mut().for_each(|v| *v = mish_of::<FMA>(*v)),
        Finish::Gelu => gelu_body::<FMA>(row),
        Finish::Plain
        | Finish::Residual(..)
        | Finish::Residuals(..)
        | Finish::Gate(_)
        | Finish::Modulate(_) => {}
    }
}

widest_simd! {
    /// SPAN's attention of `row` (the convolution's outputs) with `x`, in place.
    fn gate(row: &mut [f32], x: &[f32]) = fused gate_body
}

#[inline(always)]
fn gate_body<const FMA: bool>(row: &mut [f32], x: &[f32]) {
    for (v, &x) in row.iter_mut().zip(x) {
        *v = sigmoid_gate_of::<FMA>(*v, x);
    }
}

widest_simd! {
    /// RealPLKSR's element-wise attention of `row` (the convolution's outputs) with `x`, in
    /// place.
    fn modulate(row: &mut [f32], x: &[f32]) = fused modulate_body
}

#[inline(always)]
fn modulate_body<const FMA: bool>(row: &mut [f32], x: &[f32]) {
    for (v, &x) in row.iter_mut().zip(x) {
        *v = x * sigmoid::<FMA>(*v);
    }
}

widest_simd! {
    /// `Bᵀ d B` of one 6x6 input block (`pixels`, a channel vector each), each position's
    /// channels written to its row of `dst`.
    fn transform_input(pixels: &[&[f32]; 36], dst: &mut [&mut [f32]; 36]) = fused input_body
}

#[inline(always)]
fn input_body<const FMA: bool>(pixels: &[&[f32]; 36], dst: &mut [&mut [f32]; 36]) {
    let cin = pixels[0].len();
    assert!(pixels.iter().all(|p| p.len() == cin) && dst.iter().all(|d| d.len() == cin));
    let src = pixels.map(<[f32]>::as_ptr);
    let out: [*mut f32; 36] = std::array::from_fn(|e| dst[e].as_mut_ptr());
    let full = cin - cin % CH;
    // Bᵀ d of a chunk, reused by each (zeroed once per block, not per chunk).
    let mut t = [[0f32; CH]; 36];
    for c0 in (0..full).step_by(CH) {
        // SAFETY: every pixel and every row of dst holds cin values (asserted above);
        // c0 + CH <= cin.
        unsafe { input_chunk::<FMA>(&src, &out, c0, &mut t) };
    }
    if full < cin {
        // The last, partial chunk: its values copied beside zeros, transformed, copied out.
        let n = cin - full;
        let mut padded = [[0f32; CH]; 36];
        for (p, px) in padded.iter_mut().zip(pixels) {
            p[..n].copy_from_slice(&px[full..]);
        }
        let mut res = [[0f32; CH]; 36];
        let src = std::array::from_fn(|e| padded[e].as_ptr());
        let to: [*mut f32; 36] = std::array::from_fn(|e| res[e].as_mut_ptr());
        // SAFETY: CH values at each of the 36 rows of `padded` and of `res`.
        unsafe { input_chunk::<FMA>(&src, &to, 0, &mut t) };
        for (d, r) in dst.iter_mut().zip(&res) {
            d[full..].copy_from_slice(&r[..n]);
        }
    }
}

/// `Bᵀ d` of one column of six values, its scaled terms as [`fmadd`]s.
#[inline(always)]
fn bt_column<const FMA: bool>([d0, d1, d2, d3, d4, d5]: [f32; 6]) -> [f32; 6] {
    let f = fmadd::<FMA>;
    [
        f(4.0, d0, f(-5.0, d2, d4)),
        f(-4.0, d1 + d2, d3 + d4),
        f(4.0, d1 - d2, d4 - d3),
        f(2.0, d3 - d1, d4 - d2),
        f(2.0, d1 - d3, d4 - d2),
        f(4.0, d1, f(-5.0, d3, d5)),
    ]
}

/// `Bᵀ d B` of channels `c0..c0 + CH` of the 6x6 block whose rows start at `src`, each
/// position `e`'s CH values written at `dst[e] + c0`.
///
/// # Safety
/// Each `src[e]` and `dst[e]` holds `c0 + CH` values.
#[inline(always)]
unsafe fn input_chunk<const FMA: bool>(
    src: &[*const f32; 36],
    dst: &[*mut f32; 36],
    c0: usize,
    t: &mut [[f32; CH]; 36],
) {
    // Bᵀ down each column (into `t`), then along each row of the result.
    for j in 0..6 {
        // SAFETY: the caller's.
        let d: [&[f32; CH]; 6] =
            std::array::from_fn(|i| unsafe { &*src[i * 6 + j].add(c0).cast() });
        for l in 0..CH {
            let [d0, d1, d2, d3, d4, d5] = [d[0][l], d[1][l], d[2][l], d[3][l], d[4][l], d[5][l]];
            [
                t[j][l],
                t[6 + j][l],
                t[12 + j][l],
                t[18 + j][l],
                t[24 + j][l],
                t[30 + j][l],
            ] = bt_column::<FMA>([d0, d1, d2, d3, d4, d5]);
        }
    }
    for r in 0..6 {
        // SAFETY: the caller's: rows r * 6 .. r * 6 + 6 of dst.
        let o: [&mut [f32; CH]; 6] =
            std::array::from_fn(|s| unsafe { &mut *dst[r * 6 + s].add(c0).cast() });
        let d = &t[r * 6..r * 6 + 6];
        for l in 0..CH {
            let [d0, d1, d2, d3, d4, d5] = [d[0][l], d[1][l], d[2][l], d[3][l], d[4][l], d[5][l]];
            [o[0][l], o[1][l], o[2][l], o[3][l], o[4][l], o[5][l]] =
                bt_column::<FMA>([d0, d1, d2, d3, d4, d5]);
        }
    }
}

widest_simd! {
    /// `Aᵀ m A + bias` of one block's 6x6 sums (position `e` at `m[at + e * stride..]`): its
    /// 4x4 output pixels, row-major, into `y`.
    fn transform_output(m: &[f32], at: usize, stride: usize, bias: &[f32], y: &mut [f32]) = fused output_body
}

#[inline(always)]
fn output_body<const FMA: bool>(m: &[f32], at: usize, stride: usize, bias: &[f32], y: &mut [f32]) {
    let cout = bias.len();
    assert!(m.len() >= at + 35 * stride + cout && y.len() >= 16 * cout);
    let src: [*const f32; 36] = std::array::from_fn(|e| m[at + e * stride..].as_ptr());
    let full = cout - cout % CH;
    // Aᵀ m of a chunk, reused by each.
    let mut q = [[0f32; CH]; 24];
    for c0 in (0..full).step_by(CH) {
        // SAFETY: 36 rows of cout sums `stride` apart from `at` and 16 pixels of cout outputs
        // (asserted above); c0 + CH <= cout.
        unsafe {
            output_chunk::<FMA>(
                &src,
                c0,
                bias[c0..c0 + CH].try_into().unwrap(),
                y[c0..].as_mut_ptr(),
                cout,
                &mut q,
            )
        };
    }
    if full < cout {
        let n = cout - full;
        let mut padded = [[0f32; CH]; 37];
        for (e, p) in padded.iter_mut().take(36).enumerate() {
            p[..n].copy_from_slice(&m[at + e * stride + full..][..n]);
        }
        padded[36][..n].copy_from_slice(&bias[full..]);
        let mut out = [[0f32; CH]; 16];
        let src = std::array::from_fn(|e| padded[e].as_ptr());
        // SAFETY: CH values at each of the 36 rows of `padded` and the 16 of `out`.
        unsafe { output_chunk::<FMA>(&src, 0, &padded[36], out.as_mut_ptr().cast(), CH, &mut q) };
        for (p, o) in out.iter().enumerate() {
            y[p * cout + full..][..n].copy_from_slice(&o[..n]);
        }
    }
}

/// `Aᵀ m A + bias` of channels `c0..c0 + CH` of the 36 sums whose rows start at `src`,
/// output pixel `p`'s CH values written at `dst + p * ld`.
///
/// # Safety
/// Each `src[e]` holds `c0 + CH` values; `dst` 16 rows of CH values, `ld` apart.
#[inline(always)]
unsafe fn output_chunk<const FMA: bool>(
    src: &[*const f32; 36],
    c0: usize,
    bias: &[f32; CH],
    dst: *mut f32,
    ld: usize,
    q: &mut [[f32; CH]; 24],
) {
    // Aᵀ down each column (6 -> 4 rows, into `q`), then along each of the 4 rows (6 -> 4
    // values).
    for j in 0..6 {
        // SAFETY: the caller's.
        let m: [&[f32; CH]; 6] =
            std::array::from_fn(|i| unsafe { &*src[i * 6 + j].add(c0).cast() });
        for l in 0..CH {
            let [m0, m1, m2, m3, m4, m5] = [m[0][l], m[1][l], m[2][l], m[3][l], m[4][l], m[5][l]];
            let (a, b, c, d) = (m1 + m2, m3 + m4, m1 - m2, m3 - m4);
            q[j][l] = m0 + a + b;
            q[6 + j][l] = fmadd::<FMA>(2.0, d, c);
            q[12 + j][l] = fmadd::<FMA>(4.0, b, a);
            q[18 + j][l] = fmadd::<FMA>(8.0, d, c) + m5;
        }
    }
    for r in 0..4 {
        // SAFETY: the caller's: output pixels r * 4 .. r * 4 + 4.
        let o: [&mut [f32; CH]; 4] =
            std::array::from_fn(|c| unsafe { &mut *dst.add((r * 4 + c) * ld).cast() });
        let m = &q[r * 6..r * 6 + 6];
        for l in 0..CH {
            let [m0, m1, m2, m3, m4, m5] = [m[0][l], m[1][l], m[2][l], m[3][l], m[4][l], m[5][l]];
            let (a, b, c, d) = (m1 + m2, m3 + m4, m1 - m2, m3 - m4);
            o[0][l] = m0 + a + b + bias[l];
            o[1][l] = fmadd::<FMA>(2.0, d, c) + bias[l];
            o[2][l] = fmadd::<FMA>(4.0, b, a) + bias[l];
            o[3][l] = fmadd::<FMA>(8.0, d, c) + m5 + bias[l];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer's kernel from `9 cin x cout` taps.
    fn kernel(taps: Vec<f32>, cin: usize, cout: usize) -> Winograd {
        let taps = Tensor::from_vec(taps, (9 * cin, cout), &candle_core::Device::Cpu);
        Winograd::new(taps.expect("the taps' shape"), cin, cout).expect("f32 taps on the CPU")
    }

    /// The convolution in f64, straight from its definition.
    fn direct(
        x: &[f32],
        (batch, h, w, cin): (usize, usize, usize, usize),
        wt: &[f32],
        bias: &[f32],
    ) -> Vec<f64> {
        let cout = bias.len();
        let mut out = vec![0f64; batch * h * w * cout];
        for bi in 0..batch {
            for y in 0..h {
                for xx in 0..w {
                    for co in 0..cout {
                        let mut acc = f64::from(bias[co]);
                        for dy in 0..3 {
                            for dx in 0..3 {
                                let (sy, sx) =
                                    ((y + dy).wrapping_sub(1), (xx + dx).wrapping_sub(1));
                                if sy >= h || sx >= w {
                                    continue;
                                }
                                for ci in 0..cin {
                                    acc += f64::from(x[((bi * h + sy) * w + sx) * cin + ci])
                                        * f64::from(wt[((dy * 3 + dx) * cin + ci) * cout + co]);
                                }
                            }
                        }
                        out[((bi * h + y) * w + xx) * cout + co] = acc;
                    }
                }
            }
        }
        out
    }

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    /// The kernel a layer keeps from its second call, and the buffers a first call packs into
    /// after another layer's (of other widths) left them, give the same bits as a first call
    /// on fresh memory, on every ISA the CPU has.
    #[test]
    fn kept_and_reused_kernels_give_the_first_calls_bits() {
        if !panels::available() {
            eprintln!("skipped: no AVX2 here, the panel kernels do not run");
            return;
        }
        crate::ops::cpu::isa::on_each_isa(|| {
            let dims = (1, 9, 11);
            let (cin, cout) = (24, 40);
            let x = noise(9 * 11 * cin, 7, 1.0);
            let wt = noise(9 * cin * cout, 8, 0.2);
            let bias = noise(cout, 9, 0.5);
            let run = |w: &Winograd| w.forward(&x, dims, &bias, Finish::Plain);
            let fresh = run(&kernel(wt.clone(), cin, cout));
            // Another layer first, so that this thread's buffers hold its packings.
            let other = kernel(noise(9 * 16 * 56, 10, 0.2), 16, 56);
            other.forward(
                &noise(9 * 11 * 16, 11, 1.0),
                dims,
                &[0.0; 56],
                Finish::Plain,
            );
            let layer = kernel(wt.clone(), cin, cout);
            let calls = [run(&layer), run(&layer), run(&layer)];
            if layer.kept.get().is_none() {
                return Err("no kernel kept after three calls".to_string());
            }
            match calls.iter().position(|c| c != &fresh) {
                Some(i) => Err(format!("call {} differs from a fresh first call", i + 1)),
                None => Ok(()),
            }
        })
        .unwrap();
    }

    /// Against the f64 definition, on every ISA the CPU has: sizes that are and are not
    /// multiples of the 4x4 block (one pixel, one row), channel counts below, at and past a
    /// vector, batches of two. The error is measured against the sum of the products'
    /// magnitudes (what rounding scales with), and bounded at 64 f32 ulps of it.
    #[test]
    fn matches_the_direct_convolution_in_f64() {
        if !panels::available() {
            eprintln!("skipped: no AVX2 here, the panel kernels do not run");
            return;
        }
        let cases = [
            (1, 1, 1, 3, 5),
            (1, 4, 4, 16, 16),
            (2, 9, 7, 8, 33),
            (1, 13, 18, 64, 32),
            (1, 6, 21, 35, 48),
            (2, 8, 8, 17, 70),
        ];
        crate::ops::cpu::isa::on_each_isa(|| {
            for (seed, &(batch, h, w, cin, cout)) in cases.iter().enumerate() {
                let seed = seed as u64;
                let x = noise(batch * h * w * cin, seed + 1, 1.0);
                let wt = noise(9 * cin * cout, seed + 2, 0.2);
                let bias = noise(cout, seed + 3, 0.5);
                let got =
                    kernel(wt.clone(), cin, cout).forward(&x, (batch, h, w), &bias, Finish::Plain);
                let want = direct(&x, (batch, h, w, cin), &wt, &bias);
                // The magnitude the sum is built from: |x| · |w| summed, with |bias|.
                let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                let wa: Vec<f32> = wt.iter().map(|v| v.abs()).collect();
                let ba: Vec<f32> = bias.iter().map(|v| v.abs()).collect();
                let scale = direct(&xa, (batch, h, w, cin), &wa, &ba);
                let worst = got
                    .iter()
                    .zip(&want)
                    .zip(&scale)
                    .map(|((g, w), s)| (f64::from(*g) - w).abs() / s)
                    .fold(0f64, f64::max);
                if worst > 64.0 * f64::from(f32::EPSILON) {
                    return Err(format!(
                        "{batch}x{h}x{w}, {cin} -> {cout}: relative error {worst:e}"
                    ));
                }
            }
            Ok(())
        })
        .unwrap();
    }
}
