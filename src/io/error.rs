//! The one error type of the io module. Every message starts with the file it is about and
//! fits on one line, so the CLI can print it as is.

use std::path::{Path, PathBuf};

use super::Format;

/// What went wrong reading or writing an image file. Every variant carries the `path` it is
/// about; `format` is the image format found or asked for, `detail` the codec's or the
/// check's own words.
#[allow(missing_docs)] // the fields are the same few everywhere, described above
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The file or folder does not exist.
    #[error("{}: no such file or folder", .path.display())]
    NotFound { path: PathBuf },

    /// The file has no bytes.
    #[error("{}: empty file", .path.display())]
    Empty { path: PathBuf },

    /// The file is no image format this crate knows.
    #[error("{}: not an image (upscale reads PNG, JPEG, WebP and TIFF)", .path.display())]
    NotAnImage { path: PathBuf },

    /// A known image format that this build does not read, e.g. GIF.
    #[error("{}: {kind} images are not supported (upscale reads PNG, JPEG, WebP and TIFF)", .path.display())]
    UnsupportedFormat { path: PathBuf, kind: String },

    /// A format we read, using a feature its decoder does not have.
    #[error("{}: unsupported {format} file: {detail}", .path.display())]
    Unsupported {
        path: PathBuf,
        format: Format,
        detail: String,
    },

    /// The file ends before the image does.
    #[error("{}: truncated {format} file", .path.display())]
    Truncated { path: PathBuf, format: Format },

    /// The decoder found data it cannot read.
    #[error("{}: corrupt {format} file: {detail}", .path.display())]
    Corrupt {
        path: PathBuf,
        format: Format,
        detail: String,
    },

    /// The image's size is over the decoder's limits.
    #[error("{}: image too large: {detail}", .path.display())]
    TooLarge { path: PathBuf, detail: String },

    /// The output could not be encoded or written.
    #[error("{}: cannot write {format}: {detail}", .path.display())]
    Encode {
        path: PathBuf,
        format: Format,
        detail: String,
    },

    /// An output path that cannot be used: its folder is a file, it would replace its input,
    /// two inputs map to it, and the like.
    #[error("{}: {detail}", .path.display())]
    BadOutput { path: PathBuf, detail: String },

    /// Any other error of the operating system's.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl IoError {
    #[cfg(test)]
    /// The file or folder the error is about.
    pub fn path(&self) -> &Path {
        match self {
            IoError::NotFound { path }
            | IoError::Empty { path }
            | IoError::NotAnImage { path }
            | IoError::UnsupportedFormat { path, .. }
            | IoError::Unsupported { path, .. }
            | IoError::Truncated { path, .. }
            | IoError::Corrupt { path, .. }
            | IoError::TooLarge { path, .. }
            | IoError::Encode { path, .. }
            | IoError::BadOutput { path, .. }
            | IoError::Io { path, .. } => path,
        }
    }

    /// Maps an OS error on `path`, keeping "not found" distinct because it is the common
    /// user mistake.
    pub fn os(path: &Path, source: std::io::Error) -> IoError {
        if source.kind() == std::io::ErrorKind::NotFound {
            IoError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            IoError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    /// An output `path` that cannot be used, and why.
    pub fn bad_output(path: &Path, detail: impl Into<String>) -> IoError {
        IoError::BadOutput {
            path: path.to_path_buf(),
            detail: detail.into(),
        }
    }
}

/// Codec messages sometimes span lines; ours must not.
pub(crate) fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// image wraps the codec's error in "Format error decoding Png: ..."; the codec's own
/// message is the useful part.
pub(crate) fn innermost_message(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    one_line(&cur.to_string())
}

/// Why upscaled planes could not become an image of the size and format asked for. No file
/// is named: [`IoError::Encode`] names it when there is one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutputError {
    /// 16-bit samples asked of a format that holds only 8.
    #[error("{0} is 8-bit only; write PNG or TIFF for 16-bit")]
    EightBitOnly(Format),
    /// A sample depth other than 8 or 16.
    #[error("bit depth {0} is not 8 or 16")]
    BitDepth(u8),
    /// A JPEG quality outside 1 to 100.
    #[error("quality {0} is not in 1..=100")]
    Quality(u8),
    /// Planes that are neither gray nor RGB.
    #[error("{0} channels given, expected 1 or 3")]
    Channels(usize),
    /// A side over the image library's 32-bit sizes.
    #[error("{width}x{height} does not fit the image library's 32-bit sizes")]
    TooWide {
        /// Width in pixels.
        width: usize,
        /// Height in pixels.
        height: usize,
    },
    /// An image without pixels.
    #[error("{width}x{height} image has no pixels")]
    NoPixels {
        /// Width in pixels.
        width: usize,
        /// Height in pixels.
        height: usize,
    },
    /// Planes whose sample count does not match their size.
    #[error("pixel buffer size does not match the image size")]
    BufferSize,
    /// An alpha plane of another size than the colour planes.
    #[error("alpha is {channels}x{height}x{width}, expected 1x{want_height}x{want_width}")]
    AlphaSize {
        /// The alpha planes' channels.
        channels: usize,
        /// Their height.
        height: usize,
        /// Their width.
        width: usize,
        /// The colour planes' height.
        want_height: usize,
        /// The colour planes' width.
        want_width: usize,
    },
    /// A resampled output over the pixel limit.
    #[error("an output of {width}x{height} is more than {limit} pixels")]
    TooLarge {
        /// Width asked for.
        width: usize,
        /// Height asked for.
        height: usize,
        /// The limit, in pixels.
        limit: u64,
    },
}

impl From<IoError> for crate::Error {
    fn from(e: IoError) -> Self {
        use crate::ErrorKind;
        let kind = match &e {
            IoError::NotFound { .. } => ErrorKind::NotFound,
            IoError::Io { .. } => ErrorKind::Io,
            IoError::Encode { .. } | IoError::BadOutput { .. } => ErrorKind::Output,
            _ => ErrorKind::BadImage,
        };
        crate::Error::new(kind, e)
    }
}

impl From<OutputError> for crate::Error {
    fn from(e: OutputError) -> Self {
        crate::Error::new(crate::ErrorKind::Output, e)
    }
}
