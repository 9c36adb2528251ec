//! Image files in and out: decoding to [`Planar`](crate::Planar) planes with the file's ICC
//! profile and EXIF ([`decode`], [`decode_bytes`]), encoding them back to PNG, JPEG, WebP or
//! TIFF with that metadata ([`encode`], [`encode_to_vec`]), and writes that never leave a
//! partial file under the final name ([`write_atomic`], with [`is_temporary`] and
//! [`remove_stale_temporaries`] for what a killed process leaves behind).

mod atomic;
pub(crate) mod decode;
pub(crate) mod encode;
mod error;
mod format;
mod metadata;
pub(crate) mod stream;

pub use atomic::{
    check_output_parent, is_temporary, remove_stale_temporaries, write_atomic, write_atomic_with,
};
pub use decode::{decode, decode_bytes, DecodeLimits, Decoded};
pub use encode::{encode, encode_to_vec, EncodeOptions};
pub use error::{IoError, OutputError};
pub use format::{is_image_path, Format, UnknownFormat};
pub use metadata::Metadata;
pub use stream::{can_stream, encode_bands, BandLayout, BandSink};

#[cfg(test)]
mod tests;
