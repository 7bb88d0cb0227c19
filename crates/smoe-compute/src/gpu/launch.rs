//! How a recorded kernel launches its workgroups: with counts fixed when it is recorded
//! (`Launch::Direct`), or with counts read from a buffer when it runs (`Launch::Indirect`), so
//! that a kernel earlier in the same pass can cancel everything recorded after it by zeroing
//! those counts (`SlotMap`: a streaming pass that halts at the first expert missing from VRAM).

use super::context::GpuContext;

/// The launch counts of one recording's indirect dispatches, in recording order (3 u32s each),
/// and the buffer they are read from. The host writes the counts (`upload`) before each
/// submission that uses them; a kernel may overwrite them while the submission runs.
pub struct IndirectArgs {
    buf: wgpu::Buffer,
    words: Vec<u32>,
}

impl IndirectArgs {
    /// Room for `dispatches` indirect dispatches per recording.
    pub fn new(ctx: &GpuContext, dispatches: usize) -> Self {
        let buf = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("indirect dispatch args"),
            size: (12 * dispatches.max(1)) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::INDIRECT
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        IndirectArgs {
            buf,
            words: Vec::with_capacity(3 * dispatches.max(1)),
        }
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// The buffer's size in u32 words (what a kernel zeroes to cancel every dispatch).
    pub fn capacity_words(&self) -> usize {
        (self.buf.size() / 4) as usize
    }

    /// Dispatches recorded since `clear`.
    pub fn len(&self) -> usize {
        self.words.len() / 3
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Forgets the counts of the previous recording.
    pub fn clear(&mut self) {
        self.words.clear();
    }

    /// Writes the recorded counts into the buffer (ordered before the next submission).
    pub fn upload(&self, queue: &wgpu::Queue) {
        if !self.words.is_empty() {
            queue.write_buffer(&self.buf, 0, bytemuck::cast_slice(&self.words));
        }
    }

    /// Appends one dispatch's counts; returns their byte offset.
    fn push(&mut self, groups: [u32; 3]) -> u64 {
        let at = 4 * self.words.len() as u64;
        assert!(
            at + 12 <= self.buf.size(),
            "indirect dispatch args full ({} dispatches): the recording outgrew the room it was given",
            self.len()
        );
        self.words.extend_from_slice(&groups);
        at
    }
}

/// How `record_with` launches a kernel's workgroups.
pub enum Launch<'a> {
    Direct,
    /// From `IndirectArgs` (the counts recorded there, unless a kernel zeroed them).
    Indirect(&'a mut IndirectArgs),
}

impl Launch<'_> {
    pub(crate) fn dispatch(&mut self, pass: &mut wgpu::ComputePass<'_>, [x, y, z]: [u32; 3]) {
        match self {
            Launch::Direct => pass.dispatch_workgroups(x, y, z),
            Launch::Indirect(args) => {
                let at = args.push([x, y, z]);
                pass.dispatch_workgroups_indirect(&args.buf, at);
            }
        }
    }
}
