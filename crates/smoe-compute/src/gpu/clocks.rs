//! Keeping an NVIDIA GPU at its full clock while expert streaming leaves it idle between reads.
//!
//! Under Vulkan alone NVIDIA's driver lowers the SM clock when the GPU idles: a streamed decode,
//! whose GPU waits for disk reads most of the time, ran its kernels at 400–900 MHz instead of
//! the H200's 1,980 ("GPU idle" is the reason `nvidia-smi` gives), so each layer's kernels took
//! 3–5× their time at speed. While a CUDA context exists on the device the driver keeps it at
//! its full clock, idle or not (measured: 1,980 MHz at 0–20 % utilization). A streaming decoder
//! therefore retains the device's CUDA *primary context* for as long as it lives: the driver's
//! own `libcuda` is loaded at run time (nothing is linked, nothing is built against CUDA),
//! nothing ever runs in the context, and where there is no libcuda, no NVIDIA adapter or no
//! CUDA device at the adapter's PCI address, nothing happens. Measured on the H200
//! (docs/performance.md, "The GPU's clock while streaming"): streamed decode +18 % and +24 % on
//! average at 25 and 50 % budgets, resident decode unchanged. The price: the context's device
//! memory (527 MiB on the H200) and the power of a GPU held at full clock while the model is
//! loaded. `GpuTuning::hold_clocks` false turns it off.

use super::GpuInfo;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

/// The few driver-API entry points used; all return a `CUresult` (0: success).
struct Cuda {
    _lib: libloading::Library,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int,
    primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int,
    primary_ctx_release: unsafe extern "C" fn(c_int) -> c_int,
    ctx_push_current: unsafe extern "C" fn(*mut c_void) -> c_int,
    ctx_pop_current: unsafe extern "C" fn(*mut *mut c_void) -> c_int,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int,
}

const ATTR_PCI_BUS_ID: c_int = 33;
const ATTR_PCI_DEVICE_ID: c_int = 34;
const ATTR_PCI_DOMAIN_ID: c_int = 50;
const NVIDIA: u32 = 0x10de;

#[cfg(target_os = "windows")]
const LIBCUDA: &str = "nvcuda.dll";
#[cfg(not(target_os = "windows"))]
const LIBCUDA: &str = "libcuda.so.1";

impl Cuda {
    /// The driver's libcuda, loaded and initialized once per process.
    fn get() -> Result<&'static Cuda, String> {
        static CUDA: OnceLock<Result<Cuda, String>> = OnceLock::new();
        CUDA.get_or_init(Cuda::load).as_ref().map_err(|e| e.clone())
    }

    fn load() -> Result<Cuda, String> {
        if cfg!(target_os = "macos") {
            return Err("no CUDA driver on macOS".into());
        }
        // SAFETY: loading the NVIDIA driver's own library runs its initializers, which expect
        // nothing of the process; each symbol is looked up with the C signature of cuda.h.
        unsafe {
            let lib = libloading::Library::new(LIBCUDA).map_err(|e| format!("{LIBCUDA}: {e}"))?;
            let init: libloading::Symbol<unsafe extern "C" fn(u32) -> c_int> =
                sym(&lib, &["cuInit"])?;
            check(init(0), "cuInit")?;
            let cuda = Cuda {
                device_get_count: *sym(&lib, &["cuDeviceGetCount"])?,
                device_get: *sym(&lib, &["cuDeviceGet"])?,
                device_get_attribute: *sym(&lib, &["cuDeviceGetAttribute"])?,
                primary_ctx_retain: *sym(&lib, &["cuDevicePrimaryCtxRetain"])?,
                // cuda.h maps the name to its `_v2` since CUDA 11.
                primary_ctx_release: *sym(
                    &lib,
                    &["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"],
                )?,
                ctx_push_current: *sym(&lib, &["cuCtxPushCurrent_v2", "cuCtxPushCurrent"])?,
                ctx_pop_current: *sym(&lib, &["cuCtxPopCurrent_v2", "cuCtxPopCurrent"])?,
                mem_get_info: *sym(&lib, &["cuMemGetInfo_v2", "cuMemGetInfo"])?,
                _lib: lib,
            };
            Ok(cuda)
        }
    }

    /// The CUDA device at PCI address `at` (domain, bus, device).
    fn device_at(&self, at: (u32, u32, u32)) -> Result<c_int, String> {
        let mut n = 0;
        // SAFETY: out-pointers to live locals, as cuda.h declares them.
        unsafe {
            check((self.device_get_count)(&mut n), "cuDeviceGetCount")?;
            for ordinal in 0..n {
                let mut dev = 0;
                check((self.device_get)(&mut dev, ordinal), "cuDeviceGet")?;
                let attr = |a| {
                    let mut v = 0;
                    check(
                        (self.device_get_attribute)(&mut v, a, dev),
                        "cuDeviceGetAttribute",
                    )
                    .map(|_| v as u32)
                };
                let pci = (
                    attr(ATTR_PCI_DOMAIN_ID)?,
                    attr(ATTR_PCI_BUS_ID)?,
                    attr(ATTR_PCI_DEVICE_ID)?,
                );
                if pci == at {
                    return Ok(dev);
                }
            }
        }
        Err(format!(
            "no CUDA device at PCI {:04x}:{:02x}:{:02x} among {n}",
            at.0, at.1, at.2
        ))
    }
}

