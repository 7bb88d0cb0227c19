//! One error type for everything that reads or writes vaults and checkpoints.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: disk full (no space left on device)")]
    DiskFull { path: PathBuf },
    #[error("{0}")]
    Config(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{path}: not a valid .smoe vault: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{path}: checksum mismatch in {what} (the file is corrupt)")]
    Checksum { path: PathBuf, what: String },
    #[error("{0}")]
    Tensor(String),
    #[error("{path}: truncated: {reason}")]
    Truncated { path: PathBuf, reason: String },
}

impl VaultError {
    /// Maps an I/O error, recognising a full disk so the user gets a plain message.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.raw_os_error() == Some(28) || source.kind() == std::io::ErrorKind::StorageFull {
            VaultError::DiskFull { path }
        } else {
            VaultError::Io { path, source }
        }
    }
}

pub type Result<T, E = VaultError> = std::result::Result<T, E>;
