//! The device: adapter choice, features and limits, shader modules and the pipeline cache.
//! Buffer helpers are in `buffers.rs`.

use super::kernels;
use super::tuning::{ExecBarriers, GpuTuning};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no GPU adapter found (Vulkan, Metal or DX12); install a driver, or use --backend cpu"
    )]
    NoAdapter,
    #[error("GPU adapter '{0}' lacks subgroup operations, which every smoe kernel needs")]
    NoSubgroups(String),
    #[error("could not open the GPU device: {0}")]
    Device(String),
    #[error("GPU kernel '{kernel}': {msg}")]
    Kernel { kernel: String, msg: String },
    #[error("GPU read-back failed: {0}")]
    Readback(String),
    #[error("{0}")]
    Shape(String),
}

/// What `GpuContext::info` reports: printable with `{}`.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub adapter: wgpu::AdapterInfo,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
    pub bounds_checks: bool,
    /// Why the prefill GEMMs do or do not run on the matrix units (see `MatrixUnits`).
    pub matrix_units: MatrixUnits,
    /// Whether kernels may finish in their dispatch's last workgroup (`Fuse::route`,
    /// `Fuse::sum_into`; see `fused_tails_probe`).
    pub fused_tails: bool,
    /// Which kernels' workgroup barriers are execution barriers without memory semantics
    /// (`spirv::execution_only_barriers`; see `ExecBarriers`).
    pub exec_barriers: ExecBarriers,
    /// Whether a streaming decoder holds an NVIDIA GPU's clocks up (`GpuTuning::hold_clocks`).
    pub hold_clocks: bool,
}

/// Whether the adapter is NVIDIA's own Vulkan driver (not Mesa's NVK), whose workgroup
/// barrier orders shared memory by itself (see `spirv::execution_only_barriers`).
fn nvidia_driver(info: &wgpu::AdapterInfo) -> bool {
    info.backend == wgpu::Backend::Vulkan && info.vendor == 0x10de && info.driver.contains("NVIDIA")
}

/// Fused tails rely on a storage barrier publishing a workgroup's writes device-wide before its
/// atomic count-in: naga emits a device-scope acquire-release barrier for SPIR-V (Vulkan), while
/// Metal's `threadgroup_barrier(mem_device)` orders memory only within the threadgroup. So they
/// are used on Vulkan only — not through MoltenVK, which is Metal underneath — and only where
/// `GpuTuning::fused_tails` (`wanted`) allows them.
fn fused_tails_probe(info: &wgpu::AdapterInfo, wanted: bool) -> bool {
    let metal_underneath = info.driver.contains("MoltenVK") || info.name.contains("Apple");
    info.backend == wgpu::Backend::Vulkan && !metal_underneath && wanted
}

/// Whether the prefill GEMMs use the matrix units (tensor cores): `kernels/matmul_coop.wgsl`,
/// 16 × 16 × 16 f16 cooperative matrices with f32 sums, needs the adapter to list that
/// configuration, to run subgroups of exactly 32 invocations (NVIDIA's Vulkan driver does; Metal
/// offers only 8 × 8, lavapipe none) and to take passthrough SPIR-V (see `spirv.rs` for why).
/// `GpuTuning::matrix_units` false turns them off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MatrixUnits {
    Used,
    /// Not used, and why.
    Unused(String),
}

impl MatrixUnits {
    fn probe(adapter: &wgpu::Adapter, wanted: bool) -> Self {
        use wgpu::CooperativeScalarType as T;
        let info = adapter.get_info();
        let f16_config = adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == T::F16
                && c.cr_type == T::F32
        });
        let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
        let passthrough = info.backend == wgpu::Backend::Vulkan
            && adapter
                .features()
                .contains(wgpu::Features::PASSTHROUGH_SHADERS);
        let why = if !wanted {
            "turned off (tuning: matrix_units false)"
        } else if !adapter.features().contains(need) || !f16_config {
            "the adapter offers no 16x16x16 f16 cooperative matrices"
        } else if (info.subgroup_min_size, info.subgroup_max_size) != (32, 32) {
            "the kernel needs subgroups of exactly 32"
        } else if !passthrough {
            "the kernel needs Vulkan passthrough shaders"
        } else {
            return MatrixUnits::Used;
        };
        MatrixUnits::Unused(why.into())
    }
}

