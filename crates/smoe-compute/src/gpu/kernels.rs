//! The WGSL sources, compiled into the binary. One file per kernel in `kernels/`, each with a
//! `main` entry point; shared fragments (`common.wgsl`: workgroup reductions;
//! `gemm_common.wgsl`: the GEMMs' parameters, bindings, loads and weight decoding; `topk.wgsl`:
//! the router's softmax top-k; `rope.wgsl`: RoPE's rotation;
//! `attn_merge.wgsl`: decode attention's merge of its splits) are prepended
//! to the kernels that use them, since WGSL has no includes.

const COMMON: &str = include_str!("../../kernels/common.wgsl");
const GEMM_COMMON: &str = include_str!("../../kernels/gemm_common.wgsl");
const TOPK: &str = include_str!("../../kernels/topk.wgsl");
const ROPE: &str = include_str!("../../kernels/rope.wgsl");
const MERGE: &str = include_str!("../../kernels/attn_merge.wgsl");

/// (name, source, fragments prepended to it)
const KERNELS: &[(&str, &str, &[&str])] = &[
    ("matvec", include_str!("../../kernels/matvec.wgsl"), &[TOPK]),
    (
        "matmul",
        include_str!("../../kernels/matmul.wgsl"),
        &[GEMM_COMMON],
    ),
    (
        "matmul_coop",
        include_str!("../../kernels/matmul_coop.wgsl"),
        &[GEMM_COMMON],
    ),
    (
        "expert_sort",
        include_str!("../../kernels/expert_sort.wgsl"),
        &[],
    ),
    (
        "rms_norm",
        include_str!("../../kernels/rms_norm.wgsl"),
        &[COMMON],
    ),
    (
        "qk_norm_rope",
        include_str!("../../kernels/qk_norm_rope.wgsl"),
        &[COMMON, ROPE],
    ),
    (
        "attn_decode",
        include_str!("../../kernels/attn_decode.wgsl"),
        &[COMMON, ROPE, MERGE],
    ),
    (
        "attn_prefill",
        include_str!("../../kernels/attn_prefill.wgsl"),
        &[],
    ),
    (
        "attn_combine",
        include_str!("../../kernels/attn_combine.wgsl"),
        &[MERGE],
    ),
    ("router", include_str!("../../kernels/router.wgsl"), &[TOPK]),
    (
        "weighted_sum",
        include_str!("../../kernels/weighted_sum.wgsl"),
        &[],
    ),
    (
        "argmax",
        include_str!("../../kernels/argmax.wgsl"),
        &[COMMON],
    ),
    ("copy", include_str!("../../kernels/copy.wgsl"), &[]),
    ("embed", include_str!("../../kernels/embed.wgsl"), &[]),
    ("eltwise", include_str!("../../kernels/eltwise.wgsl"), &[]),
];

/// Every kernel's name (for the Metal translation test and `smoe info`).
pub fn kernel_names() -> Vec<&'static str> {
    KERNELS.iter().map(|k| k.0).collect()
}

/// The full WGSL of `name`, as handed to the device.
pub fn kernel_source(name: &str) -> Option<String> {
    let (_, src, fragments) = KERNELS.iter().find(|k| k.0 == name)?;
    // A kernel's `enable` directives must come before any declaration: they stay first.
    let (enables, body): (Vec<&str>, Vec<&str>) =
        src.lines().partition(|l| l.starts_with("enable "));
    let mut out = enables.join("\n");
    for f in fragments.iter() {
        out.push('\n');
        out.push_str(f);
    }
    out.push('\n');
    out.push_str(&body.join("\n"));
    Some(out)
}
