//! Buffers: places in them (`BufRef`), the ranges kernels bind (`Binding`), the per-step uniform,
//! and the few blocking helpers (upload, read back) that tests, benches and model loading need.

use super::context::{GpuContext, GpuError};
use wgpu::util::DeviceExt;

/// Per-step values that change every token (written with `GpuContext::write_step` before the
/// submission); kernels that need the position bind this one small uniform buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepParams {
    /// Position of the first token of this step.
    pub pos0: u32,
    pub _pad: [u32; 3],
}

/// A place in a buffer of f32 values: the buffer and a byte offset (a multiple of 16).
#[derive(Clone, Copy, Debug)]
pub struct BufRef<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
}

impl<'a> BufRef<'a> {
    pub fn new(buffer: &'a wgpu::Buffer) -> Self {
        BufRef { buffer, offset: 0 }
    }
    pub fn at(buffer: &'a wgpu::Buffer, offset: u64) -> Self {
        BufRef { buffer, offset }
    }
    /// A binding that covers `n` f32/u32 values from this offset, and the offset inside that
    /// binding in units of `elem_bytes` (4, or 16 for kernels that load vec4s). The binding
    /// starts at the offset rounded down to the device's alignment and ends where the data ends,
    /// so a tensor inside a buffer larger than a storage binding can still be bound. Errors when
    /// the range leaves the buffer: kernels run without bounds checks in release builds, so the
    /// wrappers check every range instead.
    pub(crate) fn bind(
        &self,
        ctx: &GpuContext,
        what: &str,
        n: usize,
        elem_bytes: u64,
    ) -> Result<(Binding<'a>, u32), GpuError> {
        if !self.offset.is_multiple_of(elem_bytes) {
            return Err(GpuError::Shape(format!(
                "{what}: offset {} is not a multiple of {elem_bytes}",
                self.offset
            )));
        }
        let end = self.offset + 4 * n as u64;
        if end > self.buffer.size() {
            return Err(GpuError::Shape(format!(
                "{what}: needs {end} bytes, buffer has {}",
                self.buffer.size()
            )));
        }
        let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
        let base = self.offset / align * align;
        let size = (end - base)
            .next_multiple_of(16)
            .min(self.buffer.size() - base)
            .max(4);
        if size > ctx.limits().max_storage_buffer_binding_size {
            return Err(GpuError::Shape(format!(
                "{what}: {size} bytes exceed a storage binding"
            )));
        }
        Ok((
            Binding {
                buffer: self.buffer,
                base,
                size: Some(size),
            },
            ((self.offset - base) / elem_bytes) as u32,
        ))
    }
}

/// A buffer range to bind (`size: None`: to the end of the buffer).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Binding<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub base: u64,
    pub size: Option<u64>,
}

impl<'a> Binding<'a> {
    pub(crate) fn whole(buffer: &'a wgpu::Buffer) -> Self {
        Binding {
            buffer,
            base: 0,
            size: None,
        }
    }

    pub(crate) fn entry(&self, binding: u32) -> wgpu::BindGroupEntry<'a> {
        wgpu::BindGroupEntry {
            binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: self.buffer,
                offset: self.base,
                size: self.size.map(|s| wgpu::BufferSize::new(s).unwrap()),
            }),
        }
    }
}

impl GpuContext {
    /// A storage buffer of `bytes` (rounded up to 16), usable as copy source and destination.
    pub fn storage_buffer(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16).next_multiple_of(16),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// As `storage_buffer`, but also mappable for writing by the host (`MAP_WRITE`, which needs
    /// `MAPPABLE_PRIMARY_BUFFERS`): on unified memory the kernels' own memory, on a discrete GPU
    /// host-visible VRAM (the PCIe BAR) where the driver offers it. `None` when the device lacks
    /// the feature or the allocation fails (a BAR too small for it): use `storage_buffer`.
    pub fn mappable_storage_buffer(&self, label: &str, bytes: u64) -> Option<wgpu::Buffer> {
        if !self
            .info()
            .features
            .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
        {
            return None;
        }
        self.checked_buffer(
            label,
            bytes,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::MAP_WRITE,
        )
    }

