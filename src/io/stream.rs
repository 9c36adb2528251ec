//! Writing an image band by band while it is computed, for outputs too large to hold whole:
//! PNG through the `png` crate's streaming writer, TIFF strip by strip. JPEG and WebP cannot
//! be written this way with the encoders we have (both take the whole image at once).
//!
//! Each band is quantised by [`to_image`], as a whole image is, so the samples are the same
//! bit for bit. A TIFF file is the same byte for byte as [`super::encode()`] writes; a PNG file
//! holds the same samples and metadata, with its compressed data cut into IDAT chunks
//! differently.

use std::borrow::Cow;
use std::io::{Seek, Write};
use std::path::Path;

use image::codecs::png::{CompressionType, FilterType};
use image::{ColorType, DynamicImage};
use tiff::encoder::colortype::{self, ColorType as TiffColor};
use tiff::encoder::TiffEncoder;
use tiff::tags::Tag;

use super::atomic::write_atomic_with;
use super::encode::{to_image, EncodeOptions};
use super::metadata::{icc_fits, icc_space};
use super::{Format, IoError, Metadata};
use crate::planar::Planar;

/// Where a producer hands its bands: each `channels` planes of consecutive rows at the full
/// width, top to bottom.
pub type BandSink<'a> = dyn FnMut(Planar) -> Result<(), IoError> + 'a;

/// Whether [`encode_bands`] can write `format`.
pub fn can_stream(format: Format) -> bool {
    matches!(format, Format::Png | Format::Tiff)
}

/// What an image written in bands is, besides its bands.
#[derive(Clone, Copy, Debug)]
pub struct BandLayout {
    /// The image's width.
    pub width: usize,
    /// The image's height.
    pub height: usize,
    /// R, G and B are averaged into one luma channel, as [`super::encode()`] does.
    pub gray: bool,
    /// Alpha, the same for every pixel (`None`: no alpha).
    pub alpha: Option<f32>,
}

/// Writes an image of `layout` to `path` (PNG or TIFF, see [`can_stream`]) through a
/// temporary, taking its bands from `produce`, which gets the sink to hand them to; the file
/// gets its final name only when `produce` and the encoder succeed. Returns what of `meta` was
/// left out, as [`super::encode()`] does.
pub fn encode_bands<E: From<IoError>>(
    path: &Path,
    layout: BandLayout,
    meta: &Metadata,
    opts: &EncodeOptions,
    produce: impl FnOnce(&mut BandSink) -> Result<(), E>,
) -> Result<Vec<String>, E> {
    let err = |detail: String| IoError::Encode {
        path: path.to_path_buf(),
        format: opts.format,
        detail,
    };
    if !can_stream(opts.format) {
        return Err(err("cannot be written in bands".into()).into());
    }
    // One pixel through the whole-image quantiser: checks the options and gives the sample
    // layout every band will have.
    let probe = Planar::zeros(3, 1, 1);
    let probe_alpha = layout.alpha.map(|a| Planar::new(1, 1, 1, vec![a]));
    let color = to_image(&probe, probe_alpha.as_ref(), layout.gray, opts)
        .map_err(|e| err(e.to_string()))?
        .color();
    let (Ok(w), Ok(h)) = (u32::try_from(layout.width), u32::try_from(layout.height)) else {
        return Err(err(format!("{}x{} is too large", layout.width, layout.height)).into());
    };
    let (icc, left_out) = metadata(meta, color, opts.format);
    let quantise = |band: &Planar| -> Result<DynamicImage, IoError> {
        let alpha = layout.alpha.map(|a| {
            Planar::new(
                1,
                band.height,
                band.width,
                vec![a; band.height * band.width],
            )
        });
        to_image(band, alpha.as_ref(), layout.gray, opts).map_err(|e| err(e.to_string()))
    };
    write_atomic_with(path, |file| -> Result<(), E> {
        let rows = std::cell::Cell::new(0);
        let mut checked = |band: Planar| -> Result<DynamicImage, IoError> {
            if band.width != layout.width || rows.get() + band.height > layout.height {
                return Err(err("a band does not fit the image".into()));
            }
            rows.set(rows.get() + band.height);
            quantise(&band)
        };
        // Checked before the encoder finishes, which would fail on missing rows in its own
        // words.
        let produce = |sink: &mut BandSink| -> Result<(), E> {
            produce(sink)?;
            if rows.get() != layout.height {
                let msg = format!("{} of {} rows were written", rows.get(), layout.height);
                return Err(err(msg).into());
            }
            Ok(())
        };
        match opts.format {
            Format::Png => {
                let exif = meta.exif.as_deref();
                let png = PngHeader {
                    w,
                    h,
                    color,
                    icc,
                    exif,
                };
                write_png(file, &png, opts, &err, &mut checked, produce)
            }
            _ => write_tiff(file, (w, h), color, icc, &err, &mut checked, produce),
        }
    })?;
    Ok(left_out)
}

