//! Where routed experts come from: memory-mapped from the vault (resident; the OS pages them),
//! or streamed from the vault into a bounded cache for models larger than memory. Either way
//! the tokens are the same: the decoder sums expert outputs in expert order, whatever order
//! they arrive in.

pub mod aligned;
pub mod cache;
pub mod profile;
pub mod read_queue;
pub mod reader;
pub mod stats;
pub mod streamed;

use crate::error::EngineError;
pub use crate::experts::Expert;
use crate::experts::ExpertStore;
use profile::Profile;
pub use read_queue::{PieceSink, ReadTarget};
pub use reader::FaultHook;
use smoe_vault::Vault;
pub use stats::{Recall, StoreStats};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use streamed::StreamedStore;

/// How much memory routed experts may take (`--expert-cache`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheBudget {
    /// All experts memory-mapped (no explicit cache).
    Resident,
    Bytes(u64),
    /// A fraction of the vault's expert bytes.
    Fraction(f64),
    /// Available memory minus a margin.
    Auto,
}

impl std::str::FromStr for CacheBudget {
    type Err = String;
    /// `8GiB`, `512MiB`, `10GB`, `123456` (bytes), `25%`, `auto`, `resident`.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        if t == "auto" {
            return Ok(CacheBudget::Auto);
        }
        if t == "resident" || t == "all" {
            return Ok(CacheBudget::Resident);
        }
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("'{s}': not a percentage"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("'{s}': a percentage must be within 0–100"));
            }
            return Ok(CacheBudget::Fraction(v / 100.0));
        }
        let units = [
            ("tib", 1u64 << 40),
            ("gib", 1 << 30),
            ("mib", 1 << 20),
            ("kib", 1 << 10),
            ("tb", 1_000_000_000_000),
            ("gb", 1_000_000_000),
            ("mb", 1_000_000),
            ("kb", 1000),
            ("b", 1),
        ];
        let (num, mul) = units
            .iter()
            .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n.trim(), *m)))
            .unwrap_or((t.as_str(), 1));
        let v: f64 = num.parse().map_err(|_| {
            format!("'{s}': expected a size like 8GiB, a percentage like 25%, or auto")
        })?;
        if v < 0.0 || !v.is_finite() {
            return Err(format!("'{s}': size must be positive"));
        }
        Ok(CacheBudget::Bytes((v * mul as f64) as u64))
    }
}

impl CacheBudget {
    /// The budget in bytes for `vault` (`None`: resident). `Auto` looks at the memory free now.
    pub fn bytes(&self, vault: &Vault) -> Option<u64> {
        let total = expert_bytes(vault);
        match *self {
            CacheBudget::Resident => None,
            CacheBudget::Bytes(b) => Some(b),
            CacheBudget::Fraction(f) => Some((total as f64 * f) as u64),
            CacheBudget::Auto => {
                // Leave room for the scout, activations and the rest of the system.
                let margin =
                    (2u64 << 30) + vault.header.tensors.iter().map(|t| t.length).sum::<u64>();
                Some(
                    available_memory()
                        .map_or(4 << 30, |m| m.saturating_sub(margin))
                        .min(total),
                )
            }
        }
    }
}

/// The vault's expert blobs, at their stride.
fn expert_bytes(vault: &Vault) -> u64 {
    vault
        .expert_section()
        .map(|x| x.blob_stride * x.blobs.len() as u64)
        .unwrap_or(0)
}

/// 256 KiB: a Qwen3-30B-A3B q4 expert (2.5 MiB) is 10 pieces. On the H200 machine's disk
/// pieces of 256 KiB to 2.5 MiB read at the same 1.2–1.6 GB/s from 1 to 16 threads; an NVMe
/// wants several reads in flight, which the pieces give it even for one miss. Small pieces also
/// keep short the wait of a needed read behind a lookahead guess's piece.
pub const DEFAULT_READ_PIECE: usize = 256 << 10;

/// The bytes a read of `piece` takes for blobs `stride` apart: at most the blob, a multiple of
/// 16 KiB (`usize::MAX`: whole blobs).
pub fn read_piece_bytes(piece: usize, stride: usize) -> usize {
    piece
        .min(stride)
        .max(aligned::ALIGN)
        .next_multiple_of(aligned::ALIGN)
}

