//! `smoe bench disk`: how fast the vault's disk reads expert blobs at each read size and number
//! of threads — what `--read-piece` and `--read-threads` should be on this disk, and beside
//! what `bench decode`'s I/O bound divides by (whole blobs on 8 threads).

use crate::cmd::bench::median_spread;
use crate::common::model_path;
use crate::store_args::parse_read_piece;
use anyhow::{bail, Context, Result};
use smoe_engine::store::aligned::AlignedBuf;
use smoe_engine::store::read_piece_bytes;
use smoe_vault::format::ExpertSection;
use smoe_vault::Vault;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Reader threads to try, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16",
        value_name = "N,…"
    )]
    threads: Vec<usize>,
    /// Read sizes to try, comma-separated: each blob is split into reads of this size that the
    /// threads share, as the expert store reads (`--read-piece`); `blob` reads whole blobs.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64KiB,256KiB,1MiB,blob",
        value_name = "SIZE,…"
    )]
    pieces: Vec<String>,
    /// MiB read per measurement (blobs picked afresh from all over the vault each time).
    #[arg(long, default_value_t = 512)]
    mib: u64,
    /// Times the whole table is measured, interleaved (a virtual disk's speed drifts within
    /// minutes); the median is reported with the spread.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object: a row per (read size, threads) with each round's GB/s.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    if a.threads.is_empty() || a.threads.contains(&0) {
        bail!("--threads: each must be at least 1");
    }
    if a.mib == 0 || a.rounds == 0 {
        bail!("--mib and --rounds must be at least 1");
    }
    let pieces: Vec<(String, usize)> = (a.pieces.iter())
        .map(|p| Ok((p.clone(), parse_read_piece(p).context("--pieces")?)))
        .collect::<Result<_>>()?;
    let path = model_path(a.model.as_deref())?;
    let vault = Vault::open(&path).context("cannot open the vault")?;
    let Some(x) = vault.expert_section() else {
        bail!(
            "{}: the vault has no routed experts to read",
            path.display()
        );
    };
    let direct = smoe_engine::store::reader::open_direct(&path).is_some();
    let combos: Vec<(usize, usize)> = (0..pieces.len())
        .flat_map(|p| a.threads.iter().map(move |&t| (p, t)))
        .collect();
    let bytes = a.mib << 20;
    let pb = indicatif::ProgressBar::new((a.rounds * combos.len()) as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("reading [{bar:40}] {pos}/{len} measurements")
            .unwrap(),
    );
    let mut gbps = vec![vec![]; combos.len()];
    let mut seed = clock_seed();
    for _ in 0..a.rounds {
        for (i, &(p, t)) in combos.iter().enumerate() {
            // Each measurement starts far from the last one's blobs.
            seed = seed.wrapping_add(x.blobs.len() / 3 + 1);
            let g = read_gbps(&path, x, t, pieces[p].1, bytes, seed)
                .with_context(|| format!("reading {} failed", path.display()))?;
            gbps[i].push(g);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    let stride = x.blob_stride as usize;
    let rows: Vec<serde_json::Value> = (combos.iter().zip(&gbps))
        .map(|(&(p, t), g)| {
            serde_json::json!({
                "piece": pieces[p].0,
                "piece_bytes": read_piece_bytes(pieces[p].1, stride),
                "threads": t,
                "gb_per_s": median_spread(g.clone()).0,
                "rounds": g,
            })
        })
        .collect();
    if a.json {
        let report = serde_json::json!({
            "vault": path.display().to_string(),
            "blob_bytes": stride,
            "direct_io": direct,
            "mib_per_measurement": a.mib,
            "rows": rows,
        });
        println!("{report}");
        return Ok(());
    }
    println!(
        "{}: expert blobs of {:.2} MiB, {} reads, {} MiB per measurement; GB/s, median of {} (min–max)",
        path.display(),
        stride as f64 / (1 << 20) as f64,
        if direct { "direct (page cache bypassed)" } else { "buffered (the file system refuses direct reads: figures include its cache)" },
        a.mib,
        a.rounds
    );
    print!("{:>12}", "read size");
    for t in &a.threads {
        print!(
            "{:>22}",
            format!("{t} thread{}", if *t == 1 { "" } else { "s" })
        );
    }
    println!();
    for (p, (name, bytes)) in pieces.iter().enumerate() {
        // A size at or above the blob reads whole blobs: say so.
        let whole =
            read_piece_bytes(*bytes, stride) == stride && !name.eq_ignore_ascii_case("blob");
        let label = if whole {
            format!("{name}→blob")
        } else {
            name.clone()
        };
        print!("{label:>12}");
        for (i, _) in (combos.iter().enumerate()).filter(|(_, c)| c.0 == p) {
            let (m, lo, hi) = median_spread(gbps[i].clone());
            print!("{:>22}", format!("{m:.2} ({lo:.2}–{hi:.2})"));
        }
        println!();
    }
    println!("(the expert store reads with --read-piece 256KiB on --read-threads 8 unless told)");
    Ok(())
}

/// Nanoseconds of the wall clock: a seed that differs from run to run.
pub fn clock_seed() -> usize {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as usize)
}

/// GB/s reading about `bytes` of expert blobs from `path` on `threads` threads, each blob in
/// reads of `piece` bytes (as the store rounds them) that the threads take in turn from one
/// list, as the store's readers share a blob's pieces; the blobs are picked all over the vault
/// from `seed` on, so that no cache below the file system (a virtual disk's host) has seen them
/// lately. Direct reads where the file system allows them. None if a read fails.
pub fn read_gbps(
    path: &Path,
    x: &ExpertSection,
    threads: usize,
    piece: usize,
    bytes: u64,
    seed: usize,
) -> Option<f64> {
    let stride = x.blob_stride as usize;
    if stride == 0 || x.blobs.is_empty() {
        return None;
    }
    let piece = read_piece_bytes(piece, stride);
    let blobs = (bytes as usize / stride).clamp(1, x.blobs.len());
    let per_blob = stride.div_ceil(piece);
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let ok = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                let next = &next;
                s.spawn(move || -> Option<()> {
                    let f = smoe_engine::store::reader::open_direct(path)
                        .or_else(|| std::fs::File::open(path).ok())?;
                    let mut buf = AlignedBuf::new(piece)?;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= blobs * per_blob {
                            return Some(());
                        }
                        // 7,919 is prime: consecutive reads land far apart in the file.
                        let b = &x.blobs[(i / per_blob * 7919 + seed) % x.blobs.len()];
                        let at = i % per_blob * piece;
                        let len = piece.min(stride - at);
                        f.read_exact_at(&mut buf.as_mut_slice()[..len], b.offset + at as u64)
                            .ok()?;
                    }
                })
            })
            .collect();
        (handles.into_iter()).all(|h| h.join().ok().flatten().is_some())
    });
    ok.then(|| (blobs * stride) as f64 / start.elapsed().as_secs_f64() / 1e9)
}
