//! Channel ("transposed") attention on the CPU, as DAT's odd blocks run it: per head, the
//! `d` channels of q and k, each L2-normalised over all tokens of the image, give a `d x d`
//! score matrix (times the head's temperature); its softmax mixes the head's channels of v.
//! Two small products per head on the panels, straight from the qkv map, where candle's
//! graph transposes q, k and v, normalises them in three passes each and runs a softmax with
//! a scalar `exp`.

use candle_core::{Result, Tensor};
use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::{attention_probs, cpu_slice, panels};

/// `qkv`: `(B, N, 3C)` (q, k, v, each heads x head dim) on the CPU in f32, contiguous;
/// `temperature`: one per head; `eps`: the norms' floor (as `F.normalize` clamps them).
/// Returns `(B, N, C)`.
pub(crate) fn channel_attention(
    qkv: &Tensor,
    heads: usize,
    temperature: &[f32],
    eps: f32,
) -> Result<Tensor> {
    let (b, n, c3) = qkv.dims3()?;
    let c = c3 / 3;
    if c3 != 3 * c || heads == 0 || c % heads != 0 || temperature.len() != heads {
        candle_core::bail!("channel attention: qkv {:?} for {heads} heads", qkv.dims());
    }
    let d = c / heads;
    let (guard, layout) = qkv.storage_and_layout();
    let data = cpu_slice(&guard, layout)?;
    let mut out: Vec<f32> = Vec::with_capacity(b * n * c);
    let spare = &mut out.spare_capacity_mut()[..b * n * c];
    // Many small images (OmniSR's groups of a window's tokens) one per task; a few large
    // ones (DAT's whole maps) each split across the threads. Either way the same values.
    if b >= 2 * rayon::current_num_threads() {
        data.par_chunks_exact(n * c3)
            .zip(spare.par_chunks_exact_mut(n * c))
            .for_each(|(image, out)| {
                attend_image(image, (n, c, heads, d), temperature, eps, out, false)
            });
    } else {
        for (image, out) in data.chunks_exact(n * c3).zip(spare.chunks_exact_mut(n * c)) {
            attend_image(image, (n, c, heads, d), temperature, eps, out, true);
        }
    }
    // SAFETY: `attend_image` wrote every value of each image (all heads' columns of all rows).
    unsafe { out.set_len(b * n * c) };
    drop(guard);
    Tensor::from_vec(out, (b, n, c), qkv.device())
}

