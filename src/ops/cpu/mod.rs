//! CPU kernels for the network's hot spots in f32, where candle's generic CPU ops spend more
//! time moving memory than computing: a fused window attention, parallel gathers and copies,
//! and softmax / exact GELU with polynomial `exp`/`erf` compiled for the widest vector unit
//! the CPU has; and the machinery the layers' own CPU halves share (linear layers in
//! [`crate::ops::linear::cpu`], 3x3 convolutions in [`crate::ops::conv::cpu`]). Each
//! kernel returns `None` (or falls back to candle) on other devices and dtypes, and each is
//! tested against candle's graph in f64 (tests.rs); the golden tests check the whole network.
//!
//! One file per job: `math` (exp, erf, softmax, GELU), `attention` (the fused window
//! attention), `copy` (the dense concatenation, the pixel shuffle), `panels` (the f32 GEMM
//! microkernels on AVX-512 and AVX2). This file holds what they share (the GEMM driver,
//! parallel row writers, the SIMD dispatch), and the imports every one of them takes with
//! `use super::*`.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::ops::cpu::bf16::{Epilogue, Isa, PackedA, PackedB};
use crate::ops::windows::{RelativeBias, MASK_VALUE};

/// Elements per parallel task: enough work to amortise scheduling.
pub(super) const CHUNK: usize = 32 << 10;

fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("f32 kernel called on another dtype")
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("kernel called on a strided tensor")
    };
    Ok(&data[start..end])
}

/// Defines `$name` to run `$body` compiled for the widest vector unit the CPU has (held down
/// by [`cpu_isa`](crate::ops::cpu::isa::cpu_isa)): the binary targets baseline x86-64
/// (SSE2), and these element-wise loops are 2-4x faster with 256- or 512-bit vectors.
/// Elsewhere `$body` runs as compiled.
macro_rules! widest_simd {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) = $body:ident) => {
        $crate::ops::cpu::widest_simd!(
            $(#[$meta])* $vis fn $name($($arg: $ty),*) = $body, $body, $body
        );
    };
    // `fused body`: `body::<true>` (explicit FMAs, see `fmadd`) where the vector units have
    // them, `body::<false>` (separate multiply and add) in the x86 fallback, which may run
    // on CPUs without FMA (where `mul_add` would be a libm call per element).
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) = fused $body:ident) => {
        $crate::ops::cpu::widest_simd!(
            $(#[$meta])* $vis fn $name($($arg: $ty),*)
                = $body::<true>, $body::<true>, $body::<{ cfg!(target_arch = "aarch64") }>
        );
    };
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?)
        = $wide:path, $mid:path, $plain:path) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    $wide($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    $mid($($arg),*)
                }
                use $crate::ops::cpu::isa::{cpu_isa, CpuIsa};
                match cpu_isa() {
                    // SAFETY: `cpu_isa` never names more than the CPU has: it has the
                    // features the function is compiled for.
                    CpuIsa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    CpuIsa::Avx2 => return unsafe { avx2($($arg),*) },
                    CpuIsa::Scalar => {}
                }
            }
            $plain($($arg),*)
        }
    };
}

pub(super) use widest_simd;

/// Independent accumulators per row: float reductions only vectorise when the compiler is
/// given lanes to keep apart (it may not reassociate a single sum).
pub(super) const LANES: usize = 16;

pub(super) fn use_kernel(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && x.is_contiguous()
}

/// A strided f32 matrix operand for [`gemm_f32`]: element (i, j) is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Strided<P> {
    ptr: P,
    rs: usize,
    cs: usize,
}

fn strided<P>(ptr: P, rs: usize, cs: usize) -> Strided<P> {
    Strided { ptr, rs, cs }
}