    /// As `storage_buffer`, but `None` where the device is out of memory or refuses the size,
    /// instead of an error that surfaces later (wgpu's default: a panic at the first use).
    pub fn try_storage_buffer(&self, label: &str, bytes: u64) -> Option<wgpu::Buffer> {
        self.checked_buffer(
            label,
            bytes,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// A buffer of `usage`, or `None` (and nothing allocated) where creating it raised an
    /// out-of-memory or validation error.
    fn checked_buffer(
        &self,
        label: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Option<wgpu::Buffer> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let valid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16).next_multiple_of(16),
            usage,
            mapped_at_creation: false,
        });
        let invalid = pollster::block_on(valid.pop());
        let oom = pollster::block_on(scope.pop());
        match invalid.or(oom) {
            None => Some(buf),
            Some(_) => {
                buf.destroy();
                None
            }
        }
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 16 bytes).
    pub fn upload(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        let mut padded;
        let bytes = if data.len().is_multiple_of(16) && !data.is_empty() {
            data
        } else {
            padded = data.to_vec();
            padded.resize(data.len().max(16).next_multiple_of(16), 0);
            &padded
        };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }

    pub fn upload_f32(&self, label: &str, data: &[f32]) -> wgpu::Buffer {
        self.upload(label, bytemuck::cast_slice(data))
    }

    /// The uniform buffer of per-step values (see [`StepParams`]).
    pub fn step_buffer(&self) -> wgpu::Buffer {
        self.uniform("step", &StepParams::default())
    }

    /// Sets the position of the next step; takes effect at the next `queue.submit`.
    pub fn write_step(&self, step: &wgpu::Buffer, pos0: u32) {
        self.queue.write_buffer(
            step,
            0,
            bytemuck::bytes_of(&StepParams { pos0, _pad: [0; 3] }),
        );
    }

    pub(crate) fn uniform<T: bytemuck::Pod>(&self, label: &str, value: &T) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::bytes_of(value),
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// Creates a bind group, turning a validation error into a `GpuError` instead of a panic.
    pub(crate) fn bind_group(
        &self,
        kernel: &str,
        pipeline: &wgpu::ComputePipeline,
        entries: &[wgpu::BindGroupEntry<'_>],
    ) -> Result<wgpu::BindGroup, GpuError> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel),
            layout: &pipeline.get_bind_group_layout(0),
            entries,
        });
        match pollster::block_on(scope.pop()) {
            Some(e) => Err(GpuError::Kernel {
                kernel: kernel.into(),
                msg: e.to_string(),
            }),
            None => Ok(bind),
        }
    }

    pub fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
    }

    /// Submits `enc` and blocks until the GPU has finished it.
    pub fn submit_wait(&self, enc: wgpu::CommandEncoder) {
        let idx = self.queue.submit([enc.finish()]);
        let _ = self.device.poll(wgpu::PollType::Wait {
            submission_index: Some(idx),
            timeout: None,
        });
    }

    /// Copies `bytes` bytes from `offset` of `src` back to the CPU (blocking; not for the token
    /// loop except for the few bytes of a sampled token id).
    pub fn read_bytes(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<Vec<u8>, GpuError> {
        let size = bytes.next_multiple_of(4).max(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.encoder();
        enc.copy_buffer_to_buffer(src, offset, &staging, 0, size);
        self.submit_wait(enc);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
        rx.recv()
            .map_err(|e| GpuError::Readback(e.to_string()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let view = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = view[..bytes as usize].to_vec();
        drop(view);
        staging.unmap();
        Ok(out)
    }

    pub fn read_f32(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        n: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let b = self.read_bytes(src, offset, 4 * n as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }

    pub fn read_u32(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        n: usize,
    ) -> Result<Vec<u32>, GpuError> {
        let b = self.read_bytes(src, offset, 4 * n as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }
}
