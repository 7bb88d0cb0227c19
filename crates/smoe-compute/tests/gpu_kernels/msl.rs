//! Every kernel through naga's Metal (MSL) backend, with the capabilities the GPU backend
//! requests (subgroups, f16), so a Metal-only translation failure fails CI without a Mac.
//! Needs no GPU. naga is pinned to the version wgpu uses (see Cargo.toml).

use naga::back::msl;
use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};
use smoe_compute::gpu::{kernel_names, kernel_source};

/// The override sets worth checking per kernel: the defaults, for matvec and matmul every
/// dtype with the gated and grouped variants, and for prefill attention the extreme tiles.
fn variants(kernel: &str) -> Vec<Vec<(&'static str, f64)>> {
    if kernel == "attn_prefill" {
        return vec![
            vec![],
            // 128 rows, 32-dim steps, head_dim 256.
            vec![
                ("M", 128.0),
                ("DS", 32.0),
                ("OD", 8.0),
                ("KVC", 16.0),
                ("STAGE", 1280.0),
            ],
            // 32 rows, head_dim 48.
            vec![("M", 32.0), ("OD", 2.0), ("KVC", 32.0)],
        ];
    }
    if kernel == "matmul" {
        let mut v = vec![];
        for dtype in 0..4 {
            for (gated, grouped) in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)] {
                for (bm, bn, bk) in [(128.0, 48.0, 16.0), (64.0, 64.0, 32.0)] {
                    v.push(vec![
                        ("DTYPE", dtype as f64),
                        ("BM", bm),
                        ("BN", bn),
                        ("BK", bk),
                        ("GATED", gated),
                        ("GROUPED", grouped),
                    ]);
                }
            }
        }
        return v;
    }
    if kernel != "matvec" {
        return vec![vec![]];
    }
    let mut v = vec![];
    for dtype in 0..4 {
        for (gated, grouped) in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)] {
            v.push(vec![
                ("DTYPE", dtype as f64),
                ("NT", 3.0),
                ("TILE", 1344.0),
                ("GATED", gated),
                ("GROUPED", grouped),
            ]);
        }
    }
    v
}

fn translate(name: &str, constants: &[(&'static str, f64)]) -> Result<String, String> {
    let src = kernel_source(name).unwrap();
    let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
    // SHADER_FLOAT16_IN_FLOAT32 (unpack2x16float) is a downlevel capability every Metal and Vulkan
    // device has; wgpu grants it there.
    let caps = Capabilities::SUBGROUP
        | Capabilities::SUBGROUP_BARRIER
        | Capabilities::SHADER_FLOAT16
        | Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    let mut validator = Validator::new(ValidationFlags::all(), caps);
    validator
        .subgroup_stages(ShaderStages::COMPUTE)
        .subgroup_operations(SubgroupOperationSet::all());
    let info = validator.validate(&module).map_err(|e| format!("{e:?}"))?;
    let mut consts = naga::back::PipelineConstants::default();
    consts.extend(constants.iter().map(|(k, v)| (k.to_string(), *v)));
    let (module, info) =
        naga::back::pipeline_constants::process_overrides(&module, &info, None, &consts)
            .map_err(|e| format!("overrides: {e:?}"))?;
    let options = msl::Options {
        lang_version: (2, 4),
        ..Default::default()
    };
    let pipeline = msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, "main".into())),
        ..Default::default()
    };
    let (out, _) = msl::write_string(&module, &info, &options, &pipeline)
        .map_err(|e| format!("msl: {e:?}"))?;
    Ok(out)
}

#[test]
fn every_kernel_translates_to_msl() {
    let mut failures = vec![];
    // matmul_coop: Vulkan only (gpu::spirv's tests compile every variant of it).
    for name in kernel_names().into_iter().filter(|n| *n != "matmul_coop") {
        for consts in variants(name) {
            match translate(name, &consts) {
                Ok(msl) => assert!(msl.contains("kernel"), "{name}: no kernel function in MSL"),
                Err(e) => failures.push(format!("{name} {consts:?}: {e}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "MSL translation failed:\n{}",
        failures.join("\n")
    );
}
