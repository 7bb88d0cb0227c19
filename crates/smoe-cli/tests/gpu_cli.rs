//! `--backend gpu` through the binary: greedy generation equals `--backend cpu` on the demo
//! model; `smoe info` names the adapter; without an adapter `--backend gpu` is a one-line error
//! and `auto` runs on the CPU. With no adapter the GPU checks print `skipped: no GPU adapter`,
//! unless `SMOE_REQUIRE_GPU=1`, which turns that into a failure.

use smoe_compute::gpu::wgpu;
use std::path::Path;
use std::process::{Command, Output};

fn smoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(args)
        .output()
        .expect("run smoe")
}

/// The process's device (`smoe_engine::gpu::context`, opened once: the tests run on threads of
/// one process, and each opening and dropping a device of its own at once crashed this binary
/// under NVIDIA's driver on the H200, 2026-12-03).
fn have_gpu() -> bool {
    match smoe_engine::gpu::context() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("SMOE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("SMOE_REQUIRE_GPU=1 but the GPU is unusable: {e}");
            }
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: no GPU adapter ({e})");
            false
        }
    }
}

fn json(out: &Output) -> serde_json::Value {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "smoe failed: {err}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}); stderr {err}"))
}

fn generate(backend: &str) -> Output {
    let prompt = "The json module can be used to";
    smoe(&[
        "generate",
        "--prompt",
        prompt,
        "-n",
        "48",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--backend",
        backend,
    ])
}

