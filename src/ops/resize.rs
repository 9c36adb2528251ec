//! PyTorch's bicubic resize, `F.interpolate(mode="bicubic", align_corners=False)`, which
//! Swin2SR's compressed-input models run on their input for one branch of the upsampler.
//! Not an antialiasing resize (that is [`crate::metrics`]'s, for `eval`'s baselines): each
//! output sample mixes the four nearest input samples with Keys' cubic of a = -0.75, indices
//! past the border clamped to it, as PyTorch's kernel does.

use candle_core::{DType, Device, Result, Tensor};

/// PyTorch's bicubic coefficient.
const A: f64 = -0.75;

/// The four input indices and weights of each of `output` samples resized from `input`.
fn taps(input: usize, output: usize) -> Vec<([usize; 4], [f32; 4])> {
    let scale = input as f64 / output as f64;
    let last = input as isize - 1;
    (0..output)
        .map(|i| {
            // PyTorch's source coordinate for a cubic: not clamped at 0, unlike a linear one's.
            let src = (i as f64 + 0.5) * scale - 0.5;
            let floor = src.floor();
            let t = src - floor;
            let near = |x: f64| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
            let far = |x: f64| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
            let w = [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)];
            let base = floor as isize - 1;
            let idx = std::array::from_fn(|k| (base + k as isize).clamp(0, last) as usize);
            (idx, w.map(|w| w as f32))
        })
        .collect()
}

/// `x` `(B, H, W, C)` resized to `(B, oh, ow, C)`; computed on the host in f32 (the inputs it
/// serves are three-channel images) and returned on `x`'s device in its dtype.
pub(crate) fn bicubic(x: &Tensor, (oh, ow): (usize, usize)) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    if h == 0 || w == 0 {
        candle_core::bail!("bicubic resize of an empty {h}x{w} map");
    }
    let src = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let (rows, cols) = (taps(h, oh), taps(w, ow));
    // Along the width first, then along the height.
    let mut wide = vec![0f32; b * h * ow * c];
    for (dst, srow) in wide.chunks_exact_mut(ow * c).zip(src.chunks_exact(w * c)) {
        for (out, (idx, wt)) in dst.chunks_exact_mut(c).zip(&cols) {
            for (&i, &k) in idx.iter().zip(wt) {
                let px = &srow[i * c..(i + 1) * c];
                out.iter_mut().zip(px).for_each(|(o, v)| *o += k * v);
            }
        }
    }
    let mut out = vec![0f32; b * oh * ow * c];
    let plane = ow * c;
    for (dst, image) in out
        .chunks_exact_mut(oh * plane)
        .zip(wide.chunks_exact(h * plane))
    {
        for (orow, (idx, wt)) in dst.chunks_exact_mut(plane).zip(&rows) {
            for (&i, &k) in idx.iter().zip(wt) {
                let srow = &image[i * plane..(i + 1) * plane];
                orow.iter_mut().zip(srow).for_each(|(o, v)| *o += k * v);
            }
        }
    }
    Tensor::from_vec(out, (b, oh, ow, c), &Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(x.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights sum to 1 and a constant stays constant; the taps of one x2 output are
    /// PyTorch's (t = 0.75, for output 4 of 8 -> 16), and so are the values of squares
    /// resized 8 -> 13 (a scale that is no integer, past both borders).
    #[test]
    fn bicubic_matches_pytorch() {
        for (i, o) in [(4, 8), (5, 20), (16, 12), (1, 3)] {
            for (_, w) in taps(i, o) {
                assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            }
        }
        let (idx, w) = taps(8, 16)[4];
        assert_eq!(idx, [0, 1, 2, 3]);
        let want = [-0.03515625, 0.26171875, 0.87890625, -0.10546875];
        for (a, b) in w.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{w:?}");
        }
        // torch.nn.functional.interpolate(x, size=(1, 13), mode="bicubic"), in float64.
        let torch = [
            -0.09409137460172978,
            0.18134103322713024,
            1.1111174328629896,
            2.517580791989076,
            5.278049613108776,
            8.073680018206645,
            12.125,
            17.238677742375955,
            21.873179335457436,
            28.851217569412842,
            35.333693673190716,
            44.47398441055988,
            50.22318786982246,
        ];
        let squares: Vec<f32> = (0..8).map(|x| (x * x) as f32).collect();
        let x = Tensor::from_vec(squares, (1, 1, 8, 1), &Device::Cpu).unwrap();
        let y = bicubic(&x, (1, 13)).unwrap().flatten_all().unwrap();
        for (v, t) in y.to_vec1::<f32>().unwrap().iter().zip(torch) {
            assert!(
                (*v as f64 - t).abs() < 1e-5 * t.abs().max(1.0),
                "{v} vs {t}"
            );
        }
        let flat = Tensor::full(0.25f32, (2, 3, 5, 3), &Device::Cpu).unwrap();
        let y = bicubic(&flat, (9, 7)).unwrap();
        assert_eq!(y.dims(), &[2, 9, 7, 3]);
        for v in y.flatten_all().unwrap().to_vec1::<f32>().unwrap() {
            assert!((v - 0.25).abs() < 1e-6);
        }
    }
}