/// The ICC profile to write and what of `meta` a `format` file of `color` cannot hold, in
/// the words [`super::encode()`] uses.
fn metadata(meta: &Metadata, color: ColorType, format: Format) -> (Option<&[u8]>, Vec<String>) {
    let mut left_out = Vec::new();
    let mut icc = None;
    if let Some(profile) = &meta.icc {
        let rgb = color.has_color();
        if icc_fits(profile, rgb) {
            icc = Some(&profile[..]);
        } else {
            left_out.push(format!(
                "ICC profile left out: it is for {}, the output is {}",
                icc_space(profile),
                if rgb { "RGB" } else { "gray" }
            ));
        }
    }
    if meta.exif.is_some() && format == Format::Tiff {
        left_out.push(format!(
            "EXIF left out: the {format} writer cannot store it"
        ));
    }
    if meta.exif_dropped {
        left_out.push("EXIF left out: its orientation could not be reset safely".into());
    }
    (icc, left_out)
}

struct PngHeader<'a> {
    w: u32,
    h: u32,
    color: ColorType,
    icc: Option<&'a [u8]>,
    exif: Option<&'a [u8]>,
}

/// A PNG with the header the image crate's encoder writes for the same options.
fn write_png<W: Write, E: From<IoError>>(
    file: &mut W,
    head: &PngHeader,
    opts: &EncodeOptions,
    err: &dyn Fn(String) -> IoError,
    quantise: &mut dyn FnMut(Planar) -> Result<DynamicImage, IoError>,
    produce: impl FnOnce(&mut BandSink) -> Result<(), E>,
) -> Result<(), E> {
    let png_err = |e: png::EncodingError| err(e.to_string());
    let (color, depth) = match head.color {
        ColorType::L8 => (png::ColorType::Grayscale, png::BitDepth::Eight),
        ColorType::La8 => (png::ColorType::GrayscaleAlpha, png::BitDepth::Eight),
        ColorType::Rgb8 => (png::ColorType::Rgb, png::BitDepth::Eight),
        ColorType::Rgba8 => (png::ColorType::Rgba, png::BitDepth::Eight),
        ColorType::L16 => (png::ColorType::Grayscale, png::BitDepth::Sixteen),
        ColorType::La16 => (png::ColorType::GrayscaleAlpha, png::BitDepth::Sixteen),
        ColorType::Rgb16 => (png::ColorType::Rgb, png::BitDepth::Sixteen),
        ColorType::Rgba16 => (png::ColorType::Rgba, png::BitDepth::Sixteen),
        other => return Err(err(format!("no PNG layout for {other:?}")).into()),
    };
    let mut info = png::Info::with_size(head.w, head.h);
    info.icc_profile = head.icc.map(Cow::Borrowed);
    info.exif_metadata = head.exif.map(Cow::Borrowed);
    let mut encoder = png::Encoder::with_info(file, info).map_err(png_err)?;
    encoder.set_color(color);
    encoder.set_depth(depth);
    let (compression, level) = png_compression(opts.png_compression);
    encoder.set_compression(compression);
    if let Some(level) = level {
        encoder.set_deflate_compression(png::DeflateCompression::Level(level));
    }
    encoder.set_filter(png_filter(opts.png_filter));
    let mut writer = encoder.write_header().map_err(png_err)?;
    let mut stream = writer.stream_writer().map_err(png_err)?;
    let sixteen = depth == png::BitDepth::Sixteen;
    produce(&mut |band: Planar| {
        let img = quantise(band)?;
        let bytes = img.as_bytes();
        let written = if sixteen {
            // PNG stores 16-bit samples big-endian; the image holds them in native order.
            let be: Vec<u8> = bytes
                .chunks_exact(2)
                .flat_map(|s| u16::from_ne_bytes([s[0], s[1]]).to_be_bytes())
                .collect();
            stream.write_all(&be)
        } else {
            stream.write_all(bytes)
        };
        written.map_err(|e| err(e.to_string()))
    })?;
    stream.finish().map_err(png_err)?;
    writer.finish().map_err(png_err)?;
    Ok(())
}

/// The `png` crate's setting for the image crate's `compression`, as its PNG encoder maps it.
fn png_compression(compression: CompressionType) -> (png::Compression, Option<u8>) {
    match compression {
        CompressionType::Default => (png::Compression::Balanced, None),
        CompressionType::Best => (png::Compression::High, None),
        CompressionType::Uncompressed | CompressionType::Level(0) => {
            (png::Compression::NoCompression, None)
        }
        CompressionType::Level(n) => (png::Compression::Fast, Some(n)),
        _ => (png::Compression::Fast, None),
    }
}

