//! Kernel benchmarks: GB/s of each matvec dtype at real model shapes, beside the GB/s of a plain
//! copy kernel measured in the same run on the same device (DESIGN.md "Performance method").
//! Weights are rotated over enough copies (≥ 512 MiB in all) that they do not sit in cache.
//! Times come from GPU timestamps around one compute pass of many dispatches when the device
//! has TIMESTAMP_QUERY, else from the wall clock around the submission.

mod timer;

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::matvec::{Grouped, MatVec, MatVecDesc, MatVecTuning, WeightRef};
use super::ops::Dispatch;
use smoe_vault::quant::DType;
use std::fmt;
use timer::Timer;

/// One matrix shape to measure; `experts > 0` measures a grouped, gated (gate_up) dispatch of
/// that many experts picked from a stack of `stack` experts, `rows` being gate + up rows.
#[derive(Clone, Debug)]
pub struct BenchShape {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    pub stack: usize,
}

impl BenchShape {
    pub fn dense(name: &str, rows: usize, cols: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts: 0,
            stack: 0,
        }
    }
    pub fn experts(name: &str, rows: usize, cols: usize, experts: usize, stack: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts,
            stack,
        }
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
        BenchShape::experts("30B gate_up x8", 1536, 2048, 8, 32),
        BenchShape::dense("235B lm_head", 151_936, 4096),
        BenchShape::dense("235B q_proj", 8192, 4096),
        BenchShape::experts("235B gate_up x8", 3072, 4096, 8, 32),
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
        writeln!(
            f,
            "{:<18} {:<5} {:>10} {:>10} {:>9} {:>7}  tuning",
            "shape", "dtype", "MB", "µs", "GB/s", "ratio"
        )?;
        for r in &self.rows {
            let t = &r.tuning;
            writeln!(
                f,
                "{:<18} {:<5} {:>10.1} {:>10.1} {:>9.0} {:>6.1}%  wg {} rows {} {}",
                r.shape,
                r.dtype.name(),
                r.bytes as f64 / 1e6,
                r.micros,
                r.gbps,
                100.0 * r.ratio,
                t.wg,
                t.rows,
                if r.dtype == DType::Q4 {
                    format!("{:?}", t.q4)
                } else {
                    String::new()
                }
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
                let gbps = bytes as f64 / secs / 1e9;
                rows.push(BenchRow {
                    shape: shape.name.clone(),
                    dtype,
                    tuning,
                    bytes,
                    micros: secs * 1e6,
                    gbps,
                    ratio: gbps / copy_gbps,
                });
            }
        }
    }
    let a = &ctx.info().adapter;
    let device = format!("{} ({:?}, {})", a.name, a.backend, a.driver_info);
    let timer_name = if timer.query.is_some() {
        "GPU timestamps"
    } else {
        "wall clock"
    };
    Ok(BenchReport {
        device,
        timer: timer_name,
        copy_gbps,
        rows,
        errors,
    })
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
    let x = ctx.upload_f32("bench x", &vec![0.01f32; cols]);
    let stride = dtype.row_stride(cols) as u64;
    let grouped = shape.experts > 0;
    // Grouped: each expert holds gate then up, `rows / 2` rows each.
    let out_rows = if grouped { rows / 2 } else { rows };
    let mat_bytes = out_rows as u64 * stride * if grouped { 2 } else { 1 };
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
            w: WeightRef {
                buffer: &wbuf,
                offset: 0,
                dtype,
                rows: out_rows,
                cols,
            },
            up_offset: grouped.then_some(out_rows as u64 * stride),
            x: BufRef::new(&x),
            y: BufRef::new(&y),
            n_tokens: 1,
            grouped: grouped.then_some(Grouped {
                ids: &idbuf,
                ids_offset: 0,
                n_slots: shape.experts,
                n_mats,
                mat_stride: mat_bytes,
                x_per_slot: false,
                slots_per_x: 1,
            }),
        };
        kernels.push(MatVec::with_tuning(ctx, &desc, tuning)?);
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
