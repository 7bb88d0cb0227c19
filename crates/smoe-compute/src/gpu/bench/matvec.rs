//! Decode rows of `gpu::bench`: one token's matvec over a shape's weights, as the engine's
//! decode layer runs it (dense, or grouped over a stack of experts, with the fused work of
//! `DecodeFusion` and the experts' weighted sum), over enough copies of the weights that they
//! are read from memory, not from cache.

use super::shape::{BenchShape, DecodeFusion};
use super::timer::Timer;
use super::ROTATE_BYTES;
use crate::gpu::buffers::BufRef;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::matvec::{
    Fuse, Grouped, MatVec, MatVecDesc, MatVecTuning, RouteTail, SumTail, WeightRef,
};
use smoe_vault::quant::DType;

/// (weight bytes per call, seconds per call).
pub(super) fn bench_matvec(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    dtype: DType,
    tuning: MatVecTuning,
    host: &[u8],
    iters: usize,
) -> Result<(u64, f64), GpuError> {
    let layout = Layout::new(ctx, shape, dtype)?;
    let io = Io::new(ctx, &layout);
    let fuse = io.fuse(ctx, shape);
    let mut kernels = vec![];
    let mut keep = vec![];
    for c in 0..layout.copies {
        let (kernel, buffers) = layout.copy(ctx, tuning, host, &io, &fuse, c)?;
        kernels.push(kernel);
        keep.push(buffers);
    }
    let copies = layout.copies;
    let secs = timer.time(&|pass| (0..iters).for_each(|i| kernels[i % copies].record(pass)))?;
    Ok((layout.per_call, secs / iters as f64))
}

/// Where one copy's weights lie and how many copies the rotation needs.
struct Layout<'a> {
    shape: &'a BenchShape,
    dtype: DType,
    stride: u64,
    grouped: bool,
    /// Grouped gate_up: each expert holds gate then up, `out_rows` rows each.
    gated: bool,
    out_rows: usize,
    /// Bytes of one matrix (of one expert, gate and up together when gated).
    mat_bytes: u64,
    /// Matrices in one copy: the expert stack, or 1.
    n_mats: usize,
    copies: usize,
    /// Weight bytes one call reads: the picked experts' matrices, or the one matrix.
    per_call: u64,
}

impl<'a> Layout<'a> {
    fn new(ctx: &GpuContext, shape: &'a BenchShape, dtype: DType) -> Result<Self, GpuError> {
        let stride = dtype.row_stride(shape.cols) as u64;
        let grouped = shape.experts > 0;
        let gated = grouped && !shape.down;
        let out_rows = if gated { shape.rows / 2 } else { shape.rows };
        let mat_bytes = out_rows as u64 * stride * if gated { 2 } else { 1 };
        let n_mats = if grouped { shape.stack } else { 1 };
        let buf_bytes = mat_bytes * n_mats as u64;
        if buf_bytes > ctx.limits().max_buffer_size {
            return Err(GpuError::Shape(format!(
                "{}: {buf_bytes} bytes exceed a buffer",
                shape.name
            )));
        }
        let per_call = if grouped {
            mat_bytes * shape.experts as u64
        } else {
            mat_bytes
        };
        Ok(Layout {
            shape,
            dtype,
            stride,
            grouped,
            gated,
            out_rows,
            mat_bytes,
            n_mats,
            copies: ROTATE_BYTES.div_ceil(buf_bytes).clamp(2, 16) as usize,
            per_call,
        })
    }

