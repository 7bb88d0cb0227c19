//! Wrapper of `kernels/matvec.wgsl`: quantized matrix × activations, plain, gated
//! (silu(G·x)·(U·x)) and grouped (a stack of experts chosen by ids on the GPU).
//!
//! Here: what a product is (`MatVecDesc`) and `MatVec`, which checks one and records its
//! dispatches. `fuse` is the work a product can take over from the dispatches after it,
//! `tuning` its launch shape and the kernel's constants, `operands` what each dispatch binds.

mod fuse;
mod operands;
mod tuning;

pub use fuse::{Fuse, NextRoute, RouteTail, SumTail};
pub use tuning::{MatVecTuning, Q4Decode};

use super::buffers::BufRef;
use super::context::{GpuContext, GpuError};
use super::ops::recordable;
use super::parts::{split_rows, PartDispatches};
use fuse::Tail;
use operands::{Layout, Operands, Params, Placeholders};
use smoe_vault::quant::DType;
use tuning::KernelShape;

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

impl<'a> WeightRef<'a> {
    /// A matrix at the start of `buffer`.
    pub fn whole(buffer: &'a wgpu::Buffer, dtype: DType, rows: usize, cols: usize) -> Self {
        WeightRef {
            buffer,
            offset: 0,
            dtype,
            rows,
            cols,
        }
    }
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

impl<'a> MatVecDesc<'a> {
    /// A plain product `y = W·x` of `n_tokens` tokens: not gated, not grouped (set `up_offset`
    /// or `grouped` on it for those).
    pub fn plain(w: WeightRef<'a>, x: BufRef<'a>, y: BufRef<'a>, n_tokens: usize) -> Self {
        MatVecDesc {
            w,
            up_offset: None,
            x,
            y,
            n_tokens,
            grouped: None,
        }
    }
}

/// Tokens one workgroup multiplies at once (more are spread over dispatch z).
pub const NT_MAX: usize = 8;

/// A recorded-at-load matrix product: one dispatch per part (a matrix larger than a storage
/// binding is split by rows into parts).
pub struct MatVec {
    dispatches: PartDispatches,
}

impl MatVec {
    pub fn new(ctx: &GpuContext, d: &MatVecDesc) -> Result<Self, GpuError> {
        Self::fused(ctx, d, &Fuse::default())
    }

    /// A product with `f`'s work fused in, at the launch shape `MatVecTuning::for_shape` picks.
    pub fn fused(ctx: &GpuContext, d: &MatVecDesc, f: &Fuse) -> Result<Self, GpuError> {
        let slots = d.grouped.map_or(1, |g| g.n_slots);
        let out_slots = slots / f.reduce.map_or(1, |r| r.1.max(1));
        let grouped = d.grouped.is_some();
        let tune = MatVecTuning::for_product(d.w.rows, out_slots, grouped, f.reduce.is_some());
        Self::build(ctx, d, f, tune)
    }

    pub fn with_tuning(
        ctx: &GpuContext,
        d: &MatVecDesc,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        Self::build(ctx, d, &Fuse::default(), tune)
    }

    /// `fused` at a given launch shape (for benchmarks).
    pub fn fused_tuned(
        ctx: &GpuContext,
        d: &MatVecDesc,
        f: &Fuse,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        Self::build(ctx, d, f, tune)
    }

    fn build(
        ctx: &GpuContext,
        d: &MatVecDesc,
        f: &Fuse,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        let w = d.w;
        let err =
            |m: String| GpuError::Shape(format!("matvec {}x{} {}: {m}", w.rows, w.cols, w.dtype));
        check_matrix(d, &err)?;
        let reduce_k = reduce_group(d, f, &err)?;
        let shape = KernelShape::choose(ctx, d, f, tune, reduce_k);
        let groups_x = w.rows.div_ceil(tune.rows as usize);
        let tail = Tail::bind(ctx, d, f, groups_x, &err)?;
        let pipeline = ctx.pipeline(shape.entry, &shape.constants(d, f, &tail)?)?;
        let layout = Layout::of(d, reduce_k, &err)?;
        let spare = Placeholders::new(ctx, d, f);
        let operands = Operands::bind(ctx, d, f, &layout, &spare, &err)?;

        // Split rows so that each part's weight range fits one storage binding.
        let extra = (layout.n_mats as u64 - 1) * layout.mat_stride + d.up_offset.unwrap_or(0);
        let split = split_rows(ctx, &w, extra, d.grouped.is_none(), "matvec weights", err)?;
        if tail.kind != 0 && split.len() > 1 {
            return Err(err(
                "a fused tail needs the weights in one storage binding".into()
            ));
        }
        let shared = Params::shared(d, f, &layout, &operands, &tail);
        let max_wg = ctx.limits().max_compute_workgroups_per_dimension as u64;
        let rows_per_group = tune.rows as u64;
        let mut parts = vec![];
        for part in split {
            let params = shared.for_part(&part, rows_per_group, tail.kind, layout.out_slots);
            let params = ctx.uniform("matvec params", &params);
            let entries = operands.entries(&params, part.binding(&w), &tail);
            let bind = ctx.bind_group("matvec", &pipeline, &entries)?;
            let groups = [
                part.rows.div_ceil(rows_per_group),
                layout.out_slots as u64,
                if f.reduce.is_some() {
                    1
                } else {
                    d.n_tokens.div_ceil(shape.tokens)
                } as u64,
            ];
            if groups.iter().any(|g| *g > max_wg) {
                return Err(err(format!(
                    "dispatch {groups:?} exceeds {max_wg} workgroups per dimension"
                )));
            }
            parts.push((bind, groups.map(|g| g as u32)));
        }
        Ok(MatVec {
            dispatches: PartDispatches { pipeline, parts },
        })
    }
}

/// Checks what every product needs of its matrix, tokens and up offset.
fn check_matrix(d: &MatVecDesc, err: &dyn Fn(String) -> GpuError) -> Result<(), GpuError> {
    let w = d.w;
    w.dtype.check_cols(w.cols).map_err(err)?;
    if !w.cols.is_multiple_of(8) || !w.offset.is_multiple_of(16) || d.n_tokens == 0 || w.rows == 0 {
        return Err(err(
            "cols must be a multiple of 8, offset of 16, rows and tokens > 0".into(),
        ));
    }
    if d.up_offset.is_some_and(|u| u % 16 != 0) {
        return Err(err("up offset must be a multiple of 16".into()));
    }
    Ok(())
}

/// The slots a reduce sums into one output (1 without a reduce), checked against the product:
/// a reduce stages its k slots' inputs as the workgroup's "tokens".
fn reduce_group(
    d: &MatVecDesc,
    f: &Fuse,
    err: &dyn Fn(String) -> GpuError,
) -> Result<usize, GpuError> {
    let Some((_, k)) = f.reduce else {
        return Ok(1);
    };
    let slots = d.grouped.map_or(0, |g| g.n_slots);
    if d.grouped.is_none() || d.up_offset.is_some() || f.norm.is_some() {
        return Err(err(format!(
            "a reduce over {k} slots needs a grouped, ungated product without a norm"
        )));
    }
    if k == 0 || k > NT_MAX || !slots.is_multiple_of(k) || d.n_tokens != 1 {
        return Err(err(format!(
            "{slots} slots of {} tokens do not reduce in groups of {k} (1..={NT_MAX})",
            d.n_tokens
        )));
    }
    Ok(k)
}

recordable!(MatVec, "matvec", dispatches);
