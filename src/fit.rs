//! Whether an image's output can be written, and how, decided before the model runs: the
//! format's size limits, and the memory the whole-image path needs (the output canvas holds a
//! weighted sum per sample and a weight per pixel in f32: 16 bytes per RGB output pixel)
//! against what the system has. PNG and TIFF files can be written in bands of rows instead
//! ([`crate::io::encode_bands`]), which needs memory for a band only.

use crate::io::Format;

/// Above this, the whole-image path's memory makes a PNG or TIFF file go in bands (when
/// nothing else rules bands out): the samples are the same either way, and the band path
/// stays within the model, the batch and a band of rows.
pub const STREAM_ABOVE_BYTES: u64 = 1 << 30;

/// The largest side each format's encoder writes.
pub fn max_side(format: Format) -> u64 {
    match format {
        Format::Webp => 16383,
        Format::Jpeg => 65535,
        // Both store sizes as 32-bit integers; PNG allows up to 2^31 - 1.
        Format::Png | Format::Tiff => (1 << 31) - 1,
    }
}

/// A baseline TIFF file addresses its strips with 32-bit offsets; the margin leaves room for
/// the directory and an ICC profile.
const TIFF_MAX_SAMPLE_BYTES: u64 = u32::MAX as u64 - (16 << 20);

/// How an output is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writing {
    /// Computed whole, then encoded.
    Whole,
    /// Written in bands of rows as the tiles finish.
    Bands,
}

/// What about an image's output decides how it can be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputNeed {
    /// The output's format.
    pub format: Format,
    /// The final width.
    pub width: u64,
    /// The final height.
    pub height: u64,
    /// Samples per output pixel in the file.
    pub samples: u64,
    /// Bytes per sample in the file.
    pub sample_bytes: u64,
    /// Bytes the whole-image path holds at its peak (canvases, results, encoded samples).
    pub whole_bytes: u64,
    /// Why bands cannot be used for this output even if the format allowed them; `None`
    /// when they can.
    pub no_bands: Option<&'static str>,
}

/// Why an output cannot be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A side is over what the format's encoder writes.
    #[error(
        "the {width}x{height} output is larger than {format} allows ({limit} pixels a side); \
         write .png or .tif"
    )]
    FormatSide {
        /// The output's format.
        format: Format,
        /// The output's width.
        width: u64,
        /// The output's height.
        height: u64,
        /// The format's largest side.
        limit: u64,
    },
    /// The samples are more than a baseline TIFF file can address.
    #[error(
        "the {width}x{height} output is {} of samples, more than a TIFF file can hold \
         (4 GiB); write .png",
        gib(*bytes)
    )]
    TiffSize {
        /// The output's width.
        width: u64,
        /// The output's height.
        height: u64,
        /// Bytes of samples.
        bytes: u64,
    },
    /// Written whole, the output needs more memory than is available.
    #[error(
        "the {width}x{height} output needs about {} of memory to be written whole as \
         {format}, and {} is available; {hint}",
        gib(*need), gib(*available)
    )]
    Memory {
        /// The output's format.
        format: Format,
        /// The output's width.
        width: u64,
        /// The output's height.
        height: u64,
        /// About the bytes the whole-image path holds at its peak.
        need: u64,
        /// Bytes the system has available.
        available: u64,
        /// What would write it in bands instead.
        hint: String,
    },
}

