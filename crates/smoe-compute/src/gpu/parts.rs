//! Splitting a weight matrix by rows into parts that each fit one storage binding: shared by
//! the matvec and matmul wrappers (one dispatch per part).

use super::buffers::Binding;
use super::context::{GpuContext, GpuError};
use super::launch::Launch;
use super::matvec::WeightRef;

/// Rows `r0..r0 + rows` of a matrix, bound as `buffer[base..end]`.
pub(crate) struct WeightPart {
    pub r0: u64,
    pub rows: u64,
    pub base: u64,
    pub end: u64,
    /// vec4 index of row `r0` inside the binding.
    pub w_off: u32,
}

impl WeightPart {
    pub(crate) fn binding<'a>(&self, w: &WeightRef<'a>) -> Binding<'a> {
        Binding {
            buffer: w.buffer,
            base: self.base,
            size: Some(self.end - self.base),
        }
    }
}

pub(crate) fn check_fits(what: &str, buf: &wgpu::Buffer, end: u64) -> Result<(), GpuError> {
    if end > buf.size() {
        return Err(GpuError::Shape(format!(
            "{what}: needs {end} bytes, buffer has {}",
            buf.size()
        )));
    }
    Ok(())
}

/// The parts of `w`, halving the rows per part until each part's bytes, plus `extra` bytes that
/// every part also reaches (further stacked matrices, an up matrix), fit a storage binding.
/// `splittable: false` (a grouped product, whose parts would each need every matrix) makes a
/// matrix that does not fit an error instead. `what` names the kernel in the buffer error.
pub(crate) fn split_rows(
    ctx: &GpuContext,
    w: &WeightRef,
    extra: u64,
    splittable: bool,
    what: &str,
    err: impl Fn(String) -> GpuError,
) -> Result<Vec<WeightPart>, GpuError> {
    let stride = w.dtype.row_stride(w.cols) as u64;
    let limits = ctx.limits();
    let align = limits.min_storage_buffer_offset_alignment as u64;
    let max_bind = limits
        .max_storage_buffer_binding_size
        .min(u32::MAX as u64 / 4 * 16);
    let span = |rows: u64| rows * stride + extra + align;
    let mut rows_per_part = w.rows as u64;
    while span(rows_per_part) > max_bind {
        if !splittable || rows_per_part == 1 {
            return Err(err(format!(
                "does not fit a storage binding of {max_bind} bytes"
            )));
        }
        rows_per_part = rows_per_part.div_ceil(2);
    }
    check_fits(what, w.buffer, w.offset + w.rows as u64 * stride + extra)?;
    let mut parts = vec![];
    let mut r0 = 0u64;
    while r0 < w.rows as u64 {
        let rows = rows_per_part.min(w.rows as u64 - r0);
        let start = w.offset + r0 * stride;
        let base = start / align * align;
        parts.push(WeightPart {
            r0,
            rows,
            base,
            end: start + rows * stride + extra,
            w_off: ((start - base) / 16) as u32,
        });
        r0 += rows;
    }
    Ok(parts)
}

/// One pipeline dispatched once per part, each with its own bind group and workgroup counts.
pub(crate) struct PartDispatches {
    pub pipeline: wgpu::ComputePipeline,
    pub parts: Vec<(wgpu::BindGroup, [u32; 3])>,
}

impl super::ops::RecordPart for PartDispatches {
    /// Records every part, launched as `launch` says.
    fn record_part(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        pass.set_pipeline(&self.pipeline);
        for (bind, groups) in &self.parts {
            pass.set_bind_group(0, bind, &[]);
            launch.dispatch(pass, *groups);
        }
    }
}