/// `dst (+)= lhs · rhs` for an `m x k` lhs and a `k x n` rhs; `accumulate` adds onto dst's
/// contents instead of overwriting them (and only then is dst read).
///
/// # Safety
/// Every element the three strided views address must lie inside live allocations, dst's
/// must not overlap the inputs or be written by anyone else meanwhile, and dst must be
/// initialised where `accumulate` is set.
unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: Strided<*mut f32>,
    accumulate: bool,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr,
            dst.cs as isize,
            dst.rs as isize,
            accumulate,
            lhs.ptr,
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.ptr,
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A layer's weights as the products read them: f32 as stored (a `k x n` view through
/// strides), or packed bf16 ([`crate::ops::cpu::bf16`]).
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(Isa, &'a PackedB),
}

/// `dst (+)= lhs · rhs` for a row-major `m x k` lhs (rows `lda` apart) into a row-major
/// `m x n` dst (rows `ldc` apart), in f32 or bf16 as `rhs` says; `f32_strides` are the
/// strides of an f32 rhs.
///
/// # Safety
/// As [`gemm_f32`] and [`crate::ops::cpu::bf16::gemm`]: every addressed element inside live
/// allocations, dst not overlapping the inputs, initialised where `accumulate` is set.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn product(
    (m, n, k): (usize, usize, usize),
    (dst, ldc): (*mut f32, usize),
    accumulate: bool,
    (lhs, lda): (*const f32, usize),
    rhs: Weights,
    f32_strides: (usize, usize),
    parallel: bool,
    then: Option<&Epilogue>,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match rhs {
            Weights::F32(w) => {
                let rhs = strided(w.as_ptr(), f32_strides.0, f32_strides.1);
                let Some(then) = then else {
                    let parallelism = if parallel {
                        gemm::Parallelism::Rayon(0)
                    } else {
                        gemm::Parallelism::None
                    };
                    let (dst, lhs) = (strided(dst, ldc, 1), strided(lhs, lda, 1));
                    return gemm_f32((m, n, k), dst, accumulate, lhs, rhs, parallelism);
                };
                // Row blocks as tasks of their own, each finished by `then` while in cache.
                assert_eq!(ldc, n, "an epilogue needs contiguous output rows");
                // SAFETY: the blocks write disjoint row blocks of dst and only read lhs and
                // rhs, all of which outlive the parallel loop below.
                let ptrs = shared::Shared::new((dst, lhs, rhs));
                let block = |b: usize| {
                    let (dst, lhs, rhs) = ptrs.get();
                    let i0 = b * EPILOGUE_ROWS;
                    let rows = EPILOGUE_ROWS.min(m - i0);
                    // SAFETY (inside the caller's unsafe block): rows i0..i0 + rows of dst
                    // and lhs, inside the caller's bounds; each block writes only its own rows.
                    let (dst, lhs) = (dst.add(i0 * ldc), lhs.add(i0 * lda));
                    let (d, l) = (strided(dst, ldc, 1), strided(lhs, lda, 1));
                    gemm_f32((rows, n, k), d, accumulate, l, rhs, gemm::Parallelism::None);
                    then(std::slice::from_raw_parts_mut(dst, rows * n));
                };
                let blocks = m.div_ceil(EPILOGUE_ROWS);
                if parallel {
                    (0..blocks).into_par_iter().for_each(block);
                } else {
                    (0..blocks).for_each(block);
                }
            }
            Weights::Bf16(isa, w) => {
                debug_assert_eq!((w.rows(), w.cols()), (k, n));
                crate::ops::cpu::bf16::gemm(
                    isa,
                    m,
                    dst,
                    ldc,
                    accumulate,
                    (lhs, lda),
                    w,
                    parallel,
                    then,
                )
            }
        }
    }
}

/// Rows per task of an f32 product with an epilogue: the block's output (up to 128 x 360
/// values for DRCT's fc1) stays in L2 until the epilogue has run over it.
const EPILOGUE_ROWS: usize = 128;