/// Options of the expert store.
#[derive(Clone)]
pub struct StoreOptions {
    /// The host's expert cache (on the GPU also the VRAM slots', unless `vram_budget` says).
    pub budget: CacheBudget,
    /// GPU streaming: the VRAM expert slots' budget (`--vram-cache`). None or `Auto`: the
    /// host's, with half as many slots per try where that does not fit in GPU memory;
    /// `Resident`: every expert.
    pub vram_budget: Option<CacheBudget>,
    /// A test hook: GPU streaming slots beyond this many bytes in all fail as if the GPU were
    /// out of memory.
    pub vram_limit: Option<u64>,
    /// Read and update `M.smoe.profile`, and preload from it.
    pub profile: bool,
    pub read_threads: usize,
    /// Bytes per piece of a blob read (rounded up to 16 KiB, at most the blob: `usize::MAX`
    /// reads whole blobs): the reader threads share one blob's pieces, so one miss is read as
    /// fast as the device reads in parallel (`--read-piece`).
    pub read_piece: usize,
    /// Test hook to inject read failures.
    pub fault: Option<FaultHook>,
    /// How the decoder fuses and streams (`Tuning`; default: the fastest measured choices).
    pub tuning: crate::Tuning,
}

pub use crate::tuning::{Lookahead, LOOKAHEAD_MAX};

impl StoreOptions {
    /// The lookahead these options ask for (`Tuning::lookahead`); an error names a value out
    /// of range.
    pub fn lookahead(&self) -> Result<Lookahead, EngineError> {
        let l = self.tuning.lookahead;
        if !(1..=LOOKAHEAD_MAX).contains(&l.depth) {
            return Err(EngineError::Invalid(format!(
                "lookahead depth {}: expected 1 to {LOOKAHEAD_MAX} MoE layers",
                l.depth
            )));
        }
        if l.top == 0 {
            return Err(EngineError::Invalid(
                "lookahead top 0: expected 1 or more experts".into(),
            ));
        }
        Ok(l)
    }
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("budget", &self.budget)
            .field("vram_budget", &self.vram_budget)
            .field("vram_limit", &self.vram_limit)
            .field("profile", &self.profile)
            .field("read_threads", &self.read_threads)
            .field("read_piece", &self.read_piece)
            .field("fault", &self.fault.is_some())
            .field("tuning", &self.tuning)
            .finish()
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            budget: CacheBudget::Resident,
            vram_budget: None,
            vram_limit: None,
            profile: true,
            read_threads: 8,
            read_piece: DEFAULT_READ_PIECE,
            fault: None,
            tuning: crate::Tuning::default(),
        }
    }
}

enum Source {
    Mapped,
    Streamed(Arc<StreamedStore>),
}

/// The decoder's view of the routed experts.
pub struct Experts {
    mapped: ExpertStore,
    source: Source,
    n_experts: usize,
    /// Uses per (layer, expert) since load, for the profile.
    usage: Vec<AtomicU64>,
    profile_path: Option<PathBuf>,
    header_sum: String,
    layers: usize,
}

