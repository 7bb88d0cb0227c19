//! Overlapped decode: a single-token pass's dispatches recorded without barriers between them,
//! each waiting on a counter for every dispatch before it (`SMOE_OVERLAP_DECODE=1`).
//!
//! Why: between two dependent dispatches wgpu records a pipeline barrier, and the GPU drains the
//! first before it starts the second's workgroups. `bench kernels`' persistent chain measured
//! that boundary (twenty-second and twenty-third sessions, docs/performance.md): 48 dependent
//! bf16 products took 13.6 µs per step with barriers and 10.6 as unfenced dispatches whose
//! workgroups wait on a counter of finished workgroups — the next dispatch's workgroups are
//! already resident when the one before finishes.
//!
//! How: a chainable kernel (`CHAINED`) gets a twin (`Chained`) built from its WGSL wrapped by
//! `wrap`: a new `main` waits until `chain_sync[0]`, the count of workgroups that finished the
//! pass's chained dispatches so far, reaches the number recorded before it (`chain_step.want`),
//! runs the kernel's own `main` and counts its workgroup in. The twin's pipeline is unfenced
//! (every binding read-only in its layout, `GpuContext::pipeline_unfenced`), so wgpu records no
//! barrier between twins; what one writes another reads through `Coherent` bindings (every
//! storage binding but the weights', `WEIGHT_BINDINGS`), which no SM's cache answers from an
//! older copy, after a device-scope barrier on each side of the counter. A recording in this
//! mode (`Launch::Chained`, `ChainCursor`) resets the counter before its first twin and again
//! before any ordinary dispatch that follows twins (`chain_reset.wgsl` binds the counter
//! writable, so wgpu fences it from the twins on both sides).
//!
//! A workgroup that waits `SPIN` polls gives up, counts itself in `chain_sync[1]` and runs
//! anyway (`ChainSync::gave_up`): nothing in Vulkan promises that a later dispatch's workgroups
//! cannot hold the GPU while an earlier one's wait to start. NVIDIA's hardware starts a
//! queue's dispatches in order; the mode needs passthrough shaders and is offered only on
//! NVIDIA's own driver (`GpuInfo::exec_barriers` covering every kernel).

use std::sync::atomic::{AtomicU32, Ordering};

use super::buffers::Binding;
use super::context::{GpuContext, GpuError};
use super::ops::Dispatch;

/// The environment switch.
pub const OVERLAP_ENV: &str = "SMOE_OVERLAP_DECODE";

/// Kernels a single-token pass runs, and the names of their chained twins.
const CHAINED: &[(&str, &str)] = &[
    ("matvec", "matvec+chain"),
    ("matvec_f16", "matvec_f16+chain"),
    ("attn_decode", "attn_decode+chain"),
    ("qk_norm_rope", "qk_norm_rope+chain"),
    ("rms_norm", "rms_norm+chain"),
    ("argmax", "argmax+chain"),
];

/// The suffix of a chained twin's kernel name.
const SUFFIX: &str = "+chain";

/// Storage bindings that hold weights (never written while a model is loaded): their loads
/// keep the caches. Every other storage binding of a twin is `Coherent`.
pub(crate) const WEIGHT_BINDINGS: &[&str] = &["w", "nw", "wr", "wt", "qnw", "knw", "inv"];

/// Polls before a waiting workgroup gives up (each is a round trip to L2, ~1 µs at most: a
/// second or so, far beyond any kernel of a decode pass).
const SPIN: u32 = 1 << 20;

/// The twin's name of a chainable kernel.
pub(crate) fn chained_name(kernel: &str) -> Option<&'static str> {
    CHAINED.iter().find(|c| c.0 == kernel).map(|c| c.1)
}

/// The kernel a twin's name wraps, for a twin's name.
pub(crate) fn base_name(kernel: &str) -> Option<&str> {
    kernel.strip_suffix(SUFFIX)
}

