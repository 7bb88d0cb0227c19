//! Kernels compiled to SPIR-V here, not by wgpu, and handed to the Vulkan driver as passthrough
//! shaders: the tensor-core GEMM (`kernels/matmul_coop.wgsl`) always, and on NVIDIA's own driver
//! every kernel, with execution-only barriers (`ExecBarriers`, `execution_only_barriers`).
//!
//! Why: naga 30 declares the Vulkan memory model for any shader with cooperative matrices but
//! still emits GLSL450-model code: workgroup loads and stores without `NonPrivatePointer` and
//! barriers without availability and visibility semantics (gfx-rs/wgpu#8805). Under the Vulkan
//! model that leaves what one invocation writes to workgroup memory unordered with another's
//! reads after a `workgroupBarrier()` — a data race the driver may exploit. Under the GLSL450
//! model workgroup memory is coherent and barriers order it, which is what the kernel assumes,
//! and `SPV_KHR_cooperative_matrix` does not need the Vulkan model; so the module's memory model
//! is switched back (`use_glsl450_memory_model`). On the H200 (2026-12-01) the GEMM gave the same
//! results and speed under naga's declaration, under this one and with every workgroup access
//! marked non-private: the fix is for correctness by the specification, not a measured failure.

/// A kernel's binding in group 0: (binding, uniform buffer or storage buffer, read-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelBinding {
    pub binding: u32,
    pub uniform: bool,
    pub read_only: bool,
}

/// A kernel's WGSL parsed and validated once, with the group-0 bindings its `main` uses (what
/// wgpu's automatic layout would hold), in binding order: each pipeline of it (one per set of
/// `override`s) then only specialises and emits (`compile`), as wgpu's own shader module does.
pub struct Parsed {
    module: naga::Module,
    info: naga::valid::ModuleInfo,
    pub bindings: Vec<KernelBinding>,
    /// Whether it uses cooperative matrices (the tensor-core GEMM).
    pub cooperative: bool,
}

