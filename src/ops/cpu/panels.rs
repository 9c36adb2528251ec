//! f32 products for CPUs with AVX-512 or AVX2: the right-hand side (a layer's weights) packed
//! into column panels of up to [`PANEL`] values, the left-hand side read where it lies.
//!
//! The `gemm` crate packs both operands on every call, and its microkernel tiles the 180
//! output channels of SwinIR and HAT in 64-column strips (2 x 64 + 52). Here each output tile
//! is a few rows by one panel: on AVX-512 8 rows of up to three 16-lane vectors, 24
//! accumulators; on AVX2 6 rows of a 16-column strip at a time, 12 accumulators. The lhs
//! values are broadcast straight from the rows they sit in (given as row pointers, so a 3x3
//! convolution reads its taps from the image itself instead of from a patch matrix 9x its
//! size), and the bias, a residual or earlier partial sums loaded into the accumulators
//! before the first product instead of being written out first. Attention's small operands
//! are read in place (v) or transposed once (kᵀ) rather than packed. Which kernel runs
//! follows [`cpu_isa`]; a plain-loop kernel computes the same where neither vector unit may
//! be used (callers keep the `gemm` crate there, see [`available`]).

use super::isa::{cpu_isa, CpuIsa};
use super::shared::Shared;
use super::taps::tap_source;
use super::*;

/// Columns per packed panel and per output tile: three 16-lane vectors, or three strips of
/// two 8-lane vectors.
pub(crate) const PANEL: usize = 48;
/// Rows of the tallest tile (AVX-512's): the length of a tile's array of row pointers.
const MAX_MR: usize = 8;

/// Whether the panel kernels run on this CPU (AVX2 with FMA at least, within
/// `UPSCALE_CPU_ISA`), else callers keep the `gemm` crate. `UPSCALE_CPU_GEMM=crate` keeps the
/// crate everywhere, to measure one against the other in the same binary.
pub(crate) fn available() -> bool {
    static CRATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let keep_crate =
        *CRATE.get_or_init(|| crate::switches::from_env().unwrap_or_default().gemm_crate);
    !keep_crate && cpu_isa() >= CpuIsa::Avx2
}

/// Rows per output tile of the kernels that run on this CPU: a product of a multiple of these
/// rows leaves no tile part-empty.
pub(crate) fn tile_rows() -> usize {
    Kernel::current().mr()
}

/// Rows per parallel task of [`gemm`] on this CPU: a caller that splits a product into row
/// blocks of this many rows computes each output row exactly as one `gemm` over all rows.
pub(crate) fn task_rows() -> usize {
    Kernel::current().mc()
}

/// The tile kernel of a product, chosen once when it starts (its tasks all run the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// Plain loops: what the kernels compute, on any CPU (tests; callers take the `gemm`
    /// crate there instead).
    Scalar,
    Avx2,
    Avx512,
}

impl From<CpuIsa> for Kernel {
    fn from(isa: CpuIsa) -> Self {
        match isa {
            CpuIsa::Scalar => Self::Scalar,
            CpuIsa::Avx2 => Self::Avx2,
            CpuIsa::Avx512 => Self::Avx512,
        }
    }
}

impl Kernel {
    fn current() -> Self {
        cpu_isa().into()
    }

    /// Rows per output tile. AVX-512: 8 x 3 accumulators, 3 rhs vectors and a broadcast
    /// value leave 4 of the 32 vector registers free. AVX2: a 16-column strip at a time,
    /// 6 x 2 accumulators, 2 rhs vectors and a broadcast value in 15 of the 16.
    fn mr(self) -> usize {
        match self {
            Self::Scalar => 4,
            Self::Avx2 => 6,
            Self::Avx512 => MAX_MR,
        }
    }

    /// Rows per parallel task: whole tiles, up to 64. A 64 x 180 block of the lhs (46 KiB)
    /// stays in L2 while every panel runs over it, and a 64x64 input still gives 64 tasks
    /// to balance.
    fn mc(self) -> usize {
        64 / self.mr() * self.mr()
    }

    /// `c = start + a · b` for one tile: `rows` (at most [`Self::mr`]) rows of `a` (row `i`
    /// at `a[i]`, `k` values each) against `k` rows of `cols` (at most [`PANEL`]) values `ldb`
    /// apart; `padded`: those rows may be read up to a multiple of 16 columns (packed
    /// panels), so only the output needs masks.
    ///
    /// # Safety
    /// The CPU has the kernel's instructions ([`cpu_isa`] names them); `a[i]` holds `k`
    /// values for every `i < MAX_MR` (rows past `rows` may repeat a real one), `b` `k` rows
    /// of `cols` values (`cols` rounded up to 16 if `padded`); `c` holds `rows` rows of
    /// `cols` values `ldc` apart, as do `start`'s rows, and its bias `cols` values.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        self,
        k: usize,
        a: &[*const f32; MAX_MR],
        (b, ldb): (*const f32, usize),
        padded: bool,
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        start: Start,
    ) {
        let (b, c) = ((b, ldb), (c, ldc));
        // SAFETY: forwarded to the caller.
        unsafe {
            match (self, cols.div_ceil(16)) {
                (Self::Avx512, 1) => avx512::tile::<1>(k, a, b, c, (rows, cols), start),
                (Self::Avx512, 2) => avx512::tile::<2>(k, a, b, c, (rows, cols), start),
                (Self::Avx512, 3) => avx512::tile::<3>(k, a, b, c, (rows, cols), start),
                (Self::Avx2, _) => avx2::tile(k, a, b, padded, c, (rows, cols), start),
                (Self::Scalar, _) => scalar_tile(k, a, b, c, (rows, cols), start),
                (_, v) => unreachable!("a tile of {v} vectors"),
            }
        }
    }
}

/// A `k x n` right-hand side in f32, packed in panels of [`PANEL`] columns (the last one
/// narrower, rounded up to whole vectors), each `k` rows of its width, so that a tile reads
/// its operand front to back; lanes past `n` are zero.
#[derive(Clone, Default)]
pub(crate) struct Panels {
    k: usize,
    n: usize,
    /// The panels, from `data[start]` on: the first 64-byte boundary of the allocation, so
    /// that each row of a panel (192 bytes, or a multiple of 64 for the last) starts a cache
    /// line and no vector load straddles two. (A clone keeps the offset, correct if not
    /// aligned.)
    data: Vec<f32>,
    start: usize,
}

/// Operands of at least this many values are packed in parallel: a transformer's linear
/// weights (DAT's 180 x 540 and 180 x 720; packed on one thread at 1 << 18, its load took
/// 1.037x as long), not a Winograd position's 64 x 64 or an attention window's values.
const PARALLEL_PACK: usize = 1 << 15;

