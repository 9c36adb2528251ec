//! Reading an image file into planar f32 RGB plus optional alpha.
//!
//! The format is taken from the file's first bytes, not its name. EXIF orientation is applied,
//! so the planes are upright, and the ICC profile and EXIF are kept for the encoder (the EXIF
//! orientation reset to match). Grayscale sources come back as three equal planes with `gray`
//! set, so the model always sees RGB and the caller can write gray again.

use std::fs::File;
use std::io::Cursor;
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::path::Path;

use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageReader};

use super::error::{innermost_message, one_line};
use super::{Format, IoError, Metadata};
use crate::planar::Planar;

/// Bounds checked before any pixel buffer is allocated, so that a small file declaring a huge
/// image fails fast instead of exhausting memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Widest image accepted, in pixels.
    pub max_width: u32,
    /// Tallest image accepted, in pixels.
    pub max_height: u32,
    /// Bytes the decoder may allocate for the decoded pixels (and, as a cheap proxy for the
    /// JPEG decoder reading the whole file into memory, the largest file size accepted).
    pub max_alloc: u64,
}

impl Default for DecodeLimits {
    /// 16384 px a side: well past any camera or 8K frame, and the f32 copy of such an image
    /// (3 GiB) is already more than a x4 upscale can hold. 1 GiB holds a 16384² RGBA 8-bit or a
    /// 16384×8192 RGBA 16-bit image.
    fn default() -> Self {
        DecodeLimits {
            max_width: 16384,
            max_height: 16384,
            max_alloc: 1 << 30,
        }
    }
}

/// A decoded image: upright planes, what the file was, and the metadata to carry over.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    /// 3 channels in [0, 1], upright.
    pub rgb: Planar,
    /// 1 channel in [0, 1]; `None` when the file has no alpha channel.
    pub alpha: Option<Planar>,
    /// The file was grayscale (then the three `rgb` planes are equal).
    pub gray: bool,
    /// 8 or 16: the sample depth of the file. Float TIFFs report 16, the most we write.
    pub bit_depth: u8,
    /// The format found from the file's content.
    pub format: Format,
    /// The colour profile and EXIF to write out again.
    pub metadata: Metadata,
}

/// Reads and decodes the image file `path` (PNG, JPEG, WebP or TIFF, told by its content)
/// within the default [`DecodeLimits`]: EXIF orientation applied, gray read as three equal
/// planes, the ICC profile and EXIF kept.
pub fn decode(path: &Path) -> Result<Decoded, IoError> {
    decode_with_limits(path, &DecodeLimits::default())
}

pub fn decode_with_limits(path: &Path, limits: &DecodeLimits) -> Result<Decoded, IoError> {
    let meta = std::fs::metadata(path).map_err(|e| IoError::os(path, e))?;
    if meta.is_dir() {
        return Err(IoError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(ErrorKind::IsADirectory, "is a folder, not a file"),
        });
    }
    if meta.len() == 0 {
        return Err(IoError::Empty {
            path: path.to_path_buf(),
        });
    }
    if meta.len() > limits.max_alloc {
        return Err(too_large(
            path,
            format!(
                "the file is {} MiB, the limit is {} MiB",
                mib(meta.len()),
                mib(limits.max_alloc)
            ),
        ));
    }

    let file = File::open(path).map_err(|e| IoError::os(path, e))?;
    decode_reader(path, BufReader::new(file), limits)
}

/// An image held in memory (read from a pipe, say); `name` stands for it in error messages.
pub fn decode_bytes(name: &Path, bytes: &[u8], limits: &DecodeLimits) -> Result<Decoded, IoError> {
    if bytes.is_empty() {
        return Err(IoError::Empty {
            path: name.to_path_buf(),
        });
    }
    if bytes.len() as u64 > limits.max_alloc {
        return Err(too_large(
            name,
            format!(
                "the data is {} MiB, the limit is {} MiB",
                mib(bytes.len() as u64),
                mib(limits.max_alloc)
            ),
        ));
    }
    decode_reader(name, Cursor::new(bytes), limits)
}

