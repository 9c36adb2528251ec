//! Image quality metrics as super-resolution papers report them, and the bicubic resize
//! used to make their low-resolution inputs.
//!
//! Everything here follows BasicSR's evaluation code (the code DRCT and most SR papers
//! publish numbers with), so that `upscale eval` reproduces published tables:
//!
//! * [`psnr`] and [`ssim`] work in float64 on the 0..255 scale, crop `crop` pixels from
//!   every side first, and measure either the BT.601 "studio swing" luma `Y` or all RGB
//!   channels.
//! * BasicSR measures the 8-bit images that were saved to disk, not the network's float
//!   output; [`quantize_u8`] turns a float image into exactly what an 8-bit PNG holds, so
//!   an evaluation can measure what actually ships.
//! * [`imresize`] is MATLAB's bicubic `imresize` (antialiased when shrinking), and
//!   [`bicubic_lr`] makes an LR image from an HR one the way benchmark sets are made.
//!
//! Images are [`Planar`] values in [0, 1]. They are brought to the 255 scale by a float32
//! multiply (see `to_255`) so that an 8-bit level `k / 255` stored as f32 maps back to
//! exactly `k`; every later step is float64.

mod quality;
mod resize;
impl From<MetricsError> for Error {
    fn from(e: MetricsError) -> Self {
        Error::new(crate::ErrorKind::Metrics, e)
    }
}

#[cfg(test)]
mod tests;

pub use quality::Measure;
pub use resize::{bicubic_lr, imresize};

use crate::error::Error;
use crate::planar::Planar;

/// PSNR in dB on the 255 scale, after removing `crop` pixels from every side.
///
/// `10 log10(255^2 / MSE)` with the MSE taken in float64 over all compared pixels (and all
/// channels for [`Measure::Rgb`]). Identical images have MSE 0: the result is then
/// `f64::INFINITY`, as in BasicSR, so callers averaging over a data set should expect it.
pub fn psnr(a: &Planar, b: &Planar, crop: usize, measure: Measure) -> Result<f64, Error> {
    Ok(quality::psnr(a, b, crop, measure)?)
}

/// SSIM after removing `crop` pixels from every side, as BasicSR's `calculate_ssim`.
///
/// 11x11 Gaussian window with sigma 1.5 (applied separably), statistics only where the
/// window fits inside the image ("valid"), C1 = (0.01 * 255)^2, C2 = (0.03 * 255)^2,
/// float64; the SSIM map is averaged. For [`Measure::Rgb`] each channel is measured on
/// its own and the channel results are averaged.
pub fn ssim(a: &Planar, b: &Planar, crop: usize, measure: Measure) -> Result<f64, Error> {
    Ok(quality::ssim(a, b, crop, measure)?)
}

/// Why a metric could not be computed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum MetricsError {
    /// The two images are not the same size and channel count.
    #[error("images differ in shape: {a:?} vs {b:?} (channels, height, width)")]
    ShapeMismatch {
        /// The first image's (channels, height, width).
        a: (usize, usize, usize),
        /// The second image's.
        b: (usize, usize, usize),
    },
    /// The crop takes the whole image.
    #[error("cropping {crop} pixels per side leaves nothing of a {height}x{width} image")]
    CropTooLarge {
        /// Pixels cropped per side.
        crop: usize,
        /// The image's height before cropping.
        height: usize,
        /// Its width.
        width: usize,
    },
    /// SSIM's 11x11 Gaussian window does not fit in the cropped image.
    #[error("SSIM needs at least 11x11 pixels after cropping, got {height}x{width}")]
    TooSmallForSsim {
        /// Height after cropping.
        height: usize,
        /// Width after cropping.
        width: usize,
    },
    /// Luma asked of an image that is neither gray nor RGB (the channel count).
    #[error("the Y channel needs a 1- or 3-channel image, got {0} channels")]
    NotRgb(usize),
}

/// The three numbers an SR evaluation reports for one image pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImageMetrics {
    /// PSNR on the Y channel, dB (the number in SR papers' tables).
    pub psnr_y: f64,
    /// SSIM on the Y channel.
    pub ssim_y: f64,
    /// PSNR over all RGB channels, dB.
    pub psnr_rgb: f64,
}

impl ImageMetrics {
    /// Measures `sr` against the ground truth `hr`, both cropped by `crop` pixels per side
    /// (papers crop the scale factor). Pass images through [`quantize_u8`] first to
    /// measure what an 8-bit file would hold, as BasicSR does.
    pub fn compute(sr: &Planar, hr: &Planar, crop: usize) -> Result<Self, Error> {
        Ok(Self {
            psnr_y: psnr(sr, hr, crop, Measure::Y)?,
            ssim_y: ssim(sr, hr, crop, Measure::Y)?,
            psnr_rgb: psnr(sr, hr, crop, Measure::Rgb)?,
        })
    }
}

/// The image as an 8-bit file would store it: each value becomes `round(x * 255) / 255`,
/// clamped to [0, 1].
///
/// This mirrors BasicSR's `tensor2img` (clamp to [0, 1], multiply by 255 in float32, round
/// half to even), so metrics on the result equal metrics on the saved PNG.
pub fn quantize_u8(img: &Planar) -> Planar {
    let data = img
        .data
        .iter()
        .map(|&x| f32::from(level_u8(x)) / 255.0)
        .collect();
    Planar::new(img.channels, img.height, img.width, data)
}

/// The 8-bit level a [0, 1] value is saved as (see [`quantize_u8`]).
pub(crate) fn level_u8(x: f32) -> u8 {
    // NaN maps to 0 through the saturating cast; clamping first keeps the product in range.
    (x.clamp(0.0, 1.0) * 255.0).round_ties_even() as u8
}

/// A [0, 1] value on the 0..255 scale.
///
/// The multiply is done in f32 on purpose: f32(k / 255) * 255 rounds back to exactly `k`
/// for every 8-bit level `k`, so quantised images give the integer values BasicSR sees in
/// its uint8 arrays. For other values the f32 rounding (below 2e-5) is no larger than the
/// precision the f32 input already has.
pub(crate) fn to_255(x: f32) -> f64 {
    f64::from(x * 255.0)
}

fn shape(img: &Planar) -> (usize, usize, usize) {
    (img.channels, img.height, img.width)
}

fn same_shape(a: &Planar, b: &Planar) -> Result<(), MetricsError> {
    if shape(a) == shape(b) {
        Ok(())
    } else {
        Err(MetricsError::ShapeMismatch {
            a: shape(a),
            b: shape(b),
        })
    }
}
