//! Files in and out: decoding to [`Planar`](crate::planar::Planar), encoding back, writes
//! that never leave partial files, expanding INPUT arguments, naming outputs and sharding.

mod atomic;
pub(crate) mod decode;
pub(crate) mod encode;
mod error;
mod format;
mod metadata;
#[cfg(feature = "cli")]
mod naming;
#[cfg(feature = "cli")]
mod shard;
#[cfg(feature = "cli")]
mod walk;

pub use atomic::write_atomic;
#[cfg(feature = "cli")]
pub use atomic::{check_output_parent, is_temporary, remove_stale_temporaries};
pub use decode::{decode, Decoded};
#[cfg(feature = "cli")]
pub use decode::{decode_bytes, DecodeLimits};
#[cfg(feature = "cli")]
pub use encode::encode_to_vec;
pub use encode::{encode, EncodeOptions};
pub use error::{IoError, OutputError};
#[cfg(feature = "cli")]
pub use format::is_image_path;
pub use format::Format;
pub use metadata::Metadata;
#[cfg(feature = "cli")]
pub use naming::{
    file_output_format, is_dash, is_folder_like, plan_outputs, Job, NamingOptions, STDIN_NAME,
};
#[cfg(feature = "cli")]
pub use shard::{parse_shard, select_shard, Shard};
#[cfg(feature = "cli")]
pub use walk::{walk, InputFile};

#[cfg(test)]
mod tests;
