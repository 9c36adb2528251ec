//! bf16 matrix products on the CPU: inputs rounded to bf16, products accumulated in f32.
//!
//! Two kernels, chosen once at run time: Intel AMX tiles (`tdpbf16ps`, a 16 x 16 x 32 product
//! per instruction) where the CPU and the OS allow them, else AVX512-BF16 (`vdpbf16ps`, pairs
//! of products into 16 f32 lanes). Without either, the CPU has no bf16 arithmetic and callers
//! stay in f32.
//!
//! The right-hand side (a layer's weights, or an attention operand) is packed into panels of
//! [`NR`] columns holding pairs of consecutive rows, the layout both instructions read: each
//! 32-bit lane is (row 2p, row 2p+1) of one column. The left-hand side stays f32 in memory
//! and is rounded while it is packed for each product, so activations, softmax, LayerNorm
//! and residual sums stay f32.

use std::cell::RefCell;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::isa::{cpu_isa, CpuIsa};
use super::shared::Shared;

/// Columns per packed panel: two 16-lane vectors, or two AMX tiles side by side.
pub const NR: usize = 32;
/// Row pairs are padded to a multiple of this: one AMX tile holds 16 pairs (32 bf16) per row.
const KP_ALIGN: usize = 16;
/// AVX512 kernel: rows per micro-kernel call (2 x 12 accumulators leave registers for the
/// operands), and row pairs per cache block (a `KC x NR` panel block, 16 KiB, stays in L1).
const MR: usize = 12;
const KC: usize = 128;
/// AMX kernel: rows per output block (two tiles of 16 rows).
const AMX_ROWS: usize = 32;
/// Rows per parallel task.
const MC: usize = 96;

/// The bf16 instructions a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Amx,
    Avx512,
}

/// The bf16 instructions worth using on this CPU (and OS), if any: AMX where present, else
/// AVX512-BF16 on AMD cores (where it outruns the f32 GEMM). `UPSCALE_BF16_ISA=avx512`
/// chooses the vector kernel unconditionally (to compare the two on an AMX machine). None
/// where our kernels are held below AVX-512 (`UPSCALE_CPU_ISA`), as on a CPU without it.
pub fn isa() -> Option<Isa> {
    if cpu_isa() < CpuIsa::Avx512 {
        return None;
    }
    static ISA: OnceLock<Option<Isa>> = OnceLock::new();
    *ISA.get_or_init(|| {
        let avx512 = cpu_has_avx512_bf16();
        let forced = crate::switches::from_env().unwrap_or_default().bf16_vector;
        if forced && avx512 {
            return Some(Isa::Avx512);
        }
        if amx_bf16() {
            Some(Isa::Amx)
        } else if avx512 && vector_kernel_pays_off() {
            Some(Isa::Avx512)
        } else {
            None
        }
    })
}

/// Whether the AVX512-BF16 kernel is worth taking over f32 on this CPU. `vdpbf16ps` does
/// twice the multiply-adds of an f32 FMA per instruction, but Intel cores issue it at well
/// under half the FMA's rate (on a Sapphire Rapids Xeon with AMX switched off the kernel
/// reached 0.45x the f32 GEMM), while on a Zen 5 EPYC it runs at 1.0-1.9x on the model's
/// layer shapes. Decided by the CPU's vendor, not by a timing: a timing near 1.0x flips from
/// run to run, and the same command must give the same pixels every time.
fn vector_kernel_pays_off() -> bool {
    cpu_vendor() == *b"AuthenticAMD"
}

/// The CPU's vendor string ("GenuineIntel", "AuthenticAMD"), spelled by CPUID leaf 0 in EBX,
/// EDX, ECX; blank off x86-64.
fn cpu_vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        vendor
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [b' '; 12]
    }
}

/// `c = a · b` in f32 for row-major `m x k` and `k x n` operands: what bf16 competes with.
#[cfg(test)]
fn f32_product(
    (m, k, n): (usize, usize, usize),
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    parallelism: gemm::Parallelism,
) {
    assert!(c.len() >= m * n && a.len() >= m * k && b.len() >= k * n);
    // SAFETY: all three matrices are row-major with exactly these sizes (asserted).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Whether this CPU has bf16 arithmetic worth using that [`gemm()`] can run.
pub fn supported() -> bool {
    isa().is_some()
}

/// Whether the AVX512-BF16 instructions may run: the CPU has them and our kernels are not
/// held below AVX-512.
fn avx512_bf16() -> bool {
    cpu_isa() == CpuIsa::Avx512 && cpu_has_avx512_bf16()
}

fn cpu_has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AMX-BF16 in the CPU (CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE), and Linux's
/// permission for this process to use the tile registers, which must be asked for.
fn amx_bf16() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // Leaf 7 exists where the maximum leaf (leaf 0's EAX) reaches it.
        use std::arch::x86_64::__cpuid_count;
        if __cpuid_count(0, 0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments; it changes only whether this
        // process may use the AMX state (for all its threads).
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// f32 bits to bf16 bits, rounding to nearest even. Plain integer arithmetic, so loops over
/// it vectorise; NaN payloads are not preserved (activations are finite here).
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16
}

/// Two values as the (low, high) bf16 halves of one lane.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) | (bf16_bits(hi) << 16)
}

