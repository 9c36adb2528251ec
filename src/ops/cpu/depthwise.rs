//! DAT's per-token element-wise work on the CPU, each in one parallel pass over the map: the
//! channels-last depthwise 3x3 convolution with what follows it (GELU, or the product with the
//! other half of the feed-forward's hidden features), and the adaptive interaction's gated
//! sum. candle's graph makes two passes per tap (a broadcast product, then a sum) for the
//! convolution and four for the sum, each followed by its thread pool's spin.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::math::gelu_body;
use crate::ops::norm::cpu::RowNorm;

/// An f32 map read in place: element `(t, c)` of token `t` is `data[t * ld + offset + c]`
/// (a channel range of a wider projection, such as the v of a qkv map).
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub data: &'a [f32],
    pub ld: usize,
    pub offset: usize,
}

impl<'a> Rows<'a> {
    /// Token `t` at `data[t * ld + offset..]`.
    pub(crate) fn new(data: &'a [f32], ld: usize, offset: usize) -> Self {
        Self { data, ld, offset }
    }

    /// Token `t`'s `c` channels.
    fn token(&self, t: usize, c: usize) -> &'a [f32] {
        &self.data[t * self.ld + self.offset..][..c]
    }
}

/// What the convolution's sums go through before they are stored.
#[derive(Clone, Copy)]
pub(crate) enum Then<'a> {
    /// Nothing: the sums as they are.
    Identity,
    /// The exact GELU.
    Gelu,
    /// Times the same token's channels of these rows.
    Times(Rows<'a>),
}

/// The depthwise 3x3 convolution (zero padding 1) of `input`, `b` maps of `h x w` tokens of
/// `c` channels, with taps `(9, c)` (tap `dy * 3 + dx`) and `bias` `(c)`: each output is the
/// bias plus the taps' products in tap order, as candle's graph adds them. Returns the
/// `(b, h, w, c)` result, contiguous.
pub(crate) fn depthwise3x3(
    input: Rows,
    dims: (usize, usize, usize, usize),
    weights: (&[f32], &[f32]),
    then: Then,
) -> Vec<f32> {
    depthwise_rows::<3, { TOKENS + 2 }>(input, dims, weights, then)
}

/// [`depthwise3x3`] for a `K x K` kernel (zero padding `K / 2`; `SPAN` = `TOKENS + K - 1`),
/// taps `(K * K, c)` (tap `dy * K + dx`): output rows in parallel.
fn depthwise_rows<const K: usize, const SPAN: usize>(
    input: Rows,
    (b, h, w, c): (usize, usize, usize, usize),
    (taps, bias): (&[f32], &[f32]),
    then: Then,
) -> Vec<f32> {
    assert!(taps.len() == K * K * c && bias.len() == c);
    if b * h * w * c == 0 {
        return Vec::new();
    }
    let zeros = vec![0f32; c];
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(w * c)
            .enumerate()
            .for_each(|(row, out)| {
                let (image, y) = (row / h, row % h);
                // The input rows under the taps, absent outside the map.
                let rows = std::array::from_fn(|dy| {
                    (y + dy)
                        .checked_sub(K / 2)
                        .filter(|&yy| yy < h)
                        .map(|yy| (image * h + yy) * w)
                });
                let geometry = Row {
                    w,
                    c,
                    rows,
                    zeros: &zeros,
                };
                depthwise_row::<K, SPAN>(out, &geometry, input, (taps, bias), then, row * w);
            });
    };
    // SAFETY: every row was handed to `depthwise_row`, which writes all of it.
    unsafe { filled(b * h * w * c, fill) }
}

/// [`depthwise3x3`] of the layer norm of `input` (`norm`, over its `c` channels), without
/// the normalised map: each task normalises its rows of the input, and the row on either
/// side, into a ring of three rows as the convolution reaches them. The values are those of
/// [`depthwise3x3`] on the normalised map, bit for bit.
pub(crate) fn depthwise3x3_of_norm(
    input: Rows,
    norm: &RowNorm,
    (b, h, w, c): (usize, usize, usize, usize),
    (taps, bias): (&[f32], &[f32]),
    then: Then,
) -> Vec<f32> {
    assert!(taps.len() == 9 * c && bias.len() == c);
    let zeros = vec![0f32; c];
    // Bands of rows: each normalises two rows more than it convolves.
    let band = BAND_ROWS.min(h);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(h * w * c)
            .enumerate()
            .for_each(|(image, out)| {
                out.par_chunks_mut(band * w * c)
                    .enumerate()
                    .for_each(|(k, out)| {
                        let y0 = k * band;
                        let mut ring = vec![0f32; 3 * w * c];
                        let slot = |y: usize| (y % 3) * w;
                        let normalise = |ring: &mut [f32], y: usize| {
                            for x in 0..w {
                                let src = input.token((image * h + y) * w + x, c);
                                let dst = &mut ring[(slot(y) + x) * c..][..c];
                                // SAFETY: MaybeUninit<f32> has f32's layout, and the norm writes
                                // only initialised values.
                                let dst =
                                    unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
                                norm.row(src, dst);
                            }
                        };
                        if y0 > 0 {
                            normalise(&mut ring, y0 - 1);
                        }
                        normalise(&mut ring, y0);
                        for (dy, out) in out.chunks_mut(w * c).enumerate() {
                            let y = y0 + dy;
                            if y + 1 < h {
                                normalise(&mut ring, y + 1);
                            }
                            let geometry = Row {
                                w,
                                c,
                                rows: [
                                    y.checked_sub(1).map(slot),
                                    Some(slot(y)),
                                    (y + 1 < h).then(|| slot(y + 1)),
                                ],
                                zeros: &zeros,
                            };
                            let normed = Rows::new(&ring, c, 0);
                            let first = (image * h + y) * w;
                            depthwise_row::<3, { TOKENS + 2 }>(
                                out,
                                &geometry,
                                normed,
                                (taps, bias),
                                then,
                                first,
                            );
                        }
                    });
            });
    };
    // SAFETY: every row was handed to `depthwise_row`, which writes all of it.
    unsafe { filled(b * h * w * c, fill) }
}

