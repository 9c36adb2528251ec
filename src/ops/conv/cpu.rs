//! 3x3 convolutions (stride 1, zero padding 1) on channels-last features: as a GEMM over
//! patches gathered in chunks, written in pixel-shuffled order for the upsampler, and the
//! narrow RGB output convolution computed directly.

use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::ops::cpu::bf16::{round_pairs, Isa, PackedA, PackedB};
use crate::ops::cpu::shared::Shared;
use crate::ops::cpu::taps::tap_source;
use crate::ops::cpu::{
    cpu_slice, panels, par_rows, product, use_kernel, widest_simd, Weights, LANES,
};

/// A 3x3 convolution (stride 1, zero padding 1) on channels-last features, on the CPU: the
/// patch matrix of a band of rows is gathered in one pass straight from the input (zeros
/// outside it) and multiplied into an output prefilled with the bias. The patch matrix never
/// exceeds `chunk_elems` elements, however large the image.
///
/// `x`: `(B, H, W, cin)`; `w`: `(9 cin, cout)` with rows ordered (dy, dx, cin); `b`: `(cout)`.
/// `None` where the kernel does not apply.
pub fn conv3x3(x: &Tensor, w: &Tensor, b: &Tensor, chunk_elems: usize) -> Result<Option<Tensor>> {
    if ![x, w, b].into_iter().all(use_kernel) {
        return Ok(None);
    }
    let (batch, h, wd, cin) = x.dims4()?;
    let (k, cout) = w.dims2()?;
    if k != 9 * cin || b.dims() != [cout] {
        candle_core::bail!("conv3x3: input {:?}, weight {:?}", x.dims(), w.dims());
    }
    let (w_guard, w_layout) = w.storage_and_layout();
    let ws = cpu_slice(&w_guard, w_layout)?;
    if cout > NARROW_CONV {
        let y = conv3x3_with(x, Weights::F32(ws), (k, cout), b, chunk_elems)?;
        drop(w_guard);
        return Ok(Some(y));
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;
    let mut out = par_rows(batch * h * wd, cout, |_, w| w.write_row(bs));
    let wt = transpose(ws, k, cout);
    out.par_chunks_mut(wd * cout)
        .enumerate()
        .for_each(|(row, dst)| {
            let (bi, y) = (row / h, row % h);
            let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
            conv_row_narrow(image, &wt, dst, y, h, wd, cin);
        });
    drop((x_guard, w_guard, b_guard));
    Ok(Some(Tensor::from_vec(
        out,
        (batch, h, wd, cout),
        x.device(),
    )?))
}

/// [`conv3x3`] with the weights packed in bf16 (`9 cin x cout`); `x` and `b` are f32 on the
/// CPU.
pub fn conv3x3_bf16(
    x: &Tensor,
    isa: Isa,
    w: &PackedB,
    b: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    if !use_kernel(x) || !use_kernel(b) {
        candle_core::bail!("bf16 conv3x3: f32 tensors on the CPU only");
    }
    let k = w.rows();
    if k != 9 * x.dim(3)? || b.dims() != [w.cols()] {
        candle_core::bail!("conv3x3: input {:?}, weight {k}x{}", x.dims(), w.cols());
    }
    conv3x3_with(x, Weights::Bf16(isa, w), (k, w.cols()), b, chunk_elems)
}

/// The patch-matrix GEMM of [`conv3x3`], for f32 (`k x cout` row-major) or bf16 weights.
pub(super) fn conv3x3_with(
    x: &Tensor,
    w: Weights,
    (k, cout): (usize, usize),
    b: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    let (batch, h, wd, cin) = x.dims4()?;
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;

    let pixels = batch * h * wd;
    if let (Weights::F32(ws), true, true) = (w, panels::available(), pixels > 0) {
        // Taps read from the image in place: no patch matrix, no bias prefill.
        let packed = panels::Panels::new(ws, (k, cout), (cout, 1));
        let zeros = vec![0f32; cin];
        let mut out: Vec<f32> = Vec::with_capacity(pixels * cout);
        // SAFETY: each task writes only its own output rows of `out`, which outlives the tasks.
        let dst = unsafe { Shared::new(out.as_mut_ptr()) };
        let blocks = (h * wd).div_ceil(CONV_PIXELS);
        (0..batch * blocks).into_par_iter().for_each(|task| {
            let (bi, p0) = (task / blocks, task % blocks * CONV_PIXELS);
            let rows = CONV_PIXELS.min(h * wd - p0);
            let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
            // SAFETY: output pixels p0..p0 + rows of image bi (cout
            // values each) lie in `out` and are written by this task only.
            unsafe {
                let dst = (dst.get().wrapping_add((bi * h * wd + p0) * cout), cout);
                panels::conv3x3_pixels(image, (h, wd, cin), &zeros, &packed, (p0, rows), dst, bs)
            };
        });
        // SAFETY: the tasks covered every pixel of every image, all cout values each.
        unsafe { out.set_len(pixels * cout) };
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h, wd, cout), x.device());
    }
    let mut out = par_rows(pixels, cout, |_, w| w.write_row(bs));

    if let (Weights::Bf16(isa, w), true) = (w, cin.is_multiple_of(2)) {
        // SAFETY: each task writes only its own output rows of `out`, which outlives the tasks.
        let dst = unsafe { Shared::new(out.as_mut_ptr()) };
        let blocks = (h * wd).div_ceil(PATCH_ROWS);
        (0..batch * blocks)
            .into_par_iter()
            .for_each_init(PackedA::default, |pack, task| {
                let (bi, p0) = (task / blocks, task % blocks * PATCH_ROWS);
                let rows = PATCH_ROWS.min(h * wd - p0);
                let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
                pack_patches(pack, (isa, w), image, (h, wd, cin), p0, rows);
                // SAFETY: output rows p0..p0 + rows of image bi, cout values each, lie in
                // `out` and are written by this task only; `pack` holds their patches.
                unsafe {
                    let dst = dst.get().wrapping_add((bi * h * wd + p0) * cout);
                    crate::ops::cpu::bf16::gemm_packed(pack, w, dst, cout, true)
                };
            });
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h, wd, cout), x.device());
    }

    let row_elems = wd * k;
    let rows = (chunk_elems / row_elems.max(1)).clamp(1, h.max(1));
    let mut cols = vec![0f32; rows * row_elems];
    for bi in 0..batch {
        let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
        let mut y0 = 0;
        while y0 < h {
            let n = rows.min(h - y0);
            let cols = &mut cols[..n * row_elems];
            gather_patches(image, (h, wd, cin), y0, cols);
            let dst = &mut out[((bi * h + y0) * wd) * cout..((bi * h + y0 + n) * wd) * cout];
            // SAFETY: dst is (n*wd) x cout row-major, cols (n*wd) x k row-major, and the
            // weights k x cout (row-major f32, or packed to exactly that).
            unsafe {
                product(
                    (n * wd, cout, k),
                    (dst.as_mut_ptr(), cout),
                    true,
                    (cols.as_ptr(), k),
                    w,
                    (cout, 1),
                    true,
                    None,
                );
            }
            y0 += n;
        }
    }
    drop((x_guard, b_guard));
    Tensor::from_vec(out, (batch, h, wd, cout), x.device())
}

