//! Wrapper of `kernels/moe_block.wgsl`: one decode token's MoE block — RMSNorm, router, softmax
//! top-k, the k experts' gate_up and down and their weighted sum into the residual — as one
//! dispatch of co-resident workgroups separated by grid barriers, instead of three dependent
//! dispatches. For one token, q4 experts and a bf16 router; `MoeBlock::new` says why not
//! otherwise, and the caller records the chain of matvecs instead.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::launch::Launch;
use super::matvec::WeightRef;
use smoe_vault::quant::DType;
use std::collections::HashMap;
use std::sync::Mutex;

/// The block's inputs and outputs. `x` (`[hidden]` f32) is the residual, updated in place.
#[derive(Clone, Copy, Debug)]
pub struct MoeBlockDesc<'a> {
    pub x: BufRef<'a>,
    /// The RMSNorm weight before the router (`[hidden]` f32) and its epsilon.
    pub norm: BufRef<'a>,
    pub eps: f32,
    /// `[experts, hidden]`, bf16.
    pub router: WeightRef<'a>,
    /// Expert 0's gate matrix (`[width, hidden]`, q4); expert e's at `e · stride` further.
    pub gate: WeightRef<'a>,
    /// Bytes from a gate matrix to its up matrix (same shape and type).
    pub up_offset: u64,
    /// Expert 0's down matrix (`[hidden, width]`, q4), on the same buffer as `gate`.
    pub down: WeightRef<'a>,
    pub stride: u64,
    pub k: usize,
    /// Renormalize the k probabilities (`norm_topk_prob`).
    pub normalize: bool,
    /// Where the choice is written, as `Router` writes it: `[k]` u32 ids, `[k]` f32 weights.
    pub ids: BufRef<'a>,
    pub weights: BufRef<'a>,
}

/// The fault count (word 0) and the barrier word (word 1) that every block of a model shares (16
/// bytes). A nonzero fault count means some block's workgroups stopped waiting for each other:
/// the results since the last `clear` are wrong, and the caller must fail them and `clear`.
pub struct GridSync {
    buf: wgpu::Buffer,
}

impl GridSync {
    pub fn new(ctx: &GpuContext) -> Self {
        GridSync {
            buf: ctx.storage_buffer("grid sync", 16),
        }
    }

    /// Workgroups that gave up waiting since the last `clear` (a blocking read).
    pub fn faults(&self, ctx: &GpuContext) -> Result<u32, GpuError> {
        Ok(ctx.read_u32(&self.buf, 0, 1)?[0])
    }