/// Rows a task of [`depthwise3x3_of_norm`] convolves.
const BAND_ROWS: usize = 8;

/// One output row's geometry: its width, channels, the first token of each of the `K` input
/// rows under the taps (none outside the map), and `c` zeros for the taps outside the map.
struct Row<'a, const K: usize> {
    w: usize,
    c: usize,
    rows: [Option<usize>; K],
    zeros: &'a [f32],
}

/// [`depthwise_row`] on vectors of type `V`, for a `K x K` kernel; `SPAN` is `TOKENS + K - 1`,
/// the input tokens of a row under a group's taps.
///
/// # Safety
/// The CPU has `V`'s instructions.
#[inline(always)]
unsafe fn depthwise_row_body<V: Vector, const K: usize, const SPAN: usize>(
    out: &mut [MaybeUninit<f32>],
    g: &Row<K>,
    input: Rows,
    (taps, bias): (&[f32], &[f32]),
    then: Then,
    first: usize,
) {
    let (w, c, r) = (g.w, g.c, K / 2);
    assert!(SPAN == TOKENS + K - 1 && K % 2 == 1);
    assert!(out.len() == w * c && taps.len() == K * K * c && bias.len() == c && g.zeros.len() >= c);
    let other = match then {
        Then::Times(other) => Some(other),
        Then::Gelu | Then::Identity => None,
    };
    // TOKENS tokens at a time, each vector of channels through all of them before the next.
    // A token's sum is a chain of dependent adds in tap order; the tokens' chains are
    // independent, so the core overlaps them, and each input row's SPAN vectors under the
    // taps, and each tap vector, are loaded once for all of them. One token at a time ran at
    // about a seventh of the core's rate, waiting on each chain and reloading every input
    // vector K times. The tokens whose taps reach outside the row go one by one.
    let mut x = 0;
    while x < w {
        let n = if x >= r && x + TOKENS + r <= w {
            TOKENS
        } else {
            1
        };
        // The values the next tokens read that no earlier token brought into cache (the row
        // below's, and the product's) come from far away: asked for now, their misses
        // overlap these sums instead of stalling the next ones.
        for x in x + n..(x + 2 * n).min(w) {
            if let Some(start) = g.rows[K - 1].filter(|_| x + r < w) {
                prefetch(input.token(start + x + r, c));
            }
            if let Some(other) = other {
                prefetch(other.token(first + x, c));
            }
        }
        // SAFETY: forwarded to the caller (the instructions); the slices are as asserted
        // above, and an interior group's taps stay inside the row.
        unsafe {
            if n == TOKENS {
                interior::<V, K, SPAN>(out, g, input, (taps, bias), other, first, x);
            } else {
                token::<V, K>(out, g, input, (taps, bias), other, first, x);
            }
        }
        x += n;
    }
    if let Then::Gelu = then {
        // SAFETY: MaybeUninit<f32> has f32's layout, and the loops above wrote every value of
        // the row (each channel of each token, by exactly one `token` or `interior`).
        let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len()) };
        if V::FMA {
            gelu_body::<true>(out);
        } else {
            gelu_body::<false>(out);
        }
    }
}

/// Runs `$body` with `$c0` and `$n` bound to each run of channels `c0..c0 + n` of `$c`:
/// `V::W` at a time (a constant `n`, so the part masks fold away), then the rest as one
/// part-vector. A macro rather than a closure: a closure is compiled without the instruction
/// set of the function it sits in, and would call every intrinsic instead of inlining it.
macro_rules! lanes {
    ($v:ty, $c:expr, |$c0:ident, $n:ident| $body:block) => {{
        let c = $c;
        let mut $c0 = 0;
        while $c0 + <$v>::W <= c {
            let $n = <$v>::W;
            $body
            $c0 += <$v>::W;
        }
        if $c0 < c {
            let $n = c - $c0;
            $body
        }
    }};
}

