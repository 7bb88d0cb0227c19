//! Reads expert blobs from the vault without going through the page cache (O_DIRECT on Linux,
//! F_NOCACHE on macOS), so the bytes are held once — in our cache — not twice.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The alignment of memory and length a direct read needs (a disk's logical block is at most
/// 4 KiB).
const DIRECT_ALIGN: usize = 4096;

/// Test hook: return an error to make the read of (layer, expert) fail.
pub type FaultHook = Arc<dyn Fn(usize, usize) -> Option<io::Error> + Send + Sync>;

pub struct BlobReader {
    path: PathBuf,
    direct: Option<File>,
    buffered: File,
    /// Cleared after the first EINVAL from a direct read (a filesystem that refuses it).
    use_direct: AtomicBool,
    fault: Option<FaultHook>,
}

impl BlobReader {
    pub fn open(path: &Path, fault: Option<FaultHook>) -> io::Result<Self> {
        let buffered = File::open(path)?;
        let direct = open_direct(path);
        if direct.is_none() {
            tracing::info!(
                "{}: direct I/O unavailable, reading through the page cache",
                path.display()
            );
        }
        Ok(BlobReader {
            path: path.to_path_buf(),
            use_direct: AtomicBool::new(direct.is_some()),
            direct,
            buffered,
            fault,
        })
    }

    /// Reads `dst.len()` bytes (a multiple of 16 KiB) at `offset` (16 KiB aligned) into `dst`
    /// (16 KiB aligned: a whole `AlignedBuf` or a piece of one; memory lent by a GPU mapping
    /// may be less aligned, and is then read through the page cache). The fault hook is asked
    /// once per call, i.e. once per piece of a blob.
    pub fn read(&self, layer: usize, expert: usize, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        if let Some(err) = self.fault.as_ref().and_then(|f| f(layer, expert)) {
            return Err(err);
        }
        let aligned = (dst.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
            && dst.len().is_multiple_of(DIRECT_ALIGN);
        if aligned && self.use_direct.load(Ordering::Relaxed) {
            let f = self.direct.as_ref().expect("direct handle");
            match f.read_exact_at(dst, offset) {
                Ok(()) => return Ok(()),
                // Memory the kernel cannot DMA into (a device mapping): this read only.
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::info!(
                        "{}: direct read refused, falling back to buffered reads",
                        self.path.display()
                    );
                    self.use_direct.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        self.buffered.read_exact_at(dst, offset)
    }

    pub fn is_direct(&self) -> bool {
        self.use_direct.load(Ordering::Relaxed)
    }
}

/// Opens `path` for reads that bypass the page cache, if the platform and filesystem allow.
#[cfg(target_os = "linux")]
pub fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

/// Opens `path` for reads that bypass the page cache, if the platform and filesystem allow.
#[cfg(target_os = "macos")]
pub fn open_direct(path: &Path) -> Option<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(path).ok()?;
    // SAFETY: fcntl on a valid descriptor we own.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
    (r != -1).then_some(f)
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub fn open_direct(_: &Path) -> Option<File> {
    None
}
