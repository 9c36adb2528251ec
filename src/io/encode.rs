//! Writing planar f32 RGB (+ alpha) to PNG, JPEG, WebP or TIFF, through [`write_atomic`].
//!
//! Samples are clamped to [0, 1] and rounded: `round(clamp(x) * max)`, max = 255 or 65535
//! (NaN becomes 0). A gray source is written gray again: decoding replicated its luma into R,
//! G and B, so any weights summing to 1 undo that exactly; we take the plain mean, which
//! also averages out the model's independent per-channel deviations best.
//!
//! The input's ICC profile and EXIF ([`Metadata`]) go into the file where the format can hold
//! them; a piece it cannot hold is left out, never failing the image, and reported back.

use std::io::{Seek, Write};
use std::path::Path;

use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::codecs::tiff::TiffEncoder;
use image::codecs::webp::WebPEncoder;
use image::{DynamicImage, ImageBuffer, ImageEncoder, ImageResult};

use super::atomic::write_atomic;
use super::error::innermost_message;
use super::metadata::{icc_fits, icc_space};
use super::{Format, IoError, Metadata, OutputError};
use crate::planar::Planar;

pub const DEFAULT_JPEG_QUALITY: u8 = 95;

/// PNG deflate setting, chosen by measurement: encoding a 2048×2048 photo-like RGB image
/// (12.6 MB raw; smooth shading, multi-scale texture, ±2 levels of grain), release build, one
/// thread on a busy 2-core machine, best of 2
/// (`cargo test --release --lib png_speed -- --ignored --nocapture`):
///
/// | compression | filter   | time     | size    |
/// |-------------|----------|----------|---------|
/// | Fast        | NoFilter |    70 ms | 12.6 MB |
/// | Fast        | Paeth    |    52 ms |  5.7 MB |
/// | Fast        | Adaptive |    68 ms |  5.5 MB |
/// | Level(1)    | Adaptive |   318 ms |  5.9 MB |
/// | Level(3)    | Adaptive |   574 ms |  5.5 MB |
/// | Default     | Adaptive |  3249 ms |  5.3 MB |
/// | Best        | Adaptive |  3841 ms |  5.3 MB |
///
/// Fast + Adaptive is ~50× quicker than Default for a 4% larger file, so it is the default.
pub const DEFAULT_PNG_COMPRESSION: CompressionType = CompressionType::Fast;
pub const DEFAULT_PNG_FILTER: FilterType = FilterType::Adaptive;

/// How [`crate::io::encode`] writes an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// The file format.
    pub format: Format,
    /// 8 or 16. 16 is accepted for PNG and TIFF only; asking it of JPEG or WebP is an error
    /// (use [`Format::default_bit_depth`] to follow the source without asking).
    pub bit_depth: u8,
    /// JPEG quality, 1 to 100. WebP is always written lossless (the only WebP encoder the
    /// image crate has), so quality does not apply to it.
    pub quality: u8,
    /// PNG deflate level (the default is chosen by measurement: see the module source).
    pub png_compression: CompressionType,
    /// PNG row filter.
    pub png_filter: FilterType,
}

impl EncodeOptions {
    /// 8-bit `format` with the default JPEG quality and PNG settings.
    pub fn new(format: Format) -> Self {
        EncodeOptions {
            format,
            bit_depth: 8,
            quality: DEFAULT_JPEG_QUALITY,
            png_compression: DEFAULT_PNG_COMPRESSION,
            png_filter: DEFAULT_PNG_FILTER,
        }
    }
}