const WRAPPER: &str = "
struct ChainStep {
    want: u32,
    spin: u32,
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(30) var<uniform> chain_step: ChainStep;
// [0] workgroups of this pass's chained dispatches that finished, [1] workgroups that gave up.
@group(0) @binding(31) var<storage, read_write> chain_sync: array<atomic<u32>>;

fn chain_wait(li: u32) {
    if li == 0u {
        var polls = 0u;
        loop {
            if atomicLoad(&chain_sync[0]) >= chain_step.want {
                break;
            }
            polls++;
            if polls >= chain_step.spin {
                atomicAdd(&chain_sync[1], 1u);
                break;
            }
        }
    }
    // Device scope: what the dispatches before wrote is visible after it.
    storageBarrier();
}

fn chain_done(li: u32) {
    // Every invocation's stores before the count-in.
    storageBarrier();
    if li == 0u {
        atomicAdd(&chain_sync[0], 1u);
    }
}
";

/// The chained twin's WGSL of a kernel's: its `main` renamed `chain_body` (its parameters'
/// attributes dropped), and a new `main` with the same attributes and parameters that waits
/// (`chain_wait`), runs the body and counts in (`chain_done`). Every exit of a kernel's `main`
/// must be uniform across its workgroup (the chainable kernels' early returns are: tails and
/// reduces return whole workgroups), since `chain_done` holds a barrier.
pub(crate) fn wrap(src: &str) -> Result<String, String> {
    let at = src.find("fn main(").ok_or("no fn main(")?;
    let attrs_at = src[..at]
        .rfind("@compute")
        .ok_or("no @compute before fn main")?;
    let attrs = src[attrs_at..at].trim();
    let open = at + "fn main(".len();
    let mut depth = 1;
    let mut close = None;
    for (i, c) in src[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let close = close.ok_or("fn main( is not closed")?;
    let params: Vec<&str> = split_params(&src[open..close]);
    let mut inner = vec![];
    let mut names = vec![];
    let mut li = None;
    for p in &params {
        let colon = p
            .rfind(':')
            .ok_or_else(|| format!("parameter {p:?} has no type"))?;
        let (decl, ty) = (p[..colon].trim(), p[colon + 1..].trim());
        // The name follows the last attribute: `@builtin(local_invocation_index) li`.
        let name = decl
            .rsplit(|c: char| c == ')' || c.is_whitespace())
            .next()
            .filter(|n| !n.is_empty() && !n.starts_with('@'))
            .ok_or_else(|| format!("parameter {p:?} has no name"))?;
        if decl.contains("@builtin(local_invocation_index)") {
            li = Some(name.to_string());
        }
        inner.push(format!("{name}: {ty}"));
        names.push(name.to_string());
    }
    let mut outer: Vec<String> = params.iter().map(|p| p.trim().to_string()).collect();
    let li = match li {
        Some(n) => n,
        None => {
            outer.push("@builtin(local_invocation_index) chain_li: u32".into());
            "chain_li".into()
        }
    };
    let mut out = String::with_capacity(src.len() + WRAPPER.len() + 512);
    out.push_str(&src[..attrs_at]);
    out.push_str("fn chain_body(");
    out.push_str(&inner.join(", "));
    out.push_str(&src[close..]);
    out.push_str(WRAPPER);
    out.push_str(&format!(
        "\n{attrs}\nfn main({}) {{\n    chain_wait({li});\n    chain_body({});\n    chain_done({li});\n}}\n",
        outer.join(", "),
        names.join(", "),
    ));
    Ok(out)
}

/// A parameter list split at its top-level commas (none inside an attribute's parentheses or a
/// type's angle brackets), empty pieces (a trailing comma) dropped.
fn split_params(list: &str) -> Vec<&str> {
    let mut out = vec![];
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&list[start..]);
    out.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StepParams {
    want: u32,
    spin: u32,
    _pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ResetParams {
    value: u32,
    _pad: [u32; 3],
}

/// The chained twin of one dispatch: its pipeline, its bind group (the dispatch's own entries,
/// the step's uniform at 30 and the counter at 31) and the number of workgroups it waits for.
pub(crate) struct Chained {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    step: wgpu::Buffer,
    /// What `step` holds.
    want: AtomicU32,
}

impl Chained {
    /// The twin of a dispatch of `kernel` with `constants` and bind group `entries`; `None`
    /// where overlapped decode is off or the kernel has no twin.
    pub(crate) fn new(
        ctx: &GpuContext,
        kernel: &str,
        constants: &[(&'static str, f64)],
        entries: &[wgpu::BindGroupEntry<'_>],
    ) -> Result<Option<Self>, GpuError> {
        let Some(name) = chained_name(kernel) else {
            return Ok(None);
        };
        let Some(sync) = ctx.chain_sync() else {
            return Ok(None);
        };
        let pipeline = ctx.pipeline_unfenced(name, constants)?;
        let step = ctx.uniform(
            "chain step",
            &StepParams {
                want: 0,
                spin: SPIN,
                _pad: [0; 2],
            },
        );
        let mut e = entries.to_vec();
        e.push(Binding::whole(&step).entry(30));
        e.push(Binding::whole(&sync.buf).entry(31));
        let bind = ctx.bind_group(name, &pipeline, &e)?;
        Ok(Some(Chained {
            pipeline,
            bind,
            step,
            want: AtomicU32::new(0),
        }))
    }
}

/// The counter the twins wait on, and the dispatch that resets it.
pub(crate) struct ChainSync {
    buf: wgpu::Buffer,
    reset: Dispatch,
    /// Experiment (session 25): dispatches of more workgroups run ordinary
    /// (`SMOE_OVERLAP_MAX_GROUPS`, unlimited by default).
    pub(crate) max_groups: u32,
}

impl ChainSync {
    pub(crate) fn new(ctx: &GpuContext) -> Result<Self, GpuError> {
        let buf = ctx.storage_buffer("chain sync", 16);
        ctx.queue.write_buffer(&buf, 0, &[0; 16]);
        let p = ResetParams {
            value: 0,
            _pad: [0; 3],
        };
        let reset = Dispatch::new(
            ctx,
            "chain_reset",
            &[],
            &p,
            &[Binding::whole(&buf)],
            [1, 1, 1],
        )?;
        let max_groups = std::env::var("SMOE_OVERLAP_MAX_GROUPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(u32::MAX);
        Ok(ChainSync {
            buf,
            reset,
            max_groups,
        })
    }

    /// Workgroups that gave up waiting since the context was opened (each ran without knowing
    /// that the dispatches before it had finished). Waits for the GPU.
    pub(crate) fn gave_up(&self, ctx: &GpuContext) -> Result<u32, GpuError> {
        Ok(ctx.read_u32(&self.buf, 0, 2)?[1])
    }
}

/// Where a recording in overlapped mode stands: workgroups of chained dispatches recorded since
/// the counter's last reset.
pub struct ChainCursor<'a> {
    ctx: &'a GpuContext,
    sync: &'a ChainSync,
    total: u32,
    fresh: bool,
}

impl<'a> ChainCursor<'a> {
    /// `None` where overlapped decode is off.
    pub fn new(ctx: &'a GpuContext) -> Option<Self> {
        Some(ChainCursor {
            ctx,
            sync: ctx.chain_sync()?,
            total: 0,
            fresh: true,
        })
    }

    fn reset(&mut self, pass: &mut wgpu::ComputePass<'_>) {
        self.sync.reset.record(pass);
        self.total = 0;
        self.fresh = false;
    }

    /// Records `c` to run once every chained workgroup recorded before it has finished.
    pub(crate) fn chained(
        &mut self,
        pass: &mut wgpu::ComputePass<'_>,
        c: &Chained,
        [x, y, z]: [u32; 3],
    ) -> bool {
        if x * y * z > self.sync.max_groups {
            self.fenced(pass);
            return false;
        }
        if self.fresh {
            self.reset(pass);
        }
        if c.want.swap(self.total, Ordering::Relaxed) != self.total {
            let p = StepParams {
                want: self.total,
                spin: SPIN,
                _pad: [0; 2],
            };
            self.ctx
                .queue
                .write_buffer(&c.step, 0, bytemuck::bytes_of(&p));
        }
        pass.set_pipeline(&c.pipeline);
        pass.set_bind_group(0, &c.bind, &[]);
        pass.dispatch_workgroups(x, y, z);
        self.total += x * y * z;
        true
    }

    /// Before an ordinary dispatch (one that follows chained ones must wait for them) and at
    /// the end of a recording.
    pub fn fenced(&mut self, pass: &mut wgpu::ComputePass<'_>) {
        if self.total > 0 {
            self.reset(pass);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_keeps_the_parameters_and_adds_the_wait() {
        let src = "const WG: u32 = 64u;\n@compute @workgroup_size(WG)\nfn main(\n    @builtin(workgroup_id) wid: vec3<u32>,\n    @builtin(local_invocation_index) li: u32,\n) {\n    if wid.x == 0u { return; }\n}\n";
        let w = wrap(src).unwrap();
        assert!(w.contains("fn chain_body(wid: vec3<u32>, li: u32)"), "{w}");
        assert!(w.contains(
            "@compute @workgroup_size(WG)\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {\n    chain_wait(li);\n    chain_body(wid, li);\n    chain_done(li);"
        ), "{w}");
        assert_eq!(w.matches("@compute").count(), 1, "{w}");
        // Without the invocation index, the wrapper adds its own.
        let src = "@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n}\n";
        let w = wrap(src).unwrap();
        assert!(
            w.contains("@builtin(local_invocation_index) chain_li: u32"),
            "{w}"
        );
        assert!(w.contains("chain_body(gid);"), "{w}");
        assert!(wrap("fn f() {}").is_err());
    }

    /// A twin's SPIR-V: every storage binding but the weights' is `Coherent`, once.
    #[test]
    fn twins_bind_activations_coherent_and_weights_cached() {
        use crate::gpu::spirv::{coherent_bindings, Parsed};
        let parsed = Parsed::new(&crate::gpu::kernel_source("matvec+chain").unwrap()).unwrap();
        let coherent = parsed.storage_bindings_except(WEIGHT_BINDINGS);
        // x, y, ids, rw, hn, done, tids, tacc, ya, rp and the chain's counter; not w, nw, wr.
        let mut sorted = coherent.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![2, 3, 4, 6, 7, 8, 9, 10, 11, 13, 31]);
        let mut words = parsed.compile(&[], false, true).unwrap();
        let before = words.len();
        coherent_bindings(&mut words, &coherent).unwrap();
        assert_eq!(words.len(), before + 3 * coherent.len());
        let decorated = words
            .windows(3)
            .filter(|w| w[0] == (3 << 16) | 71 && w[2] == 23)
            .count();
        assert_eq!(decorated, coherent.len());
        // A binding the module does not have is refused.
        assert!(coherent_bindings(&mut words, &[29]).is_err());
    }

    /// Every chainable kernel's twin parses, validates (naga) and compiles to SPIR-V with the
    /// wrapper, with its defaults and with constants a decode pass sets (attention's fused
    /// RoPE and merge size override-length workgroup arrays: a second such array in the
    /// wrapper once made naga's override pass panic on the device, session 25).
    #[test]
    fn every_twin_compiles() {
        let attn: &[(&str, f64)] = &[
            ("WG", 128.0),
            ("DIRECT", 1.0),
            ("ROPE", 1.0),
            ("MERGE", 1.0),
        ];
        for (base, twin) in CHAINED {
            let src = crate::gpu::kernel_source(twin).unwrap();
            assert!(src.contains("fn chain_body("), "{base}");
            let parsed = match crate::gpu::spirv::Parsed::new(&src) {
                Ok(p) => p,
                Err(e) => panic!("{twin}: {e}"),
            };
            let sets: &[&[(&str, f64)]] = match *base {
                "attn_decode" => &[&[], attn],
                _ => &[&[]],
            };
            for constants in sets {
                let compiled = std::panic::catch_unwind(|| parsed.compile(constants, false, true));
                match compiled {
                    Ok(Ok(words)) => assert!(words.len() > 5, "{twin}"),
                    Ok(Err(e)) => panic!("{twin} {constants:?}: {e}"),
                    Err(_) => panic!("{twin} {constants:?}: naga panicked"),
                }
            }
        }
    }
}