/// One image's channel attention: `qkv` `n` rows of `3c`, into `out` `n` rows of `c`; its
/// heads and row blocks as parallel tasks when `parallel`.
fn attend_image(
    qkv: &[f32],
    (n, c, heads, d): (usize, usize, usize, usize),
    temperature: &[f32],
    eps: f32,
    out: &mut [MaybeUninit<f32>],
    parallel: bool,
) {
    let c3 = 3 * c;
    // Per head, one task: scores = (q̂ · k̂ᵀ) · temperature, softmax; then out = v · pᵀ.
    let mut probs_t = vec![0f32; heads * d * d];
    let head = |(h, probs_t): (usize, &mut [f32])| {
        // The head's kᵀ (channel-major, in registers 16 x 16 at a time) for the score
        // product's left operand: the product gives the scores transposed, q is read in
        // place. Each task transposes and measures its own head's channels.
        let mut k_t = vec![0f32; d * n];
        panels::transpose((&qkv[c + h * d..], c3), (n, d), (&mut k_t, n));
        let mut q_inv = vec![0f32; d];
        squares_of_q(&qkv[h * d..], (c3, d), &mut q_inv);
        let mut k_inv = vec![0f32; d];
        squares_of_rows(&k_t, n, &mut k_inv);
        for s in q_inv.iter_mut().chain(k_inv.iter_mut()) {
            *s = 1.0 / s.sqrt().max(eps);
        }
        let mut scores_t = vec![0f32; d * d];
        let rhs = panels::Rhs::Strided {
            ptr: qkv[h * d..].as_ptr(),
            k: n,
            n: d,
            ld: c3,
        };
        // SAFETY: kᵀ holds d rows of n values; q's head holds n rows of d values c3
        // apart inside `qkv`; `scores_t` is d x d and this task's own.
        unsafe {
            panels::gemm(
                d,
                (k_t.as_ptr(), n),
                rhs,
                (scores_t.as_mut_ptr(), d),
                panels::Start::ZERO,
                false,
                None,
            )
        };
        let mut scores = vec![0f32; d * d];
        for (i, row) in scores.chunks_exact_mut(d).enumerate() {
            let qi = q_inv[i];
            for (j, s) in row.iter_mut().enumerate() {
                *s = scores_t[j * d + i] * qi * k_inv[j] * temperature[h];
            }
        }
        attention_probs(&mut scores, None, None, d, None);
        for (i, row) in scores.chunks_exact(d).enumerate() {
            for (j, &p) in row.iter().enumerate() {
                probs_t[j * d + i] = p;
            }
        }
    };
    if parallel {
        probs_t.par_chunks_mut(d * d).enumerate().for_each(head);
    } else {
        probs_t.chunks_mut(d * d).enumerate().for_each(head);
    }

    // out[t, h*d + i] = Σ_j v[t, h*d + j] · p[i, j]: each head's d columns of every row, the
    // rows in blocks across threads.
    let rows_per = 256;
    // SAFETY: each task writes its own rows of `out` (its d columns of them per head) and
    // reads `qkv` and `probs_t`, all of which outlive the tasks.
    let shared = unsafe { Shared::new(out.as_mut_ptr().cast::<f32>()) };
    let block = |block: usize| {
        let t0 = block * rows_per;
        let rows = rows_per.min(n - t0);
        for h in 0..heads {
            let rhs = panels::Rhs::Strided {
                ptr: probs_t[h * d * d..].as_ptr(),
                k: d,
                n: d,
                ld: d,
            };
            // SAFETY: v's head holds `rows` rows of d values c3 apart from row t0 inside
            // `qkv`; pᵀ is d x d; the destination is rows t0.. of out, the head's d columns,
            // c apart, written (never read) by this task only.
            unsafe {
                panels::gemm(
                    rows,
                    (qkv[t0 * c3 + 2 * c + h * d..].as_ptr(), c3),
                    rhs,
                    (shared.get().add(t0 * c + h * d), c),
                    panels::Start::ZERO,
                    false,
                    None,
                )
            };
        }
    };
    if parallel {
        (0..n.div_ceil(rows_per)).into_par_iter().for_each(block);
    } else {
        (0..n.div_ceil(rows_per)).for_each(block);
    }
}

/// The squares of each of the first `d` values of the rows of `rows` (rows `ld` apart),
/// summed over the rows in row order, into `out`.
#[inline(always)]
fn squares_of_q_body(rows: &[f32], (ld, d): (usize, usize), out: &mut [f32]) {
    for row in rows.chunks(ld) {
        for (s, &v) in out.iter_mut().zip(&row[..d]) {
            *s += v * v;
        }
    }
}

crate::ops::cpu::widest_simd! {
    fn squares_of_q(rows: &[f32], shape: (usize, usize), out: &mut [f32]) = squares_of_q_body
}

/// The sum of squares of each length-`n` row of `data`, into `out`, in 16 lanes.
#[inline(always)]
fn squares_of_rows_body(data: &[f32], n: usize, out: &mut [f32]) {
    for (row, s) in data.chunks_exact(n).zip(out.iter_mut()) {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for chunk in &mut chunks {
            for (l, &v) in lanes.iter_mut().zip(chunk) {
                *l += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        *s = lanes.iter().sum::<f32>() + tail;
    }
}

crate::ops::cpu::widest_simd! {
    fn squares_of_rows(data: &[f32], n: usize, out: &mut [f32]) = squares_of_rows_body
}
