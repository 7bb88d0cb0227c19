//! `smoe bench`: decode/prefill speed against the I/O and bandwidth bounds, and GPU kernel GB/s.

use crate::common::{model_path, open_engine_with, Backend};
use crate::store_args::StoreArgs;
use anyhow::{bail, Result};
use smoe_engine::model::gpu_decoder::GpuProfile;
use smoe_engine::store::StoreStats;
use smoe_engine::{Engine, Logits};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum Bench {
    /// Prefill and decode tok/s, expert-cache hit rate, read GB/s, and the I/O and bandwidth
    /// bounds, all measured in this run; a streamed decode's share of the I/O bound split into
    /// busy × precise × speed.
    Decode(DecodeArgs),
    /// GB/s of each GPU matvec kernel at Qwen3-MoE shapes beside a copy kernel's GB/s, TFLOP/s
    /// of the prefill kernels (token-batched GEMM, prefill attention) at 512 tokens, and what a
    /// dependent dispatch with nothing to do costs (the floor of every decode step).
    Kernels(KernelArgs),
    /// The server under load: total tok/s and p50/p99 latency at several numbers of clients.
    Serve(crate::cmd::bench_serve::Args),
    /// Direct-read GB/s of the vault's disk for each read size and number of reader threads
    /// (what --read-piece and --read-threads should be).
    Disk(crate::cmd::bench_disk::Args),
}

#[derive(clap::Args)]
pub struct DecodeArgs {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Tokens to decode from an empty context, like llama-bench's tg.
    #[arg(short = 'n', long = "tg", default_value_t = 128)]
    tg: usize,
    /// Prompt tokens to prefill, like llama-bench's pp (0 = skip).
    #[arg(long = "pp", default_value_t = 512)]
    pp: usize,
    /// Timed repetitions of each (after one warm-up); median and spread are reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Print one JSON object (tok/s medians and spreads, bounds, cache stats, breakdown).
    #[arg(long)]
    json: bool,
    /// GPU only: after the timed runs, time every step of one more decode (and prefill) run with
    /// GPU timestamps and print where the time goes (µs per token and share).
    #[arg(long)]
    breakdown: bool,
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(clap::Args)]
pub struct KernelArgs {
    /// Small shapes (for software drivers such as lavapipe).
    #[arg(long)]
    quick: bool,
    /// Calls per timing.
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Print one JSON object: device, copy GB/s and a row per (shape, type).
    #[arg(long)]
    json: bool,
    /// q4 only, every launch shape (64/128/256 invocations × 1–32 rows) and decoding (f16
    /// pairs, float bits, int8 dot products): for choosing the defaults on a new device.
    #[arg(long)]
    sweep: bool,
    /// Only the shapes whose name contains this (e.g. "down", "235B", "router", "attn dec" for
    /// the decode attention with its RoPE, "pf512" for prefill). The dispatch floor, which every
    /// run without it measures first, then runs only if its name matches ("dispatch floor").
    #[arg(long, value_name = "TEXT")]
    shape: Option<String>,
}

pub fn run(b: Bench) -> Result<()> {
    match b {
        Bench::Decode(a) => decode(a),
        Bench::Kernels(a) => kernels(a),
        Bench::Serve(a) => crate::cmd::bench_serve::run(a),
        Bench::Disk(a) => crate::cmd::bench_disk::run(a),
    }
}

