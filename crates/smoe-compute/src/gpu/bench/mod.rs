//! Kernel benchmarks: GB/s of each matvec dtype at real model shapes, beside the GB/s of a plain
//! copy kernel measured in the same run on the same device (DESIGN.md "Performance method").
//! Weights are rotated over enough copies (≥ 512 MiB in all) that they do not sit in cache.
//! Times come from GPU timestamps around one compute pass of many dispatches when the device
//! has TIMESTAMP_QUERY, else from the wall clock around the submission.
//!
//! Prefill shapes (`tokens > 0`) are compute-bound, so their rows report GFLOP/s
//! (2·rows·cols·tokens, ×2 gated) of the GEMM beside the decode matvec's, in a section of
//! their own. So do prefill attention shapes (`BenchShape::prefill_attention`): the decode
//! attention kernel beside the prefill one in each of its tiles.

mod attention;
mod prefill;
mod timer;

use super::attn_prefill::PrefillAttnTuning;
use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::matmul::MatMulTuning;
use super::matvec::{
    Fuse, Grouped, MatVec, MatVecDesc, MatVecTuning, RouteTail, SumTail, WeightRef,
};
use super::ops::Dispatch;
pub use prefill::pseudo_random_ids;
use prefill::{bench_prefill, host_weights, Kernel};
use smoe_vault::quant::DType;
use std::fmt;
use timer::Timer;

/// One matrix shape to measure; `experts > 0` measures a grouped, gated (gate_up) dispatch of
/// that many experts picked from a stack of `stack` experts, `rows` being gate + up rows.
///
/// Prefill shapes (`tokens > 0`) multiply a chunk of `tokens` tokens: dense, or with
/// `experts > 0` through a layer of `stack` experts with top-`experts` routing
/// (`tokens·experts` slots); there `rows` are output rows and `gated` adds the up matrix.
#[derive(Clone, Debug)]
pub struct BenchShape {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    pub stack: usize,
    pub tokens: usize,
    pub gated: bool,
    /// Decode shapes with `experts > 0`: the down projection instead of gate_up, as the engine
    /// runs it: each slot's `rows` outputs from its own input, then (in the last workgroup of
    /// each row block, `Fuse::sum_into`, where the adapter fuses tails) the token's slots
    /// summed with router weights into a residual.
    pub down: bool,
    /// Causal attention of the chunk instead of a projection (`rows`, `cols` unused).
    pub attention: Option<AttnBench>,
    /// Decode shapes: work fused into the product as the engine's decode layer fuses it.
    pub fused: DecodeFusion,
}

/// What a decode row fuses into its matvec (`Fuse`), as the engine's decode layer does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeFusion {
    #[default]
    None,
    /// The input's RMSNorm (the stacked q, k and v projection).
    Norm,
    /// The router: RMSNorm, the normed input written out for the experts, and the softmax
    /// top-`k` in the last workgroup (where the adapter fuses tails).
    Route { k: usize },
}

/// An attention measurement: a chunk of `BenchShape::tokens` queries at positions `pos0..`
/// over f32 caches holding positions `0..pos0 + tokens`.
#[derive(Clone, Copy, Debug)]
pub struct AttnBench {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub pos0: usize,
    pub window: Option<usize>,
    /// One decoded token with the QK-norm, RoPE and KV append fused in
    /// (`DecodeAttention::with_rope`), as the engine decodes; `pos0` is its position.
    pub rope: bool,
    /// Positions the caches hold (what sets the decode kernel's context splits); at least
    /// `pos0 + tokens`.
    pub capacity: usize,
}