/// The 3x3 patch matrix of image rows `y0..` (as many as `cols` holds: `wd` patches of
/// `9 cin` values per row, taps ordered (dy, dx, cin)), zeros outside the image.
pub(super) fn gather_patches(
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    y0: usize,
    cols: &mut [f32],
) {
    cols.par_chunks_mut(9 * cin)
        .enumerate()
        .for_each(|(p, patch)| {
            let (y, x) = (y0 + p / wd, p % wd);
            for (tap, dst) in patch.chunks_exact_mut(cin).enumerate() {
                match tap_source(image, (h, wd, cin), (y, x), tap) {
                    Some(src) => dst.copy_from_slice(src),
                    None => dst.fill(0.0),
                }
            }
        });
}

/// Pixels per task of the f32 convolutions on panels: a whole 64-pixel image row.
const CONV_PIXELS: usize = 64;

/// Pixels per task of the bf16 convolutions, whose patches are packed in blocks this size.
pub(super) const PATCH_ROWS: usize = 96;

/// The patches of pixels `p0..p0 + rows` (row-major over the image; taps ordered (dy, dx,
/// cin), zeros outside the image) rounded straight into `pack`, laid out for products with
/// `b`: the f32 patch matrix, 9x the input, is never written and read back, and each value is
/// rounded once however many weight blocks use it. `cin` must be even, so that no bf16 pair
/// straddles two taps.
pub(super) fn pack_patches(
    pack: &mut PackedA,
    (isa, b): (Isa, &PackedB),
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    p0: usize,
    rows: usize,
) {
    pack.prepare(isa, rows, b);
    for r in 0..rows {
        let (y, x) = ((p0 + r) / wd, (p0 + r) % wd);
        for (tap, out) in pack.row_pairs_mut(r).chunks_exact_mut(cin / 2).enumerate() {
            match tap_source(image, (h, wd, cin), (y, x), tap) {
                Some(src) => round_pairs(src, out),
                None => out.fill(0),
            }
        }
    }
}