/// Memory the OS says is available (Linux `MemAvailable`), if known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Experts {
    pub fn open(vault: &Vault, opts: &StoreOptions) -> Result<Self, EngineError> {
        let cfg = &vault.header.config;
        let mapped = ExpertStore::new(vault)?;
        let total = expert_bytes(vault);
        let source = match opts.budget.bytes(vault) {
            Some(b) if total > 0 => {
                tracing::info!("expert cache budget {b} bytes of {total}");
                Source::Streamed(StreamedStore::new(
                    vault,
                    b,
                    opts.read_threads,
                    opts.read_piece,
                    opts.fault.clone(),
                )?)
            }
            _ => Source::Mapped,
        };
        // The preamble already carries the header's checksum: no need to re-serialize it.
        let header_sum = format!("{:016x}", vault.header_xxh3);
        Ok(Experts {
            mapped,
            source,
            n_experts: cfg.num_experts,
            usage: (0..cfg.num_layers * cfg.num_experts)
                .map(|_| AtomicU64::new(0))
                .collect(),
            profile_path: opts.profile.then(|| Profile::path_for(vault.path())),
            header_sum,
            layers: cfg.num_layers,
        })
    }

    /// Calls `f(expert, weights)` for each expert of `layer` in `experts` (any order).
    pub fn for_each(
        &self,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, Expert<'_>),
    ) -> Result<(), EngineError> {
        self.note_uses(layer, experts);
        let parts = self.mapped.parts();
        self.for_each_blob(layer, experts, (None, &[]), &mut |e, bytes| {
            f(e, Expert::from_blob(parts, bytes))
        })
    }

    /// `(expert, index of its blob in the vault)` for `experts` of `layer`.
    fn with_blobs(&self, layer: usize, experts: &[usize]) -> Vec<(usize, usize)> {
        experts
            .iter()
            .map(|&e| {
                (
                    e,
                    self.mapped.blob_index(layer, e).expect("checked at load"),
                )
            })
            .collect()
    }

    /// Calls `f(expert, blob)` with each expert's raw blob bytes (any order), without counting
    /// uses (see `note_uses`): the GPU backend copies them into its VRAM slots. Streamed blobs
    /// are `blob_stride` long (O_DIRECT reads into aligned buffers); mapped ones are the blob.
    /// Streaming, a sink (`to.0`) gets the blobs read from disk now piece by piece, on the
    /// reader threads, instead of `f`, and those with a target (`to.1`) are read straight into
    /// it (see `StreamedStore::for_each_blob`).
    pub fn for_each_blob(
        &self,
        layer: usize,
        experts: &[usize],
        to: (Option<&PieceSink>, &[(usize, ReadTarget)]),
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), EngineError> {
        match &self.source {
            Source::Mapped => {
                for &e in experts {
                    f(e, self.mapped.blob_bytes(layer, e)?);
                }
                Ok(())
            }
            Source::Streamed(s) => s.for_each_blob(layer, &self.with_blobs(layer, experts), to, f),
        }
    }

    /// Counts uses of `experts` of `layer` for the profile (what `for_each` does itself), and
    /// settles the blobs `take_ready` handed out for it against them.
    pub fn note_uses(&self, layer: usize, experts: &[usize]) {
        for &e in experts {
            self.usage[layer * self.n_experts + e].fetch_add(1, Ordering::Relaxed);
        }
        if let Source::Streamed(s) = &self.source {
            s.settle(layer, experts);
        }
    }

    /// Hands `f(expert, blob)` each of `experts` of `layer` whose blob is in memory now (cached
    /// or read ahead completely), without waiting or reading, and returns those handed: for
    /// placing blobs before the layer chooses. `note_uses` counts them once it has. Nothing
    /// when the experts are resident.
    pub fn take_ready(
        &self,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Vec<usize> {
        match &self.source {
            Source::Streamed(s) => s.take_ready(layer, &self.with_blobs(layer, experts), f),
            Source::Mapped => vec![],
        }
    }

    /// Starts reading `experts` of `layer` ahead of use (streaming only; a no-op otherwise).
    /// Returns how many reads it started (not those cached or already coming).
    pub fn prefetch(&self, layer: usize, experts: &[usize]) -> usize {
        match &self.source {
            Source::Streamed(s) => s.prefetch(layer, &self.with_blobs(layer, experts)),
            Source::Mapped => 0,
        }
    }

    /// Of `experts` of `layer`, those whose bytes are not in memory yet (neither cached nor read
    /// ahead completely): what a `for_each_blob` would wait for. Empty when not streaming.
    pub fn pending(&self, layer: usize, experts: &[usize]) -> Vec<usize> {
        match &self.source {
            Source::Streamed(s) => s.pending(layer, experts),
            Source::Mapped => vec![],
        }
    }

    /// Starts reading `experts` of `layer` that it certainly needs, ahead of the
    /// `for_each`/`for_each_blob` that will ask for them (streaming only; a no-op otherwise).
    /// Returns how many reads it started (not those cached or already coming).
    pub fn fetch_early(&self, layer: usize, experts: &[usize]) -> usize {
        match &self.source {
            Source::Streamed(s) => s.fetch_early(layer, &self.with_blobs(layer, experts)),
            Source::Mapped => 0,
        }
    }

    /// As `prefetch`, started only once the next `for_each`/`for_each_blob` has queued the
    /// reads it certainly needs (streaming only; a no-op otherwise).
    pub fn prefetch_after(&self, layer: usize, experts: &[usize]) {
        if let Source::Streamed(s) = &self.source {
            s.prefetch_after(layer, self.with_blobs(layer, experts));
        }
    }

    /// Streaming: seconds since the store opened during which no read was in flight (a
    /// monotone clock; the difference of two readings is the disk's idle time between them).
    /// `None` when the experts are resident.
    pub fn disk_idle_s(&self) -> Option<f64> {
        match &self.source {
            Source::Streamed(s) => Some(s.disk_idle_s()),
            _ => None,
        }
    }

    /// Drops the lookahead guesses for `layer` that no reader has started, when it ran without
    /// asking for its experts (streaming only; a no-op otherwise): none of them was needed.
    pub fn drop_guesses(&self, layer: usize) {
        if let Source::Streamed(s) = &self.source {
            s.drop_guesses(layer);
        }
    }

    /// Adds the score of a lookahead guess of `layer`'s experts (streaming only): `--stats`'
    /// lookahead recall.
    pub fn note_lookahead(&self, layer: usize, r: Recall) {
        if let Source::Streamed(s) = &self.source {
            s.note_lookahead(layer, r);
        }
    }

    /// Marks the end of a forward pass (ages the cache's use counts).
    pub fn tick(&self) {
        if let Source::Streamed(s) = &self.source {
            s.tick();
        }
    }

    pub fn stats(&self) -> Option<StoreStats> {
        match &self.source {
            Source::Streamed(s) => Some(s.stats()),
            Source::Mapped => None,
        }
    }

    pub fn reset_stats(&self) {
        if let Source::Streamed(s) = &self.source {
            s.reset_stats();
        }
    }

    pub fn is_streaming(&self) -> bool {
        matches!(self.source, Source::Streamed(_))
    }

    fn saved_profile(&self) -> Option<Profile> {
        Profile::load(
            self.profile_path.as_ref()?,
            &self.header_sum,
            self.layers,
            self.n_experts,
        )
    }

    /// The saved profile's `(layer, expert)`s, hottest first (empty without a profile).
    pub fn hottest(&self) -> Vec<(usize, usize)> {
        self.saved_profile().map_or(vec![], |p| p.hottest())
    }

    /// Reads the hottest experts of the saved profile into the cache, pinned, until the budget is
    /// full. `progress(done, total)` is called after each. Returns how many were loaded.
    pub fn preload(&self, progress: &mut dyn FnMut(usize, usize)) -> Result<usize, EngineError> {
        let (Source::Streamed(s), Some(p)) = (&self.source, self.saved_profile()) else {
            return Ok(0);
        };
        let hot = p.hottest();
        let mut loaded = 0;
        for (i, &(l, e)) in hot.iter().enumerate() {
            let Some(blob) = self.mapped.blob_index(l, e) else {
                continue;
            };
            if !s.preload(l, e, blob)? {
                break;
            }
            loaded += 1;
            progress(i + 1, hot.len());
        }
        Ok(loaded)
    }

    /// Adds this run's usage to `M.smoe.profile` (when profiles are on).
    pub fn save_profile(&self) -> std::io::Result<()> {
        let Some(path) = &self.profile_path else {
            return Ok(());
        };
        let counts: Vec<u64> = self
            .usage
            .iter()
            .map(|c| c.swap(0, Ordering::Relaxed))
            .collect();
        if counts.iter().all(|&c| c == 0) {
            return Ok(());
        }
        let mut p = self.saved_profile().unwrap_or_else(|| {
            Profile::empty(self.header_sum.clone(), self.layers, self.n_experts)
        });
        p.merge(&counts);
        p.save(path)
    }
}

