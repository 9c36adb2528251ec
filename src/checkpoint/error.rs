//! Why a weight file could not become a model: the one error every step of opening a
//! checkpoint returns, from reading the file to building the network.

use super::pth::{PthError, PthTensorError};
use super::Source;
use crate::nets::{BuildError, ConfigError};

/// Why a checkpoint could not become a network. Every variant names the file (or the
/// embedded model) it came from; the cause, where there is one, is both quoted in the message
/// and kept as the error's `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file's path.
        path: String,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint this crate reads, or holds no state dict.
    #[error("{origin}: {msg}")]
    File {
        /// The file, or the embedded model's name.
        origin: String,
        /// What is wrong with it.
        msg: &'static str,
    },
    /// A `.pth` whose zip archive or pickle could not be read.
    #[error("{origin}: unreadable PyTorch archive: {source}")]
    Archive {
        /// The file.
        origin: String,
        /// What the archive or pickle reader said.
        #[source]
        source: PthError,
    },
    /// A safetensors file whose header could not be read.
    #[error("{origin}: unreadable safetensors: {source}")]
    Safetensors {
        /// The file, or the embedded model's name.
        origin: String,
        /// What the safetensors reader said.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The tensors do not make a model this build runs: a missing, unexplained or misshapen
    /// tensor, or another architecture.
    #[error("{origin}: {source}")]
    Config {
        /// The file, or the embedded model's name.
        origin: String,
        /// What config inference found.
        #[source]
        source: ConfigError,
    },
    /// One tensor could not be read, or holds a NaN or an infinity.
    #[error("{origin}: tensor {name}: {source}")]
    Tensor {
        /// The file, or the embedded model's name.
        origin: String,
        /// The tensor's state-dict key.
        name: String,
        /// What is wrong with it (boxed: candle's errors are large, and this one would make
        /// every `Result` carrying a `ModelError` larger).
        #[source]
        source: Box<TensorError>,
    },
    /// The tensors are consistent but the network could not be built from them.
    #[error("{origin}: building the network: {source}")]
    Build {
        /// The file, or the embedded model's name.
        origin: String,
        /// What failed.
        #[source]
        source: BuildError,
    },
}

/// Why one tensor of a checkpoint could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// It could not be read from a `.pth` archive.
    #[error(transparent)]
    Pth(#[from] PthTensorError),
    /// candle could not read or convert it.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Its storage does not match the checksum the archive records for it: the file is
    /// damaged.
    #[error("its storage does not match the archive's checksum: the file is damaged")]
    Checksum,
    /// It holds a NaN or an infinity.
    #[error("holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        /// The first such value.
        value: f32,
        /// Its index in the flattened tensor.
        index: usize,
    },
}

impl ModelError {
    pub(crate) fn file(source: &Source, msg: &'static str) -> Self {
        Self::File {
            origin: source.to_string(),
            msg,
        }
    }

    pub(crate) fn tensor(source: &Source, name: &str, e: impl Into<TensorError>) -> Self {
        Self::Tensor {
            origin: source.to_string(),
            name: name.to_string(),
            source: Box::new(e.into()),
        }
    }
}

impl ModelError {
    /// What kind of failure this is, for the crate's [`crate::Error`].
    pub(crate) fn kind(&self) -> crate::ErrorKind {
        use crate::ErrorKind;
        match self {
            ModelError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            ModelError::Io { .. } => ErrorKind::Io,
            ModelError::Build {
                source: BuildError::Env(_),
                ..
            } => ErrorKind::InvalidOption,
            _ => ErrorKind::Model,
        }
    }
}

impl From<ModelError> for crate::Error {
    fn from(e: ModelError) -> Self {
        crate::Error::new(e.kind(), e)
    }
}
