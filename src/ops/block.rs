//! A whole Swin block on the CPU in f32 a window at a time
//! ([`crate::ops::attention::cpu::swin_block`]): here its tensors are checked and read.

use candle_core::{DType, Result, Tensor};

use crate::ops::attention::cpu::{swin_block, BlockLayers};
use crate::ops::attention::Attend;
use crate::ops::cpu::{panels, with_cpu_slices};
use crate::ops::linear::Dense;
use crate::ops::norm::cpu::with_row_norm;
use crate::ops::norm::Norm;
use crate::ops::windows::WindowCache;

/// A Swin block's layers, as the network holds them.
pub(crate) struct SwinLayers<'a> {
    pub norm1: &'a Norm,
    pub qkv: &'a Dense,
    pub attend: &'a Attend,
    pub proj: &'a Dense,
    pub norm2: &'a Norm,
    pub fc1: &'a Dense,
    pub fc2: &'a Dense,
    /// A SwinV2 block's logit scales ([`BlockLayers::v2`]).
    pub v2: Option<&'a [f32]>,
}

/// The block over `x` `(B, H, W, C)` (H and W multiples of the window), with HAT's
/// `(z (B, H, W, C), s (B, C))` added to the attention's residual sum, a window per task on
/// the CPU in f32: the values of the layers one after the other. `None` where it does not
/// apply: off the CPU, bf16 products, layers not packed, padded channels, or fewer windows
/// than twice the threads (the steps over all tokens split their products across threads
/// instead).
pub(crate) fn swin_block_by_windows(
    layers: &SwinLayers,
    x: &Tensor,
    extra: Option<(&Tensor, &Tensor)>,
    (window, shifted): (usize, bool),
    windows: &WindowCache,
) -> Result<Option<Tensor>> {
    let (b, h, w, c) = x.dims4()?;
    let (Some(table), true) = (layers.attend.cpu_f32_table(), panels::available()) else {
        return Ok(None);
    };
    let (Some(qkv), Some(proj), Some(fc1), Some(fc2)) = (
        packed(layers.qkv),
        packed(layers.proj),
        packed(layers.fc1),
        packed(layers.fc2),
    ) else {
        return Ok(None);
    };
    // Padded channels (DRCT's, where asked for) give qkv other widths: the steps in turn.
    let hidden = fc1.0.dims().1;
    let chained = [qkv.0.dims(), proj.0.dims(), fc1.0.dims(), fc2.0.dims()]
        == [(c, 3 * c), (c, c), (c, hidden), (hidden, c)];
    let on_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    let extra_ok = extra.is_none_or(|(z, s)| on_cpu(z) && on_cpu(s));
    let count = b * (h / window.max(1)) * (w / window.max(1));
    // A SwinV2 block has no HAT term.
    let extra_ok = extra_ok && (extra.is_none() || layers.v2.is_none());
    if !chained || !on_cpu(x) || !extra_ok || count < 2 * rayon::current_num_threads() {
        return Ok(None);
    }
    let (order, _) = windows.partition(h, w, shifted)?;
    let order = order.to_vec1::<u32>()?;
    let regions = shifted.then(|| windows.regions(h, w)).transpose()?;
    let x = x.contiguous()?;
    let extra = extra
        .map(|(z, s)| Ok::<_, candle_core::Error>((z.contiguous()?, s.contiguous()?)))
        .transpose()?;
    let tensors: Vec<&Tensor> = [&x, qkv.1, proj.1, fc1.1, fc2.1]
        .into_iter()
        .chain(extra.as_ref().map(|(z, s)| [z, s]).into_iter().flatten())
        .collect();
    let out = with_cpu_slices(&tensors, |slices| {
        with_row_norm(layers.norm1, c, |norm1| {
            with_row_norm(layers.norm2, c, |norm2| {
                let layers = BlockLayers {
                    norm1,
                    qkv: (qkv.0, slices[1]),
                    proj: (proj.0, slices[2]),
                    norm2,
                    fc1: (fc1.0, slices[3]),
                    fc2: (fc2.0, slices[4]),
                    v2: layers.v2,
                };
                let extra = (slices.len() == 7).then(|| (slices[5], slices[6]));
                let regions = regions.as_deref();
                swin_block(
                    slices[0],
                    (b, h * w, c),
                    &order,
                    extra,
                    &layers,
                    table,
                    regions,
                )
            })
        })
    })?;
    // Nothing where either norm has no kernel; an error from the block itself is passed on.
    match out.transpose()?.flatten().transpose()? {
        Some(out) => Ok(Some(Tensor::from_vec(out, (b, h, w, c), x.device())?)),
        None => Ok(None),
    }
}