#[cfg(test)]
mod tests {
    use super::CacheBudget::*;
    use super::*;

    #[test]
    fn lookahead_options_are_checked() {
        let with = |depth, top| StoreOptions {
            tuning: crate::Tuning {
                lookahead: Lookahead { depth, top },
                ..Default::default()
            },
            ..Default::default()
        };
        let want = Lookahead { depth: 3, top: 2 };
        assert_eq!(with(3, 2).lookahead().unwrap(), want);
        for (depth, top, named) in [(0, 2, "depth 0"), (5, 2, "depth 5"), (2, 0, "top 0")] {
            let err = with(depth, top).lookahead().unwrap_err().to_string();
            assert!(err.contains(named), "{err}");
        }
    }

    #[test]
    fn budgets_parse() {
        assert_eq!("8GiB".parse::<CacheBudget>().unwrap(), Bytes(8 << 30));
        assert_eq!(
            "10GB".parse::<CacheBudget>().unwrap(),
            Bytes(10_000_000_000)
        );
        assert_eq!("1.5 MiB".parse::<CacheBudget>().unwrap(), Bytes(3 << 19));
        assert_eq!("25%".parse::<CacheBudget>().unwrap(), Fraction(0.25));
        assert_eq!("auto".parse::<CacheBudget>().unwrap(), Auto);
        assert_eq!("0".parse::<CacheBudget>().unwrap(), Bytes(0));
        assert!("lots".parse::<CacheBudget>().is_err());
        assert!("120%".parse::<CacheBudget>().is_err());
    }
}