#[test]
fn greedy_generation_on_gpu_equals_cpu() {
    if !have_gpu() {
        // No adapter: `gpu` refuses in one line, `auto` falls back to the CPU.
        let out = generate("gpu");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "--backend gpu without an adapter succeeded"
        );
        let last = err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
        assert!(
            last.starts_with("error:") && last.contains("no GPU adapter"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        json(&generate("auto"));
        return;
    }
    let (g, c) = (json(&generate("gpu")), json(&generate("cpu")));
    assert_eq!(g["tokens"], c["tokens"], "GPU and CPU greedy tokens differ");
    assert_eq!(g["text"], c["text"]);
    assert_eq!(g["tokens"].as_array().map(|t| t.len()), Some(48));
}

#[test]
fn info_names_the_adapter() {
    let out = smoe(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    if have_gpu() {
        assert!(
            text.contains("adapter:") && text.contains("SUBGROUP"),
            "{text}"
        );
        assert!(text.contains("max storage binding"), "{text}");
    } else {
        assert!(text.contains("no GPU adapter"), "{text}");
    }
}

/// `SMOE_FUSED_TAILS=0` reaches the GPU device's settings (`GpuTuning::fused_tails`): `smoe
/// info` reports the fused tails off, where by default Vulkan (lavapipe, NVIDIA) has them on.
#[test]
fn info_reports_fused_tails_as_the_environment_sets_them() {
    if !have_gpu() {
        return;
    }
    let line = |vars: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .arg("info")
            .envs(vars.iter().copied())
            .output()
            .expect("run smoe");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let l = text.lines().find(|l| l.starts_with("fused tails"));
        l.unwrap_or_else(|| panic!("no fused tails line: {text}"))
            .to_owned()
    };
    assert!(line(&[("SMOE_FUSED_TAILS", "0")]).ends_with(": off"));
    let ctx = smoe_engine::gpu::context().unwrap();
    let on = if ctx.fused_tails() { ": on" } else { ": off" };
    assert!(line(&[]).ends_with(on), "{}", line(&[]));
}

/// `SMOE_FUSED_ROUTER=0` reaches the engine's settings (`Tuning::fused_router`): a decoded
/// token's router, which runs inside the o projection where tails fuse, gets a dispatch of its
/// own (`bench decode --breakdown` names the steps).
#[test]
fn fused_router_off_gives_the_router_its_own_dispatch() {
    if !have_gpu() || !smoe_engine::gpu::context().unwrap().fused_tails() {
        return;
    }
    let args = [
        "bench",
        "decode",
        "--backend",
        "gpu",
        "--tg",
        "3",
        "--reps",
        "1",
        "--pp",
        "0",
        "--breakdown",
        "--json",
    ];
    let steps = |vars: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(args)
            .envs(vars.iter().copied())
            .output()
            .expect("run smoe");
        let v = json(&out);
        let run = &v["breakdown"][0];
        assert_eq!(run["run"], "decode", "{v}");
        let names = run["steps"].as_array().unwrap().iter();
        names
            .map(|s| s["step"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let fused = steps(&[]);
    assert!(fused.iter().any(|s| s == "o proj + router"), "{fused:?}");
    assert!(!fused.iter().any(|s| s == "router"), "{fused:?}");
    let own = steps(&[("SMOE_FUSED_ROUTER", "0")]);
    assert!(!own.iter().any(|s| s == "o proj + router"), "{own:?}");
    assert!(
        own.iter().any(|s| s == "router") && own.iter().any(|s| s == "o proj"),
        "{own:?}"
    );
}

/// `smoe bench kernels --json`: one row per (shape, type) with GB/s and the ratio to the copy
/// kernel measured in the same run, and the cost of an empty dependent dispatch.
#[test]
fn bench_kernels_reports_ratios_to_copy() {
    if !have_gpu() {
        return;
    }
    let v = json(&smoe(&[
        "bench", "kernels", "--quick", "--iters", "2", "--json",
    ]));
    assert!(v["copy_gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // The dispatch floor: a chain of empty dispatches, one workgroup and many.
    let floor = &v["dependent_dispatch_us"];
    for key in ["one_workgroup", "many_workgroups"] {
        let us = floor[key].as_f64().unwrap_or(-1.0);
        assert!(us > 0.0 && us < 1e6, "{key}: {floor}");
    }
    assert_eq!(floor["workgroups"], 1024, "{floor}");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(
        rows.len(),
        12,
        "3 shapes (dense, gate_up, down) × 4 types: {v}"
    );
    for r in rows {
        let (gbps, ratio) = (
            r["gb_per_s"].as_f64().unwrap(),
            r["ratio_to_copy"].as_f64().unwrap(),
        );
        assert!(
            gbps > 0.0 && (ratio - gbps / v["copy_gb_per_s"].as_f64().unwrap()).abs() < 0.5,
            "{r}"
        );
        // Decode shapes: no prefill fields (prefill rows carry tokens, kernel and GFLOP/s).
        assert!(r["prefill"].is_null(), "{r}");
    }
}

/// `--shape` narrows the dispatch floor too: it runs only where its name matches (null in the
/// JSON otherwise), and a filter that matches only it measures just that.
#[test]
fn bench_kernels_shape_filter_selects_the_extras_too() {
    if !have_gpu() {
        return;
    }
    let run = |f: &str| {
        json(&smoe(&[
            "bench", "kernels", "--quick", "--iters", "2", "--json", "--shape", f,
        ]))
    };
    let v = run("small");
    assert_eq!(v["rows"].as_array().unwrap().len(), 4, "{v}");
    assert!(v["dependent_dispatch_us"].is_null(), "{v}");
    assert!(v["copy_gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    let v = run("dispatch floor");
    assert!(v["rows"].as_array().unwrap().is_empty(), "{v}");
    assert!(
        v["dependent_dispatch_us"]["one_workgroup"]
            .as_f64()
            .unwrap()
            > 0.0,
        "{v}"
    );
    assert!(v["device"].as_str().is_some_and(|d| !d.is_empty()), "{v}");
    // Nothing at all matches: an error, not an empty report.
    let out = smoe(&["bench", "kernels", "--quick", "--shape", "no such shape"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no benchmark shape matches"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `smoe bench decode --backend gpu` on the demo model, 3 decoded tokens, one repetition,
/// as JSON; `extra` adds flags.
fn bench_decode_gpu(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "bench",
        "decode",
        "--backend",
        "gpu",
        "--tg",
        "3",
        "--reps",
        "1",
        "--json",
    ];
    args.extend_from_slice(extra);
    json(&smoe(&args))
}

/// `smoe bench decode --breakdown`: GPU timestamps per step, for decode and prefill. Every step
/// of a Qwen3-MoE layer shows up, shares sum to one, and the GPU time fits inside the wall time.
#[test]
fn bench_decode_breakdown_times_every_step() {
    if !have_gpu() {
        return;
    }
    let v = bench_decode_gpu(&["--pp", "5", "--breakdown"]);
    let runs = v["breakdown"].as_array().expect("breakdown");
    assert_eq!(runs.len(), 2, "{v}");
    for r in runs {
        let steps = r["steps"].as_array().unwrap();
        let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
        // A decoded token's router runs inside the o projection where tails fuse (lavapipe
        // fuses them); a prompt's is a GEMM of its own.
        let o_and_router: &[&str] = if r["run"] == "decode" {
            &["o proj + router"]
        } else {
            &["o proj", "router"]
        };
        for &want in [
            "qkv",
            "attention",
            "experts gate_up",
            "experts down",
            "lm head",
        ]
        .iter()
        .chain(o_and_router)
        {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        let share: f64 = steps
            .iter()
            .map(|s| s["share_of_gpu"].as_f64().unwrap())
            .sum();
        assert!((share - 1.0).abs() < 1e-6, "{r}");
        let (gpu, wall) = (
            r["gpu_us_per_token"].as_f64().unwrap(),
            r["wall_us_per_token"].as_f64().unwrap(),
        );
        assert!(gpu > 0.0 && gpu <= wall * 1.05, "{r}");
    }
    let decode = &runs[0];
    assert_eq!(decode["run"], "decode");
    let qkv = decode["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "qkv")
        .unwrap();
    // The demo model has 6 layers: one fused q/k/v matvec each per decoded token.
    assert_eq!(
        qkv["dispatch_groups_per_token"].as_f64().unwrap(),
        6.0,
        "{qkv}"
    );
}

/// `smoe bench decode --backend gpu --expert-cache`: the streamed GPU path reports its router
/// stops and where the host's time went there (`vram_slots`), consistent with each other.
#[test]
fn bench_decode_streaming_reports_the_router_stops() {
    if !have_gpu() {
        return;
    }
    let v = bench_decode_gpu(&["--pp", "0", "--expert-cache", "25%", "--no-profile"]);
    let s = &v["vram_slots"];
    let f = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    // The demo model has 6 MoE layers, and each decoded token's either stops or, where its
    // experts were all placed in VRAM ahead of it (fill-ahead, as the reads' timing allows),
    // runs through.
    assert_eq!(f("stops") + f("run_through"), 18.0, "{v}");
    assert!(f("stops") > 0.0, "{v}");
    assert!(f("hit_stops") <= f("stops"), "{v}");
    assert!(f("hits") + f("misses") > 0.0, "{v}");
    assert!(f("pass_s") >= f("gpu_wait_s") + f("fill_s"), "{v}");
    assert!(f("fill_s") >= f("upload_s") + f("map_s"), "{v}");
    // The disk's idle time within each span is at most the span (readings of two clocks taken
    // a moment apart: 1 ms of slack), and the passes' holds the waits' and fills'.
    let idle = |k: &str| {
        s["disk_idle"][k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k}: {v}"))
    };
    assert!(idle("gpu_wait_s") <= f("gpu_wait_s") + 1e-3, "{v}");
    assert!(idle("fill_s") <= f("fill_s") + 1e-3, "{v}");
    assert!(idle("pass_s") <= f("pass_s") + 1e-3, "{v}");
    assert!(
        idle("pass_s") + 1e-3 >= idle("gpu_wait_s") + idle("fill_s"),
        "{v}"
    );
    assert!(idle("pass_s") > 0.0, "{v}");
    // Slots the host maps where the device offers it; on unified memory (lavapipe in CI) disk
    // reads land in them.
    let ctx = smoe_engine::gpu::context().unwrap();
    let info = ctx.info();
    let mappable = (info.features).contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    assert_eq!(s["mapped"].as_bool(), Some(mappable), "{v}");
    let unified = matches!(
        info.adapter.device_type,
        wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
    );
    assert_eq!(f("landed") > 0.0, mappable && unified, "{v}");
}

/// `--vram-cache` apart from `--expert-cache`: the VRAM slots take its share of the demo
/// model's 16 experts per MoE layer (4 of them at 25 %), and the host keeps what the slots have
/// no room for, so some of the slots' misses are host-cache hits rather than disk reads; alone
/// it streams a model that would be resident.
#[test]
fn bench_decode_with_a_vram_cache_below_the_expert_cache() {
    if !have_gpu() {
        return;
    }
    let v = bench_decode_gpu(&[
        "--pp",
        "0",
        "--expert-cache",
        "100%",
        "--vram-cache",
        "25%",
        "--no-profile",
    ]);
    let s = &v["vram_slots"];
    assert_eq!(s["slots"].as_u64(), Some(4), "{v}");
    // 6 MoE layers of 4 slots of one 16 KiB-aligned blob stride each.
    let bytes = s["slot_bytes"].as_u64().unwrap_or(0);
    assert!(bytes > 0 && bytes.is_multiple_of(6 * 4 * 16384), "{v}");
    assert!(s["misses"].as_u64().unwrap_or(0) > 0, "{v}");
    assert!(v["hit_rate"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
    // A VRAM budget alone (the demo model is resident by default) streams the experts.
    let v = bench_decode_gpu(&["--pp", "0", "--vram-cache", "25%", "--no-profile"]);
    assert_eq!(v["vram_slots"]["slots"].as_u64(), Some(4), "{v}");
}

/// A GPU run with `--expert-cache` saves the usage profile beside the vault, and the next start
/// preloads from it (into the VRAM slots too) and says so.
#[test]
fn gpu_streaming_preloads_from_the_saved_profile() {
    if !have_gpu() {
        return;
    }
    let d = smoe_fixtures::ScratchDir::new("gpu-profile").unwrap();
    let vault = d.join("demo.smoe");
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo-qwen3-moe.smoe");
    std::fs::copy(demo, &vault).unwrap();
    let vs = vault.to_str().unwrap();
    let run = || {
        let out = smoe(&[
            "generate",
            "-m",
            vs,
            "--backend",
            "gpu",
            "--expert-cache",
            "25%",
            "--prompt",
            "Hello there",
            "-n",
            "4",
            "--temperature",
            "0",
            "-v",
        ]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let first = run();
    assert!(!first.contains("preloaded"), "{first}");
    assert!(
        d.join("demo.smoe.profile").exists(),
        "no profile saved: {first}"
    );
    let second = run();
    assert!(second.contains("preloaded"), "{second}");
    let _ = std::fs::remove_dir_all(&d);
}