impl Panels {
    /// Packs `b[r][c] = src[r * rs + c * cs]` for `r < k`, `c < n`, a panel per task.
    pub(crate) fn new(src: &[f32], dims: (usize, usize), strides: (usize, usize)) -> Self {
        Self::reusing(Vec::new(), src, dims, strides)
    }

    /// [`Panels::new`] in `data`'s allocation where it is large enough (one that
    /// [`Panels::into_buffer`] gave back: memory already paged in).
    pub(crate) fn reusing(
        mut data: Vec<f32>,
        src: &[f32],
        (k, n): (usize, usize),
        (rs, cs): (usize, usize),
    ) -> Self {
        if k > 0 && n > 0 {
            assert!(
                (k - 1) * rs + (n - 1) * cs < src.len(),
                "operand out of bounds"
            );
        }
        let len = k * ((n / PANEL) * PANEL + (n % PANEL).next_multiple_of(16));
        // Every value of the panels is written below (the padding columns too): a reused
        // buffer is not cleared first, and a new one comes zeroed from the allocator, for
        // its alignment slack. Clearing them cost a pass over every kernel packed.
        if data.is_empty() {
            data = vec![0.0; len + 15];
        } else {
            data.resize(len + 15, 0.0);
        }
        let start = data.as_ptr().align_offset(64).min(15);
        if k > 0 {
            // Small operands (a Winograd position's 64 x 64, packed 36 at a time per
            // convolution) on the calling thread: a parallel pass per panel cost more in
            // handing out the work than the copy.
            let min_len = if len < PARALLEL_PACK { usize::MAX } else { 1 };
            data[start..start + len]
                .par_chunks_mut(k * PANEL)
                .with_min_len(min_len)
                .enumerate()
                .for_each(|(p, out)| {
                    let width = out.len() / k;
                    let c0 = p * PANEL;
                    let cols = (n - c0).min(width);
                    if cols < width {
                        for row in out.chunks_exact_mut(width) {
                            row[cols..].fill(0.0);
                        }
                    }
                    if cs == 1 {
                        // Rows of the source are rows of the panel.
                        for (r, row) in out.chunks_exact_mut(width).enumerate() {
                            row[..cols].copy_from_slice(&src[r * rs + c0..][..cols]);
                        }
                    } else if rs == 1 {
                        // A linear layer's weight rows are the panel's columns: transposed in
                        // registers (a value at a time, this was most of a transformer's load).
                        transpose((&src[c0 * cs..], cs), (cols, k), (out, width));
                    } else {
                        // Column by column: the source is read front to back, the panel (in
                        // L1) written across.
                        for j in 0..cols {
                            let column = (c0 + j) * cs;
                            for (r, row) in out.chunks_exact_mut(width).enumerate() {
                                row[j] = src[column + r * rs];
                            }
                        }
                    }
                });
        }
        Self { k, n, data, start }
    }

    /// The allocation, for [`Panels::reusing`].
    pub(crate) fn into_buffer(self) -> Vec<f32> {
        self.data
    }

    /// The packed panels, one after the other.
    fn packed(&self) -> &[f32] {
        let len = self.data.len().saturating_sub(15);
        &self.data[self.start..self.start + len]
    }

    /// `(k, n)`: the operand's rows and columns.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// The product operand these panels are.
    pub(crate) fn rhs(&self) -> Rhs<'_> {
        self.rows(0, self.k)
    }

    /// The product operand of rows `first..first + k` of these panels: the weight of a
    /// range of input channels.
    pub(crate) fn rows(&self, first: usize, k: usize) -> Rhs<'_> {
        assert!(
            first + k <= self.k,
            "rows {first}..{} of {}",
            first + k,
            self.k
        );
        Rhs::Panels {
            panels: self,
            first,
            k,
        }
    }
}

/// The right-hand side of a product: packed panels, or a `k x n` view whose row `r` is `n`
/// values at `ptr + r * ld` (attention's v in place, its kᵀ transposed into a buffer).
#[derive(Clone, Copy)]
pub(crate) enum Rhs<'a> {
    /// Rows `first..first + k` of packed panels.
    Panels {
        panels: &'a Panels,
        first: usize,
        k: usize,
    },
    Strided {
        ptr: *const f32,
        k: usize,
        n: usize,
        ld: usize,
    },
}

impl Rhs<'_> {
    fn k(&self) -> usize {
        match self {
            Self::Panels { k, .. } | Self::Strided { k, .. } => *k,
        }
    }

    fn n(&self) -> usize {
        match self {
            Self::Panels { panels, .. } => panels.n,
            Self::Strided { n, .. } => *n,
        }
    }

    /// Column block `p` ([`PANEL`] wide, the last narrower): its first column, its columns,
    /// and where its row 0 is and how far apart its rows are.
    fn block(&self, p: usize) -> (usize, usize, *const f32, usize) {
        let c0 = p * PANEL;
        let cols = (self.n() - c0).min(PANEL);
        match self {
            Self::Panels { panels, first, .. } => {
                // A panel's rows are `width` apart (a multiple of 16 values: rows from any
                // `first` keep the panel's alignment).
                let width = cols.next_multiple_of(16);
                let at = c0 * panels.k + first * width;
                (c0, cols, panels.packed()[at..].as_ptr(), width)
            }
            Self::Strided { ptr, ld, .. } => (c0, cols, ptr.wrapping_add(c0), *ld),
        }
    }

    fn blocks(&self) -> usize {
        self.n().div_ceil(PANEL)
    }
}

/// Where a tile's accumulators start before its products are added: each row of `init`
/// (rows `ld` apart: earlier partial sums, or a residual) plus the `bias` row, either
/// optional; both absent, zero.
#[derive(Clone, Copy)]
pub(crate) struct Start {
    pub init: Option<(*const f32, usize)>,
    pub bias: Option<*const f32>,
}

impl Start {
    pub(crate) const ZERO: Self = Self {
        init: None,
        bias: None,
    };
}