/// The first of `names` that `lib` exports, as a function of type `T`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn sym<'l, T>(
    lib: &'l libloading::Library,
    names: &[&str],
) -> Result<libloading::Symbol<'l, T>, String> {
    let mut last = String::new();
    for name in names {
        match lib.get::<T>(name.as_bytes()) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("{name}: {e}"),
        }
    }
    Err(last)
}

fn check(code: c_int, call: &str) -> Result<(), String> {
    match code {
        0 => Ok(()),
        c => Err(format!("{call} failed (CUresult {c})")),
    }
}

/// A wgpu adapter's PCI address (`AdapterInfo::device_pci_bus_id`, "dddd:bb:dd.f" in hex) as
/// (domain, bus, device); `None` where the backend did not report one.
pub fn parse_pci_bus_id(id: &str) -> Option<(u32, u32, u32)> {
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, _function) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(device)?))
}

/// The CUDA driver and the device behind `adapter` (found by its PCI address).
fn cuda_device(adapter: &wgpu::AdapterInfo) -> Result<(&'static Cuda, c_int), String> {
    let at = parse_pci_bus_id(&adapter.device_pci_bus_id).ok_or_else(|| {
        format!(
            "the adapter reports no PCI address ('{}')",
            adapter.device_pci_bus_id
        )
    })?;
    let cuda = Cuda::get()?;
    Ok((cuda, cuda.device_at(at)?))
}

