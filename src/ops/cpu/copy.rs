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