impl From<Refusal> for crate::Error {
    fn from(e: Refusal) -> Self {
        crate::Error::new(crate::ErrorKind::Output, e)
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// How `need` is written: in bands when `stream` says so (`None`: when the whole image would
/// take more than [`STREAM_ABOVE_BYTES`]) and the format and the run allow it; whole
/// otherwise, if `available` memory (when known) holds it.
pub fn plan(
    need: &OutputNeed,
    available: Option<u64>,
    stream: Option<bool>,
) -> Result<Writing, Refusal> {
    let (format, width, height) = (need.format, need.width, need.height);
    let limit = max_side(format);
    if width > limit || height > limit {
        return Err(Refusal::FormatSide {
            format,
            width,
            height,
            limit,
        });
    }
    let bytes = width * height * need.samples * need.sample_bytes;
    if format == Format::Tiff && bytes > TIFF_MAX_SAMPLE_BYTES {
        return Err(Refusal::TiffSize {
            width,
            height,
            bytes,
        });
    }
    let bands_possible = crate::io::can_stream(format) && need.no_bands.is_none();
    let bands = match stream {
        Some(s) => s,
        None => need.whole_bytes > STREAM_ABOVE_BYTES,
    };
    if bands && bands_possible {
        return Ok(Writing::Bands);
    }
    match available {
        Some(available) if need.whole_bytes > available => Err(Refusal::Memory {
            format,
            width,
            height,
            need: need.whole_bytes,
            available,
            hint: match need.no_bands {
                Some(why) => format!("it cannot be written in bands {why}"),
                None if !crate::io::can_stream(format) => {
                    "write .png or .tif to write it in bands as it is computed".into()
                }
                None => "UPSCALE_STREAM=never keeps it whole".into(),
            },
        }),
        _ => Ok(Writing::Whole),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(format: Format, width: u64, height: u64) -> OutputNeed {
        OutputNeed {
            format,
            width,
            height,
            samples: 3,
            sample_bytes: 1,
            whole_bytes: width * height * 19,
            no_bands: None,
        }
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn format_limits_are_refused_with_the_format_that_would_do() {
        let e = plan(&need(Format::Webp, 16384, 100), None, None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("16384x100") && msg.contains("WebP") && msg.contains("16383"));
        assert!(msg.contains(".png or .tif"), "{msg}");
        assert!(plan(&need(Format::Webp, 16383, 16383), None, Some(false)).is_ok());
        assert!(plan(&need(Format::Jpeg, 100, 65536), None, None).is_err());
        assert!(plan(&need(Format::Jpeg, 100, 65535), None, None).is_ok());
        let e = plan(&need(Format::Tiff, 40000, 40000), None, None).unwrap_err();
        assert!(matches!(e, Refusal::TiffSize { .. }), "{e}");
        assert!(e.to_string().contains("write .png"));
        assert!(plan(&need(Format::Png, 40000, 40000), None, None).is_ok());
    }

    #[test]
    fn large_png_and_tiff_go_in_bands_and_small_ones_whole() {
        let big = need(Format::Png, 32000, 24000);
        assert_eq!(plan(&big, Some(4 * GIB), None), Ok(Writing::Bands));
        assert_eq!(plan(&big, None, None), Ok(Writing::Bands));
        let small = need(Format::Tiff, 1000, 1000);
        assert_eq!(plan(&small, Some(4 * GIB), None), Ok(Writing::Whole));
        assert_eq!(plan(&small, Some(4 * GIB), Some(true)), Ok(Writing::Bands));
        assert_eq!(plan(&big, None, Some(false)), Ok(Writing::Whole));
    }

    #[test]
    fn whole_images_that_do_not_fit_in_memory_are_refused() {
        let jpeg = need(Format::Jpeg, 32000, 24000);
        let e = plan(&jpeg, Some(4 * GIB), None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("32000x24000") && msg.contains("JPEG"), "{msg}");
        assert!(msg.contains("13.6 GiB") && msg.contains("4.0 GiB"), "{msg}");
        assert!(msg.contains("write .png or .tif"), "{msg}");
        // Unknown memory (not Linux): not refused.
        assert_eq!(plan(&jpeg, None, None), Ok(Writing::Whole));
        assert_eq!(plan(&jpeg, Some(20 * GIB), None), Ok(Writing::Whole));
        // A PNG that cannot go in bands says why.
        let mut tta = need(Format::Png, 32000, 24000);
        tta.no_bands = Some("with --tta");
        let msg = plan(&tta, Some(4 * GIB), None).unwrap_err().to_string();
        assert!(
            msg.contains("cannot be written in bands with --tta"),
            "{msg}"
        );
        // Kept whole on request, and too large for that.
        let png = need(Format::Png, 32000, 24000);
        let msg = plan(&png, Some(4 * GIB), Some(false))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("UPSCALE_STREAM=never"), "{msg}");
    }
}
