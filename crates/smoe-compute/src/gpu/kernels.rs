//! The WGSL sources, compiled into the binary. One file per kernel in `kernels/`, each with a
//! `main` entry point; shared fragments (`common.wgsl`: workgroup reductions;
//! `gemm_common.wgsl`: the GEMMs' parameters, bindings, loads and weight decoding; `topk.wgsl`:
//! the router's softmax top-k; `rope.wgsl`: RoPE's rotation; `code_pair_f16.wgsl` /
//! `code_pair_f32.wgsl`: the matvec's q4 code pairs, with and without f16 arithmetic;
//! `attn_merge.wgsl`: decode attention's merge of its splits; `attn_prefill_common.wgsl`: the
//! prefill attention's parameters and its tiles' key units) are prepended to the kernels that
//! use them, since WGSL has no includes.

use std::borrow::Cow;
use std::path::Path;

/// A fragment: (file name without `.wgsl`, source).
type Fragment = (&'static str, &'static str);

const COMMON: Fragment = ("common", include_str!("../../kernels/common.wgsl"));
const GEMM_COMMON: Fragment = (
    "gemm_common",
    include_str!("../../kernels/gemm_common.wgsl"),
);
const TOPK: Fragment = ("topk", include_str!("../../kernels/topk.wgsl"));
const ROPE: Fragment = ("rope", include_str!("../../kernels/rope.wgsl"));
const MERGE: Fragment = ("attn_merge", include_str!("../../kernels/attn_merge.wgsl"));
const CODE_PAIR_F16: Fragment = (
    "code_pair_f16",
    include_str!("../../kernels/code_pair_f16.wgsl"),
);
const PREFILL_COMMON: Fragment = (
    "attn_prefill_common",
    include_str!("../../kernels/attn_prefill_common.wgsl"),
);
const CODE_PAIR_F32: Fragment = (
    "code_pair_f32",
    include_str!("../../kernels/code_pair_f32.wgsl"),
);

/// `embedded`, or the file `name.wgsl` in `dir` where there is one.
fn text(dir: Option<&Path>, name: &str, embedded: &'static str) -> Cow<'static, str> {
    if let Some(dir) = dir {
        let path = dir.join(format!("{name}.wgsl"));
        if let Ok(s) = std::fs::read_to_string(&path) {
            tracing::warn!("kernel {name} read from {}", path.display());
            return s.into();
        }
    }
    embedded.into()
}

/// (name, source, fragments prepended to it)
const KERNELS: &[(&str, &str, &[Fragment])] = &[
    (
        "matvec",
        include_str!("../../kernels/matvec.wgsl"),
        &[CODE_PAIR_F32, TOPK],
    ),
    // The same kernel with f16 arithmetic where it helps (the device must have SHADER_F16).
    (
        "matvec_f16",
        include_str!("../../kernels/matvec.wgsl"),
        &[CODE_PAIR_F16, TOPK],
    ),
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
        &[PREFILL_COMMON],
    ),
    (
        "attn_prefill_merge",
        include_str!("../../kernels/attn_prefill_merge.wgsl"),
        &[PREFILL_COMMON],
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
    ("slot_map", include_str!("../../kernels/slot_map.wgsl"), &[]),
];

/// Every kernel's name (for the Metal translation test and `smoe info`).
pub fn kernel_names() -> Vec<&'static str> {
    KERNELS.iter().map(|k| k.0).collect()
}

/// The full compiled-in WGSL of `name`, as handed to the device (`GpuContext::kernel_source`
/// has it with `GpuTuning::kernel_dir`'s edits).
pub fn kernel_source(name: &str) -> Option<String> {
    source_with_edits(name, None)
}

/// `kernel_source` with the edited kernels of `dir` (`GpuTuning::kernel_dir`).
pub(crate) fn source_with_edits(name: &str, dir: Option<&Path>) -> Option<String> {
    let (name, src, fragments) = KERNELS.iter().find(|k| k.0 == name)?;
    let src = text(dir, name, src);
    // An edited kernel that starts with this line carries its fragments itself.
    let fragments = match src.starts_with("// smoe: standalone") {
        true => &[][..],
        false => &fragments[..],
    };
    // A kernel's directives (`enable`, `diagnostic`) must come before any declaration: they
    // stay first.
    let (enables, body): (Vec<&str>, Vec<&str>) = src
        .lines()
        .partition(|l| l.starts_with("enable ") || l.starts_with("diagnostic("));
    let mut out = enables.join("\n");
    for (f, f_src) in fragments.iter() {
        out.push('\n');
        out.push_str(&text(dir, f, f_src));
    }
    out.push('\n');
    out.push_str(&body.join("\n"));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edited_kernels_replace_the_compiled_in_ones() {
        let dir = std::env::temp_dir().join(format!("smoe-kernel-edits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let embedded = source_with_edits("rms_norm", None).unwrap();
        assert!(embedded.contains(COMMON.1) && embedded.contains("fn main"));
        // No file for it: the compiled-in source.
        assert_eq!(source_with_edits("rms_norm", Some(&dir)).unwrap(), embedded);
        // An edited fragment goes into every kernel that uses it.
        std::fs::write(dir.join("common.wgsl"), "// edited common\n").unwrap();
        let s = source_with_edits("rms_norm", Some(&dir)).unwrap();
        assert!(s.contains("// edited common") && !s.contains(COMMON.1));
        // An edited kernel gets the fragments, or none when standalone; enables stay first.
        std::fs::write(
            dir.join("copy.wgsl"),
            "// mine\nenable f16;\nfn main() {}\n",
        )
        .unwrap();
        assert!(source_with_edits("copy", Some(&dir))
            .unwrap()
            .starts_with("enable f16;\n"));
        // So do `diagnostic` directives (WGSL rejects them after a declaration).
        std::fs::write(
            dir.join("rms_norm.wgsl"),
            "enable f16;\ndiagnostic(off, derivative_uniformity);\nfn main() {}\n",
        )
        .unwrap();
        let s = source_with_edits("rms_norm", Some(&dir)).unwrap();
        assert!(s.starts_with("enable f16;\ndiagnostic(off, derivative_uniformity);\n"));
        assert!(s.contains("// edited common"));
        std::fs::write(
            dir.join("rms_norm.wgsl"),
            "// smoe: standalone\nfn main() {}\n",
        )
        .unwrap();
        let s = source_with_edits("rms_norm", Some(&dir)).unwrap();
        assert!(!s.contains("edited common") && s.contains("fn main() {}"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
