//! How the bytes of a streamed expert reach a VRAM expert slot during a router stop.
//!
//! Where the device offers `MAPPABLE_PRIMARY_BUFFERS`, a streaming layer's slot buffer is also
//! mappable for writing: at a stop with misses the host maps it and copies each blob (each
//! piece, as the reader threads read it) straight into the memory the kernels read. On unified
//! memory (Apple, integrated GPUs, lavapipe) that is the GPU's own memory; on a discrete GPU wgpu
//! puts a mappable buffer in host-visible VRAM (the PCIe BAR), so the copy crosses the bus once
//! and no staging buffer or GPU copy is involved. On unified memory the disk read itself lands in
//! the mapped slot (`SlotWriter::target`): the bytes move once. Elsewhere `queue.write_buffer` copies into
//! wgpu's staging memory and the GPU copies that into the slot before the next submission.

use crate::error::EngineError;
use crate::store::ReadTarget;
use smoe_compute::gpu::{wgpu, GpuContext};
use std::sync::RwLock;

/// Writes blobs into one layer's expert slot buffer for the duration of a router stop; `finish`
/// before the next submission that uses the buffer.
pub(crate) enum SlotWriter {
    Mapped {
        buf: wgpu::Buffer,
        /// The mapping's start while mapped; `None` once `finish` unmapped it.
        ptr: RwLock<Option<usize>>,
        /// Reads may land in the mapping directly (`target`): unified memory.
        lands: bool,
    },
    Queued {
        queue: wgpu::Queue,
        buf: wgpu::Buffer,
    },
}

impl SlotWriter {
    /// A writer for `buf`: mapped when `mappable` (waits for the GPU to be done with it: at a
    /// router stop it already is, and a buffer no submission in flight uses maps at once),
    /// else through the queue. `lands`: disk reads may land in the
    /// mapping itself (`target`; only where it is ordinary host memory, i.e. unified memory —
    /// a discrete GPU's BAR mapping takes no DMA and reads back at a crawl).
    pub fn open(
        ctx: &GpuContext,
        buf: &wgpu::Buffer,
        mappable: bool,
        lands: bool,
    ) -> Result<Self, EngineError> {
        if !mappable {
            return Ok(SlotWriter::Queued {
                queue: ctx.queue.clone(),
                buf: buf.clone(),
            });
        }
        let fail = |e: String| EngineError::Backend(format!("GPU: mapping expert slots: {e}"));
        let slice = buf.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Write, move |r| {
            let _ = tx.send(r);
        });
        // A buffer that no submission still in flight uses maps on this poll, without
        // waiting for those that are (fill-ahead runs while the GPU works on other layers).
        let _ = ctx.device.poll(wgpu::PollType::Poll);
        let mapped = match rx.try_recv() {
            Ok(r) => r,
            Err(_) => {
                let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
                rx.recv().map_err(|e| fail(e.to_string()))?
            }
        };
        mapped.map_err(|e| fail(e.to_string()))?;
        let mut view = slice
            .get_mapped_range_mut()
            .map_err(|e| fail(e.to_string()))?;
        // The mapping stays valid until `unmap`; the view only guards overlapping views.
        let ptr = view.slice(..).as_raw_element_ptr().as_ptr() as usize;
        drop(view);
        Ok(SlotWriter::Mapped {
            buf: buf.clone(),
            ptr: RwLock::new(Some(ptr)),
            lands,
        })
    }

    /// The slot at `base` (`len` bytes: one blob stride) as memory a disk read can land in,
    /// when this writer allows it. Valid until `finish`: the caller's reads into it must have
    /// finished by then (a router stop waits for all its reads before it finishes).
    pub fn target(&self, (base, len): (u64, u64)) -> Option<ReadTarget> {
        let SlotWriter::Mapped {
            buf,
            ptr,
            lands: true,
        } = self
        else {
            return None;
        };
        let start = (*ptr.read().unwrap_or_else(|e| e.into_inner()))?;
        assert!(base + len <= buf.size(), "slot out of bounds");
        // SAFETY: in bounds of the mapping, which stays valid until `finish`; each missed
        // expert has a slot of its own, which nothing else writes during the stop, and the GPU
        // does not use a mapped buffer.
        Some(unsafe { ReadTarget::new((start as *mut u8).add(base as usize), len as usize) })
    }

    /// Copies `bytes`, found at `at` in an expert's blob, into its slot (`base` and length in
    /// the buffer), leaving out what lies beyond the slot (a blob is padded to 16 KiB). Callers
    /// write disjoint ranges (each piece of each missed blob once).
    pub fn write(&self, (base, len): (u64, u64), at: usize, bytes: &[u8]) {
        let end = (at + bytes.len()).min(len as usize);
        if end <= at {
            return;
        }
        match self {
            SlotWriter::Mapped { buf, ptr, .. } => {
                let ptr = ptr.read().unwrap_or_else(|e| e.into_inner());
                let Some(start) = *ptr else {
                    debug_assert!(false, "a write after finish");
                    return;
                };
                let to = base as usize + at;
                assert!(
                    to + (end - at) <= buf.size() as usize,
                    "slot write out of bounds"
                );
                // SAFETY: in bounds of the mapped buffer (checked above); the mapping lives
                // until `finish`, which takes the write lock, so not while this read lock is
                // held; writers copy into disjoint ranges, and the GPU does not use a mapped
                // buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        (start as *mut u8).add(to),
                        end - at,
                    )
                };
            }
            SlotWriter::Queued { queue, buf } => {
                // `write_buffer` wants a multiple of 4 bytes.
                let n = (end - at) & !3;
                queue.write_buffer(buf, base + at as u64, &bytes[..n]);
            }
        }
    }

    /// Unmaps a mapped buffer (after any write still running), so the next submission can use
    /// it. Queued writes land before the next submission by themselves.
    pub fn finish(&self) {
        if let SlotWriter::Mapped { buf, ptr, .. } = self {
            let mut ptr = ptr.write().unwrap_or_else(|e| e.into_inner());
            if ptr.take().is_some() {
                buf.unmap();
            }
        }
    }
}

impl Drop for SlotWriter {
    fn drop(&mut self) {
        self.finish();
    }
}
