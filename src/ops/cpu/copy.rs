//! Copies: the dense connection's concatenation with its LeakyReLU, and the pixel shuffle.

use super::*;

/// `cat([x, leaky_relu(y, slope)], -1)` for channels-last `x` `(.., Cx)` and `y` `(.., Cy)`:
/// the dense connection of a residual dense group in one parallel pass, where candle would
/// run the activation as two element-wise ops and the concatenation as a third pass. `None`
/// where the kernel does not apply.
pub fn cat_leaky(x: &Tensor, y: &Tensor, slope: f32) -> Result<Option<Tensor>> {
    if !use_kernel(x) || !use_kernel(y) {
        return Ok(None);
    }
    let (dx, dy) = (x.dims(), y.dims());
    let (Some((&cx, lead_x)), Some((&cy, lead_y))) = (dx.split_last(), dy.split_last()) else {
        candle_core::bail!("cat_leaky: scalar input");
    };
    if lead_x != lead_y {
        candle_core::bail!("cat_leaky: x {dx:?}, y {dy:?}");
    }
    let rows = lead_x.iter().product::<usize>();
    let (x_guard, x_layout) = x.storage_and_layout();
    let (y_guard, y_layout) = y.storage_and_layout();
    let (xs, ys) = (
        cpu_slice(&x_guard, x_layout)?,
        cpu_slice(&y_guard, y_layout)?,
    );
    let out = par_rows(rows, cx + cy, |r, w| {
        w.write_row(&xs[r * cx..(r + 1) * cx]);
        w.write_leaky(&ys[r * cy..(r + 1) * cy], slope);
    });
    drop((x_guard, y_guard));
    let mut shape = dx.to_vec();
    *shape.last_mut().expect("checked above") = cx + cy;
    Ok(Some(Tensor::from_vec(out, shape, x.device())?))
}

/// PixelShuffle by `r` of channels-last features whose channels are in (i, j, c) order (see
/// `ops::conv::shuffle_order`): output row `y*r + i` takes, for each x, channels
/// `[i*r*c, (i+1)*r*c)` of input pixel (y, x), which are output pixels `x*r .. x*r + r`.
pub fn pixel_shuffle_reordered(x: &Tensor, r: usize) -> Result<Option<Tensor>> {
    if !use_kernel(x) {
        return Ok(None);
    }
    let (b, h, w, cc) = x.dims4()?;
    let c = cc / (r * r);
    if c * r * r != cc {
        candle_core::bail!("pixel shuffle: {cc} channels for factor {r}");
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let out = par_rows(b * h * r, w * r * c, |row, dst| {
        let (bi, yy) = (row / (h * r), row % (h * r));
        let (y, i) = (yy / r, yy % r);
        for px in 0..w {
            let src = ((bi * h + y) * w + px) * cc + i * r * c;
            dst.write_row(&xs[src..src + r * c]);
        }
    });
    drop(x_guard);
    Ok(Some(Tensor::from_vec(
        out,
        (b, h * r, w * r, c),
        x.device(),
    )?))
}

/// `a + b` for two contiguous f32 tensors of one shape on the CPU, on rayon's threads like
/// the kernels around it (candle's binary op runs on a pool of its own, whose idle worker
/// spins for a while after each op, on a core the next kernel wants). `None` where the kernel
/// does not apply.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    if !use_kernel(a) || !use_kernel(b) {
        return Ok(None);
    }
    if a.dims() != b.dims() {
        candle_core::bail!("add: {:?} and {:?}", a.dims(), b.dims());
    }
    let (a_guard, a_layout) = a.storage_and_layout();
    let (b_guard, b_layout) = b.storage_and_layout();
    let (xs, ys) = (
        cpu_slice(&a_guard, a_layout)?,
        cpu_slice(&b_guard, b_layout)?,
    );
    let mut out: Vec<f32> = Vec::with_capacity(xs.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK).zip(ys.par_chunks(CHUNK)))
        .for_each(|(row, (x, y))| RowWriter { row, at: 0 }.write_sum(x, y));
    // SAFETY: all three are cut into the same CHUNK-sized pieces, so every element of `out`
    // received a sum.
    unsafe { out.set_len(xs.len()) };
    drop((a_guard, b_guard));
    Ok(Some(Tensor::from_vec(out, a.dims(), a.device())?))
}