/// A `k x n` right-hand side in bf16, packed in panels of [`NR`] columns, each `pairs` rows
/// of `NR` lanes; rows past `k` and columns past `n` are zero, so they add nothing.
#[derive(Clone, Default)]
pub struct PackedB {
    k: usize,
    n: usize,
    pairs: usize,
    data: Vec<u32>,
}

impl PackedB {
    /// Packs `b[r][c] = src[r * rs + c * cs]` for `r < k`, `c < n`.
    pub fn new(src: &[f32], (k, n): (usize, usize), (rs, cs): (usize, usize)) -> Self {
        let mut p = Self::default();
        p.repack(src, (k, n), (rs, cs));
        p
    }

    /// [`PackedB::new`] reusing this buffer (attention packs an operand per window and head).
    pub fn repack(&mut self, src: &[f32], (k, n): (usize, usize), (rs, cs): (usize, usize)) {
        if k > 0 && n > 0 {
            assert!(
                (k - 1) * rs + (n - 1) * cs < src.len(),
                "operand out of bounds"
            );
        }
        self.k = k;
        self.n = n;
        self.pairs = k.div_ceil(2).next_multiple_of(KP_ALIGN);
        self.data.clear();
        self.data.resize(n.div_ceil(NR) * self.pairs * NR, 0);
        if k == 0 || n == 0 {
            return;
        }
        // The two layouts attention and the layers hand over, a pair's two values side by
        // side (kᵀ, weights) or a row's columns side by side (v), take vector code; the
        // scalar loop gathers one value at a time.
        if avx512_bf16() && (rs == 1 || cs == 1) {
            // SAFETY: the CPU has the instructions; the bounds were asserted above.
            unsafe {
                if rs == 1 {
                    self.fill_pairs_contiguous(src, cs)
                } else {
                    self.fill_columns_contiguous(src, rs)
                }
            }
        } else {
            self.fill(src, (rs, cs));
        }
    }

    /// Writes the used pairs of every panel (the rest stays zero), one value at a time.
    fn fill(&mut self, src: &[f32], (rs, cs): (usize, usize)) {
        let (k, n, kp) = (self.k, self.n, self.pairs);
        for (panel, out) in self.data.chunks_exact_mut(kp * NR).enumerate() {
            let cols = (n - panel * NR).min(NR);
            for (p, row) in out.chunks_exact_mut(NR).take(k.div_ceil(2)).enumerate() {
                let r = 2 * p;
                let lo = &src[r * rs..];
                if r + 1 < k {
                    let hi = &src[(r + 1) * rs..];
                    for (j, v) in row[..cols].iter_mut().enumerate() {
                        let c = (panel * NR + j) * cs;
                        *v = pair(lo[c], hi[c]);
                    }
                } else {
                    for (j, v) in row[..cols].iter_mut().enumerate() {
                        *v = bf16_bits(lo[(panel * NR + j) * cs]);
                    }
                }
            }
        }
    }