/// A layer's packed panels and bias, where it has them.
fn packed(layer: &Dense) -> Option<(&panels::Panels, &Tensor)> {
    match layer {
        Dense::CpuPacked { panels, bias } => Some((panels, bias)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::add;
    use crate::ops::attention::cosine::normalise_qk;
    use crate::ops::attention::Attend;
    use crate::ops::norm::{add_gather_norm, layer_norm, norm_gather};
    use crate::ops::pad::Pad;
    use crate::ops::LoadPlan;
    use crate::tests::normal;
    use candle_core::{Device, Module};

    /// The block's steps one after the other over all tokens, as the network runs them
    /// without the fused block.
    fn in_turn(
        l: &SwinLayers,
        x: &Tensor,
        extra: Option<(&Tensor, &Tensor)>,
        (ws, shifted): (usize, bool),
        windows: &WindowCache,
    ) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (order, back) = windows.partition(h, w, shifted)?;
        let x = x.reshape((b, h * w, c))?;
        if let Some(scales) = l.v2 {
            // Swin2SR's steps: the norms after the attention and the MLP.
            let tokens = x
                .index_select(&order, 1)?
                .reshape((b * h * w / (ws * ws), ws * ws, c))?;
            let qkv = normalise_qk(&l.qkv.forward(&tokens)?, scales)?;
            let y = l
                .proj
                .forward(&l.attend.forward(&qkv, (h, w), shifted, windows)?)?;
            let y = norm_gather(l.norm1, &y.reshape((b, h * w, c))?, &back)?;
            let s = add(&x, &y)?;
            let m = l.fc2.forward(&l.fc1.forward_gelu(&s)?)?;
            return add(&s, &layer_norm(l.norm2, &m)?)?.reshape((b, h, w, c));
        }
        let tokens =
            norm_gather(l.norm1, &x, &order)?.reshape((b * h * w / (ws * ws), ws * ws, c))?;
        let attended = l
            .attend
            .forward(&l.qkv.forward(&tokens)?, (h, w), shifted, windows)?;
        let y = l.proj.forward(&attended)?.reshape((b, h * w, c))?;
        let z = extra.map(|(z, _)| z.reshape((b, h * w, c))).transpose()?;
        let scaled = z.as_ref().zip(extra.map(|(_, s)| s));
        let (sum, normed) = add_gather_norm(l.norm2, &x, scaled, &y, &back)?;
        let hidden = l.fc1.forward_gelu(&normed)?;
        l.fc2.forward_residual(&hidden, &sum)?.reshape((b, h, w, c))
    }

    /// A window at a time, the block gives the bits of its steps in turn: shifted and not,
    /// with HAT's scaled term and without, SwinV2's post-norm cosine form (Swin2SR's), 4x4 windows with heads of 5 and 16x16 ones with
    /// DRCT's heads of 53 (v packed on AVX2), two images; with fewer windows than twice the
    /// threads it declines.
    #[test]
    fn the_block_by_windows_is_its_steps_in_turn() -> Result<()> {
        crate::ops::cpu::isa::on_each_isa(|| {
            let dev = Device::Cpu;
            let plan = LoadPlan::default();
            let threads = rayon::current_num_threads();
            for (ws, heads, d) in [(4, 3, 5), (16, 2, 53)] {
                let c = heads * d;
                let channels = Pad::OFF.one(c);
                let dense = |cin: usize, cout: usize| -> Result<Dense> {
                    let w = (normal(0.0, 1.0, (cout, cin), &dev)? / (cin as f64).sqrt())?;
                    Dense::new(w, normal(0.0, 1.0, cout, &dev)?, &plan)
                };
                let norm = || {
                    let weight = (normal(0.0, 0.2, c, &dev)? + 1.0)?;
                    Norm::new(&channels, weight, normal(0.0, 0.2, c, &dev)?, 1e-5)
                };
                let table = normal(0.0, 1.0, ((2 * ws - 1) * (2 * ws - 1), heads), &dev)?;
                let (norm1, norm2) = (norm()?, norm()?);
                let (qkv, proj, fc1, fc2) = (
                    dense(c, 3 * c)?,
                    dense(c, c)?,
                    dense(c, 2 * c)?,
                    dense(2 * c, c)?,
                );
                let attend = Attend::new(&table, heads, d, ws, &plan)?;
                let scales: Vec<f32> = (0..heads).map(|i| 3.0 + 20.0 * i as f32).collect();
                let mut layers = SwinLayers {
                    norm1: &norm1,
                    qkv: &qkv,
                    attend: &attend,
                    proj: &proj,
                    norm2: &norm2,
                    fc1: &fc1,
                    fc2: &fc2,
                    v2: None,
                };
                let windows = WindowCache::new(ws, DType::F32, &dev);
                // Two images of enough windows: a 2 x k grid of them each.
                let side = (threads.max(2)).div_ceil(2) * ws;
                let x = normal(0.0, 1.0, (2, 2 * ws, side, c), &dev)?;
                let z = normal(0.0, 1.0, (2, 2 * ws, side, c), &dev)?;
                let s = normal(0.0, 1.0, (2, c), &dev)?;
                for (shifted, v2) in [(false, false), (true, false), (false, true), (true, true)] {
                    layers.v2 = v2.then_some(&scales[..]);
                    // A SwinV2 block has no HAT term: asked for one, it declines.
                    if v2 {
                        let shape = (ws, shifted);
                        let hat = Some((&z, &s));
                        assert!(swin_block_by_windows(&layers, &x, hat, shape, &windows)?.is_none());
                    }
                    let extras = if v2 {
                        vec![None]
                    } else {
                        vec![None, Some((&z, &s))]
                    };
                    for extra in extras {
                        let shape = (ws, shifted);
                        let got = swin_block_by_windows(&layers, &x, extra, shape, &windows)?;
                        let Some(got) = got else {
                            // Only where the panel kernels do not run (no AVX2).
                            assert!(!panels::available());
                            return Ok(());
                        };
                        let want = in_turn(&layers, &x, extra, shape, &windows)?;
                        assert_eq!(got.dims(), want.dims());
                        let got = got.flatten_all()?.to_vec1::<f32>()?;
                        let want = want.flatten_all()?.to_vec1::<f32>()?;
                        let case = (ws, shifted, extra.is_some(), v2);
                        assert!(got == want, "{case:?}: not the bits of the steps in turn");
                    }
                }
                let one = x.narrow(0, 0, 1)?.narrow(1, 0, ws)?.narrow(2, 0, ws)?;
                let few = swin_block_by_windows(&layers, &one, None, (ws, false), &windows)?;
                assert!(few.is_none(), "one window");
            }
            Ok(())
        })
    }
}