fn kernels(a: KernelArgs) -> Result<()> {
    use smoe_compute::gpu::bench::{
        bench_kernels, device_label, dispatch_floor, qwen3_shapes, BenchShape,
    };
    use smoe_compute::gpu::{MatVecTuning, Q4Decode};
    use smoe_vault::DType;
    // The process's device, with the settings `tuning::configure_process` gave it.
    let ctx = smoe_engine::gpu::context()
        .map_err(|e| anyhow::anyhow!("bench kernels needs a GPU: {e}"))?;
    if !a.json {
        println!("{}\n", ctx.info());
    }
    let shapes = if a.quick {
        vec![
            BenchShape::dense("small", 512, 1024),
            BenchShape::experts("experts x8", 256, 1024, 8, 16),
            BenchShape::experts_down("experts down x8", 1024, 128, 8, 16),
        ]
    } else {
        qwen3_shapes()
    };
    let wanted = |name: &str| a.shape.as_ref().is_none_or(|f| name.contains(f.as_str()));
    let shapes: Vec<_> = shapes.into_iter().filter(|s| wanted(&s.name)).collect();
    let want_floor = wanted("dispatch floor");
    if shapes.is_empty() && !want_floor {
        bail!(
            "no benchmark shape matches --shape {:?}",
            a.shape.unwrap_or_default()
        );
    }
    // Once, before the shapes: what every decode step pays at least.
    let floor = want_floor
        .then(|| dispatch_floor(&ctx, a.iters))
        .transpose()?;
    if let (Some(floor), false) = (&floor, a.json) {
        println!("{floor}\n");
    }
    let device = device_label(&ctx);
    // (copy_gb_per_s stays 0 where --shape left no shape to measure beside it.)
    let (mut rows, mut errors, mut copy) = (vec![], vec![], 0f64);
    // One shape at a time, so partial results show even if a later shape fails.
    for shape in &shapes {
        let (dtypes, tunings) = if a.sweep {
            let mut t = vec![];
            for q4 in [Q4Decode::PairsF16, Q4Decode::FloatBits, Q4Decode::Int8Dot] {
                for wg in [64, 128, 256] {
                    for rows in [1, 2, 4, 8, 16, 32] {
                        t.push(MatVecTuning {
                            wg,
                            rows,
                            q4,
                            items: 0,
                        });
                    }
                }
            }
            // Rows loaded together per subgroup (the default for q4 is 1).
            for rows in [4, 8, 16, 32] {
                for items in [2, 4, 8] {
                    t.push(MatVecTuning {
                        wg: 256,
                        rows,
                        q4: Q4Decode::PairsF16,
                        items,
                    });
                }
            }
            (vec![DType::Q4], t)
        } else {
            // The launch shape MatVec::new picks for this shape.
            let grouped = shape.experts > 0;
            let tune = match (grouped, shape.down) {
                (true, true) => MatVecTuning::for_shape(shape.rows, shape.experts, true),
                (true, false) => MatVecTuning::for_shape(shape.rows / 2, shape.experts, true),
                (false, _) => MatVecTuning::for_shape(shape.rows, 1, false),
            };
            let all = vec![DType::Bf16, DType::Q8, DType::Q4, DType::Q2];
            (all, vec![tune])
        };
        let report = bench_kernels(
            &ctx,
            std::slice::from_ref(shape),
            &dtypes,
            &tunings,
            a.iters,
        )?;
        if !a.json {
            println!("{report}");
        }
        copy = copy.max(report.copy_gbps);
        errors.extend(report.errors.iter().cloned());
        rows.extend(report.rows.iter().map(|r| {
            let prefill = (r.tokens > 0).then(|| serde_json::json!({"tokens": r.tokens,
                "kernel": r.kernel_label(), "gflop_per_s": r.gflops}));
            serde_json::json!({"shape": r.shape, "dtype": r.dtype.name(), "bytes": r.bytes, "micros": r.micros,
                               "gb_per_s": r.gbps, "ratio_to_copy": r.ratio, "prefill": prefill})
        }));
    }
    if a.json {
        println!(
            "{}",
            // (The floor is null where --shape left it out.)
            serde_json::json!({"device": device, "copy_gb_per_s": copy,
                "dependent_dispatch_us": floor.map(|floor| serde_json::json!({
                    "one_workgroup": floor.one_us,
                    "workgroups": floor.wide_groups, "many_workgroups": floor.wide_us})),
                "rows": rows, "errors": errors})
        );
    }
    Ok(())
}

/// The median, smallest and largest of `v` (not empty).
pub(crate) fn median_spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Direct-read bandwidth of the vault's disk: 1 GiB of expert blobs read on 8 threads, one read
/// per blob, picked afresh each time from all over the vault so that no cache below the file
/// system (a virtual disk's host) has seen them (`smoe bench disk` measures other read sizes and
/// thread counts).
fn disk_gbps(engine: &Engine) -> Option<f64> {
    let x = engine.vault.expert_section()?;
    let seed = crate::cmd::bench_disk::clock_seed();
    crate::cmd::bench_disk::read_gbps(engine.vault.path(), x, 8, usize::MAX, 1 << 30, seed)
}

