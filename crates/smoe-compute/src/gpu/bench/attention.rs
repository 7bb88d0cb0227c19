//! Prefill attention measurements for `gpu::bench`: one chunk's causal attention over the KV
//! cache by `DecodeAttention` (the path prefill took before) and by `PrefillAttention` in each
//! tile shape the device has the workgroup memory for (without key splits), the default tile
//! first, the default tile at 2, 4 and 8 splits, the other row counts at the default splits, and
//! 32-row tiles with 64- and 128-dim score steps at the default splits. FLOP/s count the causal
//! work only: 4·head_dim per (query head, visible key), for q·k and p·v.

use super::timer::Timer;
use super::{AttnBench, BenchRow, BenchShape};
use crate::gpu::attention::{AttnDesc, DecodeAttention, FusedRope};
use crate::gpu::attn_prefill::{PrefillAttention, PrefillAttnTuning};
use crate::gpu::buffers::BufRef;
use crate::gpu::context::{GpuContext, GpuError};
use smoe_vault::quant::DType;

/// Cache bytes a decode attention row rotates over: twice an H200's L2.
const DECODE_ROTATE_BYTES: u64 = 100 << 20;

/// Deterministic values in [-1, 1): timing does not depend on them, but NaN or denormals might.
pub(super) fn filler(n: usize, seed: u64) -> Vec<f32> {
    filler_iter(seed).take(n).collect()
}

/// `filler`'s values one at a time (for callers that keep only a conversion of them).
pub(super) fn filler_iter(seed: u64) -> impl Iterator<Item = f32> {
    let mut s = seed | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    })
}

/// The rows of one attention shape, and the errors of the kernels that could not run.
pub(super) fn bench_attention(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    a: AttnBench,
    iters: usize,
    copy_gbps: f64,
) -> (Vec<BenchRow>, Vec<String>) {
    let (nt, hd) = (shape.tokens, a.head_dim);
    if a.rope {
        return bench_decode(ctx, timer, shape, a, iters, copy_gbps);
    }
    let cap = a.capacity;
    let kvw = a.n_kv_heads * hd;
    let q = ctx.upload_f32("bench q", &filler(nt * a.n_heads * hd, 1));
    let kc = ctx.upload_f32("bench k cache", &filler(cap * kvw, 2));
    let vc = ctx.upload_f32("bench v cache", &filler(cap * kvw, 3));
    let out = ctx.storage_buffer("bench attention out", 4 * (nt * a.n_heads * hd) as u64);
    let step = ctx.step_buffer();
    ctx.write_step(&step, a.pos0 as u32);
    let desc = AttnDesc {
        q: BufRef::new(&q),
        k_cache: BufRef::new(&kc),
        v_cache: BufRef::new(&vc),
        out: BufRef::new(&out),
        step: &step,
        n_heads: a.n_heads,
        n_kv_heads: a.n_kv_heads,
        head_dim: hd,
        n_tokens: nt,
        capacity: cap,
        scale: 1.0 / (hd as f32).sqrt(),
        window: a.window,
    };
    // The cache bytes of the visible context (each kernel reads them at least once).
    let bytes = 8 * (cap * kvw) as u64;
    let row = |kernel, attn, secs: f64| BenchRow {
        tokens: nt,
        attn,
        gflops: shape.flops() as f64 / secs / 1e9,
        ..BenchRow::measured(shape, DType::F32, kernel, bytes, secs, copy_gbps)
    };
    let (mut rows, mut errors) = (vec![], vec![]);
    let time = |rec: &dyn Fn(&mut wgpu::ComputePass<'_>)| {
        timer.time(&|pass| (0..iters).for_each(|_| rec(pass)))
    };
    let what = |k: &str, e: GpuError| format!("{} {k}: {e}", shape.name);
    match DecodeAttention::new(ctx, &desc).and_then(|d| time(&|p| d.record(p))) {
        Ok(secs) => rows.push(row("attn_decode", None, secs / iters as f64)),
        Err(e) => errors.push(what("attn_decode", e)),
    }
    // The default first; then every tile without splits, the default tile at other splits,
    // and other tiles at the default's. Each once.
    let pick = PrefillAttnTuning::pick(ctx, hd);
    let mut tunings = vec![pick];
    let mut add = |t: PrefillAttnTuning| {
        if !tunings.contains(&t) {
            tunings.push(t);
        }
    };
    for rows in [32, 64, 128] {
        for dims in [16, 32, 64, 128] {
            add(PrefillAttnTuning {
                rows,
                dims,
                splits: 1,
            });
        }
    }
    for splits in [2, 4, 8] {
        add(PrefillAttnTuning { splits, ..pick });
    }
    for rows in [32, 128] {
        add(PrefillAttnTuning { rows, ..pick });
    }
    for dims in [64, 128] {
        add(PrefillAttnTuning {
            rows: 32,
            dims,
            ..pick
        });
    }
    for t in tunings {
        match PrefillAttention::with_tuning(ctx, &desc, t) {
            Ok(k) => match time(&|p| k.record(p)) {
                Ok(secs) => rows.push(row("attn_prefill", Some(t), secs / iters as f64)),
                Err(e) => errors.push(what("attn_prefill", e)),
            },
            // A tile larger than this device's workgroup memory is not an error of the bench.
            Err(GpuError::Shape(m)) if m.contains("workgroup memory") => {}
            Err(e) => errors.push(what("attn_prefill", e)),
        }
    }
    (rows, errors)
}