impl BenchShape {
    pub fn dense(name: &str, rows: usize, cols: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts: 0,
            stack: 0,
            tokens: 0,
            gated: false,
            down: false,
            attention: None,
            fused: DecodeFusion::None,
        }
    }
    /// A decode product with `fused` work (`DecodeFusion`).
    pub fn dense_fused(name: &str, rows: usize, cols: usize, fused: DecodeFusion) -> Self {
        BenchShape {
            fused,
            ..Self::dense(name, rows, cols)
        }
    }
    pub fn experts(name: &str, rows: usize, cols: usize, experts: usize, stack: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts,
            stack,
            tokens: 0,
            gated: false,
            down: false,
            attention: None,
            fused: DecodeFusion::None,
        }
    }
    /// The experts' down projection of one token: `experts` of `stack` experts, each its own
    /// `rows` outputs, summed with router weights into a residual (`BenchShape::down`).
    pub fn experts_down(
        name: &str,
        rows: usize,
        cols: usize,
        experts: usize,
        stack: usize,
    ) -> Self {
        BenchShape {
            down: true,
            ..Self::experts(name, rows, cols, experts, stack)
        }
    }
    /// A dense projection of `tokens` tokens at once.
    pub fn prefill(name: &str, rows: usize, cols: usize, tokens: usize) -> Self {
        BenchShape {
            tokens,
            ..Self::dense(name, rows, cols)
        }
    }
    /// A layer's experts for `tokens` tokens, each routed to `top_k` of `n_experts`; `rows`
    /// output rows per expert (gated: of gate and of up each).
    pub fn prefill_experts(
        name: &str,
        rows: usize,
        cols: usize,
        tokens: usize,
        top_k: usize,
        n_experts: usize,
        gated: bool,
    ) -> Self {
        BenchShape {
            tokens,
            gated,
            ..Self::experts(name, rows, cols, top_k, n_experts)
        }
    }
    /// Causal attention of a `tokens`-token chunk at `pos0` (no window).
    pub fn prefill_attention(
        name: &str,
        tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        pos0: usize,
    ) -> Self {
        BenchShape {
            tokens,
            attention: Some(AttnBench {
                n_heads,
                n_kv_heads,
                head_dim,
                pos0,
                window: None,
                rope: false,
                capacity: pos0 + tokens,
            }),
            ..Self::dense(name, 0, 0)
        }
    }
    /// One decoded token's attention at position `pos` (a context of `pos + 1`) in caches of
    /// `capacity` positions, with the QK-norm, RoPE and KV append fused in, as the engine
    /// decodes.
    pub fn decode_attention(
        name: &str,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        pos: usize,
        capacity: usize,
    ) -> Self {
        BenchShape {
            tokens: 1,
            attention: Some(AttnBench {
                n_heads,
                n_kv_heads,
                head_dim,
                pos0: pos,
                window: None,
                rope: true,
                capacity: capacity.max(pos + 1),
            }),
            ..Self::dense(name, 0, 0)
        }
    }
    /// Multiply-adds ×2 of one call (prefill shapes); attention: of q·k and p·v over the keys
    /// each query sees.
    pub fn flops(&self) -> u64 {
        if let Some(a) = self.attention {
            let keys: usize = (0..self.tokens)
                .map(|t| (a.pos0 + t + 1).min(a.window.unwrap_or(usize::MAX)))
                .sum();
            return 4 * (a.head_dim * a.n_heads * keys) as u64;
        }
        let slots = self.tokens * self.experts.max(1);
        2 * (self.rows * self.cols * slots) as u64 * (1 + self.gated as u64)
    }
}

/// Qwen3-30B-A3B (hidden 2048, 32×128 q heads, moe_intermediate 768) and Qwen3-235B-A22B
/// (hidden 4096, 64×128 q heads, moe_intermediate 1536) shapes. Expert stacks hold 32 experts
/// (of 128) so that a bf16 stack fits one storage binding; rotation keeps them out of cache.
pub fn qwen3_shapes() -> Vec<BenchShape> {
    vec![
        BenchShape::dense("30B lm_head", 151_936, 2048),
        BenchShape::dense("30B q_proj", 4096, 2048),
        BenchShape::dense("30B o_proj", 2048, 4096),
        // The decode layer's other steps as the engine fuses them: q, k and v stacked with the
        // RMSNorm, the router with its norm and top-k, the attention with its RoPE.
        BenchShape::dense_fused("30B qkv norm", 5120, 2048, DecodeFusion::Norm),
        BenchShape::dense_fused("30B router", 128, 2048, DecodeFusion::Route { k: 8 }),
        // `bench decode`'s sessions hold just their tokens; the server's hold 4,096 positions.
        BenchShape::decode_attention("30B attn dec @63", 32, 4, 128, 63, 129),
        BenchShape::decode_attention("30B attn dec @63 c4096", 32, 4, 128, 63, 4096),
        BenchShape::decode_attention("30B attn dec @1023 c4096", 32, 4, 128, 1023, 4096),
        BenchShape::decode_attention("30B attn dec @4000 c4096", 32, 4, 128, 4000, 4096),
        BenchShape::experts("30B gate_up x8", 1536, 2048, 8, 32),
        BenchShape::experts_down("30B down x8", 2048, 768, 8, 32),
        BenchShape::dense("235B lm_head", 151_936, 4096),
        BenchShape::dense("235B q_proj", 8192, 4096),
        BenchShape::experts("235B gate_up x8", 3072, 4096, 8, 32),
        BenchShape::experts_down("235B down x8", 4096, 1536, 8, 32),
    ]
    .into_iter()
    .chain(qwen3_prefill_shapes())
    .collect()
}