impl fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.adapter;
        writeln!(
            f,
            "adapter: {} ({:?}, {:?})",
            a.name, a.device_type, a.backend
        )?;
        writeln!(f, "driver: {} {}", a.driver, a.driver_info)?;
        writeln!(
            f,
            "subgroup size: {}..{}",
            a.subgroup_min_size, a.subgroup_max_size
        )?;
        let mut feats = vec![];
        for (flag, name) in [
            (wgpu::Features::SUBGROUP, "SUBGROUP"),
            (wgpu::Features::SHADER_F16, "SHADER_F16"),
            (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
            (
                wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
                "TIMESTAMP_QUERY_INSIDE_PASSES",
            ),
        ] {
            if self.features.contains(flag) {
                feats.push(name);
            }
        }
        writeln!(f, "features: {}", feats.join(" "))?;
        let l = &self.limits;
        writeln!(
            f,
            "limits: max buffer {} MiB, max storage binding {} MiB, workgroup storage {} KiB, \
             invocations/workgroup {}, workgroups/dim {}",
            l.max_buffer_size >> 20,
            l.max_storage_buffer_binding_size >> 20,
            l.max_compute_workgroup_storage_size >> 10,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension
        )?;
        writeln!(
            f,
            "shader bounds checks: {}",
            if self.bounds_checks { "on" } else { "off" }
        )?;
        writeln!(
            f,
            "fused tails (router top-k, experts' sum in their matvecs): {}",
            if self.fused_tails { "on" } else { "off" }
        )?;
        match &self.matrix_units {
            MatrixUnits::Used => write!(
                f,
                "matrix units (prefill GEMMs): f16 16x16x16, f32 sums{}",
                match self.exec_barriers {
                    ExecBarriers::Off => "",
                    ExecBarriers::TensorCoreGemm => ", execution-only barriers (GEMM)",
                    ExecBarriers::AllKernels => ", execution-only barriers (every kernel)",
                }
            ),
            MatrixUnits::Unused(why) => write!(f, "matrix units (prefill GEMMs): not used ({why})"),
        }
    }
}

/// (kernel, its `override`s).
type PipelineKey = (&'static str, Vec<(&'static str, u64)>);

pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    info: GpuInfo,
    /// What the context was opened with.
    tuning: GpuTuning,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    /// Kernels parsed for `pipeline_spirv`, once each (as `modules` for wgpu's path).
    parsed: Mutex<HashMap<&'static str, Arc<super::spirv::Parsed>>>,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    /// Why the matrix units were turned off after opening (a kernel that failed to build).
    matrix_units_off: Mutex<Option<String>>,
}

impl GpuContext {
    /// Opens the best adapter (a discrete / high-performance one when there is one) with the
    /// default `GpuTuning`.
    pub fn new() -> Result<Self, GpuError> {
        Self::with_tuning(GpuTuning::default())
    }

    /// Opens the best adapter with `tuning`.
    pub fn with_tuning(tuning: GpuTuning) -> Result<Self, GpuError> {
        pollster::block_on(Self::open(tuning))
    }

