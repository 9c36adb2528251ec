//! Image files in and out: decoding to [`Planar`] planes with the file's ICC
//! profile and EXIF ([`decode`], [`decode_bytes`]), encoding them back to PNG, JPEG, WebP or
//! TIFF with that metadata ([`encode`], [`encode_to_vec`]), and writes that never leave a
//! partial file under the final name ([`write_atomic`], with [`is_temporary`] and
//! [`remove_stale_temporaries`] for what a killed process leaves behind).

//!
//! Every function here returns the crate's [`Error`]; its message names the file.

mod atomic;
pub(crate) mod decode;
pub(crate) mod encode;
mod error;
mod format;
mod metadata;
pub(crate) mod stream;

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::Error;
use crate::planar::Planar;

pub use atomic::is_temporary;
pub use decode::{DecodeLimits, Decoded};
pub use encode::EncodeOptions;
pub(crate) use error::{IoError, OutputError};
pub use format::{is_image_path, Format};
pub use metadata::Metadata;
pub(crate) use stream::{can_stream, encode_bands, BandLayout};

/// Reads and decodes the image file `path` (PNG, JPEG, WebP or TIFF, told by its content)
/// within the default [`DecodeLimits`]: EXIF orientation applied, gray read as three equal
/// planes, the ICC profile and EXIF kept.
pub fn decode(path: &Path) -> Result<Decoded, Error> {
    Ok(decode::decode(path)?)
}

/// An image held in memory (read from a pipe, say); `name` stands for it in error messages.
pub fn decode_bytes(name: &Path, bytes: &[u8], limits: &DecodeLimits) -> Result<Decoded, Error> {
    Ok(decode::decode_bytes(name, bytes, limits)?)
}

/// Writes `rgb` (3 channels, or 1 for gray) and `alpha` (1 channel, same size) to `path`
/// through [`write_atomic`], creating missing parent folders. With `gray`, R, G and B are
/// averaged into one luma channel. JPEG has no alpha, so alpha is dropped there
/// ([`Format::supports_alpha`] lets the caller warn); TIFF has no gray+alpha layout in the
/// image crate, so gray with alpha is written to TIFF as RGBA. `meta` goes in as far as the
/// format allows; what did not is returned, one message per piece.
pub fn encode(
    path: &Path,
    rgb: &Planar,
    alpha: Option<&Planar>,
    gray: bool,
    meta: &Metadata,
    opts: &EncodeOptions,
) -> Result<Vec<String>, Error> {
    Ok(encode::encode(path, rgb, alpha, gray, meta, opts)?)
}

/// [`encode`]'s bytes, for a destination that is not a file (a pipe, say), and what of
/// `meta` was left out; `name` stands for the destination in error messages.
pub fn encode_to_vec(
    name: &Path,
    rgb: &Planar,
    alpha: Option<&Planar>,
    gray: bool,
    meta: &Metadata,
    opts: &EncodeOptions,
) -> Result<(Vec<u8>, Vec<String>), Error> {
    Ok(encode::encode_to_vec(name, rgb, alpha, gray, meta, opts)?)
}

/// Creates `dest`'s missing parent folders, then runs `write` on a buffered temporary file
/// beside it and renames it to `dest` (replacing a file already there) only if `write`
/// succeeded: `dest` is never left half-written, and the temporary is removed on failure.
pub fn write_atomic<F>(dest: &Path, write: F) -> Result<(), Error>
where
    F: FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
{
    Ok(atomic::write_atomic(dest, |w| {
        write(w).map_err(|e| IoError::os(dest, e))
    })?)
}

/// Fails when a folder that would have to hold `path` is an existing regular file
/// (`-o notes.txt/out.png`). Creates nothing.
pub fn check_output_parent(path: &Path) -> Result<(), Error> {
    Ok(atomic::check_output_parent(path)?)
}

/// Removes the temporaries that writers of `outputs` left behind (a killed run) and that have
/// not been touched for `min_age` (so a live writer, even another process's, keeps its own).
/// Only the outputs' own folders are read, not below them, and only temporaries of exactly
/// these outputs are removed. Returns what was removed.
pub fn remove_stale_temporaries(
    outputs: &[&Path],
    min_age: Duration,
) -> Result<Vec<PathBuf>, Error> {
    Ok(atomic::remove_stale_temporaries(outputs, min_age)?)
}

#[cfg(test)]
mod tests;
