//! The image formats upscale reads and writes, and the file extensions that name them.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// An image file format that is read and written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// PNG: 8 or 16 bits, alpha.
    Png,
    /// JPEG: 8 bits, no alpha.
    Jpeg,
    /// WebP, written lossless: 8 bits, alpha.
    Webp,
    /// TIFF: 8 or 16 bits, alpha.
    Tiff,
}

impl Format {
    /// Case-insensitive; `None` for anything that is not an extension folder walks pick up (png, jpg, jpeg, webp, tif, tiff).
    pub fn from_extension(ext: &str) -> Option<Format> {
        match ext.to_ascii_lowercase().as_str() {
            "png" => Some(Format::Png),
            "jpg" | "jpeg" => Some(Format::Jpeg),
            "webp" => Some(Format::Webp),
            "tif" | "tiff" => Some(Format::Tiff),
            _ => None,
        }
    }

    /// The format `path`'s extension names, if any.
    pub fn from_path(path: &Path) -> Option<Format> {
        Format::from_extension(path.extension()?.to_str()?)
    }

    /// The extension given to files we name ourselves.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Png => "png",
            Format::Jpeg => "jpg",
            Format::Webp => "webp",
            Format::Tiff => "tif",
        }
    }

    /// Whether the format holds 16-bit samples.
    pub fn supports_16bit(self) -> bool {
        matches!(self, Format::Png | Format::Tiff)
    }

    /// JPEG has no alpha channel: encoding drops alpha when writing it.
    pub fn supports_alpha(self) -> bool {
        self != Format::Jpeg
    }

    /// The output depth when the user asked for none: the source depth where the format
    /// can hold it, else 8.
    pub fn default_bit_depth(self, source_depth: u8) -> u8 {
        if source_depth == 16 && self.supports_16bit() {
            16
        } else {
            8
        }
    }

    pub(crate) fn image_format(self) -> image::ImageFormat {
        match self {
            Format::Png => image::ImageFormat::Png,
            Format::Jpeg => image::ImageFormat::Jpeg,
            Format::Webp => image::ImageFormat::WebP,
            Format::Tiff => image::ImageFormat::Tiff,
        }
    }

    /// Recognises a file by its first bytes (16 are enough), so that a misnamed file still
    /// decodes and a text file named `.png` is reported as not an image.
    pub fn sniff(head: &[u8]) -> Option<Format> {
        const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";
        if head.starts_with(PNG) {
            Some(Format::Png)
        } else if head.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(Format::Jpeg)
        } else if head.len() >= 12 && &head[..4] == b"RIFF" && &head[8..12] == b"WEBP" {
            Some(Format::Webp)
        } else if [b"II*\0", b"MM\0*", b"II+\0", b"MM\0+"]
            .iter()
            .any(|m| head.starts_with(*m))
        {
            // The last two are BigTIFF, which the tiff decoder also reads.
            Some(Format::Tiff)
        } else {
            None
        }
    }
}

/// True when the path's extension is an extension folder walks pick up (png, jpg, jpeg, webp, tif, tiff).
pub fn is_image_path(path: &Path) -> bool {
    Format::from_path(path).is_some()
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Png => "PNG",
            Format::Jpeg => "JPEG",
            Format::Webp => "WebP",
            Format::Tiff => "TIFF",
        })
    }
}

/// A name that is none of the formats' extensions, as [`Format`]'s `from_str` got it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown image format '{0}' (expected png, jpg, webp or tiff)")]
pub struct UnknownFormat(pub String);

impl FromStr for Format {
    type Err = crate::Error;

    /// Accepts the extensions (`png`, `jpg`, `jpeg`, `webp`, `tif`, `tiff`), any case.
    fn from_str(s: &str) -> Result<Format, crate::Error> {
        Format::from_extension(s).ok_or_else(|| {
            crate::Error::new(
                crate::ErrorKind::InvalidOption,
                UnknownFormat(s.to_string()),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_case_insensitive() {
        assert_eq!(Format::from_path(Path::new("a/B.JPEG")), Some(Format::Jpeg));
        assert_eq!(Format::from_path(Path::new("x.TiF")), Some(Format::Tiff));
        assert_eq!(Format::from_path(Path::new("x.gif")), None);
        assert_eq!(Format::from_path(Path::new("png")), None);
        assert_eq!("WEBP".parse::<Format>().ok(), Some(Format::Webp));
        let err = "bmp".parse::<Format>().unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidOption);
        assert!(err.to_string().contains("'bmp'"), "{err}");
    }

    #[test]
    fn default_depth_follows_source_where_possible() {
        assert_eq!(Format::Png.default_bit_depth(16), 16);
        assert_eq!(Format::Jpeg.default_bit_depth(16), 8);
        assert_eq!(Format::Tiff.default_bit_depth(8), 8);
    }
}