    async fn open(tuning: GpuTuning) -> Result<Self, GpuError> {
        if let Some(d) = tuning.kernel_dir.as_ref().filter(|d| !d.is_dir()) {
            // A mistyped path would otherwise silently measure the compiled-in kernels.
            tracing::warn!(
                "kernel folder {} is not a folder: no kernel edits",
                d.display()
            );
        }
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        // wgpu checks every indirect dispatch's counts with an extra dispatch and two barriers
        // before it. Ours are counts the wrappers checked when they were built, or zeros
        // (`Launch`, `SlotMap`), so the check would only slow a streaming pass down.
        desc.flags
            .remove(wgpu::InstanceFlags::VALIDATION_INDIRECT_CALL);
        let instance = wgpu::Instance::new(desc);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|_| GpuError::NoAdapter)?;
        let ainfo = adapter.get_info();
        let have = adapter.features();
        if !have.contains(wgpu::Features::SUBGROUP) {
            return Err(GpuError::NoSubgroups(ainfo.name));
        }
        // Timestamps inside passes: the per-step breakdown of `smoe bench decode --breakdown`.
        // Mappable storage buffers: streamed experts are copied straight into their VRAM slots
        // (`mappable_storage_buffer`).
        let wanted = wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_F16
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
            | wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        let matrix_units = MatrixUnits::probe(&adapter, tuning.matrix_units);
        let mut features = have & wanted;
        if matrix_units == MatrixUnits::Used {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
                | wgpu::Features::PASSTHROUGH_SHADERS;
        }
        // Everything the adapter offers: big weight bindings and workgroup memory matter here.
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("smoe"),
                required_features: features,
                required_limits: limits.clone(),
                // SAFETY: the one experimental feature requested is cooperative matrices, used
                // only by matmul_coop.wgsl, whose every variant the GPU tests check against the
                // CPU on an adapter that has them.
                experimental_features: if matrix_units == MatrixUnits::Used {
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::Device(e.to_string()))?;
        let fused_tails = fused_tails_probe(&ainfo, tuning.fused_tails);
        let exec_barriers = match (&matrix_units, tuning.exec_barriers) {
            (MatrixUnits::Unused(_), _) => ExecBarriers::Off,
            (MatrixUnits::Used, Some(set)) => set,
            (MatrixUnits::Used, None) if nvidia_driver(&ainfo) => ExecBarriers::AllKernels,
            (MatrixUnits::Used, None) => ExecBarriers::Off,
        };
        let info = GpuInfo {
            fused_tails,
            exec_barriers,
            hold_clocks: tuning.hold_clocks,
            adapter: ainfo,
            features,
            limits,
            bounds_checks: tuning.bounds_checks,
            matrix_units,
        };
        Ok(GpuContext {
            device,
            queue,
            info,
            tuning,
            modules: Mutex::default(),
            parsed: Mutex::default(),
            pipelines: Mutex::default(),
            matrix_units_off: Mutex::default(),
        })
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The settings the context was opened with (`GpuInfo` says what they came to on this
    /// adapter).
    pub fn tuning(&self) -> &GpuTuning {
        &self.tuning
    }

    /// The full WGSL of `kernel` as this context builds it (with `GpuTuning::kernel_dir`'s
    /// edits, if any).
    pub fn kernel_source(&self, kernel: &str) -> Option<String> {
        kernels::source_with_edits(kernel, self.tuning.kernel_dir.as_deref())
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.info.limits
    }

    /// Whether decode kernels may run their follow-up work in their last workgroup.
    pub fn fused_tails(&self) -> bool {
        self.info.fused_tails
    }

    /// Whether the prefill GEMMs can run on the matrix units (`MatrixUnits`).
    pub fn has_matrix_units(&self) -> bool {
        self.matrix_units() == MatrixUnits::Used
    }

    /// `GpuInfo::matrix_units`, or why they were turned off since (`disable_matrix_units`).
    pub fn matrix_units(&self) -> MatrixUnits {
        match &*self
            .matrix_units_off
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            Some(why) => MatrixUnits::Unused(why.clone()),
            None => self.info.matrix_units.clone(),
        }
    }

