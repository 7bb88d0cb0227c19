//! Wrappers of the small kernels: RMSNorm, weighted accumulate, argmax, element-wise ops; and
//! `Dispatch`, the
//! one-pipeline-one-bind-group shape they (and the router and attention wrappers) share.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::launch::Launch;

/// One dispatch, fully prepared at load time.
pub(crate) struct Dispatch {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: [u32; 3],
}

impl Dispatch {
    /// `bufs[i]` is bound at binding `i + 1`; binding 0 is a uniform holding `params`.
    pub(crate) fn new<P: bytemuck::Pod>(
        ctx: &GpuContext,
        kernel: &'static str,
        constants: &[(&'static str, f64)],
        params: &P,
        bufs: &[Binding],
        groups: [usize; 3],
    ) -> Result<Self, GpuError> {
        let pipeline = ctx.pipeline(kernel, constants)?;
        let max = ctx.limits().max_compute_workgroups_per_dimension as usize;
        if groups.iter().any(|g| *g > max || *g == 0) {
            return Err(GpuError::Shape(format!(
                "{kernel}: dispatch {groups:?} is empty or exceeds {max}"
            )));
        }
        let pbuf = ctx.uniform(kernel, params);
        let mut entries = vec![Binding::whole(&pbuf).entry(0)];
        for (i, b) in bufs.iter().enumerate() {
            entries.push(b.entry(i as u32 + 1));
        }
        let bind = ctx.bind_group(kernel, &pipeline, &entries)?;
        Ok(Dispatch {
            pipeline,
            bind,
            groups: groups.map(|g| g as u32),
        })
    }

    pub(crate) fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.record_with(pass, &mut Launch::Direct);
    }

    pub(crate) fn record_with(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        launch.dispatch(pass, self.groups);
    }
}

/// A part of a wrapper that `recordable!` records: a dispatch, or one the wrapper's shape may
/// leave out (a merge pass that runs only where tails are not fused).
pub(crate) trait RecordPart {
    fn record_part(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch);
}

impl RecordPart for Dispatch {
    fn record_part(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        self.record_with(pass, launch);
    }
}

impl RecordPart for Option<Dispatch> {
    fn record_part(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        if let Some(d) = self {
            d.record_with(pass, launch);
        }
    }
}

/// Implements `record` and `encode` for a wrapper made of `Dispatch`es (or optional ones) run
/// in order.
macro_rules! recordable {
    ($t:ty, $label:literal, $($field:ident),+) => {
        impl $t {
            /// Records the kernel into an open compute pass.
            pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
                self.record_with(pass, &mut $crate::gpu::Launch::Direct);
            }
            /// Records the kernel, launched as `launch` says.
            pub fn record_with(
                &self,
                pass: &mut wgpu::ComputePass<'_>,
                launch: &mut $crate::gpu::Launch,
            ) {
                $($crate::gpu::ops::RecordPart::record_part(&self.$field, pass, launch);)+
            }
            /// Records the kernel into its own compute pass of `enc`.
            pub fn encode(&self, enc: &mut wgpu::CommandEncoder) {
                super::in_pass(enc, $label, |p| self.record(p));
            }
        }
    };
}
pub(crate) use recordable;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct NormParams {
    n: u32,
    eps: f32,
    x_off: u32,
    y_off: u32,
    w_off: u32,
    _pad: [u32; 3],
}

/// `y[r] = x[r] · 1/sqrt(mean(x[r]²) + eps) · weight` for `rows` rows of `n` f32.
/// `x` and `y` must be different buffers.
pub struct RmsNorm {
    d: Dispatch,
}

impl RmsNorm {
    pub fn new(
        ctx: &GpuContext,
        x: BufRef,
        weight: BufRef,
        y: BufRef,
        n: usize,
        rows: usize,
        eps: f32,
    ) -> Result<Self, GpuError> {
        let (xb, x_off) = x.bind(ctx, "rms_norm x", n * rows, 4)?;
        let (yb, y_off) = y.bind(ctx, "rms_norm y", n * rows, 4)?;
        let (wb, w_off) = weight.bind(ctx, "rms_norm weight", n, 4)?;
        let p = NormParams {
            n: n as u32,
            eps,
            x_off,
            y_off,
            w_off,
            _pad: [0; 3],
        };
        let bufs = [xb, wb, yb];
        let d = Dispatch::new(ctx, "rms_norm", &[("WG", 256.0)], &p, &bufs, [rows, 1, 1])?;
        Ok(RmsNorm { d })
    }
}
recordable!(RmsNorm, "rms_norm", d);

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct WsumParams {
    n: u32,
    k: u32,
    acc_off: u32,
    y_off: u32,
    w_off: u32,
    _pad: [u32; 3],
}

