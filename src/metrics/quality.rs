//! PSNR and SSIM exactly as BasicSR's `calculate_psnr` / `calculate_ssim` compute them.

use super::{same_shape, to_255, MetricsError};
use crate::planar::Planar;

/// Which signal a metric compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// The BT.601 studio-swing luma `Y` (BasicSR's `test_y_channel=True`); a 1-channel image is
    /// used as it is. This is what SR papers report.
    Y,
    /// Every channel of the image as stored (BasicSR's `test_y_channel=False`).
    Rgb,
}

/// A single image plane on the 0..255 scale, in float64.
struct Plane {
    height: usize,
    width: usize,
    data: Vec<f64>,
}

#[cfg(test)]
/// BT.601 studio-swing luma of an RGB image, on the 0..255 scale, row-major `height * width`.
///
/// `Y = 16 + 65.481 R + 128.553 G + 24.966 B` with R, G, B in [0, 1], computed in f64 and
/// not rounded: the formula of MATLAB's `rgb2ycbcr` that BasicSR's `bgr2ycbcr` copies.
/// (It is not the full-range `0.299 R + 0.587 G + 0.114 B`; the two differ by the 16..235
/// range compression, which changes PSNR by about 1 dB.)
pub fn rgb_to_y(img: &Planar) -> Result<Vec<f64>, MetricsError> {
    if img.channels != 3 {
        return Err(MetricsError::NotRgb(img.channels));
    }
    Ok(y_plane(img, 0).data)
}

/// [`crate::metrics::psnr`], with the step's own error.
pub fn psnr(a: &Planar, b: &Planar, crop: usize, measure: Measure) -> Result<f64, MetricsError> {
    let (pa, pb) = compared_planes(a, b, crop, measure)?;
    let mut sum = 0.0;
    let mut count = 0usize;
    for (x, y) in pa.iter().zip(&pb) {
        sum += x
            .data
            .iter()
            .zip(&y.data)
            .map(|(p, q)| (p - q) * (p - q))
            .sum::<f64>();
        count += x.data.len();
    }
    let mse = sum / count as f64;
    if mse == 0.0 {
        return Ok(f64::INFINITY);
    }
    Ok(10.0 * (255.0 * 255.0 / mse).log10())
}

/// [`crate::metrics::ssim`], with the step's own error.
pub fn ssim(a: &Planar, b: &Planar, crop: usize, measure: Measure) -> Result<f64, MetricsError> {
    let (pa, pb) = compared_planes(a, b, crop, measure)?;
    let (height, width) = (pa[0].height, pa[0].width);
    if height < WINDOW || width < WINDOW {
        return Err(MetricsError::TooSmallForSsim { height, width });
    }
    let kernel = gaussian_kernel();
    let total: f64 = pa
        .iter()
        .zip(&pb)
        .map(|(x, y)| ssim_plane(x, y, &kernel))
        .sum();
    Ok(total / pa.len() as f64)
}

const WINDOW: usize = 11;
const SIGMA: f64 = 1.5;

/// The normalised 1-D Gaussian (OpenCV's `getGaussianKernel(11, 1.5)`); BasicSR's 2-D window
/// is its outer product, so filtering rows then columns with it is the same filter.
fn gaussian_kernel() -> [f64; WINDOW] {
    let mut k = [0.0; WINDOW];
    let centre = (WINDOW / 2) as f64;
    for (i, v) in k.iter_mut().enumerate() {
        let d = i as f64 - centre;
        *v = (-d * d / (2.0 * SIGMA * SIGMA)).exp();
    }
    let sum: f64 = k.iter().sum();
    k.iter_mut().for_each(|v| *v /= sum);
    k
}