    /// [`Self::fill`] for row stride 1: column `c` is `k` consecutive values at `src[c * cs..]`,
    /// so each of its pairs is two neighbours. 32 values of a column round into 16 pairs at
    /// once; a gather then turns 32 columns' pairs into the panel's rows of 32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512-BF16; `src` holds `(k - 1) + (n - 1) * cs + 1` values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn fill_pairs_contiguous(&mut self, src: &[f32], cs: usize) {
        use std::arch::x86_64::*;
        let (k, n, kp) = (self.k, self.n, self.pairs);
        // Column j's 16 pairs of one chunk at block[16 j..]; lane j of the panel's row i is
        // then element 16 j + i.
        let mut block = [0u32; NR * 16];
        let across = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(16),
        );
        for (panel, out) in self.data.chunks_exact_mut(kp * NR).enumerate() {
            let cols = (n - panel * NR).min(NR);
            block.fill(0);
            // kp is a multiple of 16 pairs, so the chunks tile it exactly.
            for (chunk, rows) in out.chunks_exact_mut(16 * NR).enumerate() {
                let r0 = 32 * chunk;
                if r0 >= k {
                    break;
                }
                let left = k - r0;
                let mask = |from: usize| -> __mmask16 {
                    match left.saturating_sub(from) {
                        0 => 0,
                        l if l >= 16 => !0,
                        l => (1u16 << l) - 1,
                    }
                };
                let (m_lo, m_hi) = (mask(0), mask(16));
                for j in 0..cols {
                    // SAFETY: lanes under the masks are rows r0.. of column panel*NR + j,
                    // inside `src` by the caller's bound; block holds 16 lanes at 16 j.
                    unsafe {
                        let base = src.as_ptr().add((panel * NR + j) * cs + r0);
                        let lo = _mm512_maskz_loadu_ps(m_lo, base);
                        let hi = if m_hi == 0 {
                            _mm512_setzero_ps()
                        } else {
                            _mm512_maskz_loadu_ps(m_hi, base.add(16))
                        };
                        let bits =
                            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
                        _mm512_storeu_si512(block.as_mut_ptr().add(16 * j).cast(), bits);
                    }
                }
                for (i, row) in rows.chunks_exact_mut(NR).enumerate() {
                    // SAFETY: the gathers read block[16 j + i] for j < 32, inside the block;
                    // the row has NR = 32 lanes.
                    unsafe {
                        let idx = _mm512_add_epi32(across, _mm512_set1_epi32(i as i32));
                        let first = _mm512_i32gather_epi32::<4>(idx, block.as_ptr().cast());
                        let second =
                            _mm512_i32gather_epi32::<4>(idx, block.as_ptr().add(256).cast());
                        _mm512_storeu_si512(row.as_mut_ptr().cast(), first);
                        _mm512_storeu_si512(row.as_mut_ptr().add(16).cast(), second);
                    }
                }
            }
        }
    }

    /// [`Self::fill`] for column stride 1: row `r` is `n` consecutive values at
    /// `src[r * rs..]`. Rows 2p and 2p + 1 round 16 columns at a time and interleave into
    /// the low and high halves of the lanes.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512-BF16; `src` holds `(k - 1) * rs + (n - 1) + 1` values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn fill_columns_contiguous(&mut self, src: &[f32], rs: usize) {
        use std::arch::x86_64::*;
        let (k, n, kp) = (self.k, self.n, self.pairs);
        let round = |v: __m512| -> __m512i {
            // SAFETY: the caller's CPU has the instructions.
            _mm512_cvtepu16_epi32(unsafe {
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
            })
        };
        for (panel, out) in self.data.chunks_exact_mut(kp * NR).enumerate() {
            let cols = (n - panel * NR).min(NR);
            for (p, row) in out.chunks_exact_mut(NR).take(k.div_ceil(2)).enumerate() {
                for half in 0..2 {
                    let c0 = panel * NR + 16 * half;
                    let m: __mmask16 = match cols.saturating_sub(16 * half) {
                        0 => continue,
                        l if l >= 16 => !0,
                        l => (1u16 << l) - 1,
                    };
                    // SAFETY: the masked lanes are columns c0.. of rows 2p and 2p + 1 (when
                    // under k), inside `src` by the caller's bound; the row has 32 lanes.
                    unsafe {
                        let lo = _mm512_maskz_loadu_ps(m, src.as_ptr().add(2 * p * rs + c0));
                        let hi = if 2 * p + 1 < k {
                            _mm512_maskz_loadu_ps(m, src.as_ptr().add((2 * p + 1) * rs + c0))
                        } else {
                            _mm512_setzero_ps()
                        };
                        let lanes = _mm512_or_si512(round(lo), _mm512_slli_epi32::<16>(round(hi)));
                        _mm512_storeu_si512(row.as_mut_ptr().add(16 * half).cast(), lanes);
                    }
                }
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn fill_pairs_contiguous(&mut self, src: &[f32], cs: usize) {
        self.fill(src, (1, cs))
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn fill_columns_contiguous(&mut self, src: &[f32], rs: usize) {
        self.fill(src, (rs, 1))
    }

    /// Columns `first..first + cols` as a packed matrix of their own, where `first` starts a
    /// panel (`None` otherwise).
    pub fn column_block(&self, first: usize, cols: usize) -> Option<Self> {
        if !first.is_multiple_of(NR) || first + cols > self.n {
            return None;
        }
        let panel = self.pairs * NR;
        let start = first / NR * panel;
        let mut data = self.data[start..start + cols.div_ceil(NR) * panel].to_vec();
        // Lanes past `cols` in the last panel belong to the next block: zero them.
        if !cols.is_multiple_of(NR) {
            let last = data.len() - panel;
            for row in data[last..].chunks_exact_mut(NR) {
                row[cols % NR..].fill(0);
            }
        }
        Some(Self {
            k: self.k,
            n: cols,
            pairs: self.pairs,
            data,
        })
    }

    pub fn rows(&self) -> usize {
        self.k
    }

    pub fn cols(&self) -> usize {
        self.n
    }
}

thread_local! {
    /// The left-hand side of one task, packed: reused across calls on each thread.
    static A_PACK: RefCell<PackedA> = RefCell::new(PackedA::default());
}

/// A left-hand side rounded to bf16: rows of `pairs` lanes (lane p holds values 2p and 2p + 1),
/// padded to a multiple of [`AMX_ROWS`] rows for AMX (what a tile loads, 16 rows at a stride)
/// or of [`MR`] rows for the vector kernel (which broadcasts one lane of each of its rows).
/// Row-major for both, so that a row is rounded 32 values per instruction; interleaving the
/// vector kernel's rows instead cost a scalar store per pair, a fifth of a bf16 forward on a
/// CPU without AMX. Filled row by row, so that a producer can round each row while it is
/// still in cache.
#[derive(Default)]
pub struct PackedA {
    isa: Option<Isa>,
    rows: usize,
    k: usize,
    pairs: usize,
    data: Vec<u32>,
}

impl PackedA {
    /// Makes room for `rows` rows of `k` values, laid out for a product with `b` on `isa`.
    /// Every row must then be written with [`PackedA::set_row`]. The padding rows past `rows`
    /// may hold stale values from an earlier use: each output row depends on its own input
    /// row only, and the kernels never store the padding rows' outputs.
    pub fn prepare(&mut self, isa: Isa, rows: usize, b: &PackedB) {
        let padded = match isa {
            Isa::Amx => rows.next_multiple_of(AMX_ROWS),
            Isa::Avx512 => rows.next_multiple_of(MR),
        };
        let len = padded * b.pairs;
        if self.isa != Some(isa) || self.pairs != b.pairs || self.data.len() < len {
            self.data.clear();
            self.data.resize(len, 0);
        }
        self.isa = Some(isa);
        self.rows = rows;
        self.k = b.k;
        self.pairs = b.pairs;
    }

    /// Row `r` as its `k / 2` pairs (`k` even), for a caller that rounds the row in pieces
    /// ([`round_pairs`]) and must write all of them; the padding pairs past them are zeroed
    /// here.
    pub fn row_pairs_mut(&mut self, r: usize) -> &mut [u32] {
        assert!(
            r < self.rows && self.k.is_multiple_of(2),
            "row {r} of {}, k {}",
            self.rows,
            self.k
        );
        let kp = self.pairs;
        let (used, padding) = self.data[r * kp..(r + 1) * kp].split_at_mut(self.k / 2);
        padding.fill(0);
        used
    }

    /// Rounds `row` (`k` values) into row `r`; the pairs past `k` are zeroed.
    pub fn set_row(&mut self, r: usize, row: &[f32]) {
        assert!(
            r < self.rows && row.len() == self.k,
            "row {r} of {}",
            self.rows
        );
        assert!(self.isa.is_some(), "`prepare` sets the ISA");
        let (kp, used) = (self.pairs, self.k.div_ceil(2));
        let (out, padding) = self.data[r * kp..(r + 1) * kp].split_at_mut(used);
        round_pairs(row, out);
        padding.fill(0);
    }
}

/// Work done on a block of finished output rows while they are still in cache.
pub type Epilogue = dyn Fn(&mut [f32]) + Sync;

/// `dst (+)= a · b` with `a` an `m x k` f32 matrix (rows `lda` apart, unit column stride) and
/// `dst` `m x b.cols()` (rows `ldc` apart); `accumulate` adds onto dst's contents. Row blocks
/// run in parallel when `parallel` is set; `then`, if given, runs on each block's rows once
/// they are final.
///
/// # Safety
/// `isa` must be one this CPU offers ([`isa`]). `a` must hold `m` rows of `k = b.rows()`
/// values `lda` apart, and `dst` `m` rows of `b.cols()` values `ldc` apart, not overlapping
/// `a` nor written by anyone else meanwhile, initialised where `accumulate` is set.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    isa: Isa,
    m: usize,
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    (a, lda): (*const f32, usize),
    b: &PackedB,
    parallel: bool,
    then: Option<&Epilogue>,
) {
    if m == 0 || b.n == 0 {
        return;
    }
    assert!(
        then.is_none() || ldc == b.n,
        "an epilogue needs contiguous output rows"
    );
    // SAFETY: each row block reads its own rows of `a` and writes its own rows of dst (see
    // above), both alive until the blocks are done.
    let ptrs = unsafe { Shared::new((a, dst)) };
    let block = |i0: usize| {
        let (a, dst) = ptrs.get();
        let rows = MC.min(m - i0);
        A_PACK.with_borrow_mut(|pack| {
            pack.prepare(isa, rows, b);
            for r in 0..rows {
                // SAFETY: row i0 + r of the caller's `a`.
                let row = unsafe { std::slice::from_raw_parts(a.add((i0 + r) * lda), b.k) };
                pack.set_row(r, row);
            }
            // SAFETY: rows i0..i0+rows of dst, inside the caller's bounds; each block writes
            // only its own rows of dst; the caller vouches for the ISA.
            unsafe {
                let dst = dst.add(i0 * ldc);
                product_packed(pack, b, dst, ldc, accumulate);
                if let Some(then) = then {
                    // The block's rows are contiguous (asserted above) and its own.
                    then(std::slice::from_raw_parts_mut(dst, rows * ldc));
                }
            }
        });
    };
    let blocks = m.div_ceil(MC);
    if parallel && blocks > 1 {
        (0..blocks).into_par_iter().for_each(|i| block(i * MC));
    } else {
        (0..blocks).for_each(|i| block(i * MC));
    }
}

/// `dst (+)= a · b` for an already packed `a`.
///
/// # Safety
/// The CPU has `a`'s ISA; `dst` holds `a`'s rows of `b.cols()` values `ldc` apart
/// (initialised if `accumulate`).
unsafe fn product_packed(a: &PackedA, b: &PackedB, dst: *mut f32, ldc: usize, accumulate: bool) {
    assert!(
        a.k == b.k && a.pairs == b.pairs,
        "operands packed for other shapes"
    );
    // The kernels walk every row group of the slice they are given: exactly `a.rows` rows,
    // padded, not the whole (possibly larger, reused) buffer.
    // SAFETY: forwarded to the caller; `prepare` sized the packing for these rows.
    unsafe {
        match a.isa {
            Some(Isa::Amx) => {
                let data = &a.data[..a.rows.next_multiple_of(AMX_ROWS) * a.pairs];
                amx::block_product(data, a.rows, b, dst, ldc, accumulate)
            }
            Some(Isa::Avx512) => {
                let data = &a.data[..a.rows.next_multiple_of(MR) * a.pairs];
                block_product(data, a.rows, b, dst, ldc, accumulate)
            }
            None => {}
        }
    }
}

/// `dst (+)= a · b` on one thread, with `a` packed by the caller ([`PackedA`]): attention rounds
/// each row of probabilities as its softmax finishes it, convolutions round their patches
/// straight from the image. `accumulate` adds onto dst's contents.
///
/// # Safety
/// The CPU has the ISA `a` was prepared for; `dst` holds `a`'s rows of `b.cols()` values
/// `ldc` apart (initialised if `accumulate`) and overlaps no operand.
pub unsafe fn gemm_packed(a: &PackedA, b: &PackedB, dst: *mut f32, ldc: usize, accumulate: bool) {
    // SAFETY: forwarded to the caller.
    unsafe { product_packed(a, b, dst, ldc, accumulate) }
}

/// `src` rounded to bf16 pairs into `out` (an odd last value pairs with zero).
pub fn round_pairs(src: &[f32], out: &mut [u32]) {
    assert_eq!(
        src.len().div_ceil(2),
        out.len(),
        "pairs for {} values",
        src.len()
    );
    if avx512_bf16() {
        // SAFETY: the CPU has the instructions (checked above).
        unsafe { round_row_avx512(src, out) };
    } else {
        round_row(src, out);
    }
}

/// `row` rounded to bf16 pairs: `out[p]` holds values 2p (low half) and 2p + 1.
fn round_row(row: &[f32], out: &mut [u32]) {
    let (whole, rest) = row.as_chunks::<2>();
    for (v, two) in out.iter_mut().zip(whole) {
        *v = pair(two[0], two[1]);
    }
    if let [last] = rest {
        out[whole.len()] = bf16_bits(*last);
    }
}

/// [`round_row`] 32 values per instruction (`vcvtne2ps2bf16` rounds to nearest even, as
/// [`bf16_bits`] does; it only differs on subnormal inputs, which it flushes to zero).
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_row_avx512(row: &[f32], out: &mut [u32]) {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_cvtne2ps_pbh, _mm512_loadu_ps, _mm512_mask_storeu_epi32,
        _mm512_maskz_loadu_ps, _mm512_storeu_si512,
    };
    let (blocks, rest) = row.as_chunks::<32>();
    assert!(out.len() >= row.len().div_ceil(2));
    for (block, out) in blocks.iter().zip(out.chunks_exact_mut(16)) {
        // SAFETY: 32 values read from the block, 16 lanes written to `out`'s chunk.
        unsafe {
            let lo = _mm512_loadu_ps(block.as_ptr());
            let hi = _mm512_loadu_ps(block.as_ptr().add(16));
            let v = _mm512_cvtne2ps_pbh(hi, lo);
            let bits = std::mem::transmute::<__m512bh, __m512i>(v);
            _mm512_storeu_si512(out.as_mut_ptr().cast(), bits);
        }
    }
    // The tail (all of a 30-value attention head) through masks rather than scalar rounding.
    if !rest.is_empty() {
        let out = &mut out[blocks.len() * 16..];
        let lanes = |n: usize| ((1u32 << n) - 1) as u16;
        let (lo_n, hi_n) = (rest.len().min(16), rest.len().saturating_sub(16));
        // SAFETY: the masked loads read only the `rest.len()` values of the tail and the
        // masked store writes only its `rest.len().div_ceil(2)` lanes, which `out` holds.
        unsafe {
            let lo = _mm512_maskz_loadu_ps(lanes(lo_n), rest.as_ptr());
            let hi = _mm512_maskz_loadu_ps(lanes(hi_n), rest.as_ptr().add(lo_n));
            let v = _mm512_cvtne2ps_pbh(hi, lo);
            let bits = std::mem::transmute::<__m512bh, __m512i>(v);
            _mm512_mask_storeu_epi32(out.as_mut_ptr().cast(), lanes(rest.len().div_ceil(2)), bits);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn round_row_avx512(row: &[f32], out: &mut [u32]) {
    round_row(row, out)
}

/// All of one packed row block times `b` with the AVX512 kernel, cache block by cache block.
///
/// # Safety
/// `dst` holds `rows` rows of `b.cols()` values `ldc` apart (initialised if `accumulate`).
unsafe fn block_product(
    apack: &[u32],
    rows: usize,
    b: &PackedB,
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let kp = b.pairs;
    // The pairs past k are zero in both operands (padding for AMX's 16-pair tiles): this
    // kernel skips them, which adds nothing but time (6% of the pairs at DRCT's K of 180).
    let used = b.k.div_ceil(2);
    for p0 in (0..used).step_by(KC) {
        let kc = KC.min(used - p0);
        let load_c = accumulate || p0 > 0;
        for (panel, bp) in b.data.chunks_exact(kp * NR).enumerate() {
            let cols = (b.n - panel * NR).min(NR);
            for (g, ap) in apack.chunks_exact(kp * MR).enumerate() {
                let r = (rows - g * MR).min(MR);
                // SAFETY: kc pairs from p0 lie inside both packed panels; the output tile is
                // r rows of `cols` columns inside dst.
                unsafe {
                    micro(
                        kc,
                        (ap[p0..].as_ptr(), kp),
                        bp[p0 * NR..].as_ptr(),
                        dst.add(g * MR * ldc + panel * NR),
                        ldc,
                        (r, cols),
                        load_c,
                    );
                }
            }
        }
    }
}
/// One `MR x NR` output tile over `kc` pairs: `MR * 2` vector accumulators, each step a
/// broadcast pair of `a` against two vectors of `b`.
///
/// # Safety
/// `a` holds `MR` rows of `kc` pairs, `lda` apart, and `b` `kc * NR` values; `c` the tile's
/// `rows x cols` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro(
    kc: usize,
    (a, lda): (*const u32, usize),
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    (rows, cols): (usize, usize),
    load_c: bool,
) {
    use std::arch::x86_64::*;
    // The output tile's lines are usually not in cache (its rows are ldc apart in a large
    // map); asking for them now lets the misses overlap the products instead of stalling the
    // loads and stores after them (6% of a bf16 forward on a Zen 5 core).
    for r in 0..rows {
        // A prefetch never faults; wrapping arithmetic keeps the address computation defined.
        let row = c.wrapping_add(r * ldc);
        _mm_prefetch::<_MM_HINT_T0>(row.cast());
        if cols > 16 {
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(16).cast());
        }
    }
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kc {
        // SAFETY: inside the caller's kc * NR values and MR rows of kc pairs; the bf16
        // vectors are the same 512 bits reinterpreted.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_epi32(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_epi32(b.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.add(r * lda + p) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
            }
        }
    }
    let m0: __mmask16 = if cols >= 16 { 0xffff } else { (1 << cols) - 1 };
    let m1: __mmask16 = if cols >= 32 {
        0xffff
    } else if cols > 16 {
        (1 << (cols - 16)) - 1
    } else {
        0
    };
    for (r, acc) in acc.iter().enumerate().take(rows) {
        // SAFETY: row r < rows of the tile, masked to its columns.
        unsafe {
            let row = c.add(r * ldc);
            let (mut v0, mut v1) = (acc[0], acc[1]);
            if load_c {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, row));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, row.add(16)));
            }
            _mm512_mask_storeu_ps(row, m0, v0);
            _mm512_mask_storeu_ps(row.add(16), m1, v1);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro(
    _: usize,
    _: (*const u32, usize),
    _: *const u32,
    _: *mut f32,
    _: usize,
    _: (usize, usize),
    _: bool,
) {
    unreachable!("bf16 products are only offered where `supported()` is true")
}