impl Parsed {
    pub fn new(src: &str) -> Result<Self, String> {
        use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags};
        let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
        let mut validator =
            naga::valid::Validator::new(ValidationFlags::all(), Capabilities::all());
        validator
            .subgroup_stages(ShaderStages::COMPUTE)
            .subgroup_operations(SubgroupOperationSet::all());
        let info = validator.validate(&module).map_err(|e| format!("{e:?}"))?;
        let main = module
            .entry_points
            .iter()
            .position(|e| e.name == "main")
            .ok_or("no entry point named main")?;
        let uses = info.get_entry_point(main);
        let mut bindings: Vec<KernelBinding> = module
            .global_variables
            .iter()
            .filter(|(h, _)| !uses[*h].is_empty())
            .filter_map(|(_, g)| {
                let b = g.binding.as_ref().filter(|b| b.group == 0)?;
                let (uniform, read_only) = match g.space {
                    naga::AddressSpace::Uniform => (true, true),
                    naga::AddressSpace::Storage { access } => {
                        (false, !access.contains(naga::StorageAccess::STORE))
                    }
                    _ => return None,
                };
                Some(KernelBinding {
                    binding: b.binding,
                    uniform,
                    read_only,
                })
            })
            .collect();
        bindings.sort_by_key(|b| b.binding);
        let cooperative = module
            .types
            .iter()
            .any(|(_, t)| matches!(t.inner, naga::TypeInner::CooperativeMatrix { .. }));
        Ok(Parsed {
            module,
            info,
            bindings,
            cooperative,
        })
    }

    /// SPIR-V of `main` with its `override`s set to `constants`, under the GLSL450 memory model
    /// (`use_glsl450_memory_model` where naga declared the Vulkan one); `exec_barriers`: its
    /// workgroup barriers without memory semantics (`execution_only_barriers`).
    pub fn compile(
        &self,
        constants: &[(&str, f64)],
        bounds_checks: bool,
        exec_barriers: bool,
    ) -> Result<Vec<u32>, String> {
        let mut words = self.naga_words(constants, bounds_checks)?;
        if declares_vulkan_model(&words) {
            use_glsl450_memory_model(&mut words)?;
        }
        if exec_barriers {
            execution_only_barriers(&mut words)?;
        }
        Ok(words)
    }

    /// naga's SPIR-V of `main`, as it declares it.
    fn naga_words(
        &self,
        constants: &[(&str, f64)],
        bounds_checks: bool,
    ) -> Result<Vec<u32>, String> {
        let mut consts = naga::back::PipelineConstants::default();
        consts.extend(constants.iter().map(|(k, v)| (k.to_string(), *v)));
        // naga's override pass has panicked on valid modules (an assertion in its arenas, with
        // two override-sized workgroup arrays): a kernel that cannot be built is an error the
        // caller reports, not a crash of the process.
        let (module, info) = std::panic::catch_unwind(|| {
            naga::back::pipeline_constants::process_overrides(
                &self.module,
                &self.info,
                None,
                &consts,
            )
            .map_err(|e| format!("overrides: {e:?}"))
        })
        .map_err(|_| "naga panicked setting the overrides".to_string())??;
        let check = match bounds_checks {
            true => naga::proc::BoundsCheckPolicy::Restrict,
            false => naga::proc::BoundsCheckPolicy::Unchecked,
        };
        let options = naga::back::spv::Options {
            // Vulkan 1.2's SPIR-V; cooperative matrices need Vulkan 1.3 drivers anyway.
            lang_version: (1, 5),
            flags: naga::back::spv::WriterFlags::empty(),
            bounds_check_policies: naga::proc::BoundsCheckPolicies {
                index: check,
                buffer: check,
                image_load: check,
                binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
            },
            // As wgpu does for modules without runtime checks: a counter in every loop keeps the
            // driver from unrolling them (the GEMM's K-steps ran 2.5x slower with it).
            force_loop_bounding: bounds_checks,
            // Every kernel writes its workgroup memory before reading it.
            zero_initialize_workgroup_memory:
                naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
            ..Default::default()
        };
        let pipeline = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: "main".into(),
        };
        naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
            .map_err(|e| format!("SPIR-V: {e:?}"))
    }
}

/// Kernel `name` (with `tuning.kernel_dir`'s edits) as the SPIR-V its pipeline runs on NVIDIA's
/// driver — bounds checks off, as release builds hand it over; the memory model switched back
/// where naga declared the Vulkan one; barriers as `tuning.exec_barriers` leaves them (see
/// `ExecBarriers`; `None`: NVIDIA's default, every kernel) — and its group-0 bindings. For
/// tools that build the pipeline outside wgpu (`examples/pipeline_stats.rs` asks the driver
/// for its register counts).
pub fn kernel_spirv(
    name: &str,
    constants: &[(&str, f64)],
    tuning: &super::GpuTuning,
) -> Result<(Vec<u32>, Vec<KernelBinding>), String> {
    use super::ExecBarriers;
    let src = super::kernels::source_with_edits(name, tuning.kernel_dir.as_deref())
        .ok_or_else(|| format!("no kernel named {name}"))?;
    let parsed = Parsed::new(&src)?;
    let exec = (tuning.exec_barriers)
        .unwrap_or(ExecBarriers::AllKernels)
        .covers(parsed.cooperative);
    Ok((parsed.compile(constants, false, exec)?, parsed.bindings))
}

/// The instructions of a SPIR-V module after its 5-word header: each one's word offset and its
/// words (the first holds its word count and opcode). Fails on a wrong magic number or an
/// instruction whose word count is 0 or runs past the end, so no rewrite below works on a
/// module it misreads.
fn instructions(words: &[u32]) -> Result<Vec<(usize, &[u32])>, String> {
    if words.len() < HEADER || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    let mut out = vec![];
    let mut i = HEADER;
    while i < words.len() {
        let count = (words[i] >> 16) as usize;
        if count == 0 || i + count > words.len() {
            return Err(format!("malformed SPIR-V instruction at word {i}"));
        }
        out.push((i, &words[i..i + count]));
        i += count;
    }
    Ok(out)
}