/// Writes `rgb` (3 channels, or 1 for gray) and `alpha` (1 channel, same size) to `path`,
/// creating missing parent folders. With `gray`, R, G and B are averaged into one luma
/// channel. JPEG has no alpha, so alpha is dropped there ([`Format::supports_alpha`] lets the
/// caller warn); TIFF has no gray+alpha layout in the image crate, so gray with alpha is
/// written to TIFF as RGBA. `meta` goes in as far as the format allows; what did not is
/// returned, one message per piece.
pub fn encode(
    path: &Path,
    rgb: &Planar,
    alpha: Option<&Planar>,
    gray: bool,
    meta: &Metadata,
    opts: &EncodeOptions,
) -> Result<Vec<String>, IoError> {
    let img = to_image(rgb, alpha, gray, opts).map_err(|e| IoError::Encode {
        path: path.to_path_buf(),
        format: opts.format,
        detail: e.to_string(),
    })?;
    let mut left_out = Vec::new();
    write_atomic(path, |w| {
        left_out = write_image(w, &img, meta, opts).map_err(|e| IoError::Encode {
            path: path.to_path_buf(),
            format: opts.format,
            detail: innermost_message(&e),
        })?;
        Ok(())
    })?;
    Ok(left_out)
}

/// The encoded file's bytes, for a destination that is not a file (a pipe, say), and what
/// of `meta` was left out; `name` stands for the destination in error messages.
pub fn encode_to_vec(
    name: &Path,
    rgb: &Planar,
    alpha: Option<&Planar>,
    gray: bool,
    meta: &Metadata,
    opts: &EncodeOptions,
) -> Result<(Vec<u8>, Vec<String>), IoError> {
    let failed = |detail: String| IoError::Encode {
        path: name.to_path_buf(),
        format: opts.format,
        detail,
    };
    let img = to_image(rgb, alpha, gray, opts).map_err(|e| failed(e.to_string()))?;
    let mut out = std::io::Cursor::new(Vec::new());
    let left_out =
        write_image(&mut out, &img, meta, opts).map_err(|e| failed(innermost_message(&e)))?;
    Ok((out.into_inner(), left_out))
}

/// Encodes an already built image with `meta`, for callers that write somewhere else than a
/// file; returns a message for each piece of `meta` the format could not take.
pub fn write_image<W: Write + Seek>(
    w: &mut W,
    img: &DynamicImage,
    meta: &Metadata,
    opts: &EncodeOptions,
) -> ImageResult<Vec<String>> {
    let format = opts.format;
    match format {
        Format::Png => with_metadata(
            img,
            PngEncoder::new_with_quality(w, opts.png_compression, opts.png_filter),
            meta,
            format,
        ),
        Format::Jpeg => with_metadata(
            img,
            JpegEncoder::new_with_quality(w, opts.quality),
            meta,
            format,
        ),
        Format::Webp => with_metadata(img, WebPEncoder::new_lossless(w), meta, format),
        Format::Tiff => with_metadata(img, TiffEncoder::new(w), meta, format),
    }
}

fn with_metadata<E: ImageEncoder>(
    img: &DynamicImage,
    mut encoder: E,
    meta: &Metadata,
    format: Format,
) -> ImageResult<Vec<String>> {
    let mut left_out = Vec::new();
    if let Some(icc) = &meta.icc {
        let rgb = img.color().has_color();
        if !icc_fits(icc, rgb) {
            left_out.push(format!(
                "ICC profile left out: it is for {}, the output is {}",
                icc_space(icc),
                if rgb { "RGB" } else { "gray" }
            ));
        } else if encoder.set_icc_profile(icc.clone()).is_err() {
            left_out.push(format!(
                "ICC profile left out: the {format} writer cannot store one"
            ));
        }
    }
    if let Some(exif) = &meta.exif {
        if encoder.set_exif_metadata(exif.clone()).is_err() {
            left_out.push(format!(
                "EXIF left out: the {format} writer cannot store it"
            ));
        }
    }
    if meta.exif_dropped {
        left_out.push("EXIF left out: its orientation could not be reset safely".into());
    }
    img.write_with_encoder(encoder)?;
    Ok(left_out)
}

