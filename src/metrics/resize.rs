//! MATLAB's bicubic `imresize`, which SR benchmarks use to make their LR inputs.
//!
//! The facts it must match (MATLAB `imresize`, mirrored by BasicSR's `imresize`):
//! * cubic convolution kernel with a = -0.5, support [-2, 2];
//! * when shrinking by `scale < 1` the kernel is stretched by `1 / scale` (and its height
//!   scaled by `scale`) so it also low-passes: the antialiasing that makes MATLAB's LR
//!   images differ from a plain bicubic filter;
//! * output pixel `i` (1-based) samples input position `u = i / scale + 0.5 (1 - 1 / scale)`;
//! * the weights of each output pixel are normalised to sum to 1;
//! * pixels beyond the border are mirrored with the edge pixel repeated (`dcba|abcd|dcba`);
//! * the two axes are resized one after the other (rows first), output size
//!   `ceil(in * scale)`.

use crate::planar::Planar;

/// Resizes `img` by `scale` on both axes with MATLAB's bicubic `imresize`.
///
/// The output is `ceil(height * scale) x ceil(width * scale)`; the arithmetic is float64
/// and the result is not clamped (bicubic overshoots slightly at edges, as in MATLAB with
/// floating-point input).
///
/// # Panics
/// If `scale` is not a positive finite number.
pub fn imresize(img: &Planar, scale: f64) -> Planar {
    assert!(
        scale.is_finite() && scale > 0.0,
        "imresize scale must be positive"
    );
    let out_h = (img.height as f64 * scale).ceil() as usize;
    let out_w = (img.width as f64 * scale).ceil() as usize;
    let planes = resize_planes(img, out_h, out_w, scale);
    let data = planes.into_iter().flatten().map(|v| v as f32).collect();
    Planar::new(img.channels, out_h, out_w, data)
}

/// Makes an LR image from an HR one the way SR benchmark sets are made: crop the HR image
/// at the bottom/right to a multiple of `scale` (BasicSR's `mod_crop`), shrink it by
/// `1 / scale` with [`imresize`], and store the result in 8 bits.
///
/// The returned image holds 8-bit levels `k / 255`.
///
/// # Panics
/// If `scale` is 0 or larger than either side of `hr`.
pub fn bicubic_lr(hr: &Planar, scale: usize) -> Planar {
    assert!(
        scale >= 1 && scale <= hr.height && scale <= hr.width,
        "bicubic_lr: scale {scale} does not fit a {}x{} image",
        hr.height,
        hr.width
    );
    let (h, w) = (hr.height / scale * scale, hr.width / scale * scale);
    let mut cropped = Planar::zeros(hr.channels, h, w);
    for c in 0..hr.channels {
        let src = hr.plane(c);
        let dst = cropped.plane_mut(c);
        for y in 0..h {
            dst[y * w..(y + 1) * w].copy_from_slice(&src[y * hr.width..y * hr.width + w]);
        }
    }
    let (out_h, out_w) = (h / scale, w / scale);
    let planes = resize_planes(&cropped, out_h, out_w, 1.0 / scale as f64);
    let data = planes
        .into_iter()
        .flatten()
        .map(|v| {
            // Rounded from the float64 result directly, so no f32 rounding sits in between.
            let level = (v.clamp(0.0, 1.0) * 255.0).round_ties_even() as u8;
            f32::from(level) / 255.0
        })
        .collect();
    Planar::new(hr.channels, out_h, out_w, data)
}

/// For one axis: which input pixels each output pixel reads, and with what weights.
/// Computed once per call and reused for every row/column and channel.
struct AxisWeights {
    /// Taps per output pixel.
    taps: usize,
    /// `out_len * taps` input indices, already mirrored into `0..in_len`.
    index: Vec<usize>,
    /// `out_len * taps` normalised weights.
    weight: Vec<f64>,
}

/// Cubic convolution kernel with a = -0.5 (Keys), as MATLAB's `cubic`.
fn cubic(x: f64) -> f64 {
    let ax = x.abs();
    let (ax2, ax3) = (ax * ax, ax * ax * ax);
    if ax <= 1.0 {
        1.5 * ax3 - 2.5 * ax2 + 1.0
    } else if ax <= 2.0 {
        -0.5 * ax3 + 2.5 * ax2 - 4.0 * ax + 2.0
    } else {
        0.0
    }
}

/// Symmetric border handling: index `i` (0-based, possibly outside `0..n`) reflected with
/// the edge pixel repeated, periodically so that even very small inputs work.
fn mirror(i: i64, n: usize) -> usize {
    let n = n as i64;
    let m = i.rem_euclid(2 * n);
    (if m < n { m } else { 2 * n - 1 - m }) as usize
}

fn axis_weights(in_len: usize, out_len: usize, scale: f64) -> AxisWeights {
    let antialias = scale < 1.0;
    let kernel_width = if antialias { 4.0 / scale } else { 4.0 };
    // Enough taps to cover the kernel support wherever its centre falls.
    let taps = kernel_width.ceil() as usize + 2;
    let mut index = Vec::with_capacity(out_len * taps);
    let mut weight = Vec::with_capacity(out_len * taps);
    for i in 1..=out_len {
        // Input coordinate (1-based) that output pixel i maps to, pixel centres aligned.
        let u = i as f64 / scale + 0.5 * (1.0 - 1.0 / scale);
        let left = (u - kernel_width / 2.0).floor();
        let start = weight.len();
        for t in 0..taps {
            let pos = left + t as f64;
            let d = u - pos;
            weight.push(if antialias {
                scale * cubic(d * scale)
            } else {
                cubic(d)
            });
            index.push(mirror(pos as i64 - 1, in_len));
        }
        let sum: f64 = weight[start..].iter().sum();
        weight[start..].iter_mut().for_each(|w| *w /= sum);
    }
    AxisWeights {
        taps,
        index,
        weight,
    }
}

/// Resizes every channel to `out_h x out_w`, rows first then columns, in float64.
fn resize_planes(img: &Planar, out_h: usize, out_w: usize, scale: f64) -> Vec<Vec<f64>> {
    let (in_h, in_w) = (img.height, img.width);
    let wy = axis_weights(in_h, out_h, scale);
    let wx = axis_weights(in_w, out_w, scale);
    (0..img.channels)
        .map(|c| {
            let src: Vec<f64> = img.plane(c).iter().map(|&v| f64::from(v)).collect();
            // Along the height: out_h x in_w.
            let mut tall = vec![0.0; out_h * in_w];
            for o in 0..out_h {
                let row = &mut tall[o * in_w..(o + 1) * in_w];
                for t in 0..wy.taps {
                    let k = o * wy.taps + t;
                    let (w, iy) = (wy.weight[k], wy.index[k]);
                    let line = &src[iy * in_w..(iy + 1) * in_w];
                    row.iter_mut().zip(line).for_each(|(r, &v)| *r += w * v);
                }
            }
            // Along the width: out_h x out_w.
            let mut out = vec![0.0; out_h * out_w];
            for y in 0..out_h {
                let line = &tall[y * in_w..(y + 1) * in_w];
                for o in 0..out_w {
                    let k = o * wx.taps;
                    out[y * out_w + o] = (0..wx.taps)
                        .map(|t| wx.weight[k + t] * line[wx.index[k + t]])
                        .sum();
                }
            }
            out
        })
        .collect()
}