/// The AMX kernel: tile registers 0-3 hold a 32 x 32 f32 output block (2 x 2 tiles of
/// 16 x 16), 4-5 two 16-row slices of the left operand, 6-7 two 16-column slices of the
/// right one; each step of 16 pairs is four `tdpbf16ps`.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use std::arch::asm;

    use super::{PackedB, AMX_ROWS, KP_ALIGN, NR};

    /// Palette 1, every tile 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    const CONFIG: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        TileConfig(c)
    };

    /// An output block that does not fit the tiles exactly goes through this buffer.
    #[repr(C, align(64))]
    struct Block([f32; AMX_ROWS * NR]);

    /// # Safety
    /// The CPU has AMX-BF16 and the process has the OS's permission ([`crate::ops::cpu::bf16::isa`]);
    /// `apack` holds rows padded to a multiple of `AMX_ROWS`, `b.pairs` pairs each; `dst`
    /// holds `rows` rows of `b.cols()` values `ldc` apart (initialised if `accumulate`).
    pub(super) unsafe fn block_product(
        apack: &[u32],
        rows: usize,
        b: &PackedB,
        dst: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        let kp = b.pairs;
        debug_assert!(
            kp.is_multiple_of(KP_ALIGN) && apack.len() >= rows.next_multiple_of(AMX_ROWS) * kp
        );
        let mut spill = Block([0.0; AMX_ROWS * NR]);
        // SAFETY: the configuration is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack)) };
        for (panel, bp) in b.data.chunks_exact(kp * NR).enumerate() {
            let cols = (b.n - panel * NR).min(NR);
            for (g, ap) in apack.chunks_exact(AMX_ROWS * kp).enumerate() {
                let r = (rows - g * AMX_ROWS).min(AMX_ROWS);
                // SAFETY: the tile rows read lie in `ap` (32 rows of kp pairs) and `bp` (kp
                // rows of NR lanes); the block written is r x cols inside dst, or `spill`.
                unsafe {
                    let out = dst.add(g * AMX_ROWS * ldc + panel * NR);
                    if r == AMX_ROWS && cols == NR {
                        tile_block(ap, bp, kp, out, ldc, accumulate);
                    } else {
                        for i in 0..r {
                            let row = &mut spill.0[i * NR..(i + 1) * NR];
                            row.fill(0.0);
                            if accumulate {
                                let src = std::slice::from_raw_parts(out.add(i * ldc), cols);
                                row[..cols].copy_from_slice(src);
                            }
                        }
                        tile_block(ap, bp, kp, spill.0.as_mut_ptr(), NR, true);
                        for i in 0..r {
                            let dst = std::slice::from_raw_parts_mut(out.add(i * ldc), cols);
                            dst.copy_from_slice(&spill.0[i * NR..i * NR + cols]);
                        }
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state.
        unsafe { asm!("tilerelease", options(nostack)) };
    }

    /// One 32 x 32 block: `c (+)= a · b` over all `kp` pairs, `c` rows `ldc` apart.
    ///
    /// # Safety
    /// As [`block_product`], with the tile configuration loaded; `c` holds 32 rows of 32.
    unsafe fn tile_block(a: &[u32], b: &[u32], kp: usize, c: *mut f32, ldc: usize, load: bool) {
        let cs = ldc * 4;
        let c1 = c.wrapping_add(16);
        let c2 = c.wrapping_add(16 * ldc);
        let c3 = c2.wrapping_add(16);
        // SAFETY: four 16 x 16 f32 tiles inside the caller's 32 x 32 block.
        unsafe {
            if load {
                asm!(
                    "tileloadd tmm0, [{c0} + {s}*1]",
                    "tileloadd tmm1, [{c1} + {s}*1]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c3} + {s}*1]",
                    c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                    s = in(reg) cs, options(nostack, readonly),
                );
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            }
        }
        let a0 = a.as_ptr();
        let a1 = a[16 * kp..].as_ptr();
        let (astride, bstride) = (kp * 4, NR * 4);
        for p in (0..kp).step_by(KP_ALIGN) {
            // SAFETY: 16 rows of 16 pairs from pair p of both operands: inside `a` (32 rows of
            // kp) and `b` (kp rows of NR lanes, the two tiles' columns side by side).
            unsafe {
                asm!(
                    "tileloadd tmm4, [{a0} + {as}*1]",
                    "tileloadd tmm5, [{a1} + {as}*1]",
                    "tileloadd tmm6, [{b0} + {bs}*1]",
                    "tileloadd tmm7, [{b1} + {bs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(p), a1 = in(reg) a1.add(p),
                    b0 = in(reg) b.as_ptr().add(p * NR), b1 = in(reg) b.as_ptr().add(p * NR + 16),
                    as = in(reg) astride, bs = in(reg) bstride,
                    options(nostack, readonly),
                );
            }
        }
        // SAFETY: as the loads above.
        unsafe {
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                s = in(reg) cs, options(nostack),
            );
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod amx {
    pub(super) unsafe fn block_product(
        _: &[u32],
        _: usize,
        _: &super::PackedB,
        _: *mut f32,
        _: usize,
        _: bool,
    ) {
        unreachable!("AMX is only offered on x86-64 Linux")
    }
}

/// Both kernels where the CPU has them, for tests: an AMX machine also runs the vector
/// kernel.
#[cfg(test)]
pub(crate) fn available_isas() -> Vec<Isa> {
    let mut v = Vec::new();
    if isa() == Some(Isa::Amx) {
        v.push(Isa::Amx);
    }
    if avx512_bf16() {
        v.push(Isa::Avx512);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vendor the AVX512-BF16 choice rests on reads as the kernel reports it.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn cpu_vendor_matches_the_kernels_report() {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let reported = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap()
            .trim();
        assert_eq!(std::str::from_utf8(&cpu_vendor()).unwrap(), reported);
    }

    fn round(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    /// Deterministic values in [-2, 2) with all mantissa bits in use.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// The product of the bf16-rounded operands in f64: what the kernel computes up to the
    /// order of its f32 sums.
    fn reference(a: &[f32], lda: usize, b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|t| f64::from(round(a[i * lda + t])) * f64::from(round(b[t * n + j])))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn products_match_the_rounded_operands_on_awkward_shapes() {
        let isas = available_isas();
        if isas.is_empty() {
            eprintln!("bf16 kernels not tested: this CPU has no bf16 arithmetic");
        }
        // Sizes below, at and past the vector, micro-tile and cache-block edges, odd k.
        for (m, k, n) in [
            (1, 1, 1),
            (5, 3, 17),
            (12, 30, 32),
            (13, 31, 33),
            (97, 257, 48),
            (200, 300, 70),
            (64, 576, 256),
        ] {
            let lda = k + 3;
            let a = values(m * lda, (m * k) as u64);
            let b = values(k * n, (k + n) as u64);
            let packed = PackedB::new(&b, (k, n), (n, 1));
            let want = reference(&a, lda, &b, (m, k, n));
            for (isa, accumulate, parallel) in isas
                .iter()
                .flat_map(|&i| [(i, false, false), (i, true, true)])
            {
                let base = values(m * n, 7);
                let mut dst = if accumulate {
                    base.clone()
                } else {
                    vec![f32::NAN; m * n]
                };
                // SAFETY: the CPU has the instructions; a is m x k with row stride lda, dst
                // m x n, both inside their vectors.
                unsafe {
                    gemm(
                        isa,
                        m,
                        dst.as_mut_ptr(),
                        n,
                        accumulate,
                        (a.as_ptr(), lda),
                        &packed,
                        parallel,
                        None,
                    )
                };
                for i in 0..m * n {
                    let w = want[i] + if accumulate { f64::from(base[i]) } else { 0.0 };
                    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                    assert!(
                        (f64::from(dst[i]) - w).abs() <= tol,
                        "{isa:?} {m}x{k}x{n} at {i}: {} vs {w}",
                        dst[i]
                    );
                }
            }
        }
    }

    #[test]
    fn column_blocks_are_the_columns_alone() {
        let (k, n) = (5, 80);
        let b = values(k * n, 9);
        let whole = PackedB::new(&b, (k, n), (n, 1));
        // Columns 32..72: panel 1 whole, panel 2 cut after 8 lanes.
        let block = whole.column_block(32, 40).expect("starts a panel");
        let sub: Vec<f32> = (0..k)
            .flat_map(|r| b[r * n + 32..r * n + 72].to_vec())
            .collect();
        assert_eq!(block.data, PackedB::new(&sub, (k, 40), (40, 1)).data);
        assert!(whole.column_block(16, 32).is_none(), "not a panel start");
        assert!(whole.column_block(64, 32).is_none(), "past the last column");
    }

    #[test]
    fn vector_packing_equals_the_scalar_packing() {
        if !avx512_bf16() {
            eprintln!("vector packing not tested: this CPU has no AVX512-BF16");
            return;
        }
        // Odd k, k past one 32-value chunk, n short of, at and past a panel; sources with
        // padding between rows or columns, as attention's strided q|k|v rows have.
        for (k, n) in [
            (1, 1),
            (3, 17),
            (30, 256),
            (31, 33),
            (33, 32),
            (64, 70),
            (257, 5),
        ] {
            for (rs, cs) in [(1, k + 5), (n + 3, 1)] {
                let src = values((k - 1) * rs + (n - 1) * cs + 1, (k * n) as u64);
                let packed = PackedB::new(&src, (k, n), (rs, cs));
                let mut scalar = PackedB {
                    k,
                    n,
                    pairs: packed.pairs,
                    data: vec![0; packed.data.len()],
                };
                scalar.fill(&src, (rs, cs));
                assert!(
                    packed.data == scalar.data,
                    "k {k}, n {n}, strides ({rs}, {cs})"
                );
            }
        }
        // Reusing a buffer packed for a larger operand leaves nothing of it behind.
        let big = values(64 * 64, 1);
        let mut reused = PackedB::new(&big, (64, 64), (1, 64));
        let small = values(5 * 9, 2);
        reused.repack(&small, (5, 9), (9, 1));
        assert!(reused.data == PackedB::new(&small, (5, 9), (9, 1)).data);
        assert!(reused.data[..].iter().skip(NR * 3).all(|&v| v == 0));
    }

    #[test]
    fn vector_rounding_equals_the_scalar_rounding_at_every_tail_length() {
        if !avx512_bf16() {
            eprintln!("vector rounding not tested: this CPU has no AVX512-BF16");
            return;
        }
        for len in 0..100 {
            let row = values(len, len as u64 + 7);
            let sentinel = 0xdead_beef;
            let (mut vector, mut scalar) = (vec![sentinel; 52], vec![sentinel; 52]);
            // SAFETY: the CPU has the instructions (checked above).
            unsafe { round_row_avx512(&row, &mut vector) };
            round_row(&row, &mut scalar);
            // Equal lanes, and nothing written past the row's pairs.
            assert_eq!(vector, scalar, "length {len}");
            assert!(vector[len.div_ceil(2)..].iter().all(|&v| v == sentinel));
        }
    }

    #[test]
    fn transposed_packing_reads_the_strides() {
        // b given as its transpose (n x k row-major): packing with swapped strides must give
        // the same panels as packing the k x n matrix itself.
        let (k, n) = (7, 35);
        let b = values(k * n, 3);
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let direct = PackedB::new(&b, (k, n), (n, 1));
        let strided = PackedB::new(&bt, (k, n), (1, k));
        assert_eq!(direct.data, strided.data);
        // And each lane holds (row 2p, row 2p+1) of its column: row 6 of column 33 sits in
        // panel 1, pair 3, lane 1, low half; the high half is the zero row past k.
        let kp = direct.pairs;
        let lane = direct.data[kp * NR + 3 * NR + 1];
        assert_eq!(lane & 0xffff, bf16_bits(b[6 * n + 33]));
        assert_eq!(lane >> 16, 0);
    }
}

#[cfg(test)]
mod throughput {
    use super::*;

    /// GFLOP/s of each kernel and of the f32 GEMM on the shapes of DRCT's layers (qkv, fc2,
    /// the widest dense-group 1x1, an upsampler conv, both attention products of a 16x16
    /// window), after the f32 FMA ceiling of all threads. Run:
    /// `cargo test --release --lib product_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn product_throughput() {
        let threads = rayon::current_num_threads();
        if let Some(total) = crate::ops::cpu::panels::fma_peak(cpu_isa(), threads) {
            eprintln!("f32 FMA ceiling, {threads} threads: {total:.0} GFLOP/s");
        }
        let shapes = [
            (4096, 180, 540),
            (4096, 360, 180),
            (4096, 308, 32),
            (16384, 576, 256),
            (256, 30, 256),
            (256, 256, 30),
        ];
        for (m, k, n) in shapes {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 97) as f32 * 0.01).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 89) as f32 * 0.01).collect();
            let packed = PackedB::new(&b, (k, n), (n, 1));
            let mut c = vec![0f32; m * n];
            let parallel = m > 1000;
            let reps = 20;
            let flops = 2.0 * (m * n * k) as f64 * reps as f64;
            let rate = |run: &mut dyn FnMut()| {
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    run();
                }
                flops / t.elapsed().as_secs_f64() / 1e9
            };
            let mut line = format!("{m}x{k}x{n}:");
            for isa in [Isa::Amx, Isa::Avx512] {
                let usable = match isa {
                    Isa::Amx => crate::ops::cpu::bf16::isa() == Some(Isa::Amx),
                    Isa::Avx512 => avx512_bf16(),
                };
                if usable {
                    // SAFETY: the CPU has `isa`; a is m x k, c m x n.
                    let g = rate(&mut || unsafe {
                        gemm(
                            isa,
                            m,
                            c.as_mut_ptr(),
                            n,
                            false,
                            (a.as_ptr(), k),
                            &packed,
                            parallel,
                            None,
                        )
                    });
                    line += &format!(" {isa:?} {g:.0}");
                }
            }
            let par = if parallel {
                gemm::Parallelism::Rayon(0)
            } else {
                gemm::Parallelism::None
            };
            let g = rate(&mut || f32_product((m, k, n), &mut c, &a, &b, par));
            eprintln!("{line} f32 {g:.0} GFLOP/s");
        }
    }
}