/// Quantizes the planes into the pixel layout `opts.format` will take. The error names no
/// file.
pub fn to_image(
    rgb: &Planar,
    alpha: Option<&Planar>,
    gray: bool,
    opts: &EncodeOptions,
) -> Result<DynamicImage, OutputError> {
    let format = opts.format;
    match opts.bit_depth {
        8 => {}
        16 if format.supports_16bit() => {}
        16 => return Err(OutputError::EightBitOnly(format)),
        d => return Err(OutputError::BitDepth(d)),
    }
    if !(1..=100).contains(&opts.quality) {
        return Err(OutputError::Quality(opts.quality));
    }
    if rgb.channels != 1 && rgb.channels != 3 {
        return Err(OutputError::Channels(rgb.channels));
    }
    let (w, h) = (rgb.width, rgb.height);
    let (Ok(w32), Ok(h32)) = (u32::try_from(w), u32::try_from(h)) else {
        return Err(OutputError::TooWide {
            width: w,
            height: h,
        });
    };
    if w == 0 || h == 0 {
        return Err(OutputError::NoPixels {
            width: w,
            height: h,
        });
    }
    if rgb.data.len() != rgb.channels * h * w {
        return Err(OutputError::BufferSize);
    }
    if let Some(a) = alpha {
        if (a.channels, a.height, a.width) != (1, h, w) || a.data.len() != h * w {
            return Err(OutputError::AlphaSize {
                channels: a.channels,
                height: a.height,
                width: a.width,
                want_height: h,
                want_width: w,
            });
        }
    }

    let alpha = alpha.filter(|_| format.supports_alpha());
    let gray_out = (gray || rgb.channels == 1) && !(alpha.is_some() && format == Format::Tiff);
    let luma;
    let mut planes: Vec<&[f32]> = if rgb.channels == 1 {
        let p = rgb.plane(0);
        if gray_out {
            vec![p]
        } else {
            vec![p, p, p]
        }
    } else if gray_out {
        luma = mean_of_planes(rgb);
        vec![&luma[..]]
    } else {
        vec![rgb.plane(0), rgb.plane(1), rgb.plane(2)]
    };
    if let Some(a) = alpha {
        planes.push(a.plane(0));
    }

    let img = if opts.bit_depth == 8 {
        let data = interleave(&planes, |x| (clamp01(x) * 255.0).round() as u8);
        match planes.len() {
            1 => DynamicImage::ImageLuma8(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            2 => DynamicImage::ImageLumaA8(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            3 => DynamicImage::ImageRgb8(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            _ => DynamicImage::ImageRgba8(ImageBuffer::from_raw(w32, h32, data).unwrap()),
        }
    } else {
        let data = interleave(&planes, |x| (clamp01(x) * 65535.0).round() as u16);
        match planes.len() {
            1 => DynamicImage::ImageLuma16(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            2 => DynamicImage::ImageLumaA16(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            3 => DynamicImage::ImageRgb16(ImageBuffer::from_raw(w32, h32, data).unwrap()),
            _ => DynamicImage::ImageRgba16(ImageBuffer::from_raw(w32, h32, data).unwrap()),
        }
    };
    Ok(img)
}

/// NaN compares false both ways and so maps to 0.
fn clamp01(x: f32) -> f32 {
    if x > 0.0 {
        x.min(1.0)
    } else {
        0.0
    }
}

fn mean_of_planes(rgb: &Planar) -> Vec<f32> {
    let (r, g, b) = (rgb.plane(0), rgb.plane(1), rgb.plane(2));
    r.iter()
        .zip(g)
        .zip(b)
        .map(|((r, g), b)| (r + g + b) / 3.0)
        .collect()
}

fn interleave<T: Copy + Default>(planes: &[&[f32]], quantize: impl Fn(f32) -> T) -> Vec<T> {
    let c = planes.len();
    let n = planes[0].len();
    let mut out = vec![T::default(); n * c];
    for (k, plane) in planes.iter().enumerate() {
        for (dst, &x) in out[k..].iter_mut().step_by(c).zip(plane.iter()) {
            *dst = quantize(x);
        }
    }
    out
}