    /// Stops using the matrix units on this context from now on.
    pub fn disable_matrix_units(&self, why: String) {
        *self
            .matrix_units_off
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    /// The compute pipeline of `kernel` (a file in `kernels/`) specialised by `constants`
    /// (WGSL `override`s), built on first use and cached. Entry point: `main`.
    pub fn pipeline(
        &self,
        kernel: &'static str,
        constants: &[(&'static str, f64)],
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        if self.info.exec_barriers == ExecBarriers::AllKernels {
            return self.pipeline_spirv(kernel, constants);
        }
        self.cached_pipeline(kernel, constants, || {
            let module = self.module(kernel)?;
            Ok(self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(kernel),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        // Every kernel writes workgroup memory before reading it.
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                }))
        })
    }

    /// Like `pipeline`, but compiled to SPIR-V by `spirv::Parsed::compile` (with its memory-model fix
    /// and, as `GpuInfo::exec_barriers` says, execution-only barriers) and handed to the driver
    /// as is, with group 0's layout made from the bindings `main` uses (a passthrough module
    /// cannot be reflected by wgpu). Needs `Features::PASSTHROUGH_SHADERS` (Vulkan).
    pub fn pipeline_spirv(
        &self,
        kernel: &'static str,
        constants: &[(&'static str, f64)],
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        self.cached_pipeline(kernel, constants, || {
            let fail = |msg: String| GpuError::Kernel {
                kernel: kernel.into(),
                msg,
            };
            let parsed = self.parsed(kernel).map_err(fail)?;
            let mut words = parsed
                .compile(
                    constants,
                    self.info.bounds_checks,
                    self.info.exec_barriers.covers(parsed.cooperative),
                )
                .map_err(fail)?;
            super::spirv::rank_bindings(&mut words, &parsed.bindings).map_err(fail)?;
            let entries: Vec<wgpu::BindGroupLayoutEntry> = parsed
                .bindings
                .iter()
                .map(|b| wgpu::BindGroupLayoutEntry {
                    binding: b.binding,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: match b.uniform {
                            true => wgpu::BufferBindingType::Uniform,
                            false => wgpu::BufferBindingType::Storage {
                                read_only: b.read_only,
                            },
                        },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                })
                .collect();
            let bgl = self
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(kernel),
                    entries: &entries,
                });
            let layout = self
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(kernel),
                    bind_group_layouts: &[Some(&bgl)],
                    immediate_size: 0,
                });
            // SAFETY: the words are naga's validated translation of our WGSL, changed only in the
            // declared memory model, the barriers' semantics and the binding numbers (ranked as
            // wgpu's Vulkan layout numbers them; spirv.rs); the layout above is the bindings its
            // entry point uses.
            let module = unsafe {
                self.device.create_shader_module_passthrough(
                    wgpu::ShaderModuleDescriptorPassthrough {
                        label: Some(kernel),
                        entry_points: std::borrow::Cow::Owned(vec![
                            wgpu::PassthroughShaderEntryPoint {
                                name: "main".into(),
                                workgroup_size: (128, 1, 1),
                            },
                        ]),
                        spirv: Some(std::borrow::Cow::Owned(words)),
                        ..Default::default()
                    },
                )
            };
            let pipeline = self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(kernel),
                    layout: Some(&layout),
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                });
            Ok(pipeline)
        })
    }

    /// The cached pipeline of (`kernel`, `constants`), or `build`'s, made under a validation
    /// error scope (its errors become `GpuError::Kernel`) and cached.
    fn cached_pipeline(
        &self,
        kernel: &'static str,
        constants: &[(&'static str, f64)],
        build: impl FnOnce() -> Result<wgpu::ComputePipeline, GpuError>,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        let key: PipelineKey = (
            kernel,
            constants.iter().map(|(k, v)| (*k, v.to_bits())).collect(),
        );
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return Ok(p.clone());
        }
        // In `examples/pipeline_stats`' argument form, so that a run's kernels can be looked up.
        let args: Vec<String> = constants.iter().map(|(k, v)| format!("{k}={v}")).collect();
        tracing::debug!(target: "smoe_pipelines", "pipeline {kernel} {}", args.join(" "));
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = build();
        let popped = pollster::block_on(scope.pop());
        let pipeline = built?;
        if let Some(e) = popped {
            return Err(GpuError::Kernel {
                kernel: kernel.into(),
                msg: e.to_string(),
            });
        }
        self.pipelines.lock().unwrap().insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// `kernel` parsed and validated for `pipeline_spirv`, on first use.
    fn parsed(&self, kernel: &'static str) -> Result<Arc<super::spirv::Parsed>, String> {
        if let Some(p) = self.parsed.lock().unwrap().get(kernel) {
            return Ok(p.clone());
        }
        let src = self.kernel_source(kernel).ok_or("no such kernel")?;
        let parsed = Arc::new(super::spirv::Parsed::new(&src)?);
        self.parsed.lock().unwrap().insert(kernel, parsed.clone());
        Ok(parsed)
    }

    fn module(&self, kernel: &'static str) -> Result<wgpu::ShaderModule, GpuError> {
        if let Some(m) = self.modules.lock().unwrap().get(kernel) {
            return Ok(m.clone());
        }
        let src = self.kernel_source(kernel).ok_or_else(|| GpuError::Kernel {
            kernel: kernel.into(),
            msg: "no such kernel".into(),
        })?;
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = if self.info.bounds_checks {
            self.device.create_shader_module(desc)
        } else {
            // SAFETY: our kernels index only inside the ranges their wrappers bind (the wrappers
            // check shapes against buffer sizes), every loop has a bound, and no kernel divides
            // by a value that can be zero. Bounds checks stay on in debug builds to catch slips.
            unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Kernel {
                kernel: kernel.into(),
                msg: e.to_string(),
            });
        }
        self.modules.lock().unwrap().insert(kernel, module.clone());
        Ok(module)
    }
}