fn decode_reader<R: BufRead + Seek>(
    path: &Path,
    mut reader: R,
    limits: &DecodeLimits,
) -> Result<Decoded, IoError> {
    let head = read_head(&mut reader).map_err(|e| IoError::os(path, e))?;
    let format = match Format::sniff(&head) {
        Some(f) => f,
        None => return Err(unknown_format(path, &head)),
    };

    let tiff_icc = match format {
        Format::Tiff => tiff_icc(&mut reader).map_err(|e| IoError::os(path, e))?,
        _ => None,
    };

    // Dimensions are checked by hand below for a clearer message; only the allocation limit
    // goes to the decoder (PNG needs it at construction).
    let mut image_limits = image::Limits::default();
    image_limits.max_alloc = Some(limits.max_alloc);
    let mut image_reader = ImageReader::with_format(reader, format.image_format());
    image_reader.limits(image_limits);
    let mut decoder = image_reader
        .into_decoder()
        .map_err(|e| classify(path, format, e))?;

    let (width, height) = decoder.dimensions();
    if width > limits.max_width || height > limits.max_height {
        return Err(too_large(
            path,
            format!(
                "{width}x{height} pixels, the limit is {}x{}",
                limits.max_width, limits.max_height
            ),
        ));
    }
    if width == 0 || height == 0 {
        return Err(IoError::Corrupt {
            path: path.to_path_buf(),
            format,
            detail: format!("{width}x{height} image has no pixels"),
        });
    }
    let needed = decoder.total_bytes();
    if needed > limits.max_alloc {
        return Err(too_large(
            path,
            format!(
                "{width}x{height} pixels need {} MiB to decode, the limit is {} MiB",
                mib(needed),
                mib(limits.max_alloc)
            ),
        ));
    }

    // Damaged metadata should not cost the picture: without it the pixels are still right
    // as stored.
    let icc = tiff_icc.or_else(|| decoder.icc_profile().ok().flatten());
    let exif = decoder.exif_metadata().ok().flatten();
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| classify(path, format, e))?;
    img.apply_orientation(orientation);
    let mut decoded = to_planar(img, format);
    decoded.metadata = Metadata::with_exif(icc, exif);
    Ok(decoded)
}

/// A TIFF's ICC profile, read before the decoder gets its limits: with them the image crate
/// caps every tag at the pixel buffer's size, which drops the profile of a small image (a
/// 3 KiB sRGB profile on a 100x100 RGB one, say). The tiff crate's own caps still hold.
fn tiff_icc<R: BufRead + Seek>(reader: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let icc = image::codecs::tiff::TiffDecoder::new(&mut *reader)
        .ok()
        .and_then(|mut d| d.icc_profile().ok().flatten());
    reader.seek(SeekFrom::Start(0))?;
    Ok(icc)
}

fn read_head<R: Read + Seek>(reader: &mut R) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(16);
    reader.by_ref().take(16).read_to_end(&mut head)?;
    reader.seek(SeekFrom::Start(0))?;
    Ok(head)
}

fn unknown_format(path: &Path, head: &[u8]) -> IoError {
    match image::guess_format(head) {
        Ok(other) => IoError::UnsupportedFormat {
            path: path.to_path_buf(),
            kind: other
                .extensions_str()
                .first()
                .map(|e| e.to_uppercase())
                .unwrap_or_else(|| format!("{other:?}")),
        },
        Err(_) => IoError::NotAnImage {
            path: path.to_path_buf(),
        },
    }
}

fn too_large(path: &Path, detail: String) -> IoError {
    IoError::TooLarge {
        path: path.to_path_buf(),
        detail,
    }
}

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

