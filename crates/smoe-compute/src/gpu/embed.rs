//! Wrapper of `kernels/embed.wgsl`: rows of an embedding matrix chosen by ids on the GPU.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::matvec::WeightRef;
use super::ops::{recordable, Dispatch};
use smoe_vault::quant::DType;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    row_stride: u32,
    param_word: u32,
    w_off: u32,
    ids_off: u32,
    y_off: u32,
    _pad: u32,
}

/// `y[t] = dequantize(w[ids[t]])` for `n_tokens` ids (u32s in `ids`): `y` receives
/// `[n_tokens][cols]` f32. The whole matrix must fit one storage binding.
pub struct EmbedGather {
    d: Dispatch,
}

impl EmbedGather {
    pub fn new(
        ctx: &GpuContext,
        w: &WeightRef,
        ids: BufRef,
        y: BufRef,
        n_tokens: usize,
    ) -> Result<Self, GpuError> {
        let err = |m: String| {
            GpuError::Shape(format!(
                "embedding gather {}x{} {}: {m}",
                w.rows, w.cols, w.dtype
            ))
        };
        w.dtype.check_cols(w.cols).map_err(err)?;
        if !w.offset.is_multiple_of(4) || w.rows == 0 || w.cols == 0 || n_tokens == 0 {
            return Err(err(
                "offset must be a multiple of 4, shape and tokens > 0".into()
            ));
        }
        let dtype = match w.dtype {
            DType::Bf16 => 0.0,
            DType::Q8 => 1.0,
            DType::Q4 => 2.0,
            DType::Q2 => 3.0,
            DType::F32 => 6.0,
        };
        let stride = w.dtype.row_stride(w.cols);
        let bytes = (w.rows * stride) as u64;
        let (wb, w_off) = BufRef::at(w.buffer, w.offset)
            .bind(ctx, "embedding", (bytes / 4) as usize, 4)
            .map_err(|e| err(e.to_string()))?;
        let (ib, ids_off) = ids.bind(ctx, "embedding ids", n_tokens, 4)?;
        let (yb, y_off) = y.bind(ctx, "embedding out", n_tokens * w.cols, 4)?;
        let p = Params {
            rows: w.rows as u32,
            cols: w.cols as u32,
            row_stride: (stride / 4) as u32,
            param_word: (w.dtype.code_bytes(w.cols) / 4) as u32,
            w_off,
            ids_off,
            y_off,
            _pad: 0,
        };
        let bufs: [Binding; 3] = [wb, ib, yb];
        let groups = [w.cols.div_ceil(256), n_tokens, 1];
        let d = Dispatch::new(ctx, "embed", &[("DTYPE", dtype)], &p, &bufs, groups)?;
        Ok(EmbedGather { d })
    }
}
recordable!(EmbedGather, "embed", d);
