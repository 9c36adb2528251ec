//! The library's one error type: what went wrong, as a [`ErrorKind`] a program can branch on,
//! with the message that names the file and the cause, and that cause's own chain as
//! [`std::error::Error::source`].
//!
//! Inside the crate each step keeps an error type of its own (reading a checkpoint, decoding
//! an image, planning tiles ...), whose variants make the one-line messages; they meet the
//! caller only as an [`Error`], so they can grow without breaking anyone. Each step's module
//! says which kind its errors are (its `From<...> for Error`), so this module names none of
//! them and sits below them all.

use std::fmt;

/// What kind of thing went wrong. New kinds may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The weights could not be read, or are not a model this build runs.
    Model,
    /// An option, or an `UPSCALE_*` switch, holds a value that cannot be used.
    InvalidOption,
    /// The device could not be opened, or the model not placed on it.
    Device,
    /// The network or the tiling failed on an image.
    Run,
    /// The device ran out of memory even with one tile of the smallest size per batch.
    OutOfMemory,
    /// A file or folder that was asked for does not exist.
    NotFound,
    /// An input file is not an image this build reads: empty, truncated, corrupt, too
    /// large, or of another format.
    BadImage,
    /// The result could not become the image asked for (format, bit depth, size), or the
    /// output path cannot be used.
    Output,
    /// The operating system refused a read or a write.
    Io,
    /// A checkpoint could not be converted to `.safetensors`.
    Convert,
    /// A quality metric could not be computed on the images given.
    Metrics,
}

/// What went wrong, in one line that names the file it is about; [`Error::kind`] says what
/// kind of failure it is, and `source()` gives the cause beneath the message, where there
/// is one (an operating-system error, a codec's).
pub struct Error {
    kind: ErrorKind,
    inner: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub(crate) fn new(
        kind: ErrorKind,
        inner: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            inner: inner.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("error", &self.inner)
            .finish()
    }
}

impl std::error::Error for Error {
    /// The message already quotes the step's own error, so the chain goes on below it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("a.png: {source}")]
    struct Step {
        source: std::io::Error,
    }

    #[test]
    fn the_message_is_the_steps_own_and_the_chain_goes_on_below_it() {
        let os = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let e = Error::new(ErrorKind::Io, Step { source: os });
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(e.to_string(), "a.png: denied");
        let source = std::error::Error::source(&e).expect("the OS error");
        assert_eq!(source.to_string(), "denied");
        assert!(std::error::Error::source(source).is_none());
    }

    #[test]
    fn each_step_maps_to_the_kind_a_caller_branches_on() {
        use crate::checkpoint::ModelError;
        use crate::engine::EngineError;
        use crate::io::IoError;
        use crate::nets::ConfigError;
        use crate::tile::{PlanError, TileError};

        let path = std::path::Path::new("m.pth");
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(
            Error::from(IoError::os(path, missing)).kind(),
            ErrorKind::NotFound
        );
        let e = ModelError::Io {
            path: "m.pth".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(
            Error::from(EngineError::Model(e)).kind(),
            ErrorKind::NotFound
        );
        let e = ModelError::Config {
            origin: "m.pth".into(),
            source: ConfigError::NoGroups,
        };
        let e = Error::from(EngineError::Model(e));
        assert_eq!(e.kind(), ErrorKind::Model);
        assert_eq!(e.to_string(), format!("m.pth: {}", ConfigError::NoGroups));
        assert_eq!(
            Error::from(IoError::bad_output(path, "is a folder")).kind(),
            ErrorKind::Output
        );
        let plan = PlanError::OverlapTooLarge {
            tile: 8,
            overlap: 8,
        };
        assert_eq!(
            Error::from(TileError::Plan(plan)).kind(),
            ErrorKind::InvalidOption
        );
        let oom = TileError::OutOfMemory {
            h: 16,
            w: 16,
            source: candle_core::Error::Msg("out of memory".into()),
        };
        assert_eq!(Error::from(oom).kind(), ErrorKind::OutOfMemory);
    }
}
