//! `smoe bench serve`: total tokens per second and request latency at several numbers of
//! concurrent clients, through the real HTTP server (started in this process on a free port).
//! Continuous batching should make many clients faster in total than one.

use crate::common::{model_path, open_engine_with, Backend};
use crate::store_args::StoreArgs;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use smoe_server::ServerConfig;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Concurrent client counts to measure, comma-separated.
    #[arg(long, default_value = "1,4,16", value_name = "N,N,…")]
    clients: String,
    /// Tokens generated per request (end-of-sequence ignored, so every request is this long).
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    max_tokens: usize,
    /// Requests each client sends one after the other.
    #[arg(long, default_value_t = 2)]
    requests: usize,
    /// Context per session (prompt + completion).
    #[arg(long, default_value_t = 1024)]
    ctx: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    #[command(flatten)]
    store: StoreArgs,
}

pub fn run(a: Args) -> Result<()> {
    let clients: Vec<usize> = a
        .clients
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .with_context(|| {
            format!(
                "--clients '{}': expected positive counts like 1,4,16",
                a.clients
            )
        })?;
    if clients.is_empty() || a.max_tokens == 0 || a.requests == 0 {
        bail!("--clients, --max-tokens and --requests must be positive");
    }
    let engine = open_engine_with(&model_path(a.model.as_deref())?, a.backend, &a.store)?;
    let cfg = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        max_concurrent: clients.iter().copied().max().unwrap_or(1),
        ctx: a.ctx.min(engine.model.config().max_position_embeddings),
        model_id: "bench".into(),
        ..ServerConfig::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if let Err(e) = smoe_server::serve(engine, cfg, |addr| {
            let _ = tx.send(addr);
        }) {
            eprintln!("error: server: {e:#}");
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .context("the server did not start")?;
    request(addr, 0, 4)?; // warm-up
    let mut rows = vec![];
    for &n in &clients {
        let t0 = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|c| {
                let (reqs, toks) = (a.requests, a.max_tokens);
                std::thread::spawn(move || -> Result<Vec<(f64, usize)>> {
                    (0..reqs)
                        .map(|r| request(addr, (c * reqs + r) as u64, toks))
                        .collect()
                })
            })
            .collect();
        let mut results = vec![];
        for h in handles {
            results.extend(
                h.join()
                    .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
            );
        }
        let wall = t0.elapsed().as_secs_f64();
        let tokens: usize = results.iter().map(|r| r.1).sum();
        let mut lat: Vec<f64> = results.iter().map(|r| r.0).collect();
        lat.sort_by(f64::total_cmp);
        let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
        rows.push(
            json!({"clients": n, "requests": lat.len(), "tokens": tokens,
            "tok_per_s": tokens as f64 / wall, "p50_s": pct(0.5), "p99_s": pct(0.99)}),
        );
    }
    let rate = |r: &Value| r["tok_per_s"].as_f64().unwrap_or(0.0);
    let ratio = rate(rows.last().unwrap()) / rate(&rows[0]).max(1e-9);
    if a.json {
        println!(
            "{}",
            json!({"max_tokens": a.max_tokens, "runs": rows, "ratio_last_to_first": ratio})
        );
        return Ok(());
    }
    println!(
        "{:>8} {:>9} {:>12} {:>9} {:>9}",
        "clients", "requests", "total tok/s", "p50 s", "p99 s"
    );
    for r in &rows {
        println!(
            "{:>8} {:>9} {:>12.1} {:>9.3} {:>9.3}",
            r["clients"].as_u64().unwrap_or(0),
            r["requests"].as_u64().unwrap_or(0),
            rate(r),
            r["p50_s"].as_f64().unwrap_or(0.0),
            r["p99_s"].as_f64().unwrap_or(0.0)
        );
    }
    println!(
        "throughput {} clients / {} client(s): {ratio:.2}x",
        clients[clients.len() - 1],
        clients[0]
    );
    Ok(())
}

/// One non-streaming completion over a fresh connection: (latency in seconds, tokens generated).
fn request(addr: SocketAddr, seed: u64, max_tokens: usize) -> Result<(f64, usize)> {
    let body = json!({"prompt": format!("Example {seed}: in Python, a"), "max_tokens": max_tokens,
                      "ignore_eos": true, "seed": seed, "temperature": 0.8})
    .to_string();
    let t0 = Instant::now();
    let mut c = TcpStream::connect(addr).context("connect to the server")?;
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    c.read_to_string(&mut raw).context("read the response")?;
    let latency = t0.elapsed().as_secs_f64();
    let json_body = raw.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    let v: Value = serde_json::from_str(json_body)
        .with_context(|| format!("unexpected response: {}", raw.lines().next().unwrap_or("")))?;
    let n = v["usage"]["completion_tokens"]
        .as_u64()
        .with_context(|| format!("no usage in the response: {v}"))?;
    Ok((latency, n as usize))
}