/// Tokens [`depthwise_row`] sums side by side.
const TOKENS: usize = 4;

/// Every channel of token `x` of one output row: the bias plus the `K x K` taps' products
/// (each rounded, then added in tap order, as the graph's separate multiply and add do;
/// zeros outside the map, as its padding adds them), times the same channels of `other`'s
/// token where given.
///
/// # Safety
/// The CPU has `V`'s instructions; `out` holds `g.w * g.c` values, `taps` `K * K * g.c`,
/// `bias` and `g.zeros` at least `g.c`.
#[inline(always)]
unsafe fn token<V: Vector, const K: usize>(
    out: &mut [MaybeUninit<f32>],
    g: &Row<K>,
    input: Rows,
    (taps, bias): (&[f32], &[f32]),
    other: Option<Rows>,
    first: usize,
    x: usize,
) {
    let c = g.c;
    // The input token under tap `dx` of row `dy`, zeros outside the map.
    let source = |dy: usize, dx: usize| {
        let xx = (x + dx).checked_sub(K / 2).filter(|&xx| xx < g.w);
        match (g.rows[dy], xx) {
            (Some(start), Some(xx)) => input.token(start + xx, c).as_ptr(),
            _ => g.zeros.as_ptr(),
        }
    };
    let sources: [[*const f32; K]; K] =
        std::array::from_fn(|dy| std::array::from_fn(|dx| source(dy, dx)));
    let other = other.map(|o| o.token(first + x, c).as_ptr());
    let out: *mut f32 = out[x * c..][..c].as_mut_ptr().cast();
    let (taps, bias) = (taps.as_ptr(), bias.as_ptr());
    // SAFETY: every pointer above starts `c` readable values (`out` `c` writable ones),
    // `taps` holds `K * K` rows of `c`, and the vectors end at `c`; the instructions are the
    // caller's.
    unsafe {
        lanes!(V, c, |c0, n| {
            let mut sum = V::load(bias.add(c0), n);
            for (dy, row) in sources.iter().enumerate() {
                for (dx, source) in row.iter().enumerate() {
                    let t = V::load(taps.add((dy * K + dx) * c + c0), n);
                    sum = sum.add(V::load(source.add(c0), n).mul(t));
                }
            }
            if let Some(o) = other {
                sum = sum.mul(V::load(o.add(c0), n));
            }
            sum.store(out.add(c0), n);
        });
    }
}

/// Tokens `x..x + TOKENS` of one output row, as [`token`] makes each, where every tap is
/// inside the row (`x >= K / 2`, `x + TOKENS + K / 2 <= g.w`): each input row's `SPAN`
/// tokens under the taps are a stride apart (an absent row is the zeros, repeated).
///
/// # Safety
/// As [`token`].
#[inline(always)]
unsafe fn interior<V: Vector, const K: usize, const SPAN: usize>(
    out: &mut [MaybeUninit<f32>],
    g: &Row<K>,
    input: Rows,
    (taps, bias): (&[f32], &[f32]),
    other: Option<Rows>,
    first: usize,
    x: usize,
) {
    let (c, r) = (g.c, K / 2);
    assert!(x >= r && x + TOKENS + r <= g.w);
    // Each input row's token under the first token's left tap, and the stride to the next:
    // the last one read, `SPAN - 1` strides on, is a token of the same row.
    let rows: [(*const f32, usize); K] = std::array::from_fn(|dy| match g.rows[dy] {
        Some(start) => {
            let _last = input.token(start + x - r + SPAN - 1, c);
            (input.token(start + x - r, c).as_ptr(), input.ld)
        }
        None => (g.zeros.as_ptr(), 0),
    });
    let other = other.map(|o| {
        let _last = o.token(first + x + TOKENS - 1, c);
        (o.token(first + x, c).as_ptr(), o.ld)
    });
    let out: *mut f32 = out[x * c..][..TOKENS * c].as_mut_ptr().cast();
    let (taps, bias) = (taps.as_ptr(), bias.as_ptr());
    // SAFETY: every pointer above starts `c` readable values at each of its strides used
    // (`out` `TOKENS * c` writable ones), `taps` holds `K * K` rows of `c`, and the vectors
    // end at `c`; the instructions are the caller's.
    unsafe {
        lanes!(V, c, |c0, n| {
            let mut sums = [V::load(bias.add(c0), n); TOKENS];
            for (dy, &(row, ld)) in rows.iter().enumerate() {
                let v: [V; SPAN] = std::array::from_fn(|j| V::load(row.add(j * ld + c0), n));
                for dx in 0..K {
                    let t = V::load(taps.add((dy * K + dx) * c + c0), n);
                    for (k, sum) in sums.iter_mut().enumerate() {
                        *sum = sum.add(v[k + dx].mul(t));
                    }
                }
            }
            for (k, sum) in sums.into_iter().enumerate() {
                let sum = match other {
                    Some((o, ld)) => sum.mul(V::load(o.add(k * ld + c0), n)),
                    None => sum,
                };
                sum.store(out.add(k * c + c0), n);
            }
        });
    }
}