/// An instruction's opcode.
fn opcode(inst: &[u32]) -> u32 {
    inst[0] & 0xffff
}

/// Words of a SPIR-V module's header.
const HEADER: usize = 5;

/// Rewrites every `OpControlBarrier` of naga's `workgroupBarrier()` (memory scope Workgroup,
/// semantics AcquireRelease | WorkgroupMemory) to an execution barrier with memory semantics
/// None, through a new u32 constant 0. Barriers that also order storage buffers
/// (`storageBarrier()`: device scope, UniformMemory — what the fused tails' count-in relies on)
/// keep their semantics.
///
/// Why: NVIDIA's Vulkan driver compiles the tensor-core GEMM's barriers with those semantics
/// into something slower than its plain workgroup barrier: H200, `bench kernels --shape pf512
/// --iters 20`, q4 experts gate_up 563.3 → 513.9 µs, down 339.9 → 323.8, q_proj 96.6 → 94.0,
/// and 126 → 116 registers (eighteenth session, docs/performance.md). On NVIDIA hardware a
/// workgroup barrier orders the workgroup's shared-memory accesses by itself (CUDA's
/// `__syncthreads`, PTX `bar.sync`), and under the GLSL450 memory model
/// (`use_glsl450_memory_model`) workgroup memory is coherent — what glslang's `barrier()`
/// with semantics None relied on for years. Used only where `GpuInfo::exec_barriers` says so
/// (NVIDIA's own driver), where the GPU tests check the GEMM against the CPU.
pub fn execution_only_barriers(words: &mut Vec<u32>) -> Result<(), String> {
    let insts = instructions(words)?;
    let mut u32_type = None;
    // id → (type, value) of every one-word constant.
    let mut values = std::collections::HashMap::new();
    for (_, inst) in &insts {
        match (opcode(inst), inst.len()) {
            (OP_TYPE_INT, 4) if inst[2] == 32 && inst[3] == 0 => u32_type = Some(inst[1]),
            (OP_CONSTANT, 4) => {
                values.insert(inst[2], (inst[1], inst[3]));
            }
            _ => {}
        }
    }
    let first_function = insts
        .iter()
        .position(|(_, inst)| opcode(inst) == OP_FUNCTION);
    let (ty, first) = match (u32_type, first_function) {
        (Some(t), Some(f)) => (t, f),
        _ => return Err("no u32 type, or no function to place a constant before".into()),
    };
    let zero = words[3];
    let mut out = words[..HEADER].to_vec();
    out[3] = zero + 1;
    out.extend_from_slice(&words[HEADER..insts[first].0]);
    out.extend_from_slice(&[(4 << 16) | OP_CONSTANT, ty, zero, 0]);
    let value = |id: u32| values.get(&id).filter(|(t, _)| *t == ty).map(|(_, v)| *v);
    for (_, inst) in &insts[first..] {
        let start = out.len();
        out.extend_from_slice(inst);
        if opcode(inst) == OP_CONTROL_BARRIER
            && value(inst[2]) == Some(SCOPE_WORKGROUP)
            && value(inst[3]) == Some(WORKGROUP_ACQUIRE_RELEASE)
        {
            out[start + 3] = zero;
        }
    }
    *words = out;
    Ok(())
}