/// A new buffer of `rows` rows of `row_len` values, each row produced in parallel by `fill`
/// from its index. `fill` hands every row to [`write_row`] pieces that cover it exactly, which
/// is what makes the final `set_len` sound; the pieces are checked to fit.
pub(super) fn par_rows(
    rows: usize,
    row_len: usize,
    fill: impl Fn(usize, &mut RowWriter) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(rows * row_len);
    if let Some(per_task) = CHUNK.checked_div(row_len) {
        let per_task = per_task.max(1);
        out.spare_capacity_mut()
            .par_chunks_mut(per_task * row_len)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (k, row) in chunk.chunks_exact_mut(row_len).enumerate() {
                    let mut w = RowWriter { row, at: 0 };
                    fill(t * per_task + k, &mut w);
                    assert_eq!(
                        w.at,
                        row_len,
                        "row {} left partly unwritten",
                        t * per_task + k
                    );
                }
            });
    }
    // SAFETY: every row was written in full (asserted above).
    unsafe { out.set_len(rows * row_len) };
    out
}

/// `data.to_vec()`, copied by all threads (a single-threaded copy of a large activation is
/// a serial step the other cores wait through).
pub(crate) fn par_copy(data: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(data.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK))
        .for_each(|(row, src)| RowWriter { row, at: 0 }.write_row(src));
    // SAFETY: both sides are cut into the same CHUNK-sized pieces, so every element of `out`
    // received one of `data`.
    unsafe { out.set_len(data.len()) };
    out
}

/// Appends values to one uninitialised output row, front to back.
pub(super) struct RowWriter<'a> {
    row: &'a mut [std::mem::MaybeUninit<f32>],
    at: usize,
}

impl RowWriter<'_> {
    pub(super) fn write_row(&mut self, src: &[f32]) {
        let dst = &mut self.row[self.at..self.at + src.len()];
        for (d, s) in dst.iter_mut().zip(src) {
            d.write(*s);
        }
        self.at += src.len();
    }

    /// Appends `leaky_relu(src, slope)`.
    pub(super) fn write_leaky(&mut self, src: &[f32], slope: f32) {
        let dst = &mut self.row[self.at..self.at + src.len()];
        for (d, &v) in dst.iter_mut().zip(src) {
            d.write(if v >= 0.0 { v } else { v * slope });
        }
        self.at += src.len();
    }

    /// Appends `a · b`, element by element.
    pub(super) fn write_product(&mut self, a: &[f32], b: &[f32]) {
        let dst = &mut self.row[self.at..self.at + a.len()];
        for ((d, x), y) in dst.iter_mut().zip(a).zip(&b[..a.len()]) {
            d.write(x * y);
        }
        self.at += a.len();
    }

    /// Appends `a · b + c`, element by element.
    pub(super) fn write_product_sum(&mut self, a: &[f32], b: &[f32], c: &[f32]) {
        let dst = &mut self.row[self.at..self.at + a.len()];
        for (((d, x), y), z) in dst.iter_mut().zip(a).zip(&b[..a.len()]).zip(&c[..a.len()]) {
            d.write(x * y + z);
        }
        self.at += a.len();
    }

    /// Appends `a + b`, element by element.
    pub(super) fn write_sum(&mut self, a: &[f32], b: &[f32]) {
        let dst = &mut self.row[self.at..self.at + a.len()];
        for ((d, x), y) in dst.iter_mut().zip(a).zip(&b[..a.len()]) {
            d.write(x + y);
        }
        self.at += a.len();
    }
}

pub(crate) fn cpu_slice<'a>(
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> Result<&'a [f32]> {
    match storage {
        candle_core::Storage::Cpu(cpu) => contiguous_f32(cpu, layout),
        _ => candle_core::bail!("CPU kernel called on a device tensor"),
    }
}

/// `f` of the f32 values of `tensors` (contiguous, on the CPU), in their order, their
/// storages held for as long as `f` runs.
pub(crate) fn with_cpu_slices<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&[&[f32]]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(|(g, l)| cpu_slice(g, l))
        .collect::<Result<Vec<_>>>()?;
    f(&slices)
}

pub mod bf16;
mod copy;
pub(crate) mod depthwise;
pub(crate) mod isa;
mod math;
pub(crate) mod panels;
pub(crate) mod shared;
pub(crate) mod taps;
#[cfg(test)]
mod tests;

pub use copy::*;
pub use math::*;