/// Qwen3-30B-A3B prefill of a 512-token chunk: q_proj, q/k/v stacked, and the 128 experts'
/// gate_up and down with top-8 routing (4096 slots, ≈ 32 per expert).
pub fn qwen3_prefill_shapes() -> Vec<BenchShape> {
    vec![
        BenchShape::prefill("30B q_proj pf512", 4096, 2048, 512),
        // q, k and v stacked, as the engine's prefill runs them (one GEMM).
        BenchShape::prefill("30B qkv pf512", 5120, 2048, 512),
        BenchShape::prefill_experts("30B gate_up pf512", 768, 2048, 512, 8, 128, true),
        // Zipf-skewed routing (expert rank r gets weight 1/(r+1)): real routers are skewed, and
        // a popular expert's token tiles must spread over the GPU.
        BenchShape::prefill_experts("30B gate_up pf512 zipf", 768, 2048, 512, 8, 128, true),
        BenchShape::prefill_experts("30B down pf512", 2048, 768, 512, 8, 128, false),
        // Attention of the chunk: the first one of a prompt, and one 3.5k tokens in.
        BenchShape::prefill_attention("30B attn pf512", 512, 32, 4, 128, 0),
        BenchShape::prefill_attention("30B attn pf512 @3584", 512, 32, 4, 128, 3584),
    ]
}

#[derive(Clone, Debug)]
pub struct BenchRow {
    pub shape: String,
    pub dtype: DType,
    pub tuning: MatVecTuning,
    /// Weight bytes one call reads.
    pub bytes: u64,
    pub micros: f64,
    pub gbps: f64,
    /// `gbps` over the copy's GB/s.
    pub ratio: f64,
    /// Prefill rows: tokens of the chunk (0: a decode row).
    pub tokens: usize,
    /// Prefill rows: "matvec" (the baseline), "matmul" or "expert_sort".
    pub kernel: &'static str,
    /// Prefill rows, matmul: its tile.
    pub gemm: Option<MatMulTuning>,
    /// Prefill attention rows, attn_prefill: its tile.
    pub attn: Option<PrefillAttnTuning>,
    /// Prefill rows: 2·rows·cols·slots (×2 gated) per second, in GFLOP/s (0 for the sort).
    pub gflops: f64,
}

impl BenchRow {
    /// A row for `bytes` read per call in `secs` per call, against the copy's GB/s; the prefill
    /// fields (`tokens`, `gemm`, `attn`, `gflops`) empty, for the caller to fill.
    fn measured(
        shape: &BenchShape,
        dtype: DType,
        kernel: &'static str,
        bytes: u64,
        secs: f64,
        copy_gbps: f64,
    ) -> Self {
        let gbps = bytes as f64 / secs / 1e9;
        BenchRow {
            shape: shape.name.clone(),
            dtype,
            tuning: MatVecTuning::default(),
            bytes,
            micros: secs * 1e6,
            gbps,
            ratio: gbps / copy_gbps,
            tokens: 0,
            kernel,
            gemm: None,
            attn: None,
            gflops: 0.0,
        }
    }