/// [`conv3x3`] followed by PixelShuffle by `r`, for a convolution whose output channels are
/// in (i, j, c) order (see [`crate::ops::cpu::pixel_shuffle_reordered`]): the products of
/// each input row are written straight into the `r` output rows they become (column block i
/// of the weights gives output row `y*r + i`, where each pixel's `r*c` values are already
/// contiguous), so the unshuffled map, as large as the output, is never allocated nor copied.
/// `None` where the kernel does not apply.
pub fn conv3x3_shuffled(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Option<Tensor>> {
    if ![x, w, b].into_iter().all(use_kernel) {
        return Ok(None);
    }
    let (k, cout) = w.dims2()?;
    let (w_guard, w_layout) = w.storage_and_layout();
    let ws = cpu_slice(&w_guard, w_layout)?;
    let c = cout / (r * r).max(1);
    let blocks: Vec<Weights> = (0..r).map(|i| Weights::F32(&ws[i * r * c..])).collect();
    let y = conv3x3_shuffled_with(x, &blocks, (k, cout), (cout, 1), b, r, chunk_elems)?;
    drop(w_guard);
    Ok(Some(y))
}

/// [`conv3x3_shuffled`] with the weights packed in bf16; `None` where a column block does
/// not start a packed panel (`r * c` not a multiple of 32), so the caller shuffles after.
pub fn conv3x3_shuffled_bf16(
    x: &Tensor,
    isa: Isa,
    w: &PackedB,
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Option<Tensor>> {
    if !use_kernel(x) || !use_kernel(b) {
        candle_core::bail!("bf16 conv3x3: f32 tensors on the CPU only");
    }
    let (k, cout) = (w.rows(), w.cols());
    let c = cout / (r * r).max(1);
    let Some(owned) = (0..r)
        .map(|i| w.column_block(i * r * c, r * c))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let blocks: Vec<Weights> = owned.iter().map(|p| Weights::Bf16(isa, p)).collect();
    conv3x3_shuffled_with(x, &blocks, (k, cout), (0, 0), b, r, chunk_elems).map(Some)
}

/// The body of both shuffled convolutions; `blocks[i]` is the weights' column block i
/// (`k x r*c`), for f32 read through `f32_strides`.
pub(super) fn conv3x3_shuffled_with(
    x: &Tensor,
    blocks: &[Weights],
    (k, cout): (usize, usize),
    f32_strides: (usize, usize),
    b: &Tensor,
    r: usize,
    chunk_elems: usize,
) -> Result<Tensor> {
    let (batch, h, wd, cin) = x.dims4()?;
    let c = cout / (r * r).max(1);
    if k != 9 * cin || c * r * r != cout || b.dims() != [cout] || blocks.len() != r {
        candle_core::bail!(
            "conv3x3 shuffled: input {:?}, weight {k}x{cout}, r {r}",
            x.dims()
        );
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let bs = cpu_slice(&b_guard, b_layout)?;
    let block = r * c;
    // Output row y*r + i holds, for every input pixel, bias block i then its products.
    let out_row = wd * block;
    let f32_blocks: Option<Vec<&[f32]>> = blocks
        .iter()
        .map(|w| match w {
            Weights::F32(ws) => Some(*ws),
            Weights::Bf16(..) => None,
        })
        .collect();
    if let (Some(ws), true) = (f32_blocks, panels::available() && wd > 0) {
        let packed: Vec<panels::Panels> = ws
            .iter()
            .map(|w| panels::Panels::new(w, (k, block), f32_strides))
            .collect();
        let zeros = vec![0f32; cin];
        let mut out: Vec<f32> = Vec::with_capacity(batch * h * r * out_row);
        // SAFETY: each task writes only its own output rows of `out`, which outlives the tasks.
        let dst = unsafe { Shared::new(out.as_mut_ptr()) };
        (0..batch * h).into_par_iter().for_each(|image_row| {
            let (bi, y) = (image_row / h, image_row % h);
            let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
            for (i, w) in packed.iter().enumerate() {
                let row = image_row * r + i;
                let bias = &bs[i * block..(i + 1) * block];
                // SAFETY: output row `row` (wd pixels of `block`
                // values, each pixel's values contiguous) lies in `out` and is written by
                // this task only; the block's weights are k x block.
                unsafe {
                    let dst = (dst.get().wrapping_add(row * out_row), block);
                    panels::conv3x3_pixels(image, (h, wd, cin), &zeros, w, (y * wd, wd), dst, bias)
                };
            }
        });
        // SAFETY: every output row (r per input row) was written in full.
        unsafe { out.set_len(batch * h * r * out_row) };
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h * r, wd * r, c), x.device());
    }
    let mut out = par_rows(batch * h * r, out_row, |row, w| {
        let i = row % r;
        for _ in 0..wd {
            w.write_row(&bs[i * block..(i + 1) * block]);
        }
    });
    // SAFETY: each task writes only its own output rows of `out`, which outlives the tasks.
    let dst = unsafe { Shared::new(out.as_mut_ptr()) };
    let packed: Option<Vec<(Isa, &PackedB)>> = blocks
        .iter()
        .map(|w| match w {
            Weights::Bf16(isa, p) => Some((*isa, *p)),
            Weights::F32(_) => None,
        })
        .collect();
    if let (Some(packed), true) = (packed, cin.is_multiple_of(2)) {
        // Each block of an input row's pixels is packed once for all r column blocks.
        let per_row = wd.div_ceil(PATCH_ROWS);
        (0..batch * h * per_row)
            .into_par_iter()
            .for_each_init(PackedA::default, |pack, task| {
                let (image_row, x0) = (task / per_row, task % per_row * PATCH_ROWS);
                let (bi, y) = (image_row / h, image_row % h);
                let rows = PATCH_ROWS.min(wd - x0);
                let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
                pack_patches(pack, packed[0], image, (h, wd, cin), y * wd + x0, rows);
                for (i, &(_, w)) in packed.iter().enumerate() {
                    let row = image_row * r + i;
                    // SAFETY: pixels x0..x0 + rows of output row `row` (`block` values
                    // each) lie in `out` and are written by this task only; `pack` holds
                    // their patches, packed for this k.
                    unsafe {
                        let dst = dst.get().wrapping_add(row * out_row + x0 * block);
                        crate::ops::cpu::bf16::gemm_packed(pack, w, dst, block, true)
                    };
                }
            });
        drop((x_guard, b_guard));
        return Tensor::from_vec(out, (batch, h * r, wd * r, c), x.device());
    }
    let rows = (chunk_elems / (wd * k).max(1)).clamp(1, h.max(1));
    let mut cols = vec![0f32; rows * wd * k];
    for bi in 0..batch {
        let image = &xs[bi * h * wd * cin..(bi + 1) * h * wd * cin];
        let mut y0 = 0;
        while y0 < h {
            let n = rows.min(h - y0);
            let cols = &mut cols[..n * wd * k];
            gather_patches(image, (h, wd, cin), y0, cols);
            let cols = &*cols;
            (0..n).into_par_iter().for_each(|yy| {
                for (i, w) in blocks.iter().enumerate() {
                    let row = (bi * h + y0 + yy) * r + i;
                    // SAFETY: output row `row` (wd pixels of `block` values, each pixel's
                    // values contiguous) lies in `out` and is written by this task only; the
                    // patches of input row yy are wd rows of k in `cols`; the block's
                    // weights are k x block.
                    unsafe {
                        product(
                            (wd, block, k),
                            (dst.get().wrapping_add(row * out_row), block),
                            true,
                            (cols[yy * wd * k..].as_ptr(), k),
                            *w,
                            f32_strides,
                            false,
                            None,
                        );
                    }
                }
            });
            y0 += n;
        }
    }
    drop((x_guard, b_guard));
    Tensor::from_vec(out, (batch, h * r, wd * r, c), x.device())
}

/// Up to this many output channels (the final RGB convolution) a 3x3 convolution is computed
/// directly: a patch matrix would be 9x the input for a GEMM the width of a few columns, which
/// only streams memory.
pub(crate) const NARROW_CONV: usize = 4;

pub(super) fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

/// One output row of a narrow 3x3 convolution, accumulated onto `dst` (prefilled with the
/// bias), `P` output pixels at a time. `wt`: `(cout, 9 cin)`, taps ordered (dy, dx, cin),
/// `cout` at most [`NARROW_CONV`].
#[inline(always)]
pub(super) fn conv_row_narrow_body<const P: usize>(
    image: &[f32],
    wt: &[f32],
    dst: &mut [f32],
    y: usize,
    h: usize,
    wd: usize,
    cin: usize,
) {
    let shape = (y, h, wd, cin);
    match wt.len() / (9 * cin) {
        1 => narrow_row::<1, P>(image, wt, dst, shape),
        2 => narrow_row::<2, P>(image, wt, dst, shape),
        3 => narrow_row::<3, P>(image, wt, dst, shape),
        4 => narrow_row::<4, P>(image, wt, dst, shape),
        cout => unreachable!("{cout} output channels is not a narrow convolution"),
    }
}

/// [`conv_row_narrow_body`] for `C` output channels, `P` pixels at a time. Taps outside the
/// image read a row of zeros, so every pixel runs the same loop.
#[inline(always)]
pub(super) fn narrow_row<const C: usize, const P: usize>(
    image: &[f32],
    wt: &[f32],
    dst: &mut [f32],
    (y, h, wd, cin): (usize, usize, usize, usize),
) {
    let zeros = vec![0f32; cin];
    let taps = |x: usize| -> [&[f32]; 9] {
        std::array::from_fn(|tap| tap_source(image, (h, wd, cin), (y, x), tap).unwrap_or(&zeros))
    };
    let mut x = 0;
    let mut groups = dst.chunks_exact_mut(P * C);
    for group in &mut groups {
        let pixels: [[&[f32]; 9]; P] = std::array::from_fn(|p| taps(x + p));
        narrow_pixels::<C, P>(&pixels, wt, cin, group);
        x += P;
    }
    for out in groups.into_remainder().chunks_exact_mut(C) {
        narrow_pixels::<C, 1>(&[taps(x)], wt, cin, out);
        x += 1;
    }
}

/// `P` neighbouring output pixels of `C` channels: `P * C` independent vector sums, so the
/// adds do not wait on each other (one sum at a time made the adds' latency the bound), and
/// each chunk of input and weights is loaded once for all the sums that use it.
/// `pixels[p][tap]`: the `cin` input values under that tap; `out`: `P * C` values, added to.
#[inline(always)]
pub(super) fn narrow_pixels<const C: usize, const P: usize>(
    pixels: &[[&[f32]; 9]; P],
    wt: &[f32],
    cin: usize,
    out: &mut [f32],
) {
    let k = 9 * cin;
    let whole = cin / LANES;
    let mut acc = [[[0f32; LANES]; C]; P];
    let mut tail = [[0f32; C]; P];
    for tap in 0..9 {
        let w: [&[f32]; C] = std::array::from_fn(|c| &wt[c * k + tap * cin..][..cin]);
        let wv: [&[[f32; LANES]]; C] = std::array::from_fn(|c| &w[c].as_chunks().0[..whole]);
        let av: [&[[f32; LANES]]; P] =
            std::array::from_fn(|p| &pixels[p][tap].as_chunks().0[..whole]);
        for j in 0..whole {
            let a: [[f32; LANES]; P] = std::array::from_fn(|p| av[p][j]);
            for c in 0..C {
                let wj = wv[c][j];
                for p in 0..P {
                    // Whole arrays in and out: element by element through references, the
                    // compiler broadcast single values into half-empty vectors.
                    acc[p][c] = std::array::from_fn(|l| acc[p][c][l] + a[p][l] * wj[l]);
                }
            }
        }
        for j in whole * LANES..cin {
            for c in 0..C {
                for p in 0..P {
                    tail[p][c] += pixels[p][tap][j] * w[c][j];
                }
            }
        }
    }
    for p in 0..P {
        for c in 0..C {
            out[p * C + c] += tail[p][c] + acc[p][c].iter().sum::<f32>();
        }
    }
}

widest_simd! {
    pub(super) fn conv_row_narrow(
        image: &[f32],
        wt: &[f32],
        dst: &mut [f32],
        y: usize,
        h: usize,
        wd: usize,
        cin: usize,
    ) = conv_row_narrow_body::<4>,
    // 16 ymm registers: two pixels' sums of three channels (two registers per sum of 16
    // lanes) fit them; four spilled to the stack and ran seven times slower. Each pixel's
    // sums are the same either way.
        conv_row_narrow_body::<2>,
        conv_row_narrow_body::<1>
}
