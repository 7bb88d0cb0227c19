//! GB/s of the GPU matvec kernels at Qwen3-MoE shapes beside a copy kernel's, in one run.
//! `bench_kernels [--quick] [--sweep] [--gemm-sweep] [--prefill] [--iters N]`: `--quick` uses
//! small shapes (for lavapipe), `--sweep` adds launch-shape variants for q4, `--gemm-sweep` tile
//! variants of the prefill GEMM, `--prefill` measures only the prefill shapes, `--list` lists
//! the adapters and exits.

use smoe_compute::gpu::bench::{
    bench_gemm_tunings, bench_kernels, qwen3_prefill_shapes, qwen3_shapes, BenchShape,
};
use smoe_compute::gpu::{GpuContext, MatMulTuning, MatVecTuning, Q4Decode};
use smoe_vault::quant::DType;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let has = |f: &str| args.iter().any(|a| a == f);
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    if has("--list") {
        // Every adapter of every backend, for diagnosing a machine where none is chosen.
        let instance = smoe_compute::gpu::wgpu::Instance::new(
            smoe_compute::gpu::wgpu::InstanceDescriptor::new_without_display_handle_from_env(),
        );
        let adapters = pollster::block_on(
            instance.enumerate_adapters(smoe_compute::gpu::wgpu::Backends::all()),
        );
        for a in &adapters {
            println!("{:?}", a.get_info());
        }
        println!("{} adapter(s)", adapters.len());
        std::process::exit(if adapters.is_empty() { 1 } else { 0 });
    }
    let ctx = match GpuContext::new() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    println!("{}\n", ctx.info());
    let dtypes = [DType::Bf16, DType::Q8, DType::Q4, DType::Q2];
    let shapes = if has("--quick") {
        vec![
            BenchShape::dense("small", 512, 1024),
            BenchShape::experts("experts x8", 256, 1024, 8, 16),
            BenchShape::prefill("small pf64", 512, 1024, 64),
            BenchShape::prefill_experts("experts pf32", 128, 512, 32, 4, 16, true),
        ]
    } else if has("--prefill") {
        qwen3_prefill_shapes()
    } else {
        qwen3_shapes()
    };
    let base = MatVecTuning::default();
    let variants: Vec<MatVecTuning> = [
        Q4Decode::PairsF16,
        Q4Decode::FloatBits,
        Q4Decode::IntToFloat,
        Q4Decode::Int8Dot,
    ]
    .into_iter()
    .map(|q4| MatVecTuning { q4, ..base })
    .collect();
    // One shape at a time, so that partial results show even if a later shape fails.
    for shape in &shapes {
        let report =
            bench_kernels(&ctx, std::slice::from_ref(shape), &dtypes, &variants, iters).unwrap();
        println!("{report}");
    }
    if has("--gemm-sweep") {
        let mut tunings = vec![];
        for (bm, bn, bk) in [
            (128, 64, 16),
            (128, 48, 16),
            (128, 32, 16),
            (128, 128, 16),
            (128, 64, 32),
            (64, 64, 16),
        ] {
            tunings.push(MatMulTuning {
                coop: false,
                bm,
                bn,
                bk,
            });
        }
        if ctx.has_matrix_units() {
            tunings.extend([16, 32, 48, 64].map(MatMulTuning::coop));
        }
        println!("prefill GEMM tile sweep:");
        for shape in shapes.iter().filter(|s| s.tokens > 0) {
            let report = bench_gemm_tunings(
                &ctx,
                std::slice::from_ref(shape),
                &[DType::Q4, DType::Bf16],
                &tunings,
                iters,
            )
            .unwrap();
            println!("{report}");
        }
    }
    if has("--sweep") {
        let mut tunings = vec![];
        for (wg, rows) in [
            (64, 4),
            (64, 8),
            (128, 8),
            (128, 32),
            (256, 16),
            (256, 32),
            (256, 64),
        ] {
            for q4 in [Q4Decode::PairsF16, Q4Decode::FloatBits, Q4Decode::Int8Dot] {
                tunings.push(MatVecTuning {
                    wg,
                    rows,
                    q4,
                    items: 0,
                });
            }
        }
        let sweep: Vec<BenchShape> = shapes
            .into_iter()
            .filter(|s| {
                s.tokens == 0
                    && (s.name.contains("lm_head")
                        || s.name.contains("gate_up")
                        || s.name.contains("q_proj"))
            })
            .collect();
        println!("q4 launch-shape sweep:");
        for shape in &sweep {
            let report = bench_kernels(
                &ctx,
                std::slice::from_ref(shape),
                &[DType::Q4],
                &tunings,
                iters,
            )
            .unwrap();
            println!("{report}");
        }
    }
}