    /// Copy `c` of the weights (with its expert ids when grouped) and its kernel; the buffers
    /// come back for the caller to keep alive while the kernel runs.
    fn copy(
        &self,
        ctx: &GpuContext,
        tuning: MatVecTuning,
        host: &[u8],
        io: &Io,
        fuse: &Fuse,
        c: usize,
    ) -> Result<(MatVec, (wgpu::Buffer, wgpu::Buffer)), GpuError> {
        let (shape, dtype) = (self.shape, self.dtype);
        let wbuf = ctx.upload("bench weights", host);
        // Grouped: each copy picks a different run of experts, so rotation covers the stack.
        let ids: Vec<u32> = (0..shape.experts)
            .map(|e| ((c * shape.experts + e) % self.n_mats) as u32)
            .collect();
        let idbuf = ctx.upload(
            "bench ids",
            bytemuck::cast_slice(&ids.iter().copied().chain([0]).collect::<Vec<_>>()),
        );
        let desc = MatVecDesc {
            up_offset: self.gated.then_some(self.out_rows as u64 * self.stride),
            grouped: self.grouped.then_some(Grouped {
                ids: &idbuf,
                ids_offset: 0,
                n_slots: shape.experts,
                n_mats: self.n_mats,
                mat_stride: self.mat_bytes,
                x_per_slot: shape.down,
                slots_per_x: 1,
            }),
            ..MatVecDesc::plain(
                WeightRef::whole(&wbuf, dtype, self.out_rows, shape.cols),
                BufRef::new(&io.x),
                BufRef::new(&io.y),
                1,
            )
        };
        let kernel = MatVec::fused_tuned(ctx, &desc, fuse, tuning)?;
        Ok((kernel, (wbuf, idbuf)))
    }
}

/// The buffers every copy shares: the input, the outputs, and what the fused work reads and
/// writes.
struct Io {
    x: wgpu::Buffer,
    y: wgpu::Buffer,
    /// The experts' router weights and the residual their sum goes into (`BenchShape::down`).
    wts: wgpu::Buffer,
    residual: wgpu::Buffer,
    /// DecodeFusion: the norm's weights, the normed input written out, the router's choice.
    norm_w: wgpu::Buffer,
    normed: wgpu::Buffer,
    route_ids: wgpu::Buffer,
    route_w: wgpu::Buffer,
}

impl Io {
    fn new(ctx: &GpuContext, layout: &Layout) -> Self {
        let shape = layout.shape;
        let (rows, cols) = (shape.rows, shape.cols);
        // The down projection reads one input per slot.
        let x_rows = if shape.down { shape.experts } else { 1 };
        let out_rows = layout.out_rows;
        Io {
            x: ctx.upload_f32("bench x", &vec![0.01f32; cols * x_rows]),
            wts: ctx.upload_f32(
                "bench router weights",
                &vec![0.125f32; shape.experts.max(1)],
            ),
            y: ctx.storage_buffer("bench y", 4 * (out_rows * shape.experts.max(1)) as u64),
            residual: ctx.storage_buffer("bench residual", 4 * out_rows as u64),
            norm_w: ctx.upload_f32("bench norm weight", &vec![1.0f32; cols]),
            normed: ctx.storage_buffer("bench normed x", 4 * cols as u64),
            route_ids: ctx.storage_buffer("bench route ids", 4 * rows.max(4) as u64),
            route_w: ctx.storage_buffer("bench route weights", 4 * rows.max(4) as u64),
        }
    }

    /// The work fused into the product, as the engine's decode layer fuses it: the experts'
    /// weighted sum (down), the input's norm, and the router's top-k; tails only where the
    /// adapter fuses them.
    fn fuse(&self, ctx: &GpuContext, shape: &BenchShape) -> Fuse<'_> {
        let sum = SumTail {
            acc: BufRef::new(&self.residual),
            weights: BufRef::new(&self.wts),
            k: shape.experts,
        };
        let mut fuse = Fuse {
            sum_into: (shape.down && ctx.fused_tails()).then_some(sum),
            ..Fuse::default()
        };
        if shape.fused != DecodeFusion::None {
            fuse.norm = Some((BufRef::new(&self.norm_w), 1e-6));
        }
        if let DecodeFusion::Route { k } = shape.fused {
            fuse.norm_out = Some(BufRef::new(&self.normed));
            if ctx.fused_tails() {
                fuse.route = Some(RouteTail {
                    ids: BufRef::new(&self.route_ids),
                    weights: BufRef::new(&self.route_w),
                    k,
                    normalize: true,
                });
            }
        }
        fuse
    }
}
