//! The expert-store flags shared by commands that run a model.

use anyhow::{Context, Result};
use smoe_engine::store::{available_memory, CacheBudget, StoreOptions, StoreStats};
use smoe_engine::Engine;
use std::path::Path;

#[derive(clap::Args, Clone, Debug)]
pub struct StoreArgs {
    /// Memory for routed experts: a size (8GiB, 512MiB), a share of the experts (25%), `auto`
    /// (available memory minus a margin) or `resident` (memory-map all). Default: resident when
    /// the experts fit comfortably in memory, else auto.
    #[arg(long, value_name = "SIZE|PCT%|auto")]
    pub expert_cache: Option<String>,
    /// Do not read or update the expert usage profile (M.smoe.profile).
    #[arg(long)]
    pub no_profile: bool,
    /// Print expert-store statistics (hits, misses, bytes read, waits) after the run.
    #[arg(long)]
    pub stats: bool,
    /// GPU streaming: memory for the VRAM expert slots (a size, a share of the experts, or
    /// `auto`: the --expert-cache budget, fewer slots where that does not fit in GPU memory).
    /// A host cache larger than the slots keeps experts in RAM that the GPU has no room for.
    #[arg(long, value_name = "SIZE|PCT%|auto")]
    pub vram_cache: Option<String>,
    /// Threads reading expert blobs in parallel (more keeps a fast NVMe busier).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub read_threads: usize,
    /// Bytes per read: the reader threads share each expert blob in pieces of this size
    /// (rounded up to 16 KiB), or `blob` for one read per blob. `smoe bench disk` measures
    /// what the vault's disk reads fastest.
    #[arg(long, default_value = "256KiB", value_name = "SIZE|blob")]
    pub read_piece: String,
}

impl Default for StoreArgs {
    fn default() -> Self {
        StoreArgs {
            expert_cache: None,
            no_profile: false,
            stats: false,
            vram_cache: None,
            read_threads: 8,
            read_piece: "256KiB".into(),
        }
    }
}

impl StoreArgs {
    pub fn options(&self, vault: &Path) -> Result<StoreOptions> {
        let budget = match &self.expert_cache {
            Some(s) => s
                .parse::<CacheBudget>()
                .map_err(anyhow::Error::msg)
                .context("--expert-cache")?,
            None => default_budget(vault),
        };
        let vram_budget = (self.vram_cache.as_deref())
            .map(|s| s.parse::<CacheBudget>().map_err(anyhow::Error::msg))
            .transpose()
            .context("--vram-cache")?;
        if self.read_threads == 0 {
            anyhow::bail!("--read-threads must be at least 1");
        }
        Ok(StoreOptions {
            budget,
            vram_budget,
            profile: !self.no_profile,
            read_threads: self.read_threads,
            read_piece: parse_read_piece(&self.read_piece).context("--read-piece")?,
            tuning: crate::tuning::engine()?,
            ..StoreOptions::default()
        })
    }

    pub fn preload(&self, engine: &Engine) -> Result<()> {
        if !engine.model.experts().is_streaming() || self.no_profile {
            return Ok(());
        }
        let pb = indicatif::ProgressBar::new(0);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} experts")
                .unwrap(),
        );
        pb.set_message("preloading");
        let n = engine.model.preload(&mut |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        })?;
        pb.finish_and_clear();
        if n > 0 {
            tracing::info!("preloaded {n} experts from the usage profile");
        }
        Ok(())
    }

    /// Saves the profile and returns the stats (printing them to stderr when asked).
    pub fn finish(&self, engine: &Engine) -> Option<StoreStats> {
        let experts = engine.model.experts();
        if let Err(e) = experts.save_profile() {
            tracing::warn!("cannot save the expert profile: {e}");
        }
        let st = experts.stats();
        if let (true, Some(v)) = (self.stats, engine.model.vram_slot_stats()) {
            let rate = if v.hits + v.misses > 0 {
                100.0 * v.hits as f64 / (v.hits + v.misses) as f64
            } else {
                0.0
            };
            eprintln!(
                "[VRAM expert slots: {} per MoE layer ({:.2} GiB), {} hits, {} misses ({rate:.1}% hit rate); passes {:.3}s: GPU wait {:.3}s, filling slots {:.3}s (uploads {:.3}s, mapping {:.3}s), no disk read in flight for {:.3}s of them ({:.3}s in GPU waits, {:.3}s filling); {} router stops ({} found every expert in VRAM), {} MoE layers ran through without one; {} experts placed ahead at halts ({:.3}s); {} speculative passes started {} reads{}{}; filled {}; GPU clocks {}; the line below is the host store behind them]",
                v.slots,
                v.slot_bytes as f64 / (1u64 << 30) as f64,
                v.hits,
                v.misses,
                v.pass_s,
                v.gpu_wait_s,
                v.fill_s,
                v.upload_s,
                v.map_s,
                v.disk_idle.pass_s,
                v.disk_idle.gpu_wait_s,
                v.disk_idle.fill_s,
                v.stops,
                v.hit_stops,
                v.run_through,
                v.placed_ahead,
                v.ahead_s,
                v.speculated,
                v.spec_guesses,
                match v.spec_recall {
                    Some(r) => format!(" (named {:.1}% of the experts those layers used)", 100.0 * r),
                    None => String::new(),
                },
                match v.oracle_reads {
                    0 => String::new(),
                    n => format!("; a replayed routing trace started {n} reads"),
                },
                match (v.mapped, v.landed) {
                    (true, 0) => "through a mapping".to_string(),
                    (true, n) => format!("through a mapping, {n} read straight into a slot"),
                    (false, _) => "through staging".to_string(),
                },
                match v.clocks_held {
                    true => "held up (CUDA context)",
                    false => "left to the driver",
                }
            );
        }
        if self.stats {
            match &st {
                Some(st) => print_stats(st),
                None => eprintln!("[experts resident (memory-mapped): no cache statistics]"),
            }
        }
        st
    }
}

