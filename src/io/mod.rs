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

pub use atomic::{is_temporary, remove_stale_temporaries, write_atomic};
pub use decode::{decode, decode_bytes, DecodeLimits, Decoded};
pub use encode::{encode, encode_to_vec, EncodeOptions};
pub use error::IoError;
pub use format::{is_image_path, Format};
pub use metadata::Metadata;
pub use naming::{
    check_output_parent, create_output_parent, file_output_format, is_dash, is_folder_like,
    plan_outputs, Job, NamingOptions, STDIN_NAME,
};
pub use shard::{parse_shard, select_shard, Shard};
pub use walk::{walk, InputFile};

#[cfg(test)]
mod tests;