    /// The buffer, whose first u32 is the fault count (to copy beside a pass's results).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// Zeroes the barrier word and the fault count (ordered before the next submission).
    pub fn clear(&self, ctx: &GpuContext) {
        ctx.queue.write_buffer(&self.buf, 0, &[0u8; 16]);
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    groups: u32,
    spin_limit: u32,
    probe: u32,
    normalize: u32,
    x_off: u32,
    nw_off: u32,
    eps: f32,
    r_off: u32,
    gate_off: u32,
    up_off: u32,
    down_off: u32,
    mat_stride: u32,
    gu_row: u32,
    gu_pw: u32,
    dn_row: u32,
    dn_pw: u32,
    logits_off: u32,
    gu_off: u32,
    ids_off: u32,
    rw_off: u32,
    _pad: [u32; 4],
}

/// Polls before a waiting workgroup gives up in the engine's dispatches: far beyond any barrier
/// of co-resident workgroups (microseconds), so only a device that stops running some of them
/// reaches it.
const SPIN_LIMIT: u32 = 1 << 24;
/// The probe's limit: a barrier of co-resident workgroups takes hundreds of polls; a count that
/// is too large for the device gives up after this many, so trying one costs milliseconds.
const PROBE_SPIN_LIMIT: u32 = 1 << 14;
/// Environment override of the workgroup count tried first (`bench` experiments).
pub const GROUPS_ENV: &str = "SMOE_MOE_GROUPS";
/// The workgroup count tried first on a GPU: four per SM of an H200 (132 SMs). Halved until the
/// probe finds them all running together.
const DEFAULT_GROUPS: usize = 528;
const WG: usize = 256;

/// One MoE block, recorded as one dispatch.
pub struct MoeBlock {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
    _params: wgpu::Buffer,
    _scratch: wgpu::Buffer,
}

/// Workgroup counts the probe found co-resident, per pipeline (the shape's constants).
static PROBED: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

impl MoeBlock {
    /// Errors (`GpuError::Shape`) name what this block cannot run; the caller then records the
    /// chain of matvecs the block replaces.
    pub fn new(ctx: &GpuContext, d: &MoeBlockDesc, sync: &GridSync) -> Result<Self, GpuError> {
        let (h, f, e, k) = (d.router.cols, d.gate.rows, d.router.rows, d.k);
        let err = |m: String| GpuError::Shape(format!("moe block {e}×{k} experts: {m}"));
        if !ctx.fused_tails() {
            return Err(err(format!(
                "workgroups cannot wait for each other on this adapter ({})",
                ctx.info().adapter.backend
            )));
        }
        if d.router.dtype != DType::Bf16
            || d.gate.dtype != DType::Q4
            || d.down.dtype != DType::Q4
        {
            return Err(err(format!(
                "needs a bf16 router and q4 experts, not {} and {}/{}",
                d.router.dtype, d.gate.dtype, d.down.dtype
            )));
        }
        let shapes_ok = d.gate.cols == h
            && d.down.rows == h
            && d.down.cols == f
            && h % 64 == 0
            && f % 64 == 0
            && h >= 64
            && f >= 64;
        if !shapes_ok || k == 0 || k > e || k > super::router::MAX_TOP_K {
            return Err(err(format!(
                "shapes: router {e}×{h}, gate {}×{}, down {}×{}, k {k}",
                d.gate.rows, d.gate.cols, d.down.rows, d.down.cols
            )));
        }
        let ss = ctx.info().adapter.subgroup_min_size.max(1) as usize;
        // Staged inputs (h, or a tile of the k slots' gu) and the kernel's other arrays.
        let wg_bytes = 4 * h.max(32 * k) + 4 * e + 8 * k + 1024;
        let have = ctx.limits().max_compute_workgroup_storage_size as usize;
        if wg_bytes > have || WG / ss > 64 {
            return Err(err(format!(
                "needs {wg_bytes} bytes of workgroup memory, the device has {have}"
            )));
        }
        let aligned = |b: u64| b % 16 == 0;
        if !aligned(d.gate.offset)
            || !aligned(d.down.offset)
            || !aligned(d.up_offset)
            || !aligned(d.stride)
            || !aligned(d.router.offset)
            || d.router.dtype.row_stride(h) != 2 * h
        {
            return Err(err("offsets and strides must be multiples of 16".into()));
        }
        let pipeline = ctx.pipeline(
            kernel_name(ctx),
            &[
                ("WG", WG as f64),
                ("H", h as f64),
                ("F", f as f64),
                ("E", e as f64),
                ("K", k as f64),
                ("SS", ss as f64),
            ],
        )?;
        let vec4 = |b: u64| -> Result<u32, GpuError> {
            u32::try_from(b / 16).map_err(|_| err(format!("{b} bytes exceed a u32 of vec4s")))
        };
        // One binding over every expert's gate, up and down.
        let experts = d.gate.buffer;
        if !std::ptr::eq(experts, d.down.buffer) {
            return Err(err("gate and down must share one buffer".into()));
        }
        let gu_stride = d.gate.dtype.row_stride(h) as u64;
        let dn_stride = d.down.dtype.row_stride(f) as u64;
        let lo = d.gate.offset.min(d.down.offset);
        let last_gate = d.gate.offset + d.up_offset + f as u64 * gu_stride;
        let last_down = d.down.offset + h as u64 * dn_stride;
        let span_end = (e as u64 - 1) * d.stride + last_gate.max(last_down);
        let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
        let base = lo / align * align;
        let size = (span_end - base).next_multiple_of(16).min(experts.size() - base);
        if size > ctx.limits().max_storage_buffer_binding_size || span_end > experts.size() {
            return Err(err(format!(
                "the experts ({size} bytes) do not fit one storage binding"
            )));
        }
        let wbind = Binding {
            buffer: experts,
            base,
            size: Some(size),
        };
        let (rb, r_off) = BufRef::at(d.router.buffer, d.router.offset).bind(ctx, "moe block router", e * h / 2, 16)?;
        let (xb, x_off) = d.x.bind(ctx, "moe block x", h, 4)?;
        let (nb, nw_off) = d.norm.bind(ctx, "moe block norm", h, 16)?;
        let (ib, ids_off) = d.ids.bind(ctx, "moe block ids", k, 4)?;
        let (wb, rw_off) = d.weights.bind(ctx, "moe block weights", k, 4)?;
        let scratch = ctx.storage_buffer("moe block scratch", 4 * (e + k * f) as u64);
        let mut params = Params {
            groups: 1,
            spin_limit: SPIN_LIMIT,
            probe: 0,
            normalize: d.normalize as u32,
            x_off,
            nw_off,
            eps: d.eps,
            r_off,
            gate_off: vec4(d.gate.offset - base)?,
            up_off: vec4(d.up_offset)?,
            down_off: vec4(d.down.offset - base)?,
            mat_stride: vec4(d.stride)?,
            gu_row: vec4(gu_stride)?,
            gu_pw: (d.gate.dtype.code_bytes(h) / 4) as u32,
            dn_row: vec4(dn_stride)?,
            dn_pw: (d.down.dtype.code_bytes(f) / 4) as u32,
            logits_off: 0,
            gu_off: e as u32,
            ids_off,
            rw_off,
            _pad: [0; 4],
        };
        let build = |p: &Params| -> Result<(wgpu::Buffer, wgpu::BindGroup), GpuError> {
            let pbuf = ctx.uniform("moe block params", p);
            let bind = ctx.bind_group(
                "moe block",
                &pipeline,
                &[
                    Binding::whole(&pbuf).entry(0),
                    rb.entry(1),
                    wbind.entry(2),
                    xb.entry(3),
                    nb.entry(4),
                    Binding::whole(&scratch).entry(5),
                    ib.entry(6),
                    wb.entry(7),
                    Binding::whole(&sync.buf).entry(8),
                ],
            )?;
            Ok((pbuf, bind))
        };
        let key = format!("{}:{h}:{f}:{e}:{k}:{ss}", kernel_name(ctx));
        let groups = match cached_groups(&key) {
            Some(g) => g,
            None => {
                let g = probe_groups(ctx, sync, &pipeline, |groups| {
                    let p = Params {
                        groups: groups as u32,
                        spin_limit: PROBE_SPIN_LIMIT,
                        probe: 1,
                        ..params
                    };
                    build(&p).map(|(_, b)| b)
                })?;
                PROBED
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert_with(HashMap::new)
                    .insert(key, g);
                g
            }
        };
        params.groups = groups as u32;
        let (pbuf, bind) = build(&params)?;
        Ok(MoeBlock {
            pipeline,
            bind,
            groups: groups as u32,
            _params: pbuf,
            _scratch: scratch,
        })
    }

