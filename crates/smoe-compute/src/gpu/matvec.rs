//! Wrapper of `kernels/matvec.wgsl`: quantized matrix × activations, plain, gated
//! (silu(G·x)·(U·x)) and grouped (a stack of experts chosen by ids on the GPU).

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use smoe_vault::quant::DType;

/// A weight matrix `[rows, cols]` in a vault storage type, stored at `offset` (a multiple of 16)
/// of `buffer`: `rows * dtype.row_stride(cols)` bytes, row after row, exactly as in the vault.
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// Grouped dispatch: slot `s` multiplies by matrix `ids[s]` of a stack of `n_mats` matrices
/// spaced `mat_stride` bytes apart (an expert section: `WeightRef::offset` is expert 0's tensor,
/// `mat_stride` the blob stride). `ids` holds u32s, e.g. the router's top-k expert ids.
#[derive(Clone, Copy, Debug)]
pub struct Grouped<'a> {
    pub ids: &'a wgpu::Buffer,
    /// Byte offset of slot 0's id (a multiple of 4).
    pub ids_offset: u64,
    pub n_slots: usize,
    pub n_mats: usize,
    pub mat_stride: u64,
    /// Each slot reads its own input (`x + s·n_tokens·cols`, e.g. the down projection after a
    /// grouped gate_up); otherwise every slot reads the same `x` (the gate_up of one token).
    pub x_per_slot: bool,
    /// With `x_per_slot`: this many consecutive slots share one input, slot `s` reading input
    /// `s / slots_per_x` (the gate_up of several tokens, slots `t·k..t·k + k` being token `t`'s k
    /// experts). 0 or 1: every slot its own input.
    pub slots_per_x: usize,
}

/// One matrix product to record. `x` holds `[slots][n_tokens][cols]` f32 (one slot unless
/// `grouped.x_per_slot`), `y` receives `[slots][n_tokens][rows]` f32.
#[derive(Clone, Copy, Debug)]
pub struct MatVecDesc<'a> {
    pub w: WeightRef<'a>,
    /// Gated: byte offset from `w` to an up matrix of the same shape; `y = silu(W·x) · (U·x)`.
    pub up_offset: Option<u64>,
    pub x: BufRef<'a>,
    pub y: BufRef<'a>,
    pub n_tokens: usize,
    pub grouped: Option<Grouped<'a>>,
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_stride: u32,
    w_off: u32,
    w_mat_stride: u32,
    w_up_off: u32,
    param_word: u32,
    x_off: u32,
    x_tok: u32,
    x_slot: u32,
    y_off: u32,
    y_tok: u32,
    y_slot: u32,
    ids_off: u32,
    x_div: u32,
}

/// Launch shape and decoding choices; `Default` is what `MatVec::new` uses. Exposed so that
/// `gpu::bench` can compare variants in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatVecTuning {
    /// Invocations per workgroup (a multiple of the subgroup size; 64..=256).
    pub wg: u32,
    /// Output rows per workgroup (subgroups share them round-robin).
    pub rows: u32,
    /// How q4 codes are turned into products.
    pub q4: Q4Decode,
}

/// q4 decoding strategies (see `kernels/matvec.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Decode {
    /// Nibble → u32 → f32 conversion: simple, but the conversion is quarter-rate on NVIDIA.
    IntToFloat,
    /// Nibble placed in the mantissa of 1.0f (exactly 1 + c/16): shifts and masks only.
    FloatBits,
    /// Inputs quantized to int8 per 64 in workgroup memory, 4 products per `dot4I8Packed`.
    /// Not exact w.r.t. the f32 CPU twin (NMSE ~1e-5): opt-in.
    Int8Dot,
}

