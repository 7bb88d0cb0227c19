//! The GPU decode path without fused tails (`SMOE_FUSED_TAILS=0`, and what Metal and other
//! non-Vulkan backends always run): the router's top-k, the experts' weighted sum and the decode
//! attention's merge of its splits as dispatches of their own. A test binary of its own, because the choice is made once per process, when the
//! shared GPU context opens. Decode logits against the CPU's on every fixture.

use smoe_engine::engine::{Backend, EngineOptions};
use smoe_engine::Engine;
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
    std::env::set_var("SMOE_FUSED_TAILS", "0");
    if !have_gpu() {
        return;
    }
    let probe = smoe_compute::gpu::GpuContext::new().expect("GPU context");
    assert!(!probe.fused_tails(), "SMOE_FUSED_TAILS=0 was not honoured");
    drop(probe);
    for name in smoe_fixtures::names() {
        let v = TempVault::new(&name, DType::Q8);
        let (gpu, cpu) = (open(&v, Backend::Gpu), open(&v, Backend::Cpu));
        assert_eq!(gpu.model.backend(), "gpu");
        let prompt = &smoe_fixtures::reference(&name).prompts[0].prompt;
        // Beyond 512 positions decode attention splits the context: the combine pass runs.
        assert_decode_matches_cpu(&name, &gpu, &cpu, prompt, 1500, 6);
    }
}