    /// The workgroups each dispatch runs (all co-resident).
    pub fn groups(&self) -> usize {
        self.groups as usize
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.record_with(pass, &mut Launch::Direct);
    }

    pub fn record_with(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        launch.dispatch(pass, [self.groups, 1, 1]);
    }

    pub fn encode(&self, enc: &mut wgpu::CommandEncoder) {
        super::in_pass(enc, "moe block", |p| self.record(p));
    }
}

fn kernel_name(ctx: &GpuContext) -> &'static str {
    match ctx.info().features.contains(wgpu::Features::SHADER_F16) {
        true => "moe_block_f16",
        false => "moe_block",
    }
}

fn cached_groups(key: &str) -> Option<usize> {
    PROBED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(key).copied())
}

/// The largest workgroup count, from `SMOE_MOE_GROUPS` or the default down by halves, whose
/// barrier-only dispatch (`bind_for`) passes without a give-up. One workgroup on a CPU adapter:
/// lavapipe runs workgroups a few at a time and its spinning ones lost arrivals
/// (`bench::grid`), so only the one-workgroup barrier — which never waits — is used there.
fn probe_groups(
    ctx: &GpuContext,
    sync: &GridSync,
    pipeline: &wgpu::ComputePipeline,
    bind_for: impl Fn(usize) -> Result<wgpu::BindGroup, GpuError>,
) -> Result<usize, GpuError> {
    if ctx.info().adapter.device_type == wgpu::DeviceType::Cpu {
        return Ok(1);
    }
    let first = std::env::var(GROUPS_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&g| g > 0 && g < 0xffff)
        .unwrap_or(DEFAULT_GROUPS);
    let mut g = first;
    while g > 1 {
        let bind = bind_for(g)?;
        sync.clear(ctx);
        let mut enc = ctx.encoder();
        super::in_pass(&mut enc, "moe block probe", |pass| {
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(g as u32, 1, 1);
        });
        ctx.submit_wait(enc);
        let faults = sync.faults(ctx)?;
        if faults == 0 {
            break;
        }
        tracing::debug!("moe block: {g} workgroups are not co-resident ({faults} gave up)");
        g /= 2;
    }
    sync.clear(ctx);
    tracing::debug!("moe block: {g} workgroups");
    Ok(g)
}
