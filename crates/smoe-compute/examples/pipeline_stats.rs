//! What the Vulkan driver says about a kernel's compiled pipeline — registers per invocation,
//! spills, workgroup memory, whatever its `VK_KHR_pipeline_executable_properties` statistics
//! hold (NVIDIA's driver lists registers) — so that a kernel variant's occupancy can be known
//! instead of guessed. The GPU has no profiler on the lent device machine; this is the next best.
//!
//!   cargo run --release -p smoe-compute --example pipeline_stats -- KERNEL [NAME=VALUE]... [--ir DIR]
//!
//! KERNEL is a file of `kernels/` (`matmul_coop`, `matvec_f16`, ...), each NAME=VALUE one of its
//! `override`s (booleans as 0/1); the `smoe` binary's `SMOE_KERNEL_DIR` and
//! `SMOE_EXEC_BARRIERS` apply here too. `--ir DIR`
//! also writes the driver's internal representations (where it offers any) to DIR. The SPIR-V
//! is the one wgpu's pipeline would run (`smoe_compute::gpu::kernel_spirv`); the pipeline is
//! built here with ash, on the first Vulkan device that has the extension, with every feature
//! that device supports enabled.
use ash::vk;
use std::ffi::CStr;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let kernel = args
        .next()
        .ok_or("usage: pipeline_stats KERNEL [NAME=VALUE]... [--ir DIR]")?;
    let mut constants: Vec<(String, f64)> = vec![];
    let mut ir_dir = None;
    while let Some(a) = args.next() {
        if a == "--ir" {
            ir_dir = Some(args.next().ok_or("--ir needs a folder")?);
            continue;
        }
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| format!("{a}: expected NAME=VALUE"))?;
        let v: f64 = v.parse().map_err(|_| format!("{a}: not a number"))?;
        constants.push((k.to_string(), v));
    }
    let consts: Vec<(&str, f64)> = constants.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    use smoe_compute::gpu::{ExecBarriers, GpuTuning};
    let tuning = GpuTuning {
        kernel_dir: std::env::var_os("SMOE_KERNEL_DIR").map(Into::into),
        exec_barriers: match std::env::var("SMOE_EXEC_BARRIERS").as_deref() {
            Ok("0") => Some(ExecBarriers::Off),
            Ok("gemm") => Some(ExecBarriers::TensorCoreGemm),
            _ => None,
        },
        ..GpuTuning::default()
    };
    let (words, bindings) = smoe_compute::gpu::kernel_spirv(&kernel, &consts, &tuning)?;
    // SAFETY: plain Vulkan calls on objects made here, destroyed before returning.
    unsafe { stats(&kernel, &words, &bindings, ir_dir.as_deref()) }
}