/// Free and total memory of the NVIDIA GPU behind `adapter`, in bytes, as its CUDA driver
/// counts them (every process's allocations included): wgpu has no such query, and NVIDIA's
/// Vulkan driver does not fail an allocation beyond the free VRAM but places it in host memory,
/// where the kernels read it over PCIe. `Err` says why it is unknown (not an NVIDIA GPU, no
/// driver library, no matching device). Retains the device's primary context for the query (a
/// streaming decoder's `ClockHold` keeps it anyway).
pub fn nvidia_memory(adapter: &wgpu::AdapterInfo) -> Result<(u64, u64), String> {
    if adapter.vendor != NVIDIA {
        return Err(format!("{} is not an NVIDIA GPU", adapter.name));
    }
    let (cuda, dev) = cuda_device(adapter)?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: as in `ClockHold::acquire`; the context is made current on this thread only for
    // the query, and popped (then released) before returning, whatever the query gave.
    unsafe {
        check(
            (cuda.primary_ctx_retain)(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain",
        )?;
        let pushed = check((cuda.ctx_push_current)(ctx), "cuCtxPushCurrent");
        let (mut free, mut total) = (0usize, 0usize);
        let got = pushed
            .clone()
            .and_then(|_| check((cuda.mem_get_info)(&mut free, &mut total), "cuMemGetInfo"));
        if pushed.is_ok() {
            let mut popped = std::ptr::null_mut();
            let _ = (cuda.ctx_pop_current)(&mut popped);
        }
        let _ = (cuda.primary_ctx_release)(dev);
        got.map(|_| (free as u64, total as u64))
    }
}

/// While alive, the CUDA primary context of the adapter's device is retained, so the driver
/// keeps the GPU at its full clock (see the module's comment). Released on drop.
pub struct ClockHold {
    cuda: &'static Cuda,
    dev: c_int,
}

impl ClockHold {
    /// Whether this process can load and initialize the CUDA driver library (once per process;
    /// later calls repeat the first answer), or why not.
    pub fn driver_loads() -> Result<(), String> {
        Cuda::get().map(|_| ())
    }

    /// Whether `acquire` would try the context's adapter at all (an NVIDIA GPU, and
    /// `GpuInfo::hold_clocks`), or why not. Where it would, a failed `acquire` is worth telling
    /// the user: the clock will drop while the decode waits for reads.
    pub fn applies(info: &GpuInfo) -> Result<(), String> {
        applies_to(&info.adapter, info.hold_clocks)
    }

    /// Retains the CUDA primary context of the device behind the context's adapter; `Err` says
    /// why not (`applies`' reasons, no driver library, no matching device). Never fatal:
    /// callers log the reason and go on.
    pub fn acquire(info: &GpuInfo) -> Result<ClockHold, String> {
        Self::acquire_for(&info.adapter, info.hold_clocks)
    }

    fn acquire_for(adapter: &wgpu::AdapterInfo, hold: bool) -> Result<ClockHold, String> {
        applies_to(adapter, hold)?;
        let (cuda, dev) = cuda_device(adapter)?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; the out-pointer is a live local. The context is
        // never made current nor used: retaining it is the whole point.
        check(
            unsafe { (cuda.primary_ctx_retain)(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(ClockHold { cuda, dev })
    }
}

/// `ClockHold::applies` for an adapter, `hold` saying whether holding is wanted at all.
fn applies_to(adapter: &wgpu::AdapterInfo, hold: bool) -> Result<(), String> {
    if !hold {
        return Err("turned off (tuning: hold_clocks false)".into());
    }
    if adapter.vendor != NVIDIA {
        return Err(format!("{} is not an NVIDIA GPU", adapter.name));
    }
    Ok(())
}

impl Drop for ClockHold {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `acquire` on the same device.
        let code = unsafe { (self.cuda.primary_ctx_release)(self.dev) };
        if let Err(e) = check(code, "cuDevicePrimaryCtxRelease") {
            tracing::warn!("GPU clocks: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_parse_as_wgpu_writes_them() {
        assert_eq!(parse_pci_bus_id("0000:18:00.0"), Some((0, 0x18, 0)));
        assert_eq!(parse_pci_bus_id("0001:ab:1f.3"), Some((1, 0xab, 0x1f)));
        assert_eq!(parse_pci_bus_id(""), None);
        assert_eq!(parse_pci_bus_id("0000:zz:00.0"), None);
        assert_eq!(parse_pci_bus_id("0000:18"), None);
    }

    #[test]
    fn other_vendors_report_no_memory() {
        let mut info = wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan);
        info.name = "llvmpipe".into();
        info.vendor = 0x10005;
        let why = nvidia_memory(&info).expect_err("not NVIDIA");
        assert!(why.contains("not an NVIDIA GPU"), "{why}");
    }

    #[test]
    fn other_vendors_hold_nothing() {
        let mut info = wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan);
        info.name = "llvmpipe".into();
        info.vendor = 0x10005;
        let why = ClockHold::acquire_for(&info, true)
            .err()
            .expect("not NVIDIA");
        assert!(why.contains("not an NVIDIA GPU"), "{why}");
        let why = ClockHold::acquire_for(&info, false).err().expect("off");
        assert!(why.contains("turned off"), "{why}");
    }
}
