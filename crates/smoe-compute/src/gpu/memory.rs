//! How much GPU memory this process may still allocate, as the driver estimates it.
//!
//! wgpu has no such query, and some drivers do not fail an allocation beyond the free memory
//! (NVIDIA's Vulkan driver places it in host memory, read over PCIe), so a caller sizing large
//! buffers (the streaming decoder's VRAM expert slots) asks here first. Two sources, the
//! cheaper first:
//! - Vulkan's `VK_EXT_memory_budget` (which wgpu enables where the driver offers it): the
//!   device-local heap's budget less this process's usage, read in microseconds, on any vendor;
//! - NVIDIA's CUDA driver (`clocks::nvidia_memory`), where the Vulkan budget is not offered:
//!   retaining the device's CUDA context for the query costs ~0.24 s (H100, driver 580).

use super::clocks::nvidia_memory;
use super::GpuContext;
use std::fmt;

/// Free and total device memory, and who said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRoom {
    /// Bytes this process may still allocate before the driver would refuse or spill.
    pub free: u64,
    /// The heap's (or the device's) size in bytes.
    pub total: u64,
    pub source: MemorySource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemorySource {
    /// `VK_EXT_memory_budget`: the largest device-local heap's budget less its usage.
    VulkanBudget,
    /// `cuMemGetInfo` through NVIDIA's CUDA driver.
    CudaDriver,
}

impl fmt::Display for MemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemorySource::VulkanBudget => "Vulkan memory budget",
            MemorySource::CudaDriver => "CUDA driver",
        })
    }
}

impl fmt::Display for MemoryRoom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:.1} GiB free of {:.1} GiB ({})",
            gib(self.free),
            gib(self.total),
            self.source
        )
    }
}

impl GpuContext {
    /// The device's free memory for this process (module doc); `Err` says why it is unknown
    /// (neither source answers: Metal, DX12, a Vulkan driver without the budget extension on a
    /// GPU that is not NVIDIA's).
    pub fn memory_room(&self) -> Result<MemoryRoom, String> {
        let vulkan = match self.vulkan_budget() {
            Ok(room) => return Ok(room),
            Err(why) => why,
        };
        nvidia_memory(&self.info().adapter)
            .map(|(free, total)| MemoryRoom {
                free,
                total,
                source: MemorySource::CudaDriver,
            })
            .map_err(|cuda| format!("{vulkan}; {cuda}"))
    }

    /// `VK_EXT_memory_budget`'s answer for the largest device-local heap.
    pub fn vulkan_budget(&self) -> Result<MemoryRoom, String> {
        use ash::vk;
        use wgpu::hal::api::Vulkan;
        // SAFETY: the hal device is only read (its physical device, instance and enabled
        // extensions) while `self.device` keeps it alive; nothing is created or destroyed.
        let hal = unsafe { self.device.as_hal::<Vulkan>() }
            .ok_or_else(|| "not a Vulkan device".to_string())?;
        let budget_ext = vk::EXT_MEMORY_BUDGET_NAME;
        if !hal.enabled_device_extensions().contains(&budget_ext) {
            return Err("the Vulkan driver offers no memory budget (VK_EXT_memory_budget)".into());
        }
        let instance = hal.shared_instance().raw_instance();
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
        // SAFETY: a query into structures that live across the call, on the physical device
        // the extension was enabled for (Vulkan 1.1's entry point, which wgpu requires).
        unsafe {
            instance.get_physical_device_memory_properties2(hal.raw_physical_device(), &mut props)
        };
        let mem = props.memory_properties;
        let heaps = &mem.memory_heaps[..(mem.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS)];
        let (i, heap) = heaps
            .iter()
            .enumerate()
            .filter(|(_, h)| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .max_by_key(|(_, h)| h.size)
            .ok_or_else(|| "no device-local memory heap".to_string())?;
        let (limit, used) = (budget.heap_budget[i], budget.heap_usage[i]);
        if limit == 0 {
            return Err("the Vulkan driver reports a budget of 0 bytes".into());
        }
        Ok(MemoryRoom {
            free: limit.saturating_sub(used),
            total: heap.size,
            source: MemorySource::VulkanBudget,
        })
    }
}
