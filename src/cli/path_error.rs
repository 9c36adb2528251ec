//! A file or folder the tool cannot use, in one line that starts with its path.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// Kept apart from other OS errors: it is the common user mistake.
    #[error("{}: no such file or folder", .0.display())]
    NotFound(PathBuf),
    #[error("{}: {source}", .path.display())]
    Os {
        path: PathBuf,
        source: std::io::Error,
    },
    /// An output path that cannot be used: its folder is a file, it would replace its input,
    /// two inputs map to it, and the like.
    #[error("{}: {detail}", .path.display())]
    BadOutput { path: PathBuf, detail: String },
    #[error(transparent)]
    Library(#[from] upscale::Error),
}

impl PathError {
    /// An operating-system error on `path`.
    pub fn os(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::NotFound(path.to_path_buf())
        } else {
            Self::Os {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    /// An output `path` that cannot be used, and why.
    pub fn bad_output(path: &Path, detail: impl Into<String>) -> Self {
        Self::BadOutput {
            path: path.to_path_buf(),
            detail: detail.into(),
        }
    }
}
