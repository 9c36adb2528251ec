//! Files in and out: decoding to [`Planar`](crate::planar::Planar), encoding back, writes
//! that never leave partial files, expanding INPUT arguments, naming outputs and sharding.

mod atomic;
pub(crate) mod decode;
pub(crate) mod encode;
mod error;
mod format;
mod metadata;
mod naming;
mod shard;
mod walk;

pub use atomic::{is_temporary, remove_stale_temporaries, write_atomic, TEMP_TAG};
pub use decode::{decode, decode_bytes, decode_with_limits, DecodeLimits, Decoded};
pub use encode::{
    encode, encode_to_vec, to_image, write_image, EncodeOptions, DEFAULT_JPEG_QUALITY,
    DEFAULT_PNG_COMPRESSION, DEFAULT_PNG_FILTER,
};
pub use error::IoError;
pub use format::{is_image_path, Format, IMAGE_EXTENSIONS};
pub use metadata::{upright_exif, Metadata};
pub use naming::{
    check_output_parent, create_output_parent, file_output_format, is_dash, is_folder_like,
    plan_outputs, Job, NamingOptions, STDIN_NAME,
};
pub use shard::{parse_shard, select_shard, Shard, ShardError};
pub use walk::{walk, InputFile};

#[cfg(test)]
mod tests;