/// [`Kernel::tile`] in plain loops, a row at a time.
///
/// # Safety
/// As [`Kernel::tile`].
unsafe fn scalar_tile(
    k: usize,
    a: &[*const f32; MAX_MR],
    (b, ldb): (*const f32, usize),
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    start: Start,
) {
    for (i, &row) in a.iter().enumerate().take(rows) {
        let mut acc = [0f32; PANEL];
        let acc = &mut acc[..cols];
        // SAFETY (all blocks): the caller's bounds: row i < rows of `c` and `start.init`,
        // `cols` values each, the bias `cols` values, `row` k values, `b` k rows of `cols`.
        if let Some(bias) = start.bias {
            acc.copy_from_slice(unsafe { std::slice::from_raw_parts(bias, cols) });
        }
        if let Some((init, ld)) = start.init {
            let init = unsafe { std::slice::from_raw_parts(init.add(i * ld), cols) };
            for (acc, x) in acc.iter_mut().zip(init) {
                *acc += x;
            }
        }
        let row = unsafe { std::slice::from_raw_parts(row, k) };
        for (p, &x) in row.iter().enumerate() {
            let b = unsafe { std::slice::from_raw_parts(b.add(p * ldb), cols) };
            for (acc, y) in acc.iter_mut().zip(b) {
                *acc += x * y;
            }
        }
        unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), cols) }.copy_from_slice(acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Start, MAX_MR as MR};
    use std::arch::x86_64::*;

    /// The lanes of vector `v` of a tile that hold columns below `cols`.
    #[inline(always)]
    fn lanes(v: usize, cols: usize) -> __mmask16 {
        match cols.saturating_sub(16 * v) {
            0 => 0,
            l if l >= 16 => 0xffff,
            l => (1u16 << l) - 1,
        }
    }

    /// [`super::transpose`], in blocks of 16 rows by 16 columns: 16 loads, 64
    /// two-source permutes (four stages, each swapping the off-diagonal blocks of every
    /// 2d x 2d block for d = 8, 4, 2, 1), 16 stores.
    ///
    /// # Safety
    /// As [`super::transpose`], whose asserts the bounds are.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(
        (src, ld): (&[f32], usize),
        (n, c): (usize, usize),
        (out, ldo): (&mut [f32], usize),
    ) {
        let stage = |d: usize| -> (__m512i, __m512i) {
            let idx = |f: &dyn Fn(usize) -> usize| {
                let v: [i32; 16] = std::array::from_fn(|l| f(l) as i32);
                // SAFETY: 16 lanes read from a 16-lane array.
                unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
            };
            (
                idx(&|l| if l & d == 0 { l } else { 16 + l - d }),
                idx(&|l| if l & d == 0 { l + d } else { 16 + l }),
            )
        };
        let stages = [stage(8), stage(4), stage(2), stage(1)];
        for j0 in (0..n).step_by(16) {
            let keys = (n - j0).min(16);
            let store = lanes(0, keys);
            for ch0 in (0..c).step_by(16) {
                let chans = (c - ch0).min(16);
                let load = lanes(0, chans);
                // Register j: channels ch0.. of key j0 + j (zero past the last key).
                let mut r: [__m512; 16] = std::array::from_fn(|j| {
                    if j < keys {
                        // SAFETY: row j0 + j < n, its columns ch0.. below c, in `src`.
                        unsafe {
                            let src = src.as_ptr().add((j0 + j) * ld + ch0);
                            _mm512_maskz_loadu_ps(load, src)
                        }
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                for (d, &(lo, hi)) in [8, 4, 2, 1].iter().zip(&stages) {
                    for i in 0..16 {
                        if i & d == 0 {
                            let (a, b) = (r[i], r[i + d]);
                            r[i] = _mm512_permutex2var_ps(a, lo, b);
                            r[i + d] = _mm512_permutex2var_ps(a, hi, b);
                        }
                    }
                }
                for (l, row) in r.iter().enumerate().take(chans) {
                    // SAFETY: row ch0 + l < c of `out`, columns j0.. below n.
                    unsafe {
                        let dst = out.as_mut_ptr().add((ch0 + l) * ldo + j0);
                        _mm512_mask_storeu_ps(dst, store, *row)
                    };
                }
            }
        }
    }

    /// [`super::Kernel::tile`] for a tile of `V` vectors. Every access to `b` and `c` is masked to
    /// the tile's columns, so an operand read in place is never read past its last column.
    ///
    /// # Safety
    /// As [`super::Kernel::tile`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const V: usize>(
        k: usize,
        a: &[*const f32; MR],
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        start: Start,
    ) {
        let masks: [__mmask16; V] = std::array::from_fn(|v| lanes(v, cols));
        let mut acc = [[_mm512_setzero_ps(); V]; MR];
        // SAFETY (all blocks): the caller's bounds: `start`'s rows and `b`'s hold `cols`
        // values (the masks cover no others), `a[i]` holds k values.
        if let Some(bias) = start.bias {
            let bias: [__m512; V] = std::array::from_fn(|v| unsafe {
                _mm512_maskz_loadu_ps(masks[v], bias.add(16 * v))
            });
            for acc in acc.iter_mut() {
                *acc = bias;
            }
        }
        if let Some((init, ld)) = start.init {
            for (i, acc) in acc.iter_mut().enumerate().take(rows) {
                for (v, acc) in acc.iter_mut().enumerate() {
                    let row = unsafe { init.add(i * ld + 16 * v) };
                    let x = unsafe { _mm512_maskz_loadu_ps(masks[v], row) };
                    *acc = _mm512_add_ps(*acc, x);
                }
            }
        }
        let a = *a;
        for p in 0..k {
            let bv: [__m512; V] = std::array::from_fn(|v| unsafe {
                _mm512_maskz_loadu_ps(masks[v], b.add(p * ldb + 16 * v))
            });
            for (row, acc) in a.iter().zip(acc.iter_mut()) {
                let x = _mm512_set1_ps(unsafe { *row.add(p) });
                for v in 0..V {
                    acc[v] = _mm512_fmadd_ps(x, bv[v], acc[v]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate().take(rows) {
            for (v, acc) in acc.iter().enumerate() {
                // SAFETY: row i < rows of the tile, masked to its columns.
                unsafe { _mm512_mask_storeu_ps(c.add(i * ldc + 16 * v), masks[v], *acc) };
            }
        }
    }
}

/// The same tiles in 8-lane vectors: the 48 columns of a panel as three strips of 16, each a
/// 6-row product of its own (AVX2 has 16 vector registers, too few for a whole panel).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Start, MAX_MR};
    use std::arch::x86_64::*;

    /// Rows per tile: 6 x 2 accumulators, 2 rhs vectors and a broadcast value.
    const MR: usize = 6;

    /// A load/store mask of the first `n` lanes (all of them from 8 up).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes(n: usize) -> __m256i {
        let n = n.min(8) as i32;
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }

    /// [`super::Kernel::tile`]: each strip of 16 columns in turn, the last one (if narrower)
    /// through masked loads and stores.
    ///
    /// # Safety
    /// As [`super::Kernel::tile`], and the CPU has AVX2 and FMA.
    pub(super) unsafe fn tile(
        k: usize,
        a: &[*const f32; MAX_MR],
        (b, ldb): (*const f32, usize),
        padded: bool,
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        start: Start,
    ) {
        debug_assert!(rows <= MR);
        for s0 in (0..cols).step_by(16) {
            let width = (cols - s0).min(16);
            let start = Start {
                init: start.init.map(|(p, ld)| (p.wrapping_add(s0), ld)),
                bias: start.bias.map(|p| p.wrapping_add(s0)),
            };
            let (b, c) = ((b.wrapping_add(s0), ldb), (c.wrapping_add(s0), ldc));
            // SAFETY: the strip is columns s0..s0 + width of the caller's tile.
            // A strip of 8 columns or fewer (the last 4 of 180 output channels, say) takes
            // one vector per row: half the products of a 16-wide one, the same sums.
            unsafe {
                match (width, padded) {
                    (16, _) => strip::<2, false, false>(k, a, b, c, (rows, width), start),
                    (8, _) => strip::<1, false, false>(k, a, b, c, (rows, width), start),
                    (9.., true) => strip::<2, false, true>(k, a, b, c, (rows, width), start),
                    (9.., false) => strip::<2, true, true>(k, a, b, c, (rows, width), start),
                    (_, true) => strip::<1, false, true>(k, a, b, c, (rows, width), start),
                    (_, false) => strip::<1, true, true>(k, a, b, c, (rows, width), start),
                }
            }
        }
    }

    /// Up to [`MR`] rows by `cols <= 8 V` columns, in `V` (1 or 2) vectors per row.
    /// `MASK_B` masks the loads from `b`, and `EDGE` those from `start` and the stores to
    /// `c`, to the strip's columns, so that an operand read in place is never read past its
    /// last column; full strips load and store whole vectors. (A padded `b` read whole keeps
    /// the masks out of the inner loop, where they would take two of the 16 registers.)
    ///
    /// # Safety
    /// As [`tile`], for `cols <= 8 V` (exactly `8 V` unless `EDGE`; `b` `8 V` wide, or 16 if
    /// padded, unless `MASK_B`).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn strip<const V: usize, const MASK_B: bool, const EDGE: bool>(
        k: usize,
        a: &[*const f32; MAX_MR],
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        (rows, cols): (usize, usize),
        start: Start,
    ) {
        let masks = [lanes(cols), lanes(cols.saturating_sub(8))];
        // Whether vector v of a row is partial. The first vector of an edge strip of 9 to 15
        // columns is whole: it takes plain loads and stores, since AMD's masked stores are
        // microcoded, several times slower (attention's 30-wide heads end in such strips).
        let partial = |v: usize| EDGE && 8 * (v + 1) > cols;
        // SAFETY (all three): `p + 8 v` is in the caller's bounds for the lanes the mask
        // keeps, and whole vectors are only read or written when they lie in the strip.
        let load = |p: *const f32, v: usize| unsafe {
            if partial(v) {
                _mm256_maskload_ps(p.add(8 * v), masks[v])
            } else {
                _mm256_loadu_ps(p.add(8 * v))
            }
        };
        let load_b = |p: *const f32, v: usize| unsafe {
            if MASK_B {
                _mm256_maskload_ps(p.add(8 * v), masks[v])
            } else {
                _mm256_loadu_ps(p.add(8 * v))
            }
        };
        let store = |p: *mut f32, v: usize, x: __m256| unsafe {
            if partial(v) {
                _mm256_maskstore_ps(p.add(8 * v), masks[v], x)
            } else {
                _mm256_storeu_ps(p.add(8 * v), x)
            }
        };
        let mut acc = [[_mm256_setzero_ps(); V]; MR];
        if let Some(bias) = start.bias {
            let bias: [__m256; V] = std::array::from_fn(|v| load(bias, v));
            acc = [bias; MR];
        }
        if let Some((init, ld)) = start.init {
            for (i, acc) in acc.iter_mut().enumerate().take(rows) {
                let row = init.wrapping_add(i * ld);
                for (v, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_add_ps(*acc, load(row, v));
                }
            }
        }
        let a: [*const f32; MR] = std::array::from_fn(|i| a[i]);
        for p in 0..k {
            let row = b.wrapping_add(p * ldb);
            // The rhs row 8 steps on, asked for now: a strip reads one line of each
            // 192-byte panel row, a stride the hardware's prefetchers follow late. Held to
            // AVX2, 4096-row products with SwinIR's shapes ran 1-10% faster (medians of 21,
            // interleaved), SwinIR-M's whole process 3% less CPU time. A prefetch never
            // faults, even past the operand's end.
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((p + 8) * ldb).cast::<i8>());
            let bv: [__m256; V] = std::array::from_fn(|v| load_b(row, v));
            for (x, acc) in a.iter().zip(acc.iter_mut()) {
                // SAFETY: every row pointer holds k values.
                let x = _mm256_set1_ps(unsafe { *x.add(p) });
                for v in 0..V {
                    acc[v] = _mm256_fmadd_ps(x, bv[v], acc[v]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate().take(rows) {
            let row = c.wrapping_add(i * ldc);
            for (v, &acc) in acc.iter().enumerate() {
                store(row, v, acc);
            }
        }
    }

    /// [`super::transpose`] in blocks of 8 rows by 8 columns: pairs of rows interleaved,
    /// then pairs of pairs, then the 128-bit halves swapped across.
    ///
    /// # Safety
    /// As [`super::transpose`], whose asserts the bounds are; the CPU has AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn transpose(
        (src, ld): (&[f32], usize),
        (n, c): (usize, usize),
        (out, ldo): (&mut [f32], usize),
    ) {
        for j0 in (0..n).step_by(8) {
            let keys = (n - j0).min(8);
            let store = lanes(keys);
            for ch0 in (0..c).step_by(8) {
                let chans = (c - ch0).min(8);
                let load = lanes(chans);
                // Register j: channels ch0.. of key j0 + j (zero past the last key).
                let mut r = [_mm256_setzero_ps(); 8];
                for (j, r) in r.iter_mut().enumerate().take(keys) {
                    // SAFETY: row j0 + j < n, its columns ch0.. below c (masked), in `src`.
                    *r = unsafe {
                        let src = src.as_ptr().add((j0 + j) * ld + ch0);
                        if chans == 8 {
                            _mm256_loadu_ps(src)
                        } else {
                            _mm256_maskload_ps(src, load)
                        }
                    };
                }
                let t = |i: usize| {
                    [
                        _mm256_unpacklo_ps(r[i], r[i + 1]),
                        _mm256_unpackhi_ps(r[i], r[i + 1]),
                    ]
                };
                // Keys 4h..4h + 4 of channels (l, l + 4) in the halves of q[h][l].
                let q = |h: usize| {
                    let ([lo0, hi0], [lo1, hi1]) = (t(4 * h), t(4 * h + 2));
                    [
                        _mm256_shuffle_ps::<0x44>(lo0, lo1),
                        _mm256_shuffle_ps::<0xee>(lo0, lo1),
                        _mm256_shuffle_ps::<0x44>(hi0, hi1),
                        _mm256_shuffle_ps::<0xee>(hi0, hi1),
                    ]
                };
                let (q0, q1) = (q(0), q(1));
                for l in 0..chans {
                    let column = if l < 4 {
                        _mm256_permute2f128_ps::<0x20>(q0[l], q1[l])
                    } else {
                        _mm256_permute2f128_ps::<0x31>(q0[l - 4], q1[l - 4])
                    };
                    // SAFETY: row ch0 + l < c of `out`, columns j0.. below n (masked). A full
                    // block takes a plain store: AMD's masked stores are microcoded, several
                    // times slower.
                    unsafe {
                        let dst = out.as_mut_ptr().add((ch0 + l) * ldo + j0);
                        if keys == 8 {
                            _mm256_storeu_ps(dst, column)
                        } else {
                            _mm256_maskstore_ps(dst, store, column)
                        }
                    };
                }
            }
        }
    }
}

/// Elsewhere [`cpu_isa`] is always scalar: the vector kernels are never called.
#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    use super::{Start, MAX_MR};

    pub(super) unsafe fn transpose(_: (&[f32], usize), _: (usize, usize), _: (&mut [f32], usize)) {
        unreachable!("AVX-512 kernels on another architecture")
    }

    pub(super) unsafe fn tile<const V: usize>(
        _: usize,
        _: &[*const f32; MAX_MR],
        _: (*const f32, usize),
        _: (*mut f32, usize),
        _: (usize, usize),
        _: Start,
    ) {
        unreachable!("AVX-512 kernels on another architecture")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    use super::{Start, MAX_MR};

    pub(super) unsafe fn transpose(_: (&[f32], usize), _: (usize, usize), _: (&mut [f32], usize)) {
        unreachable!("AVX2 kernels on another architecture")
    }

    pub(super) unsafe fn tile(
        _: usize,
        _: &[*const f32; MAX_MR],
        _: (*const f32, usize),
        _: bool,
        _: (*mut f32, usize),
        _: (usize, usize),
        _: Start,
    ) {
        unreachable!("AVX2 kernels on another architecture")
    }
}

/// Rows `r0..r0 + rows` of `dst = start + lhs · b` for every column block, `row(i)` giving
/// lhs row `i`'s pointer, and each output row at `dst + i * ldc`.
///
/// # Safety
/// As [`Kernel::tile`] for every tile: `row(i)` holds `b.k()` values for `r0 <= i < r0 + rows`,
/// dst (and `start.init`, whose row `i` is at `init + i * ld`) hold those rows of `b.n()`
/// values.
unsafe fn row_block(
    kernel: Kernel,
    b: Rhs,
    row: &impl Fn(usize) -> *const f32,
    (r0, rows): (usize, usize),
    (dst, ldc): (*mut f32, usize),
    start: Start,
) {
    for p in 0..b.blocks() {
        let (c0, cols, bp, ldb) = b.block(p);
        let mr = kernel.mr();
        for g in (0..rows).step_by(mr) {
            let i0 = r0 + g;
            let n = mr.min(rows - g);
            let a: [*const f32; MAX_MR] = std::array::from_fn(|i| row(i0 + i.min(n - 1)));
            let start = Start {
                init: start.init.map(|(s, ld)| (s.wrapping_add(i0 * ld + c0), ld)),
                bias: start.bias.map(|s| s.wrapping_add(c0)),
            };
            if g + mr < rows {
                let next = mr.min(rows - g - mr);
                prefetch_rows(
                    dst.wrapping_add((i0 + mr) * ldc + c0).cast_const(),
                    ldc,
                    (next, cols),
                );
                // A residual the sums start from is read from as far away: its next rows too
                // (4096-row products with a residual, held to AVX2: 2-6% faster).
                if let Some((s, ld)) = start.init {
                    if s != dst.wrapping_add(i0 * ldc + c0).cast_const() {
                        prefetch_rows(s.wrapping_add(mr * ld), ld, (next, cols));
                    }
                }
            }
            // SAFETY: forwarded to the caller; the tile is rows i0..i0 + n, columns
            // c0..c0 + cols.
            unsafe {
                kernel.tile(
                    b.k(),
                    &a,
                    (bp, ldb),
                    matches!(b, Rhs::Panels { .. }),
                    (dst.add(i0 * ldc + c0), ldc),
                    (n, cols),
                    start,
                )
            };
        }
    }
}

/// Asks for the cache lines of `rows` output rows of `cols` values from `c` (rows `ldc`
/// apart) before they are written, here the next tile's while the current one computes: a
/// store first has to read its line, and a product's output (megabytes for a 4096-row
/// input) is not in cache. 4096-row products with SwinIR's shapes ran 2-15% faster held to
/// AVX2 and 1-10% natively (medians of 21, interleaved).
#[inline]
pub(crate) fn prefetch_rows(c: *const f32, ldc: usize, (rows, cols): (usize, usize)) {
    #[cfg(target_arch = "x86_64")]
    for i in 0..rows {
        let row = c.wrapping_add(i * ldc).cast::<i8>();
        // From the start of the row's first line.
        let skew = row as usize % 64;
        let first = row.wrapping_sub(skew);
        for at in (0..skew + 4 * cols).step_by(64) {
            // SAFETY: a prefetch reads nothing architecturally and never faults.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(at));
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, ldc, rows, cols);
}

/// `dst = start + a · b` for a row-major `m x k` `a` (rows `lda` apart) into `m x n` `dst`
/// (rows `ldc` apart), row blocks in parallel when `parallel`, each finished by `then` (which
/// needs `ldc == n`) while in cache.
///
/// # Safety
/// `a` holds `m` rows of `b`'s `k` values, `b` its
/// `k` rows, dst and `start.init` `m` rows of `n` values (`start.init` may be dst itself:
/// each value is read before it is written), `start.bias` `n` values; dst overlaps nothing
/// else.
pub(crate) unsafe fn gemm(
    m: usize,
    (a, lda): (*const f32, usize),
    b: Rhs,
    (dst, ldc): (*mut f32, usize),
    start: Start,
    parallel: bool,
    then: Option<&Epilogue>,
) {
    assert!(
        then.is_none() || ldc == b.n(),
        "an epilogue needs contiguous output rows"
    );
    let kernel = Kernel::current();
    let mc = kernel.mc();
    // SAFETY: the tasks read a, b and start and each writes its own rows of dst (this
    // function's contract), all of which outlive them.
    let shared = unsafe { Shared::new((a, b, dst, start)) };
    let block = |t: usize| {
        let (a, b, dst, start) = shared.get();
        let r0 = t * mc;
        let rows = mc.min(m - r0);
        let row = |i: usize| a.wrapping_add(i * lda);
        // SAFETY: rows r0..r0 + rows, inside the caller's bounds, written by this task only.
        unsafe {
            row_block(kernel, b, &row, (r0, rows), (dst, ldc), start);
            if let Some(then) = then {
                then(std::slice::from_raw_parts_mut(
                    dst.add(r0 * ldc),
                    rows * ldc,
                ));
            }
        }
    };
    let tasks = m.div_ceil(mc);
    if parallel && tasks > 1 {
        (0..tasks).into_par_iter().for_each(block);
    } else {
        (0..tasks).for_each(block);
    }
}

/// Output pixels `p0..p0 + rows` of one image (row-major, all in the image) of a 3x3
/// convolution (stride 1, zero padding 1): the rhs is `9 cin x cout` with rows ordered
/// (dy, dx, cin), each tap's `cin` rows a product of their own onto the sums of the taps
/// before it, reading the input pixel under the tap (or `zeros` outside the image) where it
/// lies. The first tap starts from `bias`; output pixel `i` is written at `dst + (i - p0) *
/// ldc`.
///
/// # Safety
/// `image` is `h x wd x cin`, `zeros` `cin` zeros, `b` `9 cin` rows;
/// dst holds `rows` rows of `b`'s `n` values `ldc` apart, `bias` `n` values.
pub(crate) unsafe fn conv3x3_pixels(
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    zeros: &[f32],
    b: &Panels,
    (p0, rows): (usize, usize),
    (dst, ldc): (*mut f32, usize),
    bias: &[f32],
) {
    assert!(b.k == 9 * cin && zeros.len() >= cin && bias.len() >= b.n);
    assert!(image.len() >= h * wd * cin && p0 + rows <= h * wd);
    let b = b.rhs();
    let kernel = Kernel::current();
    let mr = kernel.mr();
    for p in 0..b.blocks() {
        let (c0, cols, bp, ldb) = b.block(p);
        for g in (0..rows).step_by(mr) {
            let n = mr.min(rows - g);
            let c = dst.wrapping_add(g * ldc + c0);
            for tap in 0..9 {
                let a: [*const f32; MAX_MR] = std::array::from_fn(|i| {
                    let pixel = p0 + g + i.min(n - 1);
                    let (y, x) = (pixel / wd, pixel % wd);
                    tap_source(image, (h, wd, cin), (y, x), tap)
                        .unwrap_or(zeros)
                        .as_ptr()
                });
                let start = if tap == 0 {
                    Start {
                        init: None,
                        bias: Some(bias[c0..].as_ptr()),
                    }
                } else {
                    Start {
                        init: Some((c, ldc)),
                        bias: None,
                    }
                };
                // SAFETY: each row pointer holds cin values (an input pixel or `zeros`), the
                // tap's rows of the block start at tap * cin; the tile is rows g..g + n of
                // dst, columns c0..c0 + cols, read (after the first tap) before written.
                unsafe {
                    kernel.tile(
                        cin,
                        &a,
                        (bp.add(tap * cin * ldb), ldb),
                        true,
                        (c, ldc),
                        (n, cols),
                        start,
                    )
                };
            }
        }
    }
}

/// The keys of one window transposed: `out[ch * n + j]` is channel `ch` of key `j`, for the
/// `n` rows of q | k | v (`3c` values each) in `qkv`.
pub(crate) fn transpose_keys(qkv: &[f32], (n, c): (usize, usize), out: &mut [f32]) {
    assert!(qkv.len() >= n * 3 * c);
    if n > 0 && c > 0 {
        transpose((&qkv[c..], 3 * c), (n, c), (out, n));
    }
}

/// `out[j * ldo + i] = src[i * ld + j]` for the `n x c` matrix `src` (rows `ld` apart): `c`
/// rows of `n` values, `ldo` apart. In registers, 16 x 16 (AVX-512) or 8 x 8 (AVX2) at a
/// time: writing each row's values down a column of the result (a store every `4 ldo` bytes)
/// took a sixth of the window attention's time, and a gather per column a tenth.
pub(crate) fn transpose(
    (src, ld): (&[f32], usize),
    (n, c): (usize, usize),
    (out, ldo): (&mut [f32], usize),
) {
    if n == 0 || c == 0 {
        return;
    }
    assert!(
        ld >= c && ldo >= n,
        "transpose: strides {ld}, {ldo} for {n} x {c}"
    );
    assert!(src.len() >= (n - 1) * ld + c && out.len() >= (c - 1) * ldo + n);
    match Kernel::current() {
        // SAFETY: the CPU has the kernel's instructions (`cpu_isa` names no more than it
        // has); the bounds are asserted above.
        Kernel::Avx512 => unsafe { avx512::transpose((src, ld), (n, c), (out, ldo)) },
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { avx2::transpose((src, ld), (n, c), (out, ldo)) },
        Kernel::Scalar => {
            for (ch, row) in out.chunks_mut(ldo).take(c).enumerate() {
                for (j, v) in row[..n].iter_mut().enumerate() {
                    *v = src[j * ld + ch];
                }
            }
        }
    }
}

/// GFLOP/s of `threads` cores doing nothing but fused multiply-adds at once, in `isa`'s
/// vector width (12 independent sums, enough to keep two FMA pipes of 4 or 5 cycles' latency
/// full): the ceiling as this machine gives it, clock and neighbours included, for the rate
/// benches to measure against. One thread: the fastest of 50 timings; more: their work over
/// the wall time of 20 rounds each, all started together. `None` for scalar code.
#[cfg(test)]
pub(crate) fn fma_peak(isa: CpuIsa, threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const SUMS: usize = 12;
        const STEPS: usize = 1 << 20;
        /// One round of `STEPS` FMAs into each of the `SUMS` sums, in one vector type.
        macro_rules! round {
            ($name:ident, $feature:literal, $set1:ident, $fmadd:ident, $first:ident) => {
                #[target_feature(enable = $feature)]
                fn $name() -> f32 {
                    let (x, y) = ($set1(0.999_999), $set1(1e-7));
                    let mut acc = [$set1(1.0); SUMS];
                    for _ in 0..STEPS {
                        for a in acc.iter_mut() {
                            *a = $fmadd(*a, x, y);
                        }
                    }
                    acc.iter().map(|a| $first(*a)).sum()
                }
            };
        }
        round!(
            avx2,
            "avx2,fma",
            _mm256_set1_ps,
            _mm256_fmadd_ps,
            _mm256_cvtss_f32
        );
        round!(
            avx512,
            "avx512f",
            _mm512_set1_ps,
            _mm512_fmadd_ps,
            _mm512_cvtss_f32
        );
        let (run, lanes): (fn() -> f32, usize) = match isa {
            // SAFETY: the caller names an ISA the CPU has (as `cpu_isa` does).
            CpuIsa::Avx2 => (|| unsafe { avx2() }, 8),
            // SAFETY: as above.
            CpuIsa::Avx512 => (|| unsafe { avx512() }, 16),
            CpuIsa::Scalar => return None,
        };
        let flops = 2.0 * (STEPS * SUMS * lanes) as f64;
        if threads <= 1 {
            let best = (0..50)
                .map(|_| {
                    let t = std::time::Instant::now();
                    std::hint::black_box(run());
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            return Some(flops / best / 1e9);
        }
        let rounds = 20;
        let t = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| (0..rounds).for_each(|_| _ = std::hint::black_box(run())));
            }
        });
        Some(flops * (threads * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, threads);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1), distinct per seed.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The layout both packings must produce: panel p holds columns 48p.., `k` rows of its
    /// width (the last panel's width rounded up to whole vectors), zeros past `n`. On every
    /// instruction set, whose transposes pack the strided source.
    #[test]
    fn strided_and_contiguous_sources_pack_alike_with_zero_padding() {
        crate::ops::cpu::isa::on_each_isa(|| {
            packs_alike(5);
            // Whole 16 x 16 and 8 x 8 transpose blocks, and partial ones.
            packs_alike(37);
            Ok::<(), ()>(())
        })
        .expect("every ISA checked");
    }

    fn packs_alike(k: usize) {
        let n = 53;
        let b = values(k * n, 1);
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let direct = Panels::new(&b, (k, n), (n, 1));
        let strided = Panels::new(&bt, (k, n), (1, k));
        let (direct, strided) = (direct.packed(), strided.packed());
        assert_eq!(direct, strided);
        assert_eq!(direct.len(), k * (48 + 16));
        assert_eq!(direct.as_ptr().align_offset(64), 0);
        // Row 3 of column 50: panel 1 (16 wide), lane 2.
        assert_eq!(direct[k * 48 + 3 * 16 + 2], b[3 * n + 50]);
        // Column 53 of the padded last vector is zero.
        assert_eq!(direct[k * 48 + 3 * 16 + 5], 0.0);
        // Row 4 of column 47: the first panel's last lane.
        assert_eq!(direct[4 * 48 + 47], b[4 * n + 47]);
    }

    /// `start + a · b` in f64 for row-major operands.
    fn reference(
        (m, k, n): (usize, usize, usize),
        a: &[f32],
        b: &[f32],
        init: Option<&[f32]>,
        bias: Option<&[f32]>,
    ) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = init.map_or(0.0, |r| r[i * n + j] as f64);
                s += bias.map_or(0.0, |b| b[j] as f64);
                for p in 0..k {
                    s += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
                c[i * n + j] = s;
            }
        }
        c
    }

    /// Every panel width (1, 2, 3 vectors, partial or not), row counts around the tile and
    /// the task, and each way of starting: zero, bias, rows (a residual), both, and the
    /// output's own earlier contents.
    #[test]
    fn products_match_float64_for_every_start_and_edge() {
        for_each_isa(products_match_float64);
    }

    /// Runs `check` with the kernels held to each ISA this CPU has, scalar included, and
    /// says which ran (a CPU without AVX2 or AVX-512 leaves those out, visibly).
    fn for_each_isa(check: fn()) {
        let isas = crate::ops::cpu::isa::supported();
        eprintln!("panel kernels tested on {isas:?}");
        for isa in isas {
            crate::ops::cpu::isa::with_cpu_isa(isa, || {
                assert_eq!(Kernel::current(), Kernel::from(isa));
                check()
            });
        }
    }

    fn products_match_float64() {
        for (m, k, n) in [
            (1, 1, 1),
            (7, 30, 16),
            (9, 3, 17),
            (8, 64, 30),
            (65, 180, 180),
            (130, 19, 95),
            (64, 7, 49),
            (6, 5, 8),
            (61, 12, 40),
            (121, 33, 33),
        ] {
            let a = values(m * k, 2);
            let b = values(k * n, 3);
            let r = values(m * n, 4);
            let bias = values(n, 5);
            let packed = Panels::new(&b, (k, n), (n, 1));
            for case in 0..5 {
                let mut out = if case == 4 {
                    r.clone()
                } else {
                    vec![f32::NAN; m * n]
                };
                let init = match case {
                    2 | 3 => Some((r.as_ptr(), n)),
                    4 => Some((out.as_ptr(), n)),
                    _ => None,
                };
                let start = Start {
                    init,
                    bias: (case == 1 || case == 3).then_some(bias.as_ptr()),
                };
                // SAFETY: a is m x k, out and r m x n, bias n.
                unsafe {
                    gemm(
                        m,
                        (a.as_ptr(), k),
                        packed.rhs(),
                        (out.as_mut_ptr(), n),
                        start,
                        true,
                        None,
                    )
                };
                let want = reference(
                    (m, k, n),
                    &a,
                    &b,
                    (case >= 2).then_some(&r[..]),
                    (case == 1 || case == 3).then_some(&bias[..]),
                );
                for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (o as f64 - w).abs() < 1e-5 * (k as f64 + 1.0),
                        "{:?} {m}x{k}x{n} start {case}: element {i} is {o}, want {w}",
                        Kernel::current()
                    );
                }
            }
        }
    }

    /// Values copied to the very end of a mapping whose next page may not be read: a
    /// kernel that reads one value past them faults instead of passing unseen.
    #[cfg(unix)]
    struct Guarded {
        base: *mut libc::c_void,
        len: usize,
        data: *const f32,
    }

    #[cfg(unix)]
    impl Guarded {
        fn new(values: &[f32]) -> Self {
            // SAFETY: a fresh private mapping of whole pages, its last page made
            // inaccessible, the values copied into the pages before it.
            unsafe {
                let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
                let bytes = std::mem::size_of_val(values);
                let pages = bytes.div_ceil(page);
                let len = (pages + 1) * page;
                let rw = libc::PROT_READ | libc::PROT_WRITE;
                let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
                let base = libc::mmap(std::ptr::null_mut(), len, rw, flags, -1, 0);
                assert_ne!(base, libc::MAP_FAILED, "mmap");
                let guard = base.cast::<u8>().add(pages * page);
                assert_eq!(libc::mprotect(guard.cast(), page, libc::PROT_NONE), 0);
                let data = guard.sub(bytes).cast::<f32>();
                std::ptr::copy_nonoverlapping(values.as_ptr(), data, values.len());
                Self { base, len, data }
            }
        }
    }

    #[cfg(unix)]
    impl Drop for Guarded {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe { libc::munmap(self.base, self.len) };
        }
    }

    /// Elsewhere a plain copy: the products are still checked, the bounds not.
    #[cfg(not(unix))]
    struct Guarded {
        data: *const f32,
        _values: Vec<f32>,
    }

    #[cfg(not(unix))]
    impl Guarded {
        fn new(values: &[f32]) -> Self {
            let values = values.to_vec();
            Self {
                data: values.as_ptr(),
                _values: values,
            }
        }
    }

    /// An operand read in place (attention's v, its kᵀ) whose last row ends where readable
    /// memory does, for column counts that end in partial vectors and strips.
    #[test]
    fn strided_operands_are_never_read_past_their_end() {
        for_each_isa(strided_products);
    }

    fn strided_products() {
        for (m, k, n, ld) in [
            (13, 30, 30, 90),
            (7, 64, 8, 8),
            (9, 5, 17, 17),
            (64, 49, 49, 49),
            (6, 16, 4, 540),
            (20, 30, 64, 64),
        ] {
            let a = values(m * k, 10);
            let b = values((k - 1) * ld + n, 11);
            let bias = values(m * n, 12);
            let guarded = Guarded::new(&b);
            let rhs = Rhs::Strided {
                ptr: guarded.data,
                k,
                n,
                ld,
            };
            let dense: Vec<f32> = (0..k * n).map(|i| b[i / n * ld + i % n]).collect();
            for with_init in [false, true] {
                let mut out = vec![f32::NAN; m * n];
                let start = Start {
                    init: with_init.then_some((bias.as_ptr(), n)),
                    bias: None,
                };
                // SAFETY: a is m x k, rhs k rows of n values ld apart, out and bias m x n.
                unsafe {
                    gemm(
                        m,
                        (a.as_ptr(), k),
                        rhs,
                        (out.as_mut_ptr(), n),
                        start,
                        false,
                        None,
                    )
                };
                let init = with_init.then_some(&bias[..]);
                let want = reference((m, k, n), &a, &dense, init, None);
                for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (o as f64 - w).abs() < 1e-5 * (k as f64 + 1.0),
                        "{:?} {m}x{k}x{n} (ld {ld}): element {i} is {o}, want {w}",
                        Kernel::current()
                    );
                }
            }
        }
    }

    /// kᵀ of windows whose key and channel counts leave partial 16 x 16 blocks.
    #[test]
    fn keys_transpose_exactly() {
        for_each_isa(keys_transpose);
    }

    fn keys_transpose() {
        for (n, c) in [
            (64, 180),
            (49, 20),
            (16, 16),
            (1, 3),
            (256, 33),
            (12, 7),
            (8, 8),
        ] {
            // The last key's v ends where readable memory does: a block read past its
            // channels there faults.
            let qkv = values(n * 3 * c, 9);
            let guarded = Guarded::new(&qkv);
            // SAFETY: the guarded copy holds the n * 3c values, alive until the end.
            let qkv_in = unsafe { std::slice::from_raw_parts(guarded.data, qkv.len()) };
            let mut out = vec![f32::NAN; c * n];
            transpose_keys(qkv_in, (n, c), &mut out);
            for ch in 0..c {
                for j in 0..n {
                    assert_eq!(
                        out[ch * n + j],
                        qkv[j * 3 * c + c + ch],
                        "{:?} {n}x{c}: ({ch}, {j})",
                        Kernel::current()
                    );
                }
            }
        }
    }

    /// The implicit-patch convolution against the direct sum over taps, zero padding at
    /// every edge, on pixel ranges that start mid-row and end in partial tiles.
    #[test]
    fn conv_pixels_match_the_direct_convolution() {
        for_each_isa(conv_pixels_match);
    }

    fn conv_pixels_match() {
        for (h, wd, cin, cout, p0, rows) in [
            (3, 5, 4, 6, 0, 15),
            (4, 9, 3, 50, 7, 21),
            (1, 1, 2, 1, 0, 1),
            (6, 4, 17, 97, 5, 13),
        ] {
            let image = values(h * wd * cin, 6);
            let w = values(9 * cin * cout, 7);
            let bias = values(cout, 8);
            let packed = Panels::new(&w, (9 * cin, cout), (cout, 1));
            let zeros = vec![0f32; cin];
            let ldc = cout + 3;
            let mut out = vec![f32::NAN; rows * ldc];
            // SAFETY: out holds `rows` rows of cout values ldc apart.
            unsafe {
                conv3x3_pixels(
                    &image,
                    (h, wd, cin),
                    &zeros,
                    &packed,
                    (p0, rows),
                    (out.as_mut_ptr(), ldc),
                    &bias,
                )
            };
            for i in 0..rows {
                let (y, x) = ((p0 + i) / wd, (p0 + i) % wd);
                for o in 0..cout {
                    let mut s = bias[o] as f64;
                    for tap in 0..9 {
                        let (sy, sx) = (y + tap / 3, x + tap % 3);
                        if sy < 1 || sx < 1 || sy > h || sx > wd {
                            continue;
                        }
                        for ci in 0..cin {
                            let v = image[((sy - 1) * wd + sx - 1) * cin + ci] as f64;
                            s += v * w[(tap * cin + ci) * cout + o] as f64;
                        }
                    }
                    let got = out[i * ldc + o] as f64;
                    assert!(
                        (got - s).abs() < 1e-5 * (9 * cin) as f64,
                        "{:?} {h}x{wd}x{cin}->{cout} pixel {}: channel {o} is {got}, want {s}",
                        Kernel::current(),
                        p0 + i
                    );
                }
                // The gap between rows is left alone.
                assert!(out[i * ldc + cout..(i + 1) * ldc]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }

    /// GFLOP/s of one core running one full tile over and over (k = 128: both operands,
    /// 24 KiB and 4 KiB, in L1), on each ISA: the kernel's own rate, against which a whole
    /// product's rate shows what the memory hierarchy costs it, and against [`super::fma_peak`] what the
    /// tile's own loads and stores cost. The fastest of 200 timings.
    /// `cargo test --release --lib tile_kernel_rate -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn tile_kernel_rate() {
        crate::ops::cpu::isa::on_each_isa(|| {
            let kernel = Kernel::current();
            let (k, mr) = (128, kernel.mr());
            let a = values(MAX_MR * k, 1);
            let b = Panels::new(&values(k * PANEL, 2), (k, PANEL), (PANEL, 1));
            let mut c = vec![0f32; MAX_MR * PANEL];
            let rows: [*const f32; MAX_MR] = std::array::from_fn(|i| a[i * k..].as_ptr());
            let reps = 500;
            let best = (0..200)
                .map(|_| {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        // SAFETY: each row holds k values, the panel k rows of PANEL, c
                        // MAX_MR rows of PANEL.
                        unsafe {
                            kernel.tile(
                                k,
                                &rows,
                                (b.packed().as_ptr(), PANEL),
                                true,
                                (c.as_mut_ptr(), PANEL),
                                (mr, PANEL),
                                Start::ZERO,
                            )
                        };
                        std::hint::black_box(&mut c);
                    }
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let flops = 2.0 * (reps * mr * k * PANEL) as f64;
            let rate = flops / best / 1e9;
            match fma_peak(cpu_isa(), 1) {
                Some(peak) => {
                    // Every core at once: what a machine whose cores share a physical one
                    // (or whose neighbours load it) gives a parallel product.
                    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                    let all = fma_peak(cpu_isa(), cores).unwrap_or(0.0);
                    eprintln!(
                        "{kernel:?}: {mr} x {PANEL} tile, k {k}: {rate:.1} GFLOP/s on one core, \
                         {:.0}% of its FMA peak ({peak:.1} GFLOP/s; {all:.0} on all {cores} \
                         cores at once)",
                        100.0 * rate / peak
                    )
                }
                None => eprintln!("{kernel:?}: {mr} x {PANEL} tile, k {k}: {rate:.1} GFLOP/s"),
            }
            Ok::<(), ()>(())
        })
        .expect("every ISA");
    }
}