/// Sorts the decoders' errors into what a user can act on.
fn classify(path: &Path, format: Format, err: ImageError) -> IoError {
    let path = path.to_path_buf();
    match err {
        ImageError::Limits(e) => IoError::TooLarge {
            path,
            detail: one_line(&e.to_string()),
        },
        ImageError::Unsupported(e) => IoError::Unsupported {
            path,
            format,
            detail: one_line(&e.to_string()),
        },
        ImageError::IoError(e) if e.kind() == ErrorKind::UnexpectedEof => {
            IoError::Truncated { path, format }
        }
        ImageError::IoError(e) => IoError::Io { path, source: e },
        other => {
            // The decoders word end-of-data differently; all of them say "eof" or "end".
            let detail = innermost_message(&other);
            let lower = detail.to_ascii_lowercase();
            if lower.contains("eof")
                || lower.contains("end of file")
                || lower.contains("unexpected end")
                || lower.contains("no more data")
                || lower.contains("not enough bytes")
            {
                IoError::Truncated { path, format }
            } else {
                IoError::Corrupt {
                    path,
                    format,
                    detail,
                }
            }
        }
    }
}

pub(crate) fn to_planar(img: DynamicImage, format: Format) -> Decoded {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let lut8: Vec<f32> = (0..=255u8).map(|v| f32::from(v) / 255.0).collect();
    let from8 = |v: u8| lut8[usize::from(v)];
    let from16 = |v: u16| f32::from(v) / 65535.0;
    // NaN compares false both ways, so it lands on 0 rather than poisoning the model input.
    let from_f = |v: f32| if v > 0.0 { v.min(1.0) } else { 0.0 };
    let (planes, depth) = match &img {
        DynamicImage::ImageLuma8(b) => (split(b.as_raw(), 1, w, h, from8), 8),
        DynamicImage::ImageLumaA8(b) => (split(b.as_raw(), 2, w, h, from8), 8),
        DynamicImage::ImageRgb8(b) => (split(b.as_raw(), 3, w, h, from8), 8),
        DynamicImage::ImageRgba8(b) => (split(b.as_raw(), 4, w, h, from8), 8),
        DynamicImage::ImageLuma16(b) => (split(b.as_raw(), 1, w, h, from16), 16),
        DynamicImage::ImageLumaA16(b) => (split(b.as_raw(), 2, w, h, from16), 16),
        DynamicImage::ImageRgb16(b) => (split(b.as_raw(), 3, w, h, from16), 16),
        DynamicImage::ImageRgba16(b) => (split(b.as_raw(), 4, w, h, from16), 16),
        DynamicImage::ImageRgb32F(b) => (split(b.as_raw(), 3, w, h, from_f), 16),
        other => (split(other.to_rgba32f().as_raw(), 4, w, h, from_f), 16),
    };
    let (rgb, alpha) = planes;
    let color = img.color();
    Decoded {
        rgb,
        alpha: if color.has_alpha() { alpha } else { None },
        gray: !color.has_color(),
        bit_depth: depth,
        format,
        metadata: Metadata::default(),
    }
}

/// De-interleaves `channels`-sample pixels (1 = L, 2 = LA, 3 = RGB, 4 = RGBA) into RGB planes
/// (gray replicated) and an alpha plane when there is one.
fn split<T: Copy>(
    raw: &[T],
    channels: usize,
    w: usize,
    h: usize,
    to_f32: impl Fn(T) -> f32,
) -> (Planar, Option<Planar>) {
    let n = w * h;
    let mut rgb = vec![0.0f32; 3 * n];
    let mut alpha = channels.is_multiple_of(2).then(|| vec![0.0f32; n]);
    let (r, rest) = rgb.split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    for (i, px) in raw.chunks_exact(channels).enumerate() {
        if channels < 3 {
            let v = to_f32(px[0]);
            (r[i], g[i], b[i]) = (v, v, v);
        } else {
            (r[i], g[i], b[i]) = (to_f32(px[0]), to_f32(px[1]), to_f32(px[2]));
        }
        if let Some(a) = alpha.as_mut() {
            a[i] = to_f32(px[channels - 1]);
        }
    }
    (
        Planar::new(3, h, w, rgb),
        alpha.map(|a| Planar::new(1, h, w, a)),
    )
}