/// Renumbers the `Binding` decorations of descriptor set 0 to each binding's rank in `layout`
/// (sorted by binding, as `Parsed::bindings` is). wgpu's Vulkan backend gives a layout entry
/// the Vulkan binding of its position in the layout sorted by binding number, not the number
/// itself (wgpu-hal's `create_bind_group_layout`), and remaps the modules naga compiles for it;
/// a passthrough module must be remapped by whoever made it. Kernels whose bindings run 0..n
/// are unchanged. One that skips a number is not: the overlapped decode's twins (twenty-fifth
/// session, bindings 30 and 31 after their kernel's 0..13) read their counter and step from
/// descriptors the layout did not have — no error, just a wait that never waited. Fails on a
/// set-0 binding that `layout` lacks.
pub fn rank_bindings(words: &mut [u32], layout: &[KernelBinding]) -> Result<(), String> {
    debug_assert!(layout.windows(2).all(|w| w[0].binding < w[1].binding));
    let insts = instructions(words)?;
    let set0: std::collections::HashSet<u32> = insts
        .iter()
        .filter(|(_, inst)| {
            opcode(inst) == OP_DECORATE
                && inst.len() == 4
                && inst[2] == DECORATION_DESCRIPTOR_SET
                && inst[3] == 0
        })
        .map(|(_, inst)| inst[1])
        .collect();
    // Where each set-0 variable's binding number sits, and the number.
    let slots: Vec<(usize, u32)> = insts
        .iter()
        .filter(|(_, inst)| {
            opcode(inst) == OP_DECORATE
                && inst.len() == 4
                && inst[2] == DECORATION_BINDING
                && set0.contains(&inst[1])
        })
        .map(|(at, inst)| (at + 3, inst[3]))
        .collect();
    for (at, binding) in slots {
        let rank = layout
            .binary_search_by_key(&binding, |b| b.binding)
            .map_err(|_| format!("binding {binding} is not in the kernel's layout"))?;
        words[at] = rank as u32;
    }
    Ok(())
}

/// Whether the module's `OpMemoryModel` is the Vulkan one.
fn declares_vulkan_model(words: &[u32]) -> bool {
    instructions(words).is_ok_and(|insts| {
        insts
            .iter()
            .find(|(_, inst)| opcode(inst) == OP_MEMORY_MODEL)
            .is_some_and(|(_, inst)| inst.get(2) == Some(&MEMORY_MODEL_VULKAN))
    })
}

const OP_EXTENSION: u32 = 10;
const OP_TYPE_INT: u32 = 21;
const OP_CONSTANT: u32 = 43;
const OP_FUNCTION: u32 = 54;
const OP_CONTROL_BARRIER: u32 = 224;
const OP_DECORATE: u32 = 71;
const DECORATION_BINDING: u32 = 33;
const DECORATION_DESCRIPTOR_SET: u32 = 34;
const SCOPE_WORKGROUP: u32 = 2;
/// AcquireRelease (0x8) | WorkgroupMemory (0x100).
const WORKGROUP_ACQUIRE_RELEASE: u32 = 0x108;
const OP_MEMORY_MODEL: u32 = 14;
const OP_CAPABILITY: u32 = 17;
const CAPABILITY_VULKAN_MEMORY_MODEL: u32 = 5345;
const CAPABILITY_VULKAN_MEMORY_MODEL_DEVICE_SCOPE: u32 = 5346;
const MEMORY_MODEL_GLSL450: u32 = 1;
const MEMORY_MODEL_VULKAN: u32 = 3;

/// Rewrites a module declared under the Vulkan memory model to the GLSL450 one: drops the
/// `VulkanMemoryModel` capabilities and extension and changes `OpMemoryModel`. Fails (rather
/// than hand the driver something half-patched) unless there was exactly one such declaration.
pub fn use_glsl450_memory_model(words: &mut Vec<u32>) -> Result<(), String> {
    let insts = instructions(words)?;
    let mut out = words[..HEADER].to_vec();
    let mut models = 0;
    for (_, inst) in insts {
        match opcode(inst) {
            OP_CAPABILITY
                if matches!(
                    inst[1],
                    CAPABILITY_VULKAN_MEMORY_MODEL | CAPABILITY_VULKAN_MEMORY_MODEL_DEVICE_SCOPE
                ) =>
            {
                continue
            }
            OP_EXTENSION if literal_string(&inst[1..]) == "SPV_KHR_vulkan_memory_model" => continue,
            OP_MEMORY_MODEL if inst[2] == MEMORY_MODEL_VULKAN => {
                models += 1;
                out.extend_from_slice(&[inst[0], inst[1], MEMORY_MODEL_GLSL450]);
                continue;
            }
            _ => out.extend_from_slice(inst),
        }
    }
    if models != 1 {
        return Err(format!(
            "expected one Vulkan-model OpMemoryModel, found {models}"
        ));
    }
    *words = out;
    Ok(())
}

