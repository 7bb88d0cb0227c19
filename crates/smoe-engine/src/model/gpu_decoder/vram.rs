//! How much GPU memory a model's routed experts take: all of them uploaded (resident), or VRAM
//! slots filled from the host cache (streaming), sized by `--vram-cache` (else `--expert-cache`)
//! and kept within the GPU's free memory where the driver says how much that is.
//!
//! Why the free memory matters: NVIDIA's Vulkan driver does not fail an allocation beyond it
//! but places the buffer in host memory, where every expert product then reads it over PCIe
//! (an H100 with 9 GiB free decoded 12 tok/s from 14 GiB of slots at an 86 % hit rate), and wgpu
//! has no query for it; Vulkan's memory budget or NVIDIA's CUDA driver answers
//! (`GpuContext::memory_room`).

use crate::store::{CacheBudget, StoreOptions};
use smoe_compute::gpu::GpuContext;
use smoe_vault::Vault;

/// Room left for the KV cache and activations beside the weights and slots.
const HEADROOM: u64 = 2 << 30;

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes of GPU memory that routed experts may take: the device's free memory less the dense
/// weights still to upload and `HEADROOM`, where the driver says how much is free
/// (`GpuContext::memory_room`: Vulkan's memory budget, else NVIDIA's CUDA driver); `None`
/// elsewhere. (A load asks once: the CUDA query retains the device's context.)
pub(super) fn room(ctx: &GpuContext, vault: &Vault) -> Option<u64> {
    let asked = std::time::Instant::now();
    let room = ctx
        .memory_room()
        .map_err(|why| tracing::debug!("GPU backend: free memory unknown ({why})"))
        .ok()?;
    tracing::debug!(
        "GPU backend: {room}, asked in {:.2} ms",
        asked.elapsed().as_secs_f64() * 1e3
    );
    let dense: u64 = vault.header.tensors.iter().map(|t| t.length).sum();
    Some(room.free.saturating_sub(dense + HEADROOM))
}

/// The VRAM budget `--vram-cache` gave, if one was given (`auto`, or none, follows
/// `--expert-cache` and may take fewer slots where they do not fit).
pub(super) fn given(store: &StoreOptions) -> Option<CacheBudget> {
    store.vram_budget.filter(|b| *b != CacheBudget::Auto)
}

/// The options a GPU load streams with instead of `store`'s resident budget, if it should: when
/// a VRAM budget is given (`--vram-cache` alone), or when every expert would not fit in the
/// GPU's free memory (`room`, or the test hook `StoreOptions::vram_limit`). Then the host cache
/// is `auto` (what the RAM holds) behind as many VRAM slots as fit.
pub(super) fn stream_instead(
    vault: &Vault,
    store: &StoreOptions,
    room: Option<u64>,
) -> Option<StoreOptions> {
    if store.budget != CacheBudget::Resident {
        return None;
    }
    let streamed = StoreOptions {
        budget: CacheBudget::Auto,
        ..store.clone()
    };
    if given(store).is_some() {
        tracing::info!("GPU backend: --vram-cache given: streaming experts (--expert-cache auto)");
        return Some(streamed);
    }
    let sec = vault.expert_section()?;
    let experts = sec.blob_stride * sec.blobs.len() as u64;
    let room = match (room, store.vram_limit) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    if experts <= room {
        return None;
    }
    tracing::warn!(
        "GPU backend: the experts ({}) do not fit in the GPU's free memory ({} after the dense weights and {}): streaming them (--expert-cache auto)",
        gib(experts),
        gib(room),
        gib(HEADROOM)
    );
    Some(streamed)
}

/// Streaming: `slots` expert slots per MoE layer (of `per_slot` bytes over all MoE layers, at
/// least `k`), within `room` (the GPU's free memory) where it is known: `auto` takes fewer,
/// with a warning; a given `--vram-cache` keeps them, with a warning that the driver may place
/// the rest in host memory.
pub(super) fn fit_slots(
    store: &StoreOptions,
    room: Option<u64>,
    (slots, k, per_slot): (usize, usize, u64),
) -> usize {
    let Some(room) = room else {
        return slots;
    };
    let fits = (room / per_slot.max(1)) as usize;
    if fits >= slots {
        return slots;
    }
    match given(store) {
        None => {
            tracing::warn!(
                "GPU backend: {fits} expert slots per MoE layer fit in the GPU's free memory, not the {slots} --expert-cache asks for; using {} (--vram-cache sets them)",
                fits.max(k)
            );
            fits.max(k)
        }
        Some(_) => {
            tracing::warn!(
                "GPU backend: --vram-cache asks for {slots} expert slots per MoE layer, the GPU's free memory holds {fits}: the driver may place the rest in host memory, read over PCIe"
            );
            slots
        }
    }
}

/// The warning when `slots` per MoE layer (`bytes` in all) failed to allocate and the load
/// tries `fewer`.
pub(super) fn retrying(slots: usize, bytes: u64, fewer: usize) {
    tracing::warn!(
        "GPU backend: {slots} expert slots per MoE layer ({}) do not fit in GPU memory; trying {fewer} (--vram-cache sets the budget)",
        gib(bytes)
    );
}