/// The vector operations of [`depthwise_row`]: the first `n` of `W` f32 lanes (`n == W` but
/// for a row's last channels), loaded and stored unaligned; a load's other lanes are zeros.
/// Each is `unsafe` for its pointer and its instructions, and inlined into a function
/// compiled for them.
trait Vector: Copy {
    const W: usize;
    /// Whether the CPU that runs these has FMA (for the GELU that may follow).
    const FMA: bool;
    /// All `W` lanes.
    unsafe fn full(p: *const f32) -> Self;
    /// The first `n < W` lanes.
    unsafe fn part(p: *const f32, n: usize) -> Self;
    unsafe fn store_full(self, p: *mut f32);
    unsafe fn store_part(self, p: *mut f32, n: usize);
    unsafe fn add(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;

    #[inline(always)]
    unsafe fn load(p: *const f32, n: usize) -> Self {
        // SAFETY: the caller's.
        unsafe {
            if n == Self::W {
                Self::full(p)
            } else {
                Self::part(p, n)
            }
        }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32, n: usize) {
        // SAFETY: the caller's.
        unsafe {
            if n == Self::W {
                self.store_full(p)
            } else {
                self.store_part(p, n)
            }
        }
    }
}

impl Vector for f32 {
    const W: usize = 1;
    const FMA: bool = cfg!(target_arch = "aarch64");
    #[inline(always)]
    unsafe fn full(p: *const f32) -> Self {
        // SAFETY: the caller's.
        unsafe { *p }
    }
    unsafe fn part(_: *const f32, _: usize) -> Self {
        unreachable!("a part of one lane")
    }
    #[inline(always)]
    unsafe fn store_full(self, p: *mut f32) {
        // SAFETY: the caller's.
        unsafe { *p = self }
    }
    unsafe fn store_part(self, _: *mut f32, _: usize) {
        unreachable!("a part of one lane")
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        self + o
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        self * o
    }
}

#[cfg(target_arch = "x86_64")]
mod vectors {
    use std::arch::x86_64::*;

    use super::Vector;

    /// 16 lanes of AVX-512.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(__m512);

    /// 8 lanes of AVX2.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(__m256);