/// A SPIR-V literal string: UTF-8 bytes, little-endian within words, NUL-terminated.
fn literal_string(words: &[u32]) -> String {
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take_while(|b| *b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (opcode, operands) of every instruction after the header.
    fn ops(words: &[u32]) -> Vec<(u32, Vec<u32>)> {
        instructions(words)
            .unwrap()
            .into_iter()
            .map(|(_, inst)| (opcode(inst), inst[1..].to_vec()))
            .collect()
    }

    /// The `Binding` numbers of descriptor set 0's variables.
    fn set0_bindings(words: &[u32]) -> Vec<u32> {
        let inst = ops(words);
        let set0: Vec<u32> = inst
            .iter()
            .filter(|(op, a)| *op == OP_DECORATE && a[1..] == [DECORATION_DESCRIPTOR_SET, 0])
            .map(|(_, a)| a[0])
            .collect();
        let mut out: Vec<u32> = inst
            .iter()
            .filter(|(op, a)| *op == OP_DECORATE && a.len() == 3 && a[1] == DECORATION_BINDING)
            .filter(|(_, a)| set0.contains(&a[0]))
            .map(|(_, a)| a[2])
            .collect();
        out.sort_unstable();
        out
    }

    /// Bindings that skip numbers (0, 2, 7) become the ranks wgpu's Vulkan layout gives them
    /// (0, 1, 2); a dense kernel's stay as they are; a binding the layout lacks is refused.
    #[test]
    fn bindings_take_their_rank_in_the_layout() {
        let src = "struct P { n: u32, a: u32, b: u32, c: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if g.x < p.n { y[g.x] = x[g.x]; }
}
";
        let parsed = Parsed::new(src).unwrap();
        let bindings: Vec<u32> = parsed.bindings.iter().map(|b| b.binding).collect();
        assert_eq!(bindings, [0, 2, 7]);
        let mut words = parsed.compile(&[], false, true).unwrap();
        assert_eq!(set0_bindings(&words), [0, 2, 7]);
        rank_bindings(&mut words, &parsed.bindings).unwrap();
        assert_eq!(set0_bindings(&words), [0, 1, 2]);
        assert!(instructions(&words).is_ok());

        let parsed = Parsed::new(&crate::gpu::kernel_source("matvec").unwrap()).unwrap();
        let mut words = parsed.compile(&[], false, true).unwrap();
        let dense = words.clone();
        rank_bindings(&mut words, &parsed.bindings).unwrap();
        assert_eq!(words, dense);
        assert!(rank_bindings(&mut words, &parsed.bindings[1..]).is_err());
    }

    /// The experts' gate_up GEMM (q4, 48-token tiles) as the engine compiles it.
    fn gated_gemm(exec_barriers: bool) -> Vec<u32> {
        let src = crate::gpu::kernel_source("matmul_coop").unwrap();
        let consts = [
            ("DTYPE", 2.0),
            ("BN", 48.0),
            ("GATED", 1.0),
            ("GROUPED", 1.0),
        ];
        Parsed::new(&src)
            .unwrap()
            .compile(&consts, false, exec_barriers)
            .unwrap()
    }

    #[test]
    fn the_coop_gemm_leaves_the_vulkan_memory_model() {
        let words = gated_gemm(false);
        let inst = ops(&words);
        let model: Vec<_> = inst.iter().filter(|i| i.0 == OP_MEMORY_MODEL).collect();
        assert_eq!(model.len(), 1);
        assert_eq!(model[0].1, vec![0, MEMORY_MODEL_GLSL450]);
        let caps: Vec<u32> = inst
            .iter()
            .filter(|i| i.0 == OP_CAPABILITY)
            .map(|i| i.1[0])
            .collect();
        assert!(!caps.contains(&CAPABILITY_VULKAN_MEMORY_MODEL), "{caps:?}");
        // CooperativeMatrixKHR stays.
        assert!(caps.contains(&6022), "{caps:?}");
        let exts: Vec<String> = inst
            .iter()
            .filter(|i| i.0 == OP_EXTENSION)
            .map(|i| literal_string(&i.1))
            .collect();
        assert!(
            exts.contains(&"SPV_KHR_cooperative_matrix".to_string()),
            "{exts:?}"
        );
        assert!(
            !exts.iter().any(|e| e.contains("vulkan_memory_model")),
            "{exts:?}"
        );
    }

    /// `execution_only_barriers`: every barrier of the GEMM (it has several) now names one new
    /// u32 constant 0, declared before the first function under a raised id bound; nothing else
    /// changes; and a module that is not SPIR-V is refused.
    fn u32_type_of(words: &[u32]) -> u32 {
        ops(words)
            .into_iter()
            .find(|i| i.0 == OP_TYPE_INT && i.1[1..] == [32, 0])
            .map(|i| i.1[0])
            .unwrap()
    }

    #[test]
    fn barriers_lose_their_memory_semantics_and_nothing_else() {
        let (before, after) = (gated_gemm(false), gated_gemm(true));
        assert_eq!(after[3], before[3] + 1, "id bound");
        let zero = before[3];
        let (b, a) = (ops(&before), ops(&after));
        assert_eq!(a.len(), b.len() + 1);
        let u32_type = b
            .iter()
            .find(|i| i.0 == OP_TYPE_INT && i.1[1..] == [32, 0])
            .map(|i| i.1[0])
            .unwrap();
        let at = a
            .iter()
            .position(|i| i.0 == OP_CONSTANT && i.1 == [u32_type, zero, 0]);
        let first_fn = a.iter().position(|i| i.0 == OP_FUNCTION).unwrap();
        assert_eq!(
            at,
            Some(first_fn - 1),
            "the constant sits just before the first function"
        );
        let mut barriers = 0;
        let rest = a[..first_fn - 1].iter().chain(&a[first_fn..]);
        for (x, y) in b.iter().zip(rest) {
            if x.0 == OP_CONTROL_BARRIER {
                barriers += 1;
                assert_eq!(y.0, OP_CONTROL_BARRIER);
                assert_eq!(
                    y.1,
                    vec![x.1[0], x.1[1], zero],
                    "scopes kept, semantics None"
                );
            } else {
                assert_eq!(x, y);
            }
        }
        assert!(barriers >= 4, "{barriers} barriers");
        // A kernel with storage barriers (the fused tails' count-in) keeps those.
        let src = crate::gpu::kernel_source("attn_decode").unwrap();
        let before = Parsed::new(&src).unwrap().naga_words(&[], false).unwrap();
        let mut after = before.clone();
        execution_only_barriers(&mut after).unwrap();
        let constant = |words: &[u32], id: u32| {
            ops(words)
                .into_iter()
                .find(|i| i.0 == OP_CONSTANT && i.1.len() == 3 && i.1[1] == id)
                .map(|i| i.1[2])
        };
        let (mut kept, mut cleared) = (0, 0);
        for ((_, x), (_, y)) in ops(&before)
            .into_iter()
            .zip(
                ops(&after)
                    .into_iter()
                    .filter(|i| i.1 != [u32_type_of(&after), after[3] - 1, 0]),
            )
            .filter(|(x, _)| x.0 == OP_CONTROL_BARRIER)
        {
            let semantics = constant(&before, x[2]).unwrap();
            if semantics == WORKGROUP_ACQUIRE_RELEASE {
                assert_eq!(constant(&after, y[2]), Some(0));
                cleared += 1;
            } else {
                assert_eq!(x, y, "semantics {semantics:#x} kept");
                kept += 1;
            }
        }
        assert!(kept >= 1 && cleared >= 1, "kept {kept}, cleared {cleared}");
        let mut junk = vec![1u32, 2, 3];
        assert!(execution_only_barriers(&mut junk).is_err());
    }

    /// The tensor-core GEMM runs only on adapters with 16 × 16 f16 cooperative matrices (not
    /// Metal, not CI's lavapipe): here every variant must at least go through the compile the
    /// engine uses (validation, overrides, SPIR-V, memory-model rewrite), with and without
    /// bounds checks.
    #[test]
    fn every_coop_gemm_variant_compiles() {
        let src = crate::gpu::kernel_source("matmul_coop").unwrap();
        let parsed = Parsed::new(&src).unwrap();
        let mut failures = vec![];
        for dtype in 0..4 {
            for (gated, grouped) in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)] {
                for (bn, bk) in [(16.0, 32.0), (48.0, 32.0), (64.0, 32.0), (48.0, 64.0)] {
                    let consts = [
                        ("DTYPE", dtype as f64),
                        ("BN", bn),
                        ("BK", bk),
                        ("GATED", gated),
                        ("GROUPED", grouped),
                    ];
                    for checks in [false, true] {
                        if let Err(e) = parsed.compile(&consts, checks, checks) {
                            failures.push(format!("{consts:?} checks {checks}: {e}"));
                        }
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// `kernel_spirv` (what `examples/pipeline_stats.rs` builds): any kernel compiles, its
    /// group-0 bindings are listed in order with their kinds, and the coop GEMM comes out with
    /// the GLSL450 memory model while a kernel naga gives GLSL450 anyway is left as it is.
    #[test]
    fn kernel_spirv_lists_bindings_and_fixes_the_memory_model() {
        let t = crate::gpu::GpuTuning::default();
        let (words, b) = kernel_spirv("rms_norm", &[], &t).unwrap();
        assert!(b.len() >= 3, "{b:?}");
        assert!(b.windows(2).all(|w| w[0].binding < w[1].binding), "{b:?}");
        assert!(b[0].uniform && b[0].read_only, "{b:?}");
        assert!(b.iter().any(|x| !x.uniform && !x.read_only), "{b:?}");
        assert!(b.iter().any(|x| !x.uniform && x.read_only), "{b:?}");
        let model = |w: &[u32]| {
            let inst = ops(w);
            inst.iter()
                .find(|i| i.0 == OP_MEMORY_MODEL)
                .unwrap()
                .1
                .clone()
        };
        assert_eq!(model(&words), vec![0, MEMORY_MODEL_GLSL450]);
        let consts = [
            ("DTYPE", 2.0),
            ("BN", 48.0),
            ("GATED", 1.0),
            ("GROUPED", 1.0),
        ];
        let (coop, _) = kernel_spirv("matmul_coop", &consts, &t).unwrap();
        assert_eq!(model(&coop), vec![0, MEMORY_MODEL_GLSL450]);
        assert!(kernel_spirv("no_such_kernel", &[], &t).is_err());
        assert!(kernel_spirv("rms_norm", &[("NO_SUCH_CONSTANT", 1.0)], &t).is_err());
    }

    #[test]
    fn patching_refuses_what_it_does_not_understand() {
        assert!(use_glsl450_memory_model(&mut vec![1, 2, 3]).is_err());
        // A valid header and a GLSL450 OpMemoryModel: nothing to patch is an error too.
        let mut m = vec![
            0x0723_0203,
            0x0001_0500,
            0,
            10,
            0,
            (3 << 16) | OP_MEMORY_MODEL,
            0,
            1,
        ];
        assert!(use_glsl450_memory_model(&mut m).is_err());
        // A truncated instruction.
        let mut t = vec![
            0x0723_0203,
            0x0001_0500,
            0,
            10,
            0,
            (9 << 16) | OP_MEMORY_MODEL,
            0,
        ];
        assert!(use_glsl450_memory_model(&mut t)
            .unwrap_err()
            .contains("malformed"));
    }
}
