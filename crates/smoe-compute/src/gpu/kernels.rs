//! The WGSL sources, compiled into the binary. One file per kernel in `kernels/`, each with a
//! `main` entry point; `common.wgsl` (reductions shared by several kernels) is prepended to those
//! that use it, since WGSL has no includes.

const COMMON: &str = include_str!("../../kernels/common.wgsl");

/// (name, source, needs common.wgsl)
const KERNELS: &[(&str, &str, bool)] = &[
    ("matvec", include_str!("../../kernels/matvec.wgsl"), false),
    ("matmul", include_str!("../../kernels/matmul.wgsl"), false),
    (
        "expert_sort",
        include_str!("../../kernels/expert_sort.wgsl"),
        false,
    ),
    (
        "rms_norm",
        include_str!("../../kernels/rms_norm.wgsl"),
        true,
    ),
    (
        "qk_norm_rope",
        include_str!("../../kernels/qk_norm_rope.wgsl"),
        true,
    ),
    (
        "attn_decode",
        include_str!("../../kernels/attn_decode.wgsl"),
        true,
    ),
    (
        "attn_prefill",
        include_str!("../../kernels/attn_prefill.wgsl"),
        false,
    ),
    (
        "attn_combine",
        include_str!("../../kernels/attn_combine.wgsl"),
        false,
    ),
    ("router", include_str!("../../kernels/router.wgsl"), true),
    (
        "weighted_sum",
        include_str!("../../kernels/weighted_sum.wgsl"),
        false,
    ),
    ("argmax", include_str!("../../kernels/argmax.wgsl"), true),
    ("copy", include_str!("../../kernels/copy.wgsl"), false),
    ("embed", include_str!("../../kernels/embed.wgsl"), false),
    ("eltwise", include_str!("../../kernels/eltwise.wgsl"), false),
];

/// Every kernel's name (for the Metal translation test and `smoe info`).
pub fn kernel_names() -> Vec<&'static str> {
    KERNELS.iter().map(|k| k.0).collect()
}

/// The full WGSL of `name`, as handed to the device.
pub fn kernel_source(name: &str) -> Option<String> {
    let (_, src, common) = KERNELS.iter().find(|k| k.0 == name)?;
    Some(if *common {
        format!("{COMMON}\n{src}")
    } else {
        src.to_string()
    })
}