    /// Lanes `0..n` of 16 set.
    #[inline(always)]
    fn mask16(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// Lanes `0..n` of 8 set.
    #[inline(always)]
    unsafe fn mask8(n: usize) -> __m256i {
        let lanes = unsafe { _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7) };
        unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes) }
    }

    // SAFETY (every method): the caller's: the pointer's lanes (all, or the first `n`) are in
    // bounds, and the CPU has the instructions. The masked forms touch no lane outside the
    // mask.
    impl Vector for Avx512 {
        const W: usize = 16;
        const FMA: bool = true;
        #[inline(always)]
        unsafe fn full(p: *const f32) -> Self {
            unsafe { Self(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn part(p: *const f32, n: usize) -> Self {
            unsafe { Self(_mm512_maskz_loadu_ps(mask16(n), p)) }
        }
        #[inline(always)]
        unsafe fn store_full(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn store_part(self, p: *mut f32, n: usize) {
            unsafe { _mm512_mask_storeu_ps(p, mask16(n), self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            unsafe { Self(_mm512_add_ps(self.0, o.0)) }
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            unsafe { Self(_mm512_mul_ps(self.0, o.0)) }
        }
    }

    impl Vector for Avx2 {
        const W: usize = 8;
        const FMA: bool = true;
        #[inline(always)]
        unsafe fn full(p: *const f32) -> Self {
            unsafe { Self(_mm256_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn part(p: *const f32, n: usize) -> Self {
            unsafe { Self(_mm256_maskload_ps(p, mask8(n))) }
        }
        #[inline(always)]
        unsafe fn store_full(self, p: *mut f32) {
            unsafe { _mm256_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn store_part(self, p: *mut f32, n: usize) {
            unsafe { _mm256_maskstore_ps(p, mask8(n), self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            unsafe { Self(_mm256_add_ps(self.0, o.0)) }
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            unsafe { Self(_mm256_mul_ps(self.0, o.0)) }
        }
    }
}

/// Asks for the cache lines of `values` (a hint: no effect on what is computed).
#[inline(always)]
fn prefetch(values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..values.len()).step_by(64 / size_of::<f32>()) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch reads nothing and never faults; the address is inside `values`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().add(i).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// One output row of the depthwise `K x K` convolution (`SPAN` = `TOKENS + K - 1`): tokens
/// `first..first + g.w` of the output, from `input`'s rows `g.rows`, then `then`.
fn depthwise_row<const K: usize, const SPAN: usize>(
    out: &mut [MaybeUninit<f32>],
    g: &Row<K>,
    input: Rows,
    weights: (&[f32], &[f32]),
    then: Then,
    first: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::{cpu_isa, CpuIsa};
        match cpu_isa() {
            // SAFETY: `cpu_isa` never names more than the CPU has.
            CpuIsa::Avx512 => {
                return unsafe { row_avx512::<K, SPAN>(out, g, input, weights, then, first) }
            }
            // SAFETY: as above.
            CpuIsa::Avx2 => {
                return unsafe { row_avx2::<K, SPAN>(out, g, input, weights, then, first) }
            }
            CpuIsa::Scalar => {}
        }
    }
    // SAFETY: plain f32 needs no instruction beyond the target's.
    unsafe { depthwise_row_body::<f32, K, SPAN>(out, g, input, weights, then, first) }
}

/// Defines `$name`, [`depthwise_row`] compiled for `$features` on vectors `$v`.
macro_rules! row_for {
    ($name:ident, $features:literal, $v:ty) => {
        /// [`depthwise_row`] compiled for the instructions its name gives.
        ///
        /// # Safety
        /// The CPU has those instructions.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<const K: usize, const SPAN: usize>(
            out: &mut [MaybeUninit<f32>],
            g: &Row<K>,
            input: Rows,
            weights: (&[f32], &[f32]),
            then: Then,
            first: usize,
        ) {
            // SAFETY: compiled for the instructions the caller checked.
            unsafe { depthwise_row_body::<$v, K, SPAN>(out, g, input, weights, then, first) }
        }
    };
}

row_for!(row_avx512, "avx512f", vectors::Avx512);
row_for!(row_avx2, "avx2,fma", vectors::Avx2);

/// A gate of [`gated_sum`]: one value per image and channel, or one per token.
#[derive(Clone, Copy)]
pub(crate) enum Gate<'a> {
    /// `(b, c)`.
    Channel(&'a [f32]),
    /// `(b, tokens)`.
    Token(&'a [f32]),
}

/// `a · ga + x · gx` of `b` images of `tokens` tokens of `c` channels, each gate broadcast as
/// its kind says: the adaptive interaction's mix of the attention and the convolution.
pub(crate) fn gated_sum(
    (a, ga): (&[f32], Gate),
    (x, gx): (&[f32], Gate),
    (b, tokens, c): (usize, usize, usize),
) -> Vec<f32> {
    let n = b * tokens * c;
    assert!(a.len() == n && x.len() == n);
    // A few dozen tokens a task.
    let per = 64;
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(per * c)
            .enumerate()
            .for_each(|(chunk, out)| {
                let t0 = chunk * per;
                let span = t0 * c..t0 * c + out.len();
                gated_rows(out, (&a[span.clone()], ga), (&x[span], gx), (t0, tokens, c));
            });
    };
    // SAFETY: every value was handed to `gated_rows`, which writes each of its tokens' values.
    unsafe { filled(n, fill) }
}

/// A new buffer of `n` values written by `fill`: never zeroed first, which would be a pass of
/// its own.
///
/// # Safety
/// `fill` writes every one of the `n` values of the slice it is given.
unsafe fn filled(n: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(n);
    if n > 0 {
        fill(&mut out.spare_capacity_mut()[..n]);
    }
    // SAFETY: the caller's contract: all n values were written.
    unsafe { out.set_len(n) };
    out
}

#[inline(always)]
fn gated_rows_body(
    out: &mut [MaybeUninit<f32>],
    (a, ga): (&[f32], Gate),
    (x, gx): (&[f32], Gate),
    (t0, tokens, c): (usize, usize, usize),
) {
    for (i, ((o, a), x)) in out
        .chunks_exact_mut(c)
        .zip(a.chunks_exact(c))
        .zip(x.chunks_exact(c))
        .enumerate()
    {
        let t = t0 + i;
        match (ga, gx) {
            (Gate::Channel(ga), Gate::Token(gx)) => {
                let (ga, gx) = (&ga[(t / tokens) * c..][..c], gx[t]);
                for (((o, &a), &x), &g) in o.iter_mut().zip(a).zip(x).zip(ga) {
                    o.write(a * g + x * gx);
                }
            }
            (Gate::Token(ga), Gate::Channel(gx)) => {
                let (ga, gx) = (ga[t], &gx[(t / tokens) * c..][..c]);
                for (((o, &a), &x), &g) in o.iter_mut().zip(a).zip(x).zip(gx) {
                    o.write(a * ga + x * g);
                }
            }
            (ga, gx) => {
                for (j, ((o, &a), &x)) in o.iter_mut().zip(a).zip(x).enumerate() {
                    o.write(a * gate(ga, t, tokens, c, j) + x * gate(gx, t, tokens, c, j));
                }
            }
        }
    }
}

#[inline(always)]
fn gate(g: Gate, t: usize, tokens: usize, c: usize, j: usize) -> f32 {
    match g {
        Gate::Channel(v) => v[(t / tokens) * c + j],
        Gate::Token(v) => v[t],
    }
}

widest_simd! {
    fn gated_rows(
        out: &mut [MaybeUninit<f32>],
        a: (&[f32], Gate),
        x: (&[f32], Gate),
        geometry: (usize, usize, usize),
    ) = gated_rows_body
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The convolution by its definition in f64, over a map embedded in wider rows.
    #[test]
    fn depthwise_matches_its_definition() {
        // On every instruction set the CPU runs (scalar, AVX2, AVX-512); 83 channels: one run
        // of 64, one of 16 and a tail of 3.
        crate::ops::cpu::isa::on_each_isa(|| {
            for (c, ld, off) in [(19, 40, 13), (83, 100, 17)] {
                depthwise_case(c, ld, off);
            }
            Ok::<(), ()>(())
        })
        .expect("every case checked");
    }

    fn depthwise_case(c: usize, ld: usize, off: usize) {
        // 11 tokens a row: the first alone, two groups of four, the last two alone.
        let (b, h, w) = (2, 5, 11);
        let data = noise(b * h * w * ld, 1);
        let taps = noise(9 * c, 2);
        let bias = noise(c, 3);
        let other = noise(b * h * w * c, 4);
        let input = Rows {
            data: &data,
            ld,
            offset: off,
        };
        let times = Rows::new(&other, c, 0);
        for (which, then) in [Then::Gelu, Then::Times(times)].into_iter().enumerate() {
            let got = depthwise3x3(input, (b, h, w, c), (&taps, &bias), then);
            for (i, &g) in got.iter().enumerate() {
                let (t, ch) = (i / c, i % c);
                let (im, y, x) = (t / (h * w), (t / w) % h, t % w);
                let mut want = bias[ch] as f64;
                for dy in 0..3 {
                    for dx in 0..3 {
                        let (yy, xx) = (y as isize + dy - 1, x as isize + dx - 1);
                        if yy < 0 || xx < 0 || yy >= h as isize || xx >= w as isize {
                            continue;
                        }
                        let s = ((im * h + yy as usize) * w + xx as usize) * ld + off + ch;
                        want += data[s] as f64 * taps[(dy * 3 + dx) as usize * c + ch] as f64;
                    }
                }
                let want = match which {
                    0 => 0.5 * want * (1.0 + libm_erf(want / std::f64::consts::SQRT_2)),
                    _ => want * other[i] as f64,
                };
                assert!((g as f64 - want).abs() < 2e-6, "{which} {i}: {g} vs {want}");
            }
        }
    }

    /// The convolution that normalises as it reads gives the bits of the norm's pass followed
    /// by the convolution, across band edges (19 rows: bands of 8, 8 and 3), a single row and
    /// a last band of one row, on every instruction set.
    #[test]
    fn depthwise_of_norm_is_the_convolution_of_the_normalised_map() -> candle_core::Result<()> {
        use crate::ops::norm::{cpu::with_row_norm, layer_norm, Norm};
        use candle_core::{Device, Tensor};
        crate::ops::cpu::isa::on_each_isa(|| {
            let (c, ld, off) = (83, 200, 100);
            let cpu = Device::Cpu;
            let weight = Tensor::from_vec(noise(c, 11), c, &cpu)?;
            let bias = Tensor::from_vec(noise(c, 12), c, &cpu)?;
            let norm = Norm::new(&crate::ops::pad::Pad::OFF.one(c), weight, bias, 1e-5)?;
            let (taps, tap_bias) = (noise(9 * c, 2), noise(c, 3));
            for (b, h, w) in [(2, 19, 7), (1, 1, 5), (1, 9, 4)] {
                // Far from zero, so that the norm matters.
                let data: Vec<f32> = noise(b * h * w * ld, 1).iter().map(|v| 3.0 + v).collect();
                let other = noise(b * h * w * c, 4);
                let map = Tensor::from_vec(data.clone(), (b, h, w, ld), &cpu)?;
                let normed = layer_norm(&norm, &map.narrow(3, off, c)?.contiguous()?)?;
                let normed = normed.flatten_all()?.to_vec1::<f32>()?;
                let input = Rows {
                    data: &data,
                    ld,
                    offset: off,
                };
                let times = Rows::new(&other, c, 0);
                for then in [Then::Gelu, Then::Times(times)] {
                    let want = depthwise3x3(
                        Rows::new(&normed, c, 0),
                        (b, h, w, c),
                        (&taps, &tap_bias),
                        then,
                    );
                    let got = with_row_norm(&norm, c, |n| {
                        depthwise3x3_of_norm(input, n, (b, h, w, c), (&taps, &tap_bias), then)
                    })?;
                    assert_eq!(got.as_ref(), Some(&want), "{b}x{h}x{w}");
                }
            }
            Ok(())
        })
    }

    /// erf by its series (plenty for |x| < 6 at the accuracy checked).
    pub(crate) fn libm_erf(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        for k in 1..200 {
            term *= -x * x / k as f64;
            sum += term / (2 * k + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gated_sum_broadcasts_each_gate_by_its_kind() {
        let (b, tokens, c) = (2, 70, 5);
        let n = b * tokens * c;
        let (a, x) = (noise(n, 5), noise(n, 6));
        let (gc, gt) = (noise(b * c, 7), noise(b * tokens, 8));
        for (ga, gx) in [
            (Gate::Channel(&gc), Gate::Token(&gt)),
            (Gate::Token(&gt), Gate::Channel(&gc)),
            (Gate::Token(&gt), Gate::Token(&gt)),
        ] {
            let got = gated_sum((&a, ga), (&x, gx), (b, tokens, c));
            for (i, &g) in got.iter().enumerate() {
                let (t, j) = (i / c, i % c);
                let want = a[i] * gate(ga, t, tokens, c, j) + x[i] * gate(gx, t, tokens, c, j);
                assert_eq!(g, want, "{i}");
            }
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use crate::ops::norm::cpu::with_row_norm;
    use crate::ops::norm::Norm;
    use crate::ops::pad::Pad;
    use candle_core::{DType, Device, Tensor};

    /// The depthwise convolution alone at OmniSR's and DAT's shapes: 128x128 x 128 channels
    /// with nothing after (OmniSR's gated feed-forward), 64x64 x 180 read from a 540-wide map
    /// with GELU after (DAT's local branch), a 32x32 x 128 map that stays in cache, and
    /// 64x64 x 360 times the other half of a 720-wide map (DAT's gate). GFLOP/s of whole calls
    /// (medians of 31, all threads, a new output each), then the row kernel's own rate: one
    /// thread, the inner rows into one buffer (no page faults), medians of 21.
    /// `cargo test --release --lib depthwise_throughput -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn depthwise_throughput() {
        for (h, c, ld, then) in [
            (128, 128, 128, 0),
            (64, 180, 540, 1),
            (32, 128, 128, 0),
            (64, 360, 720, 2),
        ] {
            let data: Vec<f32> = (0..h * h * ld).map(|i| (i % 89) as f32 * 0.01).collect();
            let (taps, bias) = (vec![0.1f32; 9 * c], vec![0.2f32; c]);
            let input = Rows::new(&data, ld, 0);
            let then = match then {
                0 => Then::Identity,
                1 => Then::Gelu,
                _ => Then::Times(Rows::new(&data, ld, ld - c)),
            };
            let median = |runs: usize, f: &mut dyn FnMut()| {
                let mut t: Vec<f64> = (0..runs)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        f();
                        start.elapsed().as_secs_f64()
                    })
                    .collect();
                t.sort_by(f64::total_cmp);
                t[runs / 2]
            };
            let whole = median(31, &mut || {
                std::hint::black_box(depthwise3x3(input, (1, h, h, c), (&taps, &bias), then));
            });
            let mut out = vec![MaybeUninit::<f32>::uninit(); h * c];
            let zeros = vec![0f32; c];
            let rows = median(21, &mut || {
                for y in 1..h - 1 {
                    let g = Row {
                        w: h,
                        c,
                        rows: [Some((y - 1) * h), Some(y * h), Some((y + 1) * h)],
                        zeros: &zeros,
                    };
                    let weights = (taps.as_slice(), bias.as_slice());
                    depthwise_row::<3, { TOKENS + 2 }>(&mut out, &g, input, weights, then, y * h);
                }
                std::hint::black_box(&out);
            });
            println!(
                "{h}x{h} x {c} (rows of {ld}): median {:.3} ms, {:.1} GFLOP/s; one thread's rows {:.2} ns per 16 outputs",
                whole * 1e3,
                (h * h * c * 18) as f64 / whole / 1e9,
                rows * 1e9 / ((h - 2) * h * c) as f64 * 16.0
            );
        }
    }

    /// DAT's SGFN gate at 64x64 (360 channels of a 720-wide map), alternating: the norm's
    /// pass then the convolution, against the convolution normalising as it reads.
    /// `cargo test --release --lib sgfn_gate_throughput -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn sgfn_gate_throughput() -> candle_core::Result<()> {
        let (b, h, w, c) = (1, 64, 64, 360);
        let hidden: Vec<f32> = (0..h * w * 2 * c).map(|i| (i % 89) as f32 * 0.01).collect();
        let (taps, bias) = (vec![0.1f32; 9 * c], vec![0.2f32; c]);
        let cpu = Device::Cpu;
        let (ones, zeros) = (
            Tensor::ones(c, DType::F32, &cpu)?,
            Tensor::zeros(c, DType::F32, &cpu)?,
        );
        let norm = Norm::new(&Pad::OFF.one(c), ones, zeros, 1e-5)?;
        let first = Rows::new(&hidden, 2 * c, 0);
        let second = Rows::new(&hidden, 2 * c, c);
        let (mut two, mut one) = (Vec::new(), Vec::new());
        for _ in 0..60 {
            let t = std::time::Instant::now();
            // The norm's pass as the network ran it before: every row into a new map.
            let mut normed = Vec::with_capacity(h * w * c);
            with_row_norm(&norm, c, |n| {
                normed.spare_capacity_mut()[..h * w * c]
                    .par_chunks_mut(64 * c)
                    .enumerate()
                    .for_each(|(k, rows)| {
                        for (r, dst) in rows.chunks_exact_mut(c).enumerate() {
                            n.row(second.token(k * 64 + r, c), dst);
                        }
                    });
                // SAFETY: every row was written above.
                unsafe { normed.set_len(h * w * c) };
            })?;
            let gate = Rows::new(&normed, c, 0);
            let a = depthwise3x3(gate, (b, h, w, c), (&taps, &bias), Then::Times(first));
            two.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let fused = with_row_norm(&norm, c, |n| {
                depthwise3x3_of_norm(second, n, (b, h, w, c), (&taps, &bias), Then::Times(first))
            })?;
            one.push(t.elapsed().as_secs_f64());
            assert_eq!(Some(a), fused);
        }
        for (name, mut t) in [("norm, then the convolution", two), ("fused", one)] {
            t.sort_by(f64::total_cmp);
            println!(
                "{name}: median {:.3} ms, fastest {:.3} ms",
                t[30] * 1e3,
                t[0] * 1e3
            );
        }
        Ok(())
    }
}

/// A depthwise `k x k` convolution (odd `k`, zero padding `k / 2`) of channels-last `x`
/// `(B, H, W, C)` with `taps` `(k², C)` (tap `dy · k + dx`) and `bias` `(C)`: output rows in
/// parallel. `x` may be a range of the channels of a wider map (read in place: MoSR's
/// convolved channels are the last of its projection's). 3x3, 5x5 and 7x7 on the row kernel
/// of [`depthwise3x3`]; other sizes one token at a time through the taps in order. MoSR's
/// 7x7 ran as candle's grouped convolution, one channel at a time. `None` where the kernel
/// does not apply (not f32 on the CPU, or strided otherwise).
pub(crate) fn depthwise_kxk(
    x: &candle_core::Tensor,
    k: usize,
    (taps, bias): (&[f32], &[f32]),
) -> candle_core::Result<Option<candle_core::Tensor>> {
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        return Ok(None);
    }
    let (b, h, w, c) = x.dims4()?;
    if taps.len() != k * k * c || bias.len() != c || k.is_multiple_of(2) {
        candle_core::bail!("depthwise: {k}x{k} taps for {c} channels");
    }
    let (guard, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = &*guard else {
        return Ok(None);
    };
    // Tokens `ld` values apart, their channels in order.
    let ld = match layout.stride() {
        [_, _, ld, 1] if layout.stride() == [h * w * ld, w * ld, *ld, 1] && *ld >= c => *ld,
        _ if layout.is_contiguous() => c,
        _ => return Ok(None),
    };
    let offset = layout.start_offset();
    if b * h * w > 0 && data.len() < offset + (b * h * w - 1) * ld + c {
        candle_core::bail!("depthwise: a map of {:?} outside its storage", x.dims());
    }
    let input = Rows::new(data, ld, offset);
    let weights = (taps, bias);
    let dims = (b, h, w, c);
    let out = match k {
        3 => depthwise_rows::<3, { TOKENS + 2 }>(input, dims, weights, Then::Identity),
        5 => depthwise_rows::<5, { TOKENS + 4 }>(input, dims, weights, Then::Identity),
        7 => depthwise_rows::<7, { TOKENS + 6 }>(input, dims, weights, Then::Identity),
        _ => depthwise_any(input, dims, k, weights),
    };
    drop(guard);
    Ok(Some(candle_core::Tensor::from_vec(
        out,
        (b, h, w, c),
        x.device(),
    )?))
}

/// [`depthwise_kxk`] for any odd `k`, one token at a time through the taps inside the map.
fn depthwise_any(
    input: Rows,
    (b, h, w, c): (usize, usize, usize, usize),
    k: usize,
    (taps, bias): (&[f32], &[f32]),
) -> Vec<f32> {
    let r = k / 2;
    let mut out = vec![0f32; b * h * w * c];
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(w * c)
        .enumerate()
        .for_each(|(row, dst)| {
            let (bi, y) = (row / h, row % h);
            let rows = y.saturating_sub(r)..(y + r + 1).min(h);
            for (px, o) in dst.chunks_exact_mut(c).enumerate() {
                o.copy_from_slice(bias);
                let cols = px.saturating_sub(r)..(px + r + 1).min(w);
                for yy in rows.clone() {
                    let dy = yy + r - y;
                    for xx in cols.clone() {
                        let dx = xx + r - px;
                        let src = input.token((bi * h + yy) * w + xx, c);
                        let tap = &taps[(dy * k + dx) * c..][..c];
                        for ((o, &s), &t) in o.iter_mut().zip(src).zip(tap) {
                            *o += s * t;
                        }
                    }
                }
            }
        });
    out
}
