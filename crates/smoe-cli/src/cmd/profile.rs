//! `smoe profile`: the expert-usage heatmap (layers × experts) from `M.smoe.profile`.

use anyhow::{bail, Context, Result};
use smoe_engine::store::profile::Profile;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The vault whose profile (VAULT.profile, written by runs with an expert cache) to render.
    vault: PathBuf,
    /// Where to write the heatmap PNG (default: VAULT.profile.png).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let path = Profile::path_for(&a.vault);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no usage profile at {} (run generate or perplexity on the vault first)",
            path.display()
        )
    })?;
    let p: Profile = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a profile", path.display()))?;
    if p.counts.is_empty() || p.experts == 0 {
        bail!("{}: empty profile", path.display());
    }
    let out = a
        .output
        .unwrap_or_else(|| path.with_extension("profile.png"));
    std::fs::write(&out, heatmap_png(&p.counts))
        .with_context(|| format!("cannot write {}", out.display()))?;
    summary(&p);
    eprintln!(
        "heatmap: {} (rows = layers, columns = experts, brighter = used more, log scale)",
        out.display()
    );
    Ok(())
}

/// What a cache holding the hottest fraction of experts would have hit, and per-layer spread.
fn summary(p: &Profile) {
    let mut all: Vec<u64> = p.counts.iter().flatten().copied().collect();
    let total: u64 = all.iter().sum();
    all.sort_unstable_by(|a, b| b.cmp(a));
    println!(
        "{} routed uses over {} layers × {} experts",
        total, p.layers, p.experts
    );
    for frac in [0.1, 0.25, 0.5] {
        let n = ((all.len() as f64) * frac).ceil() as usize;
        let covered: u64 = all[..n].iter().sum();
        println!(
            "  hottest {:>3.0}% of experts take {:5.1}% of uses",
            frac * 100.0,
            100.0 * covered as f64 / total.max(1) as f64
        );
    }
    println!("  layer  uses   effective experts (exp entropy)   top expert");
    for (l, row) in p.counts.iter().enumerate() {
        let n: u64 = row.iter().sum();
        if n == 0 {
            continue;
        }
        let h: f64 = row
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let q = c as f64 / n as f64;
                -q * q.ln()
            })
            .sum();
        let (top, c) = row.iter().enumerate().max_by_key(|(_, c)| **c).unwrap();
        println!(
            "  {l:>5} {n:>6}   {:>8.1}                         #{top} ({:.1}%)",
            h.exp(),
            100.0 * *c as f64 / n as f64
        );
    }
}

/// A grayscale PNG, each cell 6×6 pixels, brightness ∝ log(1 + count).
fn heatmap_png(counts: &[Vec<u64>]) -> Vec<u8> {
    const CELL: usize = 6;
    let (rows, cols) = (counts.len(), counts[0].len());
    let (w, h) = (cols * CELL, rows * CELL);
    let max = counts
        .iter()
        .flatten()
        .map(|&c| ((1 + c) as f64).ln())
        .fold(0.0, f64::max)
        .max(1e-9);
    let mut raw = Vec::with_capacity(h * (w + 1));
    for y in 0..h {
        raw.push(0); // filter: none
        for x in 0..w {
            let c = counts[y / CELL][x / CELL];
            raw.push((255.0 * ((1 + c) as f64).ln() / max) as u8);
        }
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = vec![];
    ihdr.extend((w as u32).to_be_bytes());
    ihdr.extend((h as u32).to_be_bytes());
    ihdr.extend([8, 0, 0, 0, 0]); // 8-bit grayscale
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &zlib_stored(&raw));
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// zlib with uncompressed (stored) deflate blocks: valid everywhere, no dependency.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = if data.is_empty() {
        vec![&[]]
    } else {
        data.chunks(65535).collect()
    };
    for (i, b) in blocks.iter().enumerate() {
        out.push((i + 1 == blocks.len()) as u8);
        out.extend((b.len() as u16).to_le_bytes());
        out.extend((!(b.len() as u16)).to_le_bytes());
        out.extend(*b);
    }
    let (mut a, mut s) = (1u32, 0u32);
    for &x in data {
        a = (a + x as u32) % 65521;
        s = (s + a) % 65521;
    }
    out.extend(((s << 16) | a).to_be_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB88320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc_and_png_signature() {
        assert_eq!(super::crc32(b"123456789"), 0xCBF43926);
        let png = super::heatmap_png(&[vec![0, 5], vec![9, 1]]);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
    }
}