/// A read size: `blob` (whole blobs: `usize::MAX`, which the store caps at the blob) or a size
/// of at least 16 KiB (`256KiB`, `1MiB`).
pub fn parse_read_piece(s: &str) -> Result<usize> {
    if s.trim().eq_ignore_ascii_case("blob") {
        return Ok(usize::MAX);
    }
    match s.parse::<CacheBudget>() {
        Ok(CacheBudget::Bytes(b)) if b >= 16 << 10 => Ok(b.min(1 << 40) as usize),
        Ok(CacheBudget::Bytes(b)) => {
            anyhow::bail!("'{s}': {b} bytes is below 16 KiB, the smallest direct read")
        }
        _ => anyhow::bail!("'{s}': expected a size like 256KiB or 1MiB, or blob"),
    }
}

/// Resident when the experts take under 60 % of available memory; otherwise stream.
fn default_budget(vault: &Path) -> CacheBudget {
    let size = std::fs::metadata(vault).map(|m| m.len()).unwrap_or(0);
    match available_memory() {
        Some(avail) if size as f64 > 0.6 * avail as f64 => {
            tracing::info!(
                "model ({size} bytes) is large for available memory ({avail}): streaming experts"
            );
            CacheBudget::Auto
        }
        _ => CacheBudget::Resident,
    }
}

pub fn print_stats(st: &StoreStats) {
    let t = &st.total;
    eprintln!(
        "[experts: {} hits, {} misses (hit rate {:.1}%; {} of them read a layer ahead, {} guesses read and unused, {} dropped unread), {:.1} MiB read at {:.2} GB/s{} ({:.1} reads in flight on average); {} read buffers allocated by a reader ({:.3}s); io wait {:.3}s, compute {:.3}s; cache {:.1}/{:.1} MiB]",
        t.hits,
        t.misses,
        100.0 * st.hit_rate,
        t.prefetched,
        t.prefetch_wasted,
        t.prefetch_cancelled,
        t.bytes_read as f64 / (1 << 20) as f64,
        st.read_gb_per_s,
        if st.direct_io { " direct" } else { " buffered" },
        st.read_depth,
        st.buffer_allocs,
        st.buffer_alloc_seconds,
        t.io_wait_seconds,
        t.compute_seconds,
        st.cache_bytes as f64 / (1 << 20) as f64,
        st.cache_budget as f64 / (1 << 20) as f64,
    );
    if let Some(r) = st.lookahead_recall {
        eprintln!(
            "[lookahead: named {:.1}% of the {} experts the layers used (the next MoE layer's router on this layer's input)]",
            100.0 * r,
            t.lookahead.checked
        );
    }
    for (l, s) in st
        .per_layer
        .iter()
        .enumerate()
        .filter(|(_, s)| s.hits + s.misses > 0)
    {
        eprintln!(
            "  layer {l:>3}: {:>6} hits {:>6} misses {:>8.1} MiB read, io wait {:.3}s",
            s.hits,
            s.misses,
            s.bytes_read as f64 / (1 << 20) as f64,
            s.io_wait_seconds
        );
    }
}

#[cfg(test)]
mod tests {
    use super::parse_read_piece;

    #[test]
    fn read_pieces_are_sizes_of_at_least_16_kib_or_whole_blobs() {
        assert_eq!(parse_read_piece("256KiB").unwrap(), 256 << 10);
        assert_eq!(parse_read_piece("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_read_piece("Blob").unwrap(), usize::MAX);
        for bad in ["8KiB", "25%", "auto", "fast", "-1MiB"] {
            assert!(parse_read_piece(bad).is_err(), "{bad} accepted");
        }
    }
}