    /// The kernel as the report prints it: "matmul tc 128x48x64" (tensor cores), "matmul
    /// 128x48x16", "attn_prefill 64x32" (with key splits "64x32 /4"), or the kernel's name.
    pub fn kernel_label(&self) -> String {
        match (self.gemm, self.attn) {
            (Some(t), _) if t.coop => format!("matmul tc {}x{}x{}", t.bm, t.bn, t.bk),
            (Some(t), _) => format!("matmul {}x{}x{}", t.bm, t.bn, t.bk),
            (_, Some(t)) if t.splits > 1 => {
                format!("{} {}x{} /{}", self.kernel, t.rows, t.dims, t.splits)
            }
            (_, Some(t)) => format!("{} {}x{}", self.kernel, t.rows, t.dims),
            _ => self.kernel.to_string(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct BenchReport {
    pub device: String,
    pub timer: &'static str,
    /// Copy kernel, bytes read + bytes written per second.
    pub copy_gbps: f64,
    pub rows: Vec<BenchRow>,
    /// Measurements that could not run (e.g. a shape too large for this device).
    pub errors: Vec<String>,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {} (timer: {})", self.device, self.timer)?;
        writeln!(f, "copy: {:.0} GB/s (read + write)", self.copy_gbps)?;
        if self.rows.iter().any(|r| r.tokens == 0) {
            writeln!(
                f,
                "{:<18} {:<5} {:>10} {:>10} {:>9} {:>7}  tuning",
                "shape", "dtype", "MB", "µs", "GB/s", "ratio"
            )?;
        }
        for r in self.rows.iter().filter(|r| r.tokens == 0) {
            let t = &r.tuning;
            writeln!(
                f,
                "{:<18} {:<5} {:>10.1} {:>10.1} {:>9.0} {:>6.1}%  wg {} rows {}{} {}",
                r.shape,
                r.dtype.name(),
                r.bytes as f64 / 1e6,
                r.micros,
                r.gbps,
                100.0 * r.ratio,
                t.wg,
                t.rows,
                match t.items {
                    0 => String::new(),
                    u => format!(" items {u}"),
                },
                if r.dtype == DType::Q4 {
                    format!("{:?}", t.q4)
                } else {
                    String::new()
                }
            )?;
        }
        if self.rows.iter().any(|r| r.tokens > 0) {
            writeln!(
                f,
                "prefill: GFLOP/s = 2·rows·cols·slots (×2 gated) / time; GB/s = weight bytes / time"
            )?;
            writeln!(
                f,
                "  attention: GFLOP/s = 4·head_dim·heads·visible keys / time; GB/s = K+V cache \
                 bytes / time; attn_prefill ROWSxDIMS, the default tile first"
            )?;
            writeln!(
                f,
                "{:<18} {:<5} {:<22} {:>10} {:>9} {:>7}",
                "shape", "dtype", "kernel", "µs", "GFLOP/s", "GB/s"
            )?;
        }
        for r in self.rows.iter().filter(|r| r.tokens > 0) {
            let kernel = r.kernel_label();
            writeln!(
                f,
                "{:<18} {:<5} {:<22} {:>10.1} {:>9.0} {:>7.0}",
                r.shape,
                r.dtype.name(),
                kernel,
                r.micros,
                r.gflops,
                r.gbps
            )?;
        }
        for e in &self.errors {
            writeln!(f, "skipped: {e}")?;
        }
        Ok(())
    }
}

/// Timed repetitions: at least `iters` calls, and the weights rotated over at least this many
/// bytes.
const ROTATE_BYTES: u64 = 512 << 20;

/// Deterministic filler bytes that decode to finite weights: random codes, and for quantized
/// types a fixed small scale in every group's parameters.
fn fill_weights(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let stride = dtype.row_stride(cols);
    let mut out = vec![0u8; rows * stride];
    let mut s = seed | 1;
    for chunk in out.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let b = s.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    let code = dtype.code_bytes(cols);
    for row in out.chunks_mut(stride) {
        match dtype {
            // bf16: keep the exponent small (|v| < 4) so values stay finite.
            DType::Bf16 => row[..code]
                .chunks_mut(2)
                .for_each(|v| v[1] = (v[1] & 0x80) | 0x3f),
            _ => row[code..]
                .chunks_mut(2)
                .for_each(|v| v.copy_from_slice(&0x2c00u16.to_le_bytes())),
        }
    }
    out
}

/// Runs the copy kernel and every (shape, dtype, tuning); `iters` calls per timing.
pub fn bench_kernels(
    ctx: &GpuContext,
    shapes: &[BenchShape],
    dtypes: &[DType],
    tunings: &[MatVecTuning],
    iters: usize,
) -> Result<BenchReport, GpuError> {
    let timer = Timer::new(ctx);
    let copy_gbps = bench_copy(ctx, &timer, iters)?;
    let mut rows = vec![];
    let mut errors = vec![];
    for shape in shapes {
        if let Some(a) = shape.attention {
            let (r, e) = attention::bench_attention(ctx, &timer, shape, a, iters, copy_gbps);
            rows.extend(r);
            errors.extend(e);
            continue;
        }
        if shape.tokens > 0 {
            let first = tunings.first().copied().unwrap_or_default();
            for &dtype in dtypes {
                let host = host_weights(shape, dtype);
                let mut kernels = vec![Kernel::MatVec(first), Kernel::MatMul(None)];
                if ctx.has_matrix_units() {
                    // Both GEMMs, to compare in one run.
                    kernels.push(Kernel::MatMulAlu);
                }
                for kernel in kernels {
                    run_prefill(ctx, &timer, shape, dtype, kernel, &host, iters, copy_gbps)
                        .map(|r| rows.push(r))
                        .unwrap_or_else(|e| errors.push(e));
                }
            }
            if shape.experts > 0 {
                run_prefill(
                    ctx,
                    &timer,
                    shape,
                    DType::Q4,
                    Kernel::Sort,
                    &[],
                    iters,
                    copy_gbps,
                )
                .map(|r| rows.push(r))
                .unwrap_or_else(|e| errors.push(e));
            }
            continue;
        }
        for &dtype in dtypes {
            let stacked = if shape.experts > 0 { shape.stack } else { 1 };
            let host = fill_weights(
                dtype,
                shape.rows * stacked,
                shape.cols,
                0x5eed + shape.rows as u64,
            );
            for &tuning in tunings {
                if dtype != DType::Q4 && tuning.q4 != MatVecTuning::default().q4 {
                    continue; // the q4 decoder choice changes nothing for other types
                }
                let (bytes, secs) =
                    match bench_matvec(ctx, &timer, shape, dtype, tuning, &host, iters) {
                        Ok(r) => r,
                        Err(e) => {
                            errors.push(format!("{} {dtype}: {e}", shape.name));
                            continue;
                        }
                    };
                rows.push(BenchRow {
                    tuning,
                    ..BenchRow::measured(shape, dtype, "matvec", bytes, secs, copy_gbps)
                });
            }
        }
    }
    Ok(report(ctx, &timer, copy_gbps, rows, errors))
}

/// The adapter as a report names it: "name (backend, driver)".
pub fn device_label(ctx: &GpuContext) -> String {
    let a = &ctx.info().adapter;
    format!("{} ({:?}, {})", a.name, a.backend, a.driver_info)
}

fn report(
    ctx: &GpuContext,
    timer: &Timer,
    copy_gbps: f64,
    rows: Vec<BenchRow>,
    errors: Vec<String>,
) -> BenchReport {
    let device = device_label(ctx);
    let timer_name = if timer.query.is_some() {
        "GPU timestamps"
    } else {
        "wall clock"
    };
    BenchReport {
        device,
        timer: timer_name,
        copy_gbps,
        rows,
        errors,
    }
}

/// One prefill row, or the error text.
#[allow(clippy::too_many_arguments)]
fn run_prefill(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    dtype: DType,
    kernel: Kernel,
    host: &[u8],
    iters: usize,
    copy_gbps: f64,
) -> Result<BenchRow, String> {
    let (bytes, secs, gemm) = bench_prefill(ctx, timer, shape, dtype, kernel, host, iters)
        .map_err(|e| format!("{} {dtype} {kernel:?}: {e}", shape.name))?;
    let (name, tuning, flops) = match kernel {
        Kernel::MatVec(t) => ("matvec", t, shape.flops()),
        Kernel::MatMul(_) | Kernel::MatMulAlu => ("matmul", MatVecTuning::default(), shape.flops()),
        Kernel::Sort => ("expert_sort", MatVecTuning::default(), 0),
    };
    Ok(BenchRow {
        tuning,
        tokens: shape.tokens,
        gemm,
        gflops: flops as f64 / secs / 1e9,
        ..BenchRow::measured(shape, dtype, name, bytes, secs, copy_gbps)
    })
}

/// The GEMM on prefill `shapes` under each of `tunings` (a launch-shape sweep).
pub fn bench_gemm_tunings(
    ctx: &GpuContext,
    shapes: &[BenchShape],
    dtypes: &[DType],
    tunings: &[MatMulTuning],
    iters: usize,
) -> Result<BenchReport, GpuError> {
    let timer = Timer::new(ctx);
    let copy_gbps = bench_copy(ctx, &timer, iters)?;
    let (mut rows, mut errors) = (vec![], vec![]);
    for shape in shapes
        .iter()
        .filter(|s| s.tokens > 0 && s.attention.is_none())
    {
        for &dtype in dtypes {
            let host = host_weights(shape, dtype);
            for &t in tunings {
                let k = Kernel::MatMul(Some(t));
                run_prefill(ctx, &timer, shape, dtype, k, &host, iters, copy_gbps)
                    .map(|r| rows.push(r))
                    .unwrap_or_else(|e| errors.push(e));
            }
        }
    }
    Ok(report(ctx, &timer, copy_gbps, rows, errors))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CopyParams {
    n: u32,
    _pad: [u32; 3],
}

/// GB/s (read + written) of the copy kernel over a buffer far larger than any cache.
/// GB/s (read + write) of the plain copy kernel on this device: the reference for ratios.
pub fn copy_gbps(ctx: &GpuContext, iters: usize) -> Result<f64, GpuError> {
    bench_copy(ctx, &Timer::new(ctx), iters)
}

fn bench_copy(ctx: &GpuContext, timer: &Timer, iters: usize) -> Result<f64, GpuError> {
    let max = ctx.limits().max_storage_buffer_binding_size;
    let bytes = (ROTATE_BYTES).min(max / 16 * 16);
    let src = ctx.storage_buffer("copy src", bytes);
    let dst = ctx.storage_buffer("copy dst", bytes);
    let n = (bytes / 16) as usize;
    let groups = n
        .div_ceil(256)
        .min(ctx.limits().max_compute_workgroups_per_dimension as usize);
    let p = CopyParams {
        n: n as u32,
        _pad: [0; 3],
    };
    let d = Dispatch::new(
        ctx,
        "copy",
        &[],
        &p,
        &[Binding::whole(&src), Binding::whole(&dst)],
        [groups, 1, 1],
    )?;
    let secs = timer.time(&|pass| (0..iters).for_each(|_| d.record(pass)))?;
    Ok(2.0 * bytes as f64 * iters as f64 / secs / 1e9)
}

/// The cost of a dispatch in a chain of dependent ones when it has no work: what every step of
/// a decode pays at least, whatever its kernel does (a Qwen3-MoE decode layer is 6 dependent
/// dispatches).
#[derive(Clone, Copy, Debug)]
pub struct DispatchFloor {
    /// µs per dispatch of one workgroup.
    pub one_us: f64,
    /// µs per dispatch of `wide_groups` workgroups (of 256 invocations) that find nothing to do.
    pub wide_us: f64,
    pub wide_groups: usize,
}

impl fmt::Display for DispatchFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dependent dispatch, nothing to do: {:.2} µs (1 workgroup), {:.2} µs ({} workgroups)",
            self.one_us, self.wide_us, self.wide_groups
        )
    }
}

/// `DispatchFloor` on this device: a chain of `iters` copies of 4 KiB, each reading what the
/// one before wrote (buffers a → b, then b → a, ...), so that every two are ordered by a
/// barrier; timed as one pass like every `bench_kernels` row.
pub fn dispatch_floor(ctx: &GpuContext, iters: usize) -> Result<DispatchFloor, GpuError> {
    let timer = Timer::new(ctx);
    const WIDE: usize = 1024;
    let n = 256; // vec4s: one per invocation of the first workgroup
    let a = ctx.storage_buffer("floor a", 16 * n as u64);
    let b = ctx.storage_buffer("floor b", 16 * n as u64);
    let p = CopyParams {
        n: n as u32,
        _pad: [0; 3],
    };
    let copy = |src: &wgpu::Buffer, dst: &wgpu::Buffer, groups: usize| {
        let bind = [Binding::whole(src), Binding::whole(dst)];
        Dispatch::new(ctx, "copy", &[], &p, &bind, [groups, 1, 1])
    };
    let mut us = [0.0; 2];
    for (u, groups) in us.iter_mut().zip([1, WIDE]) {
        let (ab, ba) = (copy(&a, &b, groups)?, copy(&b, &a, groups)?);
        let secs = timer.time(&|pass| {
            for i in 0..iters {
                [&ab, &ba][i % 2].record(pass);
            }
        })?;
        *u = secs / iters as f64 * 1e6;
    }
    Ok(DispatchFloor {
        one_us: us[0],
        wide_us: us[1],
        wide_groups: WIDE,
    })
}

/// (weight bytes per call, seconds per call).
fn bench_matvec(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    dtype: DType,
    tuning: MatVecTuning,
    host: &[u8],
    iters: usize,
) -> Result<(u64, f64), GpuError> {
    let (rows, cols) = (shape.rows, shape.cols);
    // The down projection reads one input per slot.
    let x_rows = if shape.down { shape.experts } else { 1 };
    let x = ctx.upload_f32("bench x", &vec![0.01f32; cols * x_rows]);
    let wts = ctx.upload_f32(
        "bench router weights",
        &vec![0.125f32; shape.experts.max(1)],
    );
    let stride = dtype.row_stride(cols) as u64;
    let grouped = shape.experts > 0;
    let gated = grouped && !shape.down;
    // Grouped gate_up: each expert holds gate then up, `rows / 2` rows each.
    let out_rows = if gated { rows / 2 } else { rows };
    let mat_bytes = out_rows as u64 * stride * if gated { 2 } else { 1 };
    let n_mats = if grouped { shape.stack } else { 1 };
    let buf_bytes = mat_bytes * n_mats as u64;
    let max_buf = ctx.limits().max_buffer_size;
    let copies = ROTATE_BYTES.div_ceil(buf_bytes).clamp(2, 16) as usize;
    if buf_bytes > max_buf {
        return Err(GpuError::Shape(format!(
            "{}: {buf_bytes} bytes exceed a buffer",
            shape.name
        )));
    }
    let y = ctx.storage_buffer("bench y", 4 * (out_rows * shape.experts.max(1)) as u64);
    let residual = ctx.storage_buffer("bench residual", 4 * out_rows as u64);
    // DecodeFusion: the norm's weights, the normed input written out, the router's choice.
    let norm_w = ctx.upload_f32("bench norm weight", &vec![1.0f32; cols]);
    let normed = ctx.storage_buffer("bench normed x", 4 * cols as u64);
    let route_ids = ctx.storage_buffer("bench route ids", 4 * rows.max(4) as u64);
    let route_w = ctx.storage_buffer("bench route weights", 4 * rows.max(4) as u64);
    let mut kernels = vec![];
    let mut keep = vec![];
    for c in 0..copies {
        let wbuf = ctx.upload("bench weights", host);
        // Grouped: each copy picks a different run of experts, so rotation covers the stack.
        let ids: Vec<u32> = (0..shape.experts)
            .map(|e| ((c * shape.experts + e) % n_mats) as u32)
            .collect();
        let idbuf = ctx.upload(
            "bench ids",
            bytemuck::cast_slice(&ids.iter().copied().chain([0]).collect::<Vec<_>>()),
        );
        let desc = MatVecDesc {
            up_offset: gated.then_some(out_rows as u64 * stride),
            grouped: grouped.then_some(Grouped {
                ids: &idbuf,
                ids_offset: 0,
                n_slots: shape.experts,
                n_mats,
                mat_stride: mat_bytes,
                x_per_slot: shape.down,
                slots_per_x: 1,
            }),
            ..MatVecDesc::plain(
                WeightRef::whole(&wbuf, dtype, out_rows, cols),
                BufRef::new(&x),
                BufRef::new(&y),
                1,
            )
        };
        let sum = SumTail {
            acc: BufRef::new(&residual),
            weights: BufRef::new(&wts),
            k: shape.experts,
        };
        let mut fuse = Fuse {
            sum_into: (shape.down && ctx.fused_tails()).then_some(sum),
            ..Fuse::default()
        };
        if shape.fused != DecodeFusion::None {
            fuse.norm = Some((BufRef::new(&norm_w), 1e-6));
        }
        if let DecodeFusion::Route { k } = shape.fused {
            fuse.norm_out = Some(BufRef::new(&normed));
            if ctx.fused_tails() {
                fuse.route = Some(RouteTail {
                    ids: BufRef::new(&route_ids),
                    weights: BufRef::new(&route_w),
                    k,
                    normalize: true,
                });
            }
        }
        kernels.push(MatVec::fused_tuned(ctx, &desc, &fuse, tuning)?);
        keep.push((wbuf, idbuf));
    }
    let secs = timer.time(&|pass| (0..iters).for_each(|i| kernels[i % copies].record(pass)))?;
    let per_call = if grouped {
        mat_bytes * shape.experts as u64
    } else {
        mat_bytes
    };
    Ok((per_call, secs / iters as f64))
}