/// Weighted accumulate of `k` expert outputs per token:
/// `acc[t][i] += Σ_s weights[t·k + s] · y[t·k + s][i]` (`y` as written by a grouped matvec).
pub struct WeightedSum {
    d: Dispatch,
}

impl WeightedSum {
    pub fn new(
        ctx: &GpuContext,
        acc: BufRef,
        y: BufRef,
        weights: BufRef,
        n: usize,
        k: usize,
        n_tokens: usize,
    ) -> Result<Self, GpuError> {
        let (ab, acc_off) = acc.bind(ctx, "weighted_sum acc", n * n_tokens, 4)?;
        let (yb, y_off) = y.bind(ctx, "weighted_sum y", n * k * n_tokens, 4)?;
        let (wb, w_off) = weights.bind(ctx, "weighted_sum weights", k * n_tokens, 4)?;
        let p = WsumParams {
            n: n as u32,
            k: k as u32,
            acc_off,
            y_off,
            w_off,
            _pad: [0; 3],
        };
        let bufs = [yb, wb, ab];
        let d = Dispatch::new(
            ctx,
            "weighted_sum",
            &[],
            &p,
            &bufs,
            [n.div_ceil(256), n_tokens, 1],
        )?;
        Ok(WeightedSum { d })
    }
}
recordable!(WeightedSum, "weighted_sum", d);

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ArgmaxParams {
    n: u32,
    x_off: u32,
    out_off: u32,
    _pad: u32,
}

/// Greedy token choice on the GPU: `out[r]` (u32) = index of the largest of `logits[r][..n]`,
/// ties to the lowest index, NaN as -inf (the engine's `sampler::argmax`).
pub struct Argmax {
    d: Dispatch,
}

impl Argmax {
    pub fn new(
        ctx: &GpuContext,
        logits: BufRef,
        out: BufRef,
        n: usize,
        rows: usize,
    ) -> Result<Self, GpuError> {
        let (xb, x_off) = logits.bind(ctx, "argmax logits", n * rows, 4)?;
        let (ob, out_off) = out.bind(ctx, "argmax out", rows, 4)?;
        let p = ArgmaxParams {
            n: n as u32,
            x_off,
            out_off,
            _pad: 0,
        };
        let wg = ctx.limits().max_compute_invocations_per_workgroup.min(1024) as f64;
        let d = Dispatch::new(ctx, "argmax", &[("WG", wg)], &p, &[xb, ob], [rows, 1, 1])?;
        Ok(Argmax { d })
    }
}
recordable!(Argmax, "argmax", d);

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct EltParams {
    n: u32,
    nb: u32,
    y_off: u32,
    b_off: u32,
    c: f32,
    _pad: [u32; 3],
}

/// What [`Eltwise`] does to each value.
#[derive(Clone, Copy, Debug)]
pub enum EltOp<'a> {
    /// `y[i] += bias[i % len]`: a bias of `len` values added to every row (qkv bias).
    AddRows { bias: BufRef<'a>, len: usize },
    /// `y[i] = clamp(y[i], -c, c)` (clip_qkv).
    Clamp(f32),
    /// `y[i] = 1 / (1 + exp(-y[i]))` (a shared expert's gate).
    Sigmoid,
}

/// One element-wise op in place on `n` f32 values of `y`.
pub struct Eltwise {
    d: Dispatch,
}

impl Eltwise {
    pub fn new(ctx: &GpuContext, y: BufRef, n: usize, op: EltOp) -> Result<Self, GpuError> {
        let (yb, y_off) = y.bind(ctx, "eltwise y", n, 4)?;
        // Ops without a bias bind a placeholder there (it may not alias the written `y`); the
        // bind group keeps it alive.
        let dummy;
        let (code, c, nb, (bb, b_off)) = match op {
            EltOp::AddRows { bias, len } => {
                if len == 0 || !n.is_multiple_of(len) {
                    return Err(GpuError::Shape(format!(
                        "eltwise: {n} values are not rows of {len}"
                    )));
                }
                (0.0, 0.0, len, bias.bind(ctx, "eltwise bias", len, 4)?)
            }
            EltOp::Clamp(c) => {
                dummy = ctx.storage_buffer("eltwise (unused)", 16);
                (1.0, c, 1, (Binding::whole(&dummy), 0))
            }
            EltOp::Sigmoid => {
                dummy = ctx.storage_buffer("eltwise (unused)", 16);
                (2.0, 0.0, 1, (Binding::whole(&dummy), 0))
            }
        };
        let p = EltParams {
            n: n as u32,
            nb: nb as u32,
            y_off,
            b_off,
            c,
            _pad: [0; 3],
        };
        let d = Dispatch::new(
            ctx,
            "eltwise",
            &[("OP", code)],
            &p,
            &[yb, bb],
            [n.div_ceil(256), 1, 1],
        )?;
        Ok(Eltwise { d })
    }
}
recordable!(Eltwise, "eltwise", d);