/// One decoded token with RoPE fused in, as the engine decodes: over as many copies of the
/// caches as keep them out of the GPU's L2 between calls (a layer's cache was last read a whole
/// token earlier), q, k and v as fresh as the qkv projection leaves them. The copies are
/// consecutive windows of one buffer, each starting where the previous one's visible positions
/// end (the positions past them are never read, and the one written is the last visible).
fn bench_decode(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    a: AttnBench,
    iters: usize,
    copy_gbps: f64,
) -> (Vec<BenchRow>, Vec<String>) {
    let hd = a.head_dim;
    let (cap, kvw) = (a.capacity, a.n_kv_heads * hd);
    let visible = a.pos0 + 1;
    let q = ctx.upload_f32("bench q", &filler(a.n_heads * hd, 1));
    let (k, v) = (
        ctx.upload_f32("bench raw k", &filler(kvw, 4)),
        ctx.upload_f32("bench raw v", &filler(kvw, 5)),
    );
    let norm = ctx.upload_f32("bench qk norm", &vec![1.0f32; hd]);
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1e6f32.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    let inv = ctx.upload_f32("bench inv_freq", &inv);
    let out = ctx.storage_buffer("bench attention out", 4 * (a.n_heads * hd) as u64);
    let step = ctx.step_buffer();
    ctx.write_step(&step, a.pos0 as u32);
    let rope = FusedRope {
        k: BufRef::new(&k),
        v: BufRef::new(&v),
        norms: Some((BufRef::new(&norm), BufRef::new(&norm))),
        inv_freq: BufRef::new(&inv),
        rot_dim: hd,
        rope_scale: 1.0,
        eps: 1e-6,
    };
    // The visible cache bytes, read once per call.
    let bytes = 8 * (visible * kvw) as u64;
    let copies = (DECODE_ROTATE_BYTES / bytes).clamp(2, 256) as usize;
    let stride = (bytes / 2).next_multiple_of(256);
    let len = (copies as u64 * stride / 4) as usize + cap * kvw;
    let kc = ctx.upload_f32("bench k caches", &filler(len, 2));
    let vc = ctx.upload_f32("bench v caches", &filler(len, 3));
    let what = |e: GpuError| vec![format!("{} attn_decode rope: {e}", shape.name)];
    // One partials buffer for all copies: their dispatches run one after another, as a
    // sequence's layers share theirs.
    let mut scratch = None;
    let mut kernels = vec![];
    for c in 0..copies as u64 {
        let desc = AttnDesc {
            q: BufRef::new(&q),
            k_cache: BufRef::at(&kc, c * stride),
            v_cache: BufRef::at(&vc, c * stride),
            out: BufRef::new(&out),
            step: &step,
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            head_dim: hd,
            n_tokens: 1,
            capacity: cap,
            scale: 1.0 / (hd as f32).sqrt(),
            window: a.window,
        };
        let scratch = scratch.get_or_insert_with(|| {
            ctx.storage_buffer(
                "bench attention partials",
                DecodeAttention::scratch_bytes(&desc).max(16),
            )
        });
        match DecodeAttention::with_rope(ctx, &desc, scratch, Some(&rope)) {
            Ok(d) => kernels.push(d),
            Err(e) => return (vec![], what(e)),
        }
    }
    let n = iters.max(copies);
    match timer.time(&|p| (0..n).for_each(|i| kernels[i % copies].record(p))) {
        Ok(secs) => {
            let secs = secs / n as f64;
            let row = BenchRow {
                tokens: 1,
                gflops: shape.flops() as f64 / secs / 1e9,
                ..BenchRow::measured(
                    shape,
                    DType::F32,
                    "attn_decode rope",
                    bytes,
                    secs,
                    copy_gbps,
                )
            };
            (vec![row], vec![])
        }
        Err(e) => (vec![], what(e)),
    }
}
