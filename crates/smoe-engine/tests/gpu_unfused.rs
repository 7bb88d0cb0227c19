//! The GPU decode path without fused tails (`GpuTuning::fused_tails` false, and what Metal and
//! other non-Vulkan backends always run): the router's top-k, the experts' weighted sum and the
//! decode attention's merge of its splits as dispatches of their own. A test binary of its own,
//! because the process's GPU device is opened once, with the settings `gpu::configure` gave it.
//! Decode logits against the CPU's on every fixture.

use smoe_compute::gpu::GpuTuning;
use smoe_engine::engine::{Backend, EngineOptions};
use smoe_engine::{gpu, Engine};
use smoe_vault::DType;

mod common;
use common::{assert_decode_matches_cpu, have_gpu, TempVault};

fn open(v: &TempVault, backend: Backend) -> Engine {
    let opts = EngineOptions {
        backend,
        ..Default::default()
    };
    Engine::open(v.path(), opts).expect("open")
}

#[test]
fn unfused_decode_matches_cpu() {
    // Before anything opens the GPU: the only test of this binary.
    let tuning = GpuTuning {
        fused_tails: false,
        ..GpuTuning::default()
    };
    gpu::configure(tuning.clone()).expect("the first settings");
    if !have_gpu() {
        return;
    }
    let ctx = gpu::context().unwrap();
    assert!(!ctx.fused_tails(), "fused_tails false was not honoured");
    assert_eq!(ctx.tuning(), &tuning);
    // The device is open: the same settings are accepted again, others refused.
    gpu::configure(tuning).expect("the same settings");
    let err = gpu::configure(GpuTuning::default()).unwrap_err();
    assert!(err.to_string().contains("other settings"), "{err}");
    for name in smoe_fixtures::names() {
        let v = TempVault::new(&name, DType::Q8);
        let (gpu, cpu) = (open(&v, Backend::Gpu), open(&v, Backend::Cpu));
        assert_eq!(gpu.model.backend(), "gpu");
        let prompt = &smoe_fixtures::reference(&name).prompts[0].prompt;
        // Beyond 512 positions decode attention splits the context: the combine pass runs.
        assert_decode_matches_cpu(&name, &gpu, &cpu, prompt, 1500, 6);
    }
}