impl Default for MatVecTuning {
    fn default() -> Self {
        MatVecTuning {
            wg: 128,
            rows: 16,
            q4: Q4Decode::FloatBits,
        }
    }
}
/// Tokens one workgroup multiplies at once (more are spread over dispatch z).
pub const NT_MAX: usize = 8;
/// Staged inputs per workgroup: 16 KiB, WebGPU's default workgroup memory.
const STAGE_FLOATS: usize = 4096;

/// A recorded-at-load matrix product: one dispatch per part (a matrix larger than a storage
/// binding is split by rows into parts).
pub struct MatVec {
    pipeline: wgpu::ComputePipeline,
    parts: Vec<(wgpu::BindGroup, [u32; 3])>,
}

fn dtype_code(d: DType, t: MatVecTuning) -> Result<f64, GpuError> {
    Ok(match d {
        DType::Bf16 => 0.0,
        DType::Q8 => 1.0,
        DType::Q4 => match t.q4 {
            Q4Decode::IntToFloat => 2.0,
            Q4Decode::FloatBits => 4.0,
            Q4Decode::Int8Dot => 5.0,
        },
        DType::Q2 => 3.0,
        DType::F32 => {
            return Err(GpuError::Shape(
                "matvec: f32 weights are not supported; store bf16".into(),
            ))
        }
    })
}

fn check_fits(what: &str, buf: &wgpu::Buffer, end: u64) -> Result<(), GpuError> {
    if end > buf.size() {
        return Err(GpuError::Shape(format!(
            "{what}: needs {end} bytes, buffer has {}",
            buf.size()
        )));
    }
    Ok(())
}

impl MatVec {
    pub fn new(ctx: &GpuContext, d: &MatVecDesc) -> Result<Self, GpuError> {
        Self::with_tuning(ctx, d, MatVecTuning::default())
    }