unsafe fn stats(
    kernel: &str,
    words: &[u32],
    bindings: &[smoe_compute::gpu::KernelBinding],
    ir_dir: Option<&str>,
) -> Result<(), String> {
    fn e(what: &'static str) -> impl Fn(vk::Result) -> String {
        move |r| format!("{what}: {r:?}")
    }
    let entry = ash::Entry::load().map_err(|x| format!("no Vulkan loader: {x}"))?;
    let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
    let instance = entry
        .create_instance(
            &vk::InstanceCreateInfo::default().application_info(&app),
            None,
        )
        .map_err(e("vkCreateInstance"))?;
    let exe_ext = ash::khr::pipeline_executable_properties::NAME;
    let coop_ext = ash::khr::cooperative_matrix::NAME;
    let mut chosen = None;
    for pd in instance
        .enumerate_physical_devices()
        .map_err(e("vkEnumeratePhysicalDevices"))?
    {
        let exts = instance
            .enumerate_device_extension_properties(pd)
            .map_err(e("vkEnumerateDeviceExtensionProperties"))?;
        let has = |n: &CStr| exts.iter().any(|x| x.extension_name_as_c_str() == Ok(n));
        let name = instance
            .get_physical_device_properties(pd)
            .device_name_as_c_str()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        if has(exe_ext) {
            chosen = Some((pd, name, has(coop_ext)));
            break;
        }
        eprintln!("{name}: no {exe_ext:?}");
    }
    let (pd, name, coop) =
        chosen.ok_or("no Vulkan device offers VK_KHR_pipeline_executable_properties")?;
    // Every feature the device has, enabled (the kernels need f16, subgroups and, for the
    // tensor-core GEMM, cooperative matrices; more does no harm here).
    let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f13 = vk::PhysicalDeviceVulkan13Features::default();
    let mut fexe = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
    let mut fcoop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default()
        .push_next(&mut f11)
        .push_next(&mut f12)
        .push_next(&mut f13)
        .push_next(&mut fexe);
    if coop {
        f2 = f2.push_next(&mut fcoop);
    }
    instance.get_physical_device_features2(pd, &mut f2);
    let family = instance
        .get_physical_device_queue_family_properties(pd)
        .iter()
        .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
        .ok_or("no compute queue")? as u32;
    let prio = [1.0];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(family)
        .queue_priorities(&prio)];
    let mut ext_names = vec![exe_ext.as_ptr()];
    if coop {
        ext_names.push(coop_ext.as_ptr());
    }
    let device = instance
        .create_device(
            pd,
            &vk::DeviceCreateInfo::default()
                .queue_create_infos(&queues)
                .enabled_extension_names(&ext_names)
                .push_next(&mut f2),
            None,
        )
        .map_err(e("vkCreateDevice"))?;
    let module = device
        .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None)
        .map_err(e("vkCreateShaderModule"))?;
    let layout_bindings: Vec<_> = bindings
        .iter()
        .map(|b| {
            vk::DescriptorSetLayoutBinding::default()
                .binding(b.binding)
                .descriptor_type(match b.uniform {
                    true => vk::DescriptorType::UNIFORM_BUFFER,
                    false => vk::DescriptorType::STORAGE_BUFFER,
                })
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        })
        .collect();
    let set_layout = device
        .create_descriptor_set_layout(
            &vk::DescriptorSetLayoutCreateInfo::default().bindings(&layout_bindings),
            None,
        )
        .map_err(e("vkCreateDescriptorSetLayout"))?;
    let set_layouts = [set_layout];
    let layout = device
        .create_pipeline_layout(
            &vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts),
            None,
        )
        .map_err(e("vkCreatePipelineLayout"))?;
    let stage = vk::PipelineShaderStageCreateInfo::default()
        .stage(vk::ShaderStageFlags::COMPUTE)
        .module(module)
        .name(c"main");
    let info = vk::ComputePipelineCreateInfo::default()
        .stage(stage)
        .layout(layout)
        .flags(
            vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR,
        );
    let pipeline = device
        .create_compute_pipelines(vk::PipelineCache::null(), &[info], None)
        .map_err(|(_, r)| format!("vkCreateComputePipelines: {r:?}"))?[0];
    let exe = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
    let props = exe
        .get_pipeline_executable_properties(&vk::PipelineInfoKHR::default().pipeline(pipeline))
        .map_err(e("vkGetPipelineExecutablePropertiesKHR"))?;
    println!("{kernel} on {name}: {} executable(s)", props.len());
    for (i, p) in props.iter().enumerate() {
        let text =
            |c: &[std::ffi::c_char]| CStr::from_ptr(c.as_ptr()).to_string_lossy().into_owned();
        println!(
            "  [{i}] {} — {} (subgroup size {})",
            text(&p.name),
            text(&p.description),
            p.subgroup_size
        );
        let ei = vk::PipelineExecutableInfoKHR::default()
            .pipeline(pipeline)
            .executable_index(i as u32);
        let stats = exe
            .get_pipeline_executable_statistics(&ei)
            .map_err(e("vkGetPipelineExecutableStatisticsKHR"))?;
        for s in &stats {
            let v = match s.format {
                vk::PipelineExecutableStatisticFormatKHR::BOOL32 => (s.value.b32 != 0).to_string(),
                vk::PipelineExecutableStatisticFormatKHR::INT64 => s.value.i64.to_string(),
                vk::PipelineExecutableStatisticFormatKHR::UINT64 => s.value.u64.to_string(),
                _ => format!("{:.3}", s.value.f64),
            };
            println!(
                "      {:<28} {:>10}   {}",
                text(&s.name),
                v,
                text(&s.description)
            );
        }
        if let Some(dir) = ir_dir {
            write_ir(&exe, &ei, dir, kernel, i)?;
        }
    }
    device.destroy_pipeline(pipeline, None);
    device.destroy_pipeline_layout(layout, None);
    device.destroy_descriptor_set_layout(set_layout, None);
    device.destroy_shader_module(module, None);
    device.destroy_device(None);
    instance.destroy_instance(None);
    Ok(())
}

/// The driver's internal representations of executable `ei` (two calls: sizes, then data) into
/// DIR/KERNEL.I.N.txt.
unsafe fn write_ir(
    exe: &ash::khr::pipeline_executable_properties::Device,
    ei: &vk::PipelineExecutableInfoKHR,
    dir: &str,
    kernel: &str,
    i: usize,
) -> Result<(), String> {
    let f = exe
        .fp()
        .get_pipeline_executable_internal_representations_khr;
    let mut n = 0u32;
    f(exe.device(), ei, &mut n, std::ptr::null_mut())
        .result()
        .map_err(|r| format!("internal representations: {r:?}"))?;
    let mut reps = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); n as usize];
    f(exe.device(), ei, &mut n, reps.as_mut_ptr())
        .result()
        .map_err(|r| format!("internal representations: {r:?}"))?;
    let mut bufs: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
    for (r, b) in reps.iter_mut().zip(bufs.iter_mut()) {
        r.p_data = b.as_mut_ptr().cast();
    }
    f(exe.device(), ei, &mut n, reps.as_mut_ptr())
        .result()
        .map_err(|r| format!("internal representations: {r:?}"))?;
    std::fs::create_dir_all(dir).map_err(|x| format!("{dir}: {x}"))?;
    for (j, (r, b)) in reps.iter().zip(&bufs).enumerate() {
        let name = CStr::from_ptr(r.name.as_ptr()).to_string_lossy();
        let path = format!("{dir}/{kernel}.{i}.{j}.txt");
        let body = match r.is_text != 0 {
            true => {
                String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or(&[])).into_owned()
            }
            false => format!("(binary, {} bytes)\n", b.len()),
        };
        std::fs::write(&path, format!("// {name}\n{body}")).map_err(|x| format!("{path}: {x}"))?;
        println!("      wrote {path} ({name}, {} bytes)", b.len());
    }
    Ok(())
}