fn png_filter(filter: FilterType) -> png::Filter {
    match filter {
        FilterType::NoFilter => png::Filter::NoFilter,
        FilterType::Sub => png::Filter::Sub,
        FilterType::Up => png::Filter::Up,
        FilterType::Avg => png::Filter::Avg,
        FilterType::Paeth => png::Filter::Paeth,
        _ => png::Filter::Adaptive,
    }
}

/// A baseline TIFF, strip by strip, tagged as the image crate's encoder tags it.
fn write_tiff<W: Write + Seek, E: From<IoError>>(
    file: &mut W,
    size: (u32, u32),
    color: ColorType,
    icc: Option<&[u8]>,
    err: &dyn Fn(String) -> IoError,
    quantise: &mut dyn FnMut(Planar) -> Result<DynamicImage, IoError>,
    produce: impl FnOnce(&mut BandSink) -> Result<(), E>,
) -> Result<(), E> {
    let run = Tiff {
        file,
        size,
        icc,
        err,
        quantise,
    };
    match color {
        ColorType::L8 => run.strips::<colortype::Gray8, _>(produce, |i| {
            i.as_luma8().map(|b| b.as_raw().as_slice())
        }),
        ColorType::Rgb8 => run
            .strips::<colortype::RGB8, _>(produce, |i| i.as_rgb8().map(|b| b.as_raw().as_slice())),
        ColorType::Rgba8 => run.strips::<colortype::RGBA8, _>(produce, |i| {
            i.as_rgba8().map(|b| b.as_raw().as_slice())
        }),
        ColorType::L16 => run.strips::<colortype::Gray16, _>(produce, |i| {
            i.as_luma16().map(|b| b.as_raw().as_slice())
        }),
        ColorType::Rgb16 => run.strips::<colortype::RGB16, _>(produce, |i| {
            i.as_rgb16().map(|b| b.as_raw().as_slice())
        }),
        ColorType::Rgba16 => run.strips::<colortype::RGBA16, _>(produce, |i| {
            i.as_rgba16().map(|b| b.as_raw().as_slice())
        }),
        other => Err(err(format!("no TIFF layout for {other:?}")).into()),
    }
}

struct Tiff<'a, W> {
    file: &'a mut W,
    size: (u32, u32),
    icc: Option<&'a [u8]>,
    err: &'a dyn Fn(String) -> IoError,
    quantise: &'a mut dyn FnMut(Planar) -> Result<DynamicImage, IoError>,
}

impl<W: Write + Seek> Tiff<'_, W> {
    /// Samples of colour type `C`, which `samples` finds in each quantised band, gathered
    /// into the strips the TIFF encoder asks for.
    fn strips<C, E>(
        self,
        produce: impl FnOnce(&mut BandSink) -> Result<(), E>,
        samples: impl Fn(&DynamicImage) -> Option<&[C::Inner]>,
    ) -> Result<(), E>
    where
        C: TiffColor,
        C::Inner: Copy,
        [C::Inner]: tiff::encoder::TiffValue,
        E: From<IoError>,
    {
        let err = self.err;
        let tiff_err = |e: tiff::TiffError| err(e.to_string());
        let mut encoder = TiffEncoder::new(self.file).map_err(tiff_err)?;
        let mut image = encoder
            .new_image::<C>(self.size.0, self.size.1)
            .map_err(tiff_err)?;
        if let Some(icc) = self.icc {
            image
                .encoder()
                .write_tag(Tag::IccProfile, icc)
                .map_err(tiff_err)?;
        }
        let quantise = self.quantise;
        let mut pending: Vec<C::Inner> = Vec::new();
        produce(&mut |band: Planar| {
            let img = quantise(band)?;
            let s = samples(&img).ok_or_else(|| err("band layout changed".into()))?;
            pending.extend_from_slice(s);
            let mut used = 0;
            loop {
                let need = usize::try_from(image.next_strip_sample_count()).unwrap_or(usize::MAX);
                if need == 0 || pending.len() - used < need {
                    break;
                }
                image
                    .write_strip(&pending[used..used + need])
                    .map_err(tiff_err)?;
                used += need;
            }
            pending.drain(..used);
            Ok(())
        })?;
        if image.next_strip_sample_count() != 0 || !pending.is_empty() {
            return Err(err("the bands did not fill the image".into()).into());
        }
        image.finish().map_err(tiff_err)?;
        Ok(())
    }
}
