//! Counters shared by the engine thread and the HTTP side, and their Prometheus text form.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Window over which the tokens-per-second gauge is averaged.
const RATE_WINDOW: Duration = Duration::from_secs(10);
const RATE_SAMPLE: Duration = Duration::from_millis(250);

#[derive(Default)]
pub struct Stats {
    ids: AtomicU64,
    /// Requests admitted to a session.
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub step_tokens: AtomicU64,
    pub busy_nanos: AtomicU64,
    /// Expert store (only when experts are streamed into a bounded cache).
    pub expert_streaming: AtomicBool,
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub expert_bytes_read: AtomicU64,
    /// (time, generated_tokens) samples for the tok/s gauge.
    rate: Mutex<VecDeque<(Instant, u64)>>,
    /// HTTP responses by (route, status).
    http: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl Stats {
    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Relaxed) + 1
    }

    /// One forward pass over `tokens` rows.
    pub fn record_step(&self, tokens: usize, took: Duration) {
        self.steps.fetch_add(1, Relaxed);
        self.step_tokens.fetch_add(tokens as u64, Relaxed);
        self.busy_nanos.fetch_add(took.as_nanos() as u64, Relaxed);
        let now = Instant::now();
        let mut r = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        if r.back().is_none_or(|(t, _)| now - *t >= RATE_SAMPLE) {
            r.push_back((now, self.generated_tokens.load(Relaxed)));
        }
        while r.front().is_some_and(|(t, _)| now - *t > RATE_WINDOW) {
            r.pop_front();
        }
    }

    /// Generated tokens per second over the last few seconds (0 when idle).
    pub fn tokens_per_second(&self) -> f64 {
        let now = Instant::now();
        let r = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        match r.iter().find(|(t, _)| now - *t <= RATE_WINDOW) {
            Some(&(t, n)) if now - t > Duration::from_millis(100) => {
                (self.generated_tokens.load(Relaxed) - n) as f64 / (now - t).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// Copies the expert store's counters (the engine thread calls this now and then).
    pub fn record_experts(&self, st: Option<&smoe_engine::store::StoreStats>) {
        self.expert_streaming.store(st.is_some(), Relaxed);
        if let Some(st) = st {
            self.expert_hits.store(st.total.hits, Relaxed);
            self.expert_misses.store(st.total.misses, Relaxed);
            self.expert_bytes_read.store(st.total.bytes_read, Relaxed);
        }
    }

    pub fn record_http(&self, route: &'static str, status: u16) {
        let mut m = self.http.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route, status)).or_default() += 1;
    }

    /// The Prometheus text exposition format.
    pub fn render(&self, model: &str) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        let c = |a: &AtomicU64| a.load(Relaxed).to_string();
        metric(
            "smoe_requests_total",
            "counter",
            "Requests admitted to a session.",
            c(&self.requests),
        );
        metric(
            "smoe_requests_completed_total",
            "counter",
            "Requests that finished (stop or length).",
            c(&self.completed),
        );
        metric(
            "smoe_requests_cancelled_total",
            "counter",
            "Requests dropped because the client went away.",
            c(&self.cancelled),
        );
        metric(
            "smoe_requests_failed_total",
            "counter",
            "Requests that failed inside the engine.",
            c(&self.failed),
        );
        metric(
            "smoe_queue_depth",
            "gauge",
            "Requests waiting for a free session.",
            self.queued.load(Relaxed).to_string(),
        );
        metric(
            "smoe_active_requests",
            "gauge",
            "Requests holding a session.",
            self.active.load(Relaxed).to_string(),
        );
        metric(
            "smoe_prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled (reused cache positions excluded).",
            c(&self.prompt_tokens),
        );
        metric(
            "smoe_generation_tokens_total",
            "counter",
            "Tokens generated.",
            c(&self.generated_tokens),
        );
        metric(
            "smoe_generation_tokens_per_second",
            "gauge",
            "Generated tokens per second, last 10 s.",
            format!("{:.3}", self.tokens_per_second()),
        );
        metric(
            "smoe_forward_passes_total",
            "counter",
            "Batched forward passes.",
            c(&self.steps),
        );
        metric(
            "smoe_forward_tokens_total",
            "counter",
            "Token rows over all forward passes (batch size sum).",
            c(&self.step_tokens),
        );
        metric(
            "smoe_forward_seconds_total",
            "counter",
            "Time spent in forward passes.",
            format!("{:.6}", self.busy_nanos.load(Relaxed) as f64 * 1e-9),
        );
        if self.expert_streaming.load(Relaxed) {
            let (h, m) = (
                self.expert_hits.load(Relaxed),
                self.expert_misses.load(Relaxed),
            );
            let rate = if h + m > 0 {
                h as f64 / (h + m) as f64
            } else {
                0.0
            };
            metric(
                "smoe_expert_cache_hits_total",
                "counter",
                "Expert uses served from the cache.",
                h.to_string(),
            );
            metric(
                "smoe_expert_cache_misses_total",
                "counter",
                "Expert uses read from the vault.",
                m.to_string(),
            );
            metric(
                "smoe_expert_cache_hit_rate",
                "gauge",
                "Hits over all expert uses since start.",
                format!("{rate:.4}"),
            );
            metric(
                "smoe_expert_read_bytes_total",
                "counter",
                "Expert bytes read from the vault.",
                c(&self.expert_bytes_read),
            );
        } else {
            // Memory-mapped experts have no cache of ours to report on.
            let _ = writeln!(
                o,
                "# experts are resident (memory-mapped): no expert cache statistics"
            );
        }
        let _ = writeln!(o, "# HELP smoe_model_info The served model.\n# TYPE smoe_model_info gauge\nsmoe_model_info{{model=\"{}\"}} 1", escape(model));
        let _ = writeln!(o, "# HELP smoe_http_responses_total HTTP responses by route and status.\n# TYPE smoe_http_responses_total counter");
        let m = self.http.lock().unwrap_or_else(|e| e.into_inner());
        for ((route, status), n) in m.iter() {
            let _ = writeln!(
                o,
                "smoe_http_responses_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        o
    }
}

/// Prometheus label values escape backslash, quote and newline.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