/// Correlates a plane with the separable window, keeping only the positions where the
/// whole window lies inside the plane: output is `(h - 10) x (w - 10)`.
fn filter_valid(src: &[f64], height: usize, width: usize, k: &[f64; WINDOW]) -> Vec<f64> {
    let ow = width + 1 - WINDOW;
    let oh = height + 1 - WINDOW;
    let mut rows = vec![0.0; height * ow];
    for y in 0..height {
        let line = &src[y * width..(y + 1) * width];
        for x in 0..ow {
            rows[y * ow + x] = k.iter().zip(&line[x..x + WINDOW]).map(|(w, v)| w * v).sum();
        }
    }
    let mut out = vec![0.0; oh * ow];
    for y in 0..oh {
        for x in 0..ow {
            out[y * ow + x] = k
                .iter()
                .enumerate()
                .map(|(i, w)| w * rows[(y + i) * ow + x])
                .sum();
        }
    }
    out
}

fn ssim_plane(a: &Plane, b: &Plane, k: &[f64; WINDOW]) -> f64 {
    const C1: f64 = (0.01 * 255.0) * (0.01 * 255.0);
    const C2: f64 = (0.03 * 255.0) * (0.03 * 255.0);
    let (h, w) = (a.height, a.width);
    let filt = |f: &dyn Fn(f64, f64) -> f64| {
        let prod: Vec<f64> = a.data.iter().zip(&b.data).map(|(&p, &q)| f(p, q)).collect();
        filter_valid(&prod, h, w, k)
    };
    let mu1 = filter_valid(&a.data, h, w, k);
    let mu2 = filter_valid(&b.data, h, w, k);
    let e11 = filt(&|p, _| p * p);
    let e22 = filt(&|_, q| q * q);
    let e12 = filt(&|p, q| p * q);
    let n = mu1.len();
    let mut sum = 0.0;
    for i in 0..n {
        let (m1, m2) = (mu1[i], mu2[i]);
        // Variances and covariance as E[xy] - E[x]E[y] (population form), as BasicSR.
        let s11 = e11[i] - m1 * m1;
        let s22 = e22[i] - m2 * m2;
        let s12 = e12[i] - m1 * m2;
        sum += ((2.0 * m1 * m2 + C1) * (2.0 * s12 + C2))
            / ((m1 * m1 + m2 * m2 + C1) * (s11 + s22 + C2));
    }
    sum / n as f64
}

/// The cropped planes of both images that a metric compares.
fn compared_planes(
    a: &Planar,
    b: &Planar,
    crop: usize,
    measure: Measure,
) -> Result<(Vec<Plane>, Vec<Plane>), MetricsError> {
    same_shape(a, b)?;
    if 2 * crop >= a.height || 2 * crop >= a.width {
        return Err(MetricsError::CropTooLarge {
            crop,
            height: a.height,
            width: a.width,
        });
    }
    let planes = |img: &Planar| -> Result<Vec<Plane>, MetricsError> {
        match (measure, img.channels) {
            (Measure::Y, 3) => Ok(vec![y_plane(img, crop)]),
            (Measure::Y, 1) | (Measure::Rgb, _) => Ok((0..img.channels)
                .map(|c| channel_plane(img, c, crop))
                .collect()),
            (Measure::Y, n) => Err(MetricsError::NotRgb(n)),
        }
    };
    Ok((planes(a)?, planes(b)?))
}

/// Channel `c` of `img` with `crop` pixels removed per side, on the 255 scale.
fn channel_plane(img: &Planar, c: usize, crop: usize) -> Plane {
    cropped(img, crop, |y, x| to_255(img.get(c, y, x)))
}

/// The luma of an RGB image with `crop` pixels removed per side (see [`rgb_to_y`]).
fn y_plane(img: &Planar, crop: usize) -> Plane {
    cropped(img, crop, |y, x| {
        let [r, g, b] = [0, 1, 2].map(|c| to_255(img.get(c, y, x)) / 255.0);
        16.0 + 65.481 * r + 128.553 * g + 24.966 * b
    })
}

fn cropped(img: &Planar, crop: usize, value: impl Fn(usize, usize) -> f64) -> Plane {
    let height = img.height - 2 * crop;
    let width = img.width - 2 * crop;
    let mut data = Vec::with_capacity(height * width);
    for y in crop..crop + height {
        for x in crop..crop + width {
            data.push(value(y, x));
        }
    }
    Plane {
        height,
        width,
        data,
    }
}
