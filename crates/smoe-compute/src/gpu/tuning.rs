//! `GpuTuning`: the settings a `GpuContext` is opened with. The defaults are what runs fastest
//! where it is correct; a field set otherwise is for comparisons, for working around a driver,
//! or for trying edited kernels. The library reads no environment: the `smoe` binary maps its
//! `SMOE_*` variables to these fields (`smoe-cli/src/tuning.rs`).

use std::path::PathBuf;

/// How a `GpuContext` builds and runs its kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuTuning {
    /// Shader bounds checks (each index into a buffer clamped). Default: on in debug builds
    /// (tests), off in release builds, where they cost 2× on GEMV.
    pub bounds_checks: bool,
    /// Whether decode kernels may finish follow-up work in their dispatch's last workgroup
    /// (the router's top-k, the experts' weighted sum, decode attention's merge of its splits:
    /// `Fuse::route`, `Fuse::sum_into`), where the backend makes that safe (Vulkan, not through
    /// MoltenVK; see `GpuInfo::fused_tails`). False: those run as dispatches of their own, as on
    /// Metal. Default: true.
    pub fused_tails: bool,
    /// Whether the prefill GEMMs may use the matrix units (tensor cores), where the adapter
    /// offers what they need (`MatrixUnits`). Default: true.
    pub matrix_units: bool,
    /// Which kernels get execution-only workgroup barriers where the matrix units are used
    /// (`ExecBarriers`); elsewhere none do. `None`: every kernel on NVIDIA's own Vulkan
    /// driver, none on other drivers. Default: `None`.
    pub exec_barriers: Option<ExecBarriers>,
    /// Whether a streaming decoder holds an NVIDIA GPU's clocks up with a CUDA context while it
    /// waits for reads (`ClockHold`). Default: true.
    pub hold_clocks: bool,
    /// A developer's folder of edited kernels, read instead of the compiled-in ones to try a
    /// kernel variant without rebuilding: every file `NAME.wgsl` there replaces the kernel or
    /// fragment of that name (a kernel file whose first line is `// smoe: standalone` gets no
    /// fragments prepended). Default: `None` (only the compiled-in sources).
    pub kernel_dir: Option<PathBuf>,
}

impl Default for GpuTuning {
    fn default() -> Self {
        GpuTuning {
            bounds_checks: cfg!(debug_assertions),
            fused_tails: true,
            matrix_units: true,
            exec_barriers: None,
            hold_clocks: true,
            kernel_dir: None,
        }
    }
}

/// Which kernels are compiled with execution-only workgroup barriers
/// (`spirv::execution_only_barriers`). Needs passthrough SPIR-V, which the device is opened with
/// only where the matrix units are used; by default on NVIDIA's own driver, `AllKernels`
/// (`GpuTuning::exec_barriers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecBarriers {
    Off,
    /// Only the tensor-core GEMM (compiled by us anyway).
    TensorCoreGemm,
    /// Every kernel: all of them are compiled by us and handed over as passthrough SPIR-V.
    AllKernels,
}

impl ExecBarriers {
    /// Whether a kernel's barriers lose their memory semantics (`cooperative`: the tensor-core
    /// GEMM).
    pub fn covers(self, cooperative: bool) -> bool {
        match self {
            ExecBarriers::Off => false,
            ExecBarriers::TensorCoreGemm => cooperative,
            ExecBarriers::AllKernels => true,
        }
    }
}