/// Host memory copy bandwidth with all cores (read + write counted), for the bandwidth bound.
fn copy_gbps() -> f64 {
    use rayon::prelude::*;
    let n = 1 << 30;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.par_chunks_mut(1 << 20)
            .zip(src.par_chunks(1 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    2.0 * n as f64 / best / 1e9
}

/// Bytes one decoded token touches: every dense tensor but the embedding (one row of it), and
/// top-k expert blobs in each MoE layer.
fn bytes_per_token(engine: &Engine) -> u64 {
    let h = &engine.vault.header;
    let c = &h.config;
    let dense: u64 = h
        .tensors
        .iter()
        .filter(|t| t.name != "model.embed_tokens.weight")
        .map(|t| t.length)
        .sum();
    let lm = if c.tie_word_embeddings {
        h.tensors
            .iter()
            .find(|t| t.name == "model.embed_tokens.weight")
            .map_or(0, |t| t.length)
    } else {
        0
    };
    let expert = h.experts.as_ref().map_or(0, |x| x.used_bytes);
    dense + lm + (c.moe_layers().count() * c.num_experts_per_tok) as u64 * expert
}

/// The cache of the session whose start-up `bench decode` times: `smoe serve`'s default `--ctx`.
const SESSION_CTX: usize = 4096;

fn decode(a: DecodeArgs) -> Result<()> {
    if a.tg == 0 || a.reps == 0 {
        bail!("--tg and --reps must be at least 1");
    }
    let path = model_path(a.model.as_deref())?;
    let engine = open_engine_with(&path, a.backend, &a.store)?;
    let vocab = engine.model.config().vocab_size as u32;
    let experts = engine.model.experts();
    eprintln!("measuring disk and memory bandwidth…");
    let disk_before = disk_gbps(&engine);
    // The bound uses the memory the weights are read from: the GPU's for --backend gpu.
    let on_gpu = engine.model.backend() == "gpu";
    let copy = if on_gpu {
        let ctx =
            smoe_engine::gpu::context().map_err(|e| anyhow::anyhow!("GPU copy bandwidth: {e}"))?;
        smoe_compute::gpu::bench::copy_gbps(&ctx, 100)?
    } else {
        copy_gbps()
    };
    // Decode steps are fed a fixed pseudo-random token stream (each step still runs the LM head
    // and the argmax): a random-weight model's own output collapses onto one token, which routes
    // every step to the same experts and would flatter any cache.
    let stream = |i: usize| ((i as u64 * 2654435761 + 97) % vocab as u64) as u32;
    // A resident GPU model decodes greedy chains as `generate --temperature 0` does: each pass
    // takes the previous pass's argmax on the device (its own output: nothing to flatter when
    // every expert is resident) and is queued before the host reads that id.
    let chains = engine.model.chains_greedy();
    let decode_run = |n: usize, offset: usize| -> Result<f64> {
        let mut s = engine.session(n + 1);
        let t = Instant::now();
        if chains {
            let first = s.feed_greedy(&[stream(offset)])?;
            s.decode_greedy(first, n - 1, &mut |id| {
                Ok(std::hint::black_box(id) < u32::MAX)
            })?;
        } else {
            // Greedy, as `generate --temperature 0`: on the GPU the argmax runs there and only
            // the token id comes back.
            for i in 0..n {
                std::hint::black_box(s.feed_greedy(&[stream(offset + i)])?);
            }
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    };
    // Warm-up: touches the code paths (and, with a cache, starts filling it as real use would).
    decode_run(8, 1_000_000)?;
    // What a new sequence (a server request) pays before its first token: the first pass of a
    // new session with the server's default 4,096-position cache (on the GPU the first such
    // session creates the KV cache and binds the attention dispatches to it; later ones reuse a
    // dropped session's), against the next pass of a session.
    let mut session_ms = vec![];
    for _ in 0..2 {
        let mut s = engine.session(SESSION_CTX);
        let t = Instant::now();
        s.feed_greedy(&[stream(2_000_000)])?;
        session_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let next_ms = {
        let mut s = engine.session(SESSION_CTX);
        s.feed_greedy(&[stream(2_000_000)])?;
        let t = Instant::now();
        s.feed_greedy(&[stream(2_000_001)])?;
        t.elapsed().as_secs_f64() * 1e3
    };
    let (first_ms, again_ms) = (session_ms[0], session_ms[1]);
    let mut pp_tps = vec![];
    if a.pp > 0 {
        let prompt: Vec<u32> = (0..a.pp as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        for _ in 0..a.reps {
            let mut s = engine.session(a.pp);
            let t = Instant::now();
            s.feed(&prompt, Logits::Last)?;
            pp_tps.push(a.pp as f64 / t.elapsed().as_secs_f64());
        }
    }
    experts.reset_stats();
    engine.model.reset_vram_slot_stats();
    let mut tg_tps = vec![];
    for r in 0..a.reps {
        tg_tps.push(decode_run(a.tg, r * a.tg)?);
    }
    let decode_s: f64 = tg_tps.iter().map(|tps| a.tg as f64 / tps).sum();
    let stats = a.store.finish(&engine);
    // Measured again after the runs (the disk's speed drifts): the bound takes the faster.
    let disk_after = stats.as_ref().and_then(|_| disk_gbps(&engine));
    let disk = match (disk_before, disk_after) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (d, _) => d,
    };
    let breakdown = if a.breakdown {
        let mut runs = vec![("decode", a.tg)];
        if a.pp > 0 {
            runs.push(("prefill", a.pp));
        }
        let mut out = vec![];
        for (what, n) in runs {
            // First only the pass's ends (the GPU's busy time), then every step (its shares;
            // a timestamp between every two dispatches costs a few µs each).
            let mut profiles = vec![];
            for fine in [false, true] {
                engine.model.profile_start(fine)?;
                if what == "decode" {
                    decode_run(n, 2_000_000)?;
                } else {
                    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
                    engine.session(n).feed(&prompt, Logits::Last)?;
                }
                profiles.push(engine.model.profile_take().expect("profiling was started"));
            }
            let fine = profiles.pop().expect("two runs");
            out.push((what, n, profiles.pop().expect("two runs"), fine));
        }
        Some(out)
    } else {
        None
    };
    let (tg, tg_lo, tg_hi) = median_spread(tg_tps);
    let touched = bytes_per_token(&engine);
    let bw_bound = copy / 2.0 * 1e9 / touched as f64; // reads only: half the copy traffic
    let tokens = (a.tg * a.reps) as f64;
    // The bound counts the reads the routing needed (misses), not lookahead reads that turned
    // out unused: those are the engine's overhead, charged to it.
    let read_bytes_per_token = stats
        .as_ref()
        .map_or(0.0, |s| s.total.bytes_read as f64 / tokens);
    let stride = engine.vault.expert_section().map_or(0, |x| x.blob_stride);
    let miss_bytes_per_token = stats
        .as_ref()
        .map_or(0.0, |s| (s.total.misses * stride) as f64 / tokens);
    let io_bound = match (disk, miss_bytes_per_token > 0.0) {
        (Some(d), true) => Some(d * 1e9 / miss_bytes_per_token),
        _ => None,
    };
    let factors = match (&stats, disk) {
        (Some(s), Some(d)) if io_bound.is_some() => IoFactors::of(s, d, decode_s, stride),
        _ => None,
    };
    let pp = (!pp_tps.is_empty()).then(|| median_spread(pp_tps));
    let slots = engine.model.vram_slot_stats();
    let report = serde_json::json!({
        "model": path.display().to_string(),
        "tg": a.tg, "pp": a.pp, "reps": a.reps,
        "decode_tok_per_s": {"median": tg, "min": tg_lo, "max": tg_hi},
        "prefill_tok_per_s": pp.map(|(m, lo, hi)| serde_json::json!({"median": m, "min": lo, "max": hi})),
        "session_first_pass_ms": first_ms,
        "session_first_pass_again_ms": again_ms,
        "session_next_pass_ms": next_ms,
        "bytes_touched_per_token": touched,
        "memory_copy_gb_per_s": copy,
        "backend": engine.model.backend(),
        "bandwidth_bound_tok_per_s": bw_bound,
        "decode_over_bandwidth_bound": tg / bw_bound,
        "disk_direct_read_gb_per_s": disk,
        "disk_direct_read_gb_per_s_before": disk_before,
        "disk_direct_read_gb_per_s_after": disk_after,
        "miss_bytes_per_token": miss_bytes_per_token,
        "read_bytes_per_token": read_bytes_per_token,
        "lookahead_reads": stats.as_ref().map(|s| s.total.prefetched + s.total.prefetch_wasted),
        "lookahead_unused": stats.as_ref().map(|s| s.total.prefetch_wasted),
        "lookahead_dropped": stats.as_ref().map(|s| s.total.prefetch_cancelled),
        "lookahead_recall": stats.as_ref().and_then(|s| s.lookahead_recall),
        "speculative_recall": slots.and_then(|v| v.spec_recall),
        "io_bound_tok_per_s": io_bound,
        "decode_over_io_bound": io_bound.map(|b| tg / b),
        "io_bound_factors": factors.map(|f| serde_json::json!({"busy": f.busy, "precise": f.precise, "speed": f.speed})),
        "hit_rate": stats.as_ref().map(|s| s.hit_rate),
        "read_gb_per_s": stats.as_ref().map(|s| s.read_gb_per_s),
        "read_depth": stats.as_ref().map(|s| s.read_depth),
        "cache_budget_bytes": stats.as_ref().map(|s| s.cache_budget),
        "io_wait_s": stats.as_ref().map(|s| s.total.io_wait_seconds),
        "read_buffers_allocated_inline": stats.as_ref().map(|s| s.buffer_allocs),
        "read_buffer_alloc_s": stats.as_ref().map(|s| s.buffer_alloc_seconds),
        "vram_slots": slots,
        "breakdown": breakdown.as_ref().map(|b| b.iter().map(|(what, n, busy, p)| breakdown_json(what, *n, busy, p)).collect::<Vec<_>>()),
    });
    if let Some(b) = &breakdown {
        if !a.json {
            for (what, n, busy, p) in b {
                print_breakdown(what, *n, busy, p);
            }
        }
    }
    if a.json {
        println!("{report}");
        return Ok(());
    }
    if let Some((m, lo, hi)) = pp {
        println!(
            "prefill  pp{:<5} {m:>10.1} tok/s  (min {lo:.1}, max {hi:.1})",
            a.pp
        );
    }
    println!(
        "decode   tg{:<5} {tg:>10.1} tok/s  (min {tg_lo:.1}, max {tg_hi:.1})",
        a.tg
    );
    println!("new session      first pass {first_ms:.1} ms, in the next new session {again_ms:.1} ms; a later pass {next_ms:.1} ms ({SESSION_CTX}-position cache)");
    println!("bandwidth bound  {bw_bound:>10.1} tok/s  ({:.1} MiB touched per token, memory copy {copy:.1} GB/s) → {:.1}%", touched as f64 / (1 << 20) as f64, 100.0 * tg / bw_bound);
    match (&stats, io_bound) {
        (Some(s), Some(b)) => println!(
            "I/O bound        {b:>10.1} tok/s  ({:.1} MiB missed per token ({:.1} read, lookahead included), disk {:.2} GB/s direct) → {:.1}%; hit rate {:.1}%, read {:.2} GB/s",
            miss_bytes_per_token / (1 << 20) as f64,
            read_bytes_per_token / (1 << 20) as f64,
            disk.unwrap_or(0.0),
            100.0 * tg / b,
            100.0 * s.hit_rate,
            s.read_gb_per_s
        ),
        (Some(s), None) => println!("experts all cached: hit rate {:.1}%", 100.0 * s.hit_rate),
        (None, _) => println!("experts resident (memory-mapped); disk {:.2} GB/s direct", disk.unwrap_or(0.0)),
    }
    if let Some(f) = factors {
        println!(
            "  = busy {:.0}% (time with a read in flight) × precise {:.0}% (bytes needed ÷ read) × speed {:.0}% (read rate while busy ÷ the disk bench's; {:.1} reads in flight on average), over all repetitions",
            100.0 * f.busy,
            100.0 * f.precise,
            100.0 * f.speed,
            stats.as_ref().map_or(0.0, |s| s.read_depth)
        );
    }
    Ok(())
}

/// The share of the I/O bound a streamed decode reached, as the product of three factors
/// (docs/performance.md, "What the ratio to the I/O bound is made of"): the share of the decode
/// time during which a read was in flight, the share of the bytes read that the routing needed,
/// and the read rate while busy over the disk bench's. Their product is tokens ÷ decode time ÷
/// the bound, over all repetitions.
#[derive(Clone, Copy)]
struct IoFactors {
    busy: f64,
    precise: f64,
    speed: f64,
}

impl IoFactors {
    /// From the store's counts since the reset before the decode runs, the disk bench's GB/s,
    /// the runs' decode seconds and the bytes per expert blob. `None` where nothing was read.
    fn of(s: &StoreStats, disk_gbps: f64, decode_s: f64, stride: u64) -> Option<Self> {
        let read = s.total.bytes_read as f64;
        if read <= 0.0 || s.read_gb_per_s <= 0.0 || decode_s <= 0.0 || disk_gbps <= 0.0 {
            return None;
        }
        let busy_s = read / (s.read_gb_per_s * 1e9);
        Some(IoFactors {
            busy: busy_s / decode_s,
            precise: (s.total.misses * stride) as f64 / read,
            speed: s.read_gb_per_s / disk_gbps,
        })
    }
}

fn breakdown_json(
    what: &str,
    tokens: usize,
    busy: &GpuProfile,
    p: &GpuProfile,
) -> serde_json::Value {
    let per = |ns: f64| ns / 1e3 / tokens as f64;
    let gpu: f64 = p.steps.iter().map(|s| s.1).sum();
    let busy_ns: f64 = busy.steps.iter().map(|s| s.1).sum();
    serde_json::json!({
        "run": what, "tokens": tokens,
        "plain_wall_us_per_token": per(busy.wall_ns),
        "plain_gpu_busy_us_per_token": per(busy_ns),
        "wall_us_per_token": per(p.wall_ns),
        "gpu_us_per_token": per(gpu),
        "host_record_us_per_token": per(p.record_ns),
        "untimed_steps": p.dropped,
        "steps": p.steps.iter().map(|(l, ns, c)| serde_json::json!({
            "step": l, "us_per_token": per(*ns), "share_of_gpu": ns / gpu.max(1.0),
            "dispatch_groups_per_token": *c as f64 / tokens as f64,
        })).collect::<Vec<_>>(),
    })
}

/// Where a run's time went, per token: the GPU's busy time against the wall time (timestamps
/// only around passes), then GPU time per step (a timestamp after every step, which slows each
/// step a little), and host recording.
fn print_breakdown(what: &str, tokens: usize, busy: &GpuProfile, p: &GpuProfile) {
    let per = |ns: f64| ns / 1e3 / tokens as f64;
    let gpu: f64 = p.steps.iter().map(|s| s.1).sum();
    let busy_ns: f64 = busy.steps.iter().map(|s| s.1).sum();
    println!(
        "\n{what} ({tokens} tokens): wall {:.1} µs/token, GPU busy {:.1} µs/token ({:.0}%), host recording + submission {:.1} µs/token; the rest is waiting and read-back",
        per(busy.wall_ns),
        per(busy_ns),
        100.0 * busy_ns / busy.wall_ns.max(1.0),
        per(busy.record_ns)
    );
    println!(
        "{what} per step, timed ({tokens} tokens): wall {:.1} µs/token, GPU {:.1} µs/token ({:.0}% of wall), host recording + submission {:.1} µs/token",
        per(p.wall_ns),
        per(gpu),
        100.0 * gpu / p.wall_ns.max(1.0),
        per(p.record_ns)
    );
    let mut steps = p.steps.clone();
    steps.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!(
        "  {:<24} {:>12} {:>8} {:>14}",
        "step", "µs/token", "share", "calls/token"
    );
    for (label, ns, calls) in steps {
        println!(
            "  {label:<24} {:>12.1} {:>7.1}% {:>14.1}",
            per(ns),
            100.0 * ns / gpu.max(1.0),
            calls as f64 / tokens as f64
        );
    }
    if p.dropped > 0 {
        println!(
            "  ({} steps untimed: more than a submission's timestamp capacity)",
            p.dropped
        );
    }
}
