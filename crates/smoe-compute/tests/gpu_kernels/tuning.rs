//! A `GpuTuning` takes effect: a context opened with settings off reports them off, and its
//! edited kernels (`kernel_dir`) are the ones it runs.

use super::gpu;
use smoe_compute::gpu::{wgpu, Argmax, BufRef, GpuContext, GpuTuning, MatrixUnits};

#[test]
fn a_tuning_reaches_the_context() {
    let Some(shared) = gpu() else { return };
    // A standalone argmax that writes 7 to its row's output, whatever the logits.
    let dir = std::env::temp_dir().join(format!("smoe-tuning-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("argmax.wgsl"),
        "// smoe: standalone
struct Params { n: u32, x_off: u32, out_off: u32, _pad: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
override WG: u32 = 64u;
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    if li == 0u && x[p.x_off] > -1e30 { out[p.out_off] = 7u; }
}
",
    )
    .unwrap();
    let tuning = GpuTuning {
        fused_tails: false,
        matrix_units: false,
        hold_clocks: false,
        kernel_dir: Some(dir.clone()),
        ..GpuTuning::default()
    };
    let ctx = GpuContext::with_tuning(tuning.clone()).unwrap();
    assert_eq!(ctx.tuning(), &tuning);
    let info = ctx.info();
    assert!(!ctx.fused_tails() && !info.hold_clocks, "{info:?}");
    assert!(
        matches!(&info.matrix_units, MatrixUnits::Unused(why) if why.contains("turned off")),
        "{info:?}"
    );
    assert!(
        info.to_string()
            .contains("fused tails (router top-k, experts' sum in their matvecs): off"),
        "{info}"
    );
    // The default: tails fused on Vulkan (lavapipe, NVIDIA), not over Metal.
    let vulkan = shared.info().adapter.backend == wgpu::Backend::Vulkan;
    assert!(!vulkan || shared.fused_tails() || shared.info().adapter.name.contains("Apple"));
    // The edited argmax runs on the tuned context only.
    let logits: Vec<f32> = (0..100).map(|i| i as f32).collect();
    for (c, want) in [(shared, 99), (&ctx, 7)] {
        let xb = c.upload_f32("logits", &logits);
        let ob = c.upload("out", &[0xFFu8; 4]);
        let k = Argmax::new(c, BufRef::new(&xb), BufRef::new(&ob), logits.len(), 1).unwrap();
        let mut enc = c.encoder();
        k.encode(&mut enc);
        c.submit_wait(enc);
        assert_eq!(c.read_u32(&ob, 0, 1).unwrap()[0], want);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