/// What [`centre`] does with the values it copies.
#[derive(Clone, Copy)]
pub enum Centre<'a> {
    /// Copies them.
    Plain,
    /// Multiplies channel `c` of image `b` by element `b·C + c` of this `(B, .., C)` tensor:
    /// a squeeze-and-excitation gate.
    Scaled(&'a Tensor),
    /// Adds this tensor, shaped as the centre: a U-Net's skip connection.
    Plus(&'a Tensor),
    /// Multiplies as [`Centre::Scaled`] by the first tensor and adds the second, shaped as
    /// the centre: a gated residual branch (RCAN's blocks).
    ScaledPlus(&'a Tensor, &'a Tensor),
}

/// The centre of channels-last `x` `(B, H, W, C)` less `t` pixels on every side, as `with`
/// says: a crop and what follows it in one parallel pass, instead of candle's strided copy
/// and a broadcast op after it. `None` where the kernel does not apply.
pub fn centre(x: &Tensor, t: usize, with: Centre) -> Result<Option<Tensor>> {
    let (gate, plus) = match with {
        Centre::Plain => (None, None),
        Centre::Scaled(s) => (Some(s), None),
        Centre::Plus(s) => (None, Some(s)),
        Centre::ScaledPlus(s, p) => (Some(s), Some(p)),
    };
    if !use_kernel(x) || [gate, plus].iter().flatten().any(|s| !use_kernel(s)) {
        return Ok(None);
    }
    let (b, h, w, c) = x.dims4()?;
    if 2 * t > h.min(w) {
        candle_core::bail!("centre: {:?} less {t} a side", x.dims());
    }
    let (oh, ow) = (h - 2 * t, w - 2 * t);
    if gate.is_some_and(|s| s.elem_count() != b * c)
        || plus.is_some_and(|s| s.elem_count() != b * oh * ow * c)
    {
        candle_core::bail!(
            "centre: {:?} less {t} with {:?} and {:?}",
            x.dims(),
            gate.map(|s| s.dims()),
            plus.map(|s| s.dims())
        );
    }
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let g_storage = gate.map(|s| s.storage_and_layout());
    let gs = g_storage
        .as_ref()
        .map(|(g, l)| cpu_slice(g, l))
        .transpose()?;
    let p_storage = plus.map(|s| s.storage_and_layout());
    let ps = p_storage
        .as_ref()
        .map(|(g, l)| cpu_slice(g, l))
        .transpose()?;
    let out = par_rows(b * oh, ow * c, |row, dst| {
        let (bi, y) = (row / oh, row % oh);
        let src = ((bi * h + y + t) * w + t) * c;
        let src = &xs[src..src + ow * c];
        let plus = ps.map(|ps| &ps[row * ow * c..][..ow * c]);
        match (gs.map(|gs| &gs[bi * c..(bi + 1) * c]), plus) {
            (Some(gate), Some(plus)) => {
                for (px, add) in src.chunks_exact(c).zip(plus.chunks_exact(c)) {
                    dst.write_product_sum(px, gate, add);
                }
            }
            (Some(gate), None) => {
                for px in src.chunks_exact(c) {
                    dst.write_product(px, gate);
                }
            }
            (None, Some(plus)) => dst.write_sum(src, plus),
            (None, None) => dst.write_row(src),
        }
    });
    drop((x_guard, g_storage, p_storage));
    Ok(Some(Tensor::from_vec(out, (b, oh, ow, c), x.device())?))
}

/// Space-to-depth by `r` of channels-last `x` `(B, H, W, C)` (H and W multiples of `r`):
/// output pixel (y, x) holds input pixels (y r + i, x r + j) for i, j in 0..r, in (i, j, c)
/// order, so that each `r C`-long run is copied whole. `None` where the kernel does not
/// apply.
pub fn space_to_depth(x: &Tensor, r: usize) -> Result<Option<Tensor>> {
    if !use_kernel(x) {
        return Ok(None);
    }
    let (b, h, w, c) = x.dims4()?;
    if r == 0 || h % r != 0 || w % r != 0 {
        candle_core::bail!("space_to_depth: {h}x{w} by {r}");
    }
    let (oh, ow) = (h / r, w / r);
    let (x_guard, x_layout) = x.storage_and_layout();
    let xs = cpu_slice(&x_guard, x_layout)?;
    let out = par_rows(b * oh, ow * r * r * c, |row, dst| {
        let (bi, y) = (row / oh, row % oh);
        for px in 0..ow {
            for i in 0..r {
                let src = ((bi * h + y * r + i) * w + px * r) * c;
                dst.write_row(&xs[src..src + r * c]);
            }
        }
    });
    drop(x_guard);
    Ok(Some(Tensor::from_vec(
        out,
        (b, oh, ow, r * r * c),
        x.device(),
    )?))
}

/// `leaky_relu(x, slope)` in one parallel pass (candle's takes two element-wise ops).
/// `None` where the kernel does not apply.
pub fn leaky(x: &Tensor, slope: f32) -> Result<Option<Tensor>> {
    if !use_kernel(x) {
        return Ok(None);
    }
    let (guard, layout) = x.storage_and_layout();
    let xs = cpu_slice(&guard, layout)?;
    let mut out: Vec<f32> = Vec::with_capacity(xs.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .for_each(|(row, x)| RowWriter { row, at: 0 }.write_leaky(x, slope));
    // SAFETY: both are cut into the same CHUNK-sized pieces, so every element of `out` was
    // written.
    unsafe { out.set_len(xs.len()) };
    drop(guard);
    Ok(Some(Tensor::from_vec(out, x.dims(), x.device())?))
}