    pub fn with_tuning(
        ctx: &GpuContext,
        d: &MatVecDesc,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        let w = d.w;
        let err =
            |m: String| GpuError::Shape(format!("matvec {}x{} {}: {m}", w.rows, w.cols, w.dtype));
        w.dtype.check_cols(w.cols).map_err(err)?;
        if w.cols % 8 != 0 || w.offset % 16 != 0 || d.n_tokens == 0 || w.rows == 0 {
            return Err(err(
                "cols must be a multiple of 8, offset of 16, rows and tokens > 0".into(),
            ));
        }
        if d.up_offset.is_some_and(|u| u % 16 != 0) {
            return Err(err("up offset must be a multiple of 16".into()));
        }
        let stride = w.dtype.row_stride(w.cols) as u64;
        let nt = d.n_tokens.min(NT_MAX);
        let tile = (STAGE_FLOATS / nt / 64 * 64).min(w.cols.next_multiple_of(64));
        let pipeline = ctx.pipeline(
            "matvec",
            &[
                ("DTYPE", dtype_code(w.dtype, tune)?),
                ("NT", nt as f64),
                ("TILE", tile as f64),
                ("ROWS", tune.rows as f64),
                ("WG", tune.wg as f64),
                ("GATED", d.up_offset.is_some() as u8 as f64),
                ("GROUPED", d.grouped.is_some() as u8 as f64),
            ],
        )?;
        let (n_slots, n_mats, mat_stride, x_per_slot, x_div) = match d.grouped {
            Some(g) => (
                g.n_slots,
                g.n_mats,
                g.mat_stride,
                g.x_per_slot,
                g.slots_per_x.max(1),
            ),
            None => (1, 1, 0, false, 1),
        };
        if mat_stride % 16 != 0 || n_slots == 0 {
            return Err(err(
                "group stride must be a multiple of 16 and slots > 0".into()
            ));
        }
        let (xs_slot, ys_slot) = (d.n_tokens * w.cols, d.n_tokens * w.rows);
        let x_slots = if x_per_slot {
            n_slots.div_ceil(x_div)
        } else {
            1
        };
        let (xb, x_off) = d.x.bind(ctx, "matvec x", x_slots * xs_slot, 16)?;
        let (yb, y_off) = d.y.bind(ctx, "matvec y", n_slots * ys_slot, 4)?;
        let ids_fallback;
        let (ib, ids_off) = match d.grouped {
            Some(g) => BufRef::at(g.ids, g.ids_offset).bind(ctx, "matvec ids", n_slots, 4)?,
            None => {
                ids_fallback = ctx.storage_buffer("matvec ids (unused)", 16);
                (Binding::whole(&ids_fallback), 0)
            }
        };

        // Split rows so that each part's weight range fits one storage binding.
        let limits = ctx.limits();
        let align = limits.min_storage_buffer_offset_alignment as u64;
        let max_bind = limits
            .max_storage_buffer_binding_size
            .min(u32::MAX as u64 / 4 * 16);
        let extra = (n_mats as u64 - 1) * mat_stride + d.up_offset.unwrap_or(0);
        let span = |rows: u64| rows * stride + extra + align;
        let mut rows_per_part = w.rows as u64;
        while span(rows_per_part) > max_bind {
            if d.grouped.is_some() || rows_per_part == 1 {
                return Err(err(format!(
                    "does not fit a storage binding of {max_bind} bytes"
                )));
            }
            rows_per_part = rows_per_part.div_ceil(2);
        }
        check_fits(
            "matvec weights",
            w.buffer,
            w.offset + w.rows as u64 * stride + extra,
        )?;
        let max_wg = limits.max_compute_workgroups_per_dimension as u64;
        let mut parts = vec![];
        let mut r0 = 0u64;
        while r0 < w.rows as u64 {
            let rows = rows_per_part.min(w.rows as u64 - r0);
            let start = w.offset + r0 * stride;
            let base = start / align * align;
            let end = start + rows * stride + extra;
            let params = Params {
                rows: rows as u32,
                cols: w.cols as u32,
                n_tok: d.n_tokens as u32,
                row_stride: (stride / 16) as u32,
                w_off: ((start - base) / 16) as u32,
                w_mat_stride: (mat_stride / 16) as u32,
                w_up_off: (d.up_offset.unwrap_or(0) / 16) as u32,
                param_word: (w.dtype.code_bytes(w.cols) / 4) as u32,
                x_off,
                x_tok: (w.cols / 4) as u32,
                x_slot: if x_per_slot { (xs_slot / 4) as u32 } else { 0 },
                y_off: y_off + r0 as u32,
                y_tok: w.rows as u32,
                y_slot: ys_slot as u32,
                ids_off,
                x_div: x_div as u32,
            };
            let pbuf = ctx.uniform("matvec params", &params);
            let bind = ctx.bind_group(
                "matvec",
                &pipeline,
                &[
                    Binding::whole(&pbuf).entry(0),
                    Binding {
                        buffer: w.buffer,
                        base,
                        size: Some(end - base),
                    }
                    .entry(1),
                    xb.entry(2),
                    yb.entry(3),
                    ib.entry(4),
                ],
            )?;
            let groups = [
                rows.div_ceil(tune.rows as u64),
                n_slots as u64,
                d.n_tokens.div_ceil(nt) as u64,
            ];
            if groups.iter().any(|g| *g > max_wg) {
                return Err(err(format!(
                    "dispatch {groups:?} exceeds {max_wg} workgroups per dimension"
                )));
            }
            parts.push((bind, groups.map(|g| g as u32)));
            r0 += rows;
        }
        Ok(MatVec { pipeline, parts })
    }

    /// Records the product into an open compute pass.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        for (bind, [x, y, z]) in &self.parts {
            pass.set_bind_group(0, bind, &[]);
            pass.dispatch_workgroups(*x, *y, *z);
        }
    }

    /// Records the product into its own compute pass of `enc`.
    pub fn encode(&self, enc: &mut wgpu::CommandEncoder) {
        super::in_pass(enc, "matvec", |p| self.record(p));
    }
}
