//! Request bodies: bytes → JSON object → typed, range-checked parameters. Every mistake is a 400
//! that names the parameter, so a client author can fix it from the message alone.

use crate::error::ApiError;
use axum::http::StatusCode;
use serde_json::{Map, Value};
use smoe_engine::sampler::SamplerConfig;

/// The body as a JSON object, or the 400 that says why not.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            type_name(&other)
        ))),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to a request object; JSON `null` counts as absent, as in OpenAI's API.
pub struct Obj<'a>(pub &'a Map<String, Value>);

impl<'a> Obj<'a> {
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn wrong(k: &str, want: &str, got: &Value) -> ApiError {
        ApiError::invalid(k, format!("'{k}' must be {want}, got {}", type_name(got)))
    }

    pub fn num(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| Self::wrong(k, "a number", v))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                k,
                format!("'{k}' must be between {lo} and {hi}, got {x}"),
            ));
        }
        Ok(Some(x))
    }

    pub fn int(&self, k: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        // 5.0 is accepted as 5, as Python clients may send floats.
        let x = v
            .as_i64()
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .ok_or_else(|| Self::wrong(k, "an integer", v))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(
                k,
                format!("'{k}' must be between {lo} and {hi}, got {x}"),
            ));
        }
        Ok(Some(x))
    }

    pub fn boolean(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(k, "a boolean", v)),
        }
    }

    pub fn string(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(k, "a string", v)),
        }
    }
}

/// What chat and text completions share.
#[derive(Debug, Clone)]
pub struct Common {
    pub sampler: SamplerConfig,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Reads model, n, stream, sampling and stop parameters. `defaults` is the model's
/// generation_config; a request overrides what it sets.
pub fn common(o: &Obj, model_id: &str, defaults: &SamplerConfig) -> Result<Common, ApiError> {
    if let Some(m) = o.string("model")? {
        if m != model_id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model '{m}' does not exist; this server serves '{model_id}'"),
            )
            .with_code("model_not_found"));
        }
    }
    if let Some(n) = o.int("n", i64::MIN, i64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("only n = 1 is supported, got {n}; send several requests instead"),
            ));
        }
    }
    if let Some(b) = o.int("best_of", i64::MIN, i64::MAX)? {
        if b != 1 {
            return Err(ApiError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
    }
    let stream = o.boolean("stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None => false,
        Some(Value::Object(m)) => Obj(m).boolean("include_usage")?.unwrap_or(false),
        Some(v) => return Err(Obj::wrong("stream_options", "an object", v)),
    };
    let max_tokens = match o.int("max_completion_tokens", 1, i64::MAX)? {
        Some(n) => Some(n),
        None => o.int("max_tokens", 1, i64::MAX)?,
    };
    let mut s = defaults.clone();
    if let Some(t) = o.num("temperature", 0.0, 2.0)? {
        s.temperature = t as f32;
    }
    if let Some(p) = o.num("top_p", 0.0, 1.0)? {
        // top_p = 0 asks for the single most likely token; the sampler needs p > 0.
        s.top_p = (p as f32).max(f32::MIN_POSITIVE);
    }
    if let Some(k) = o.int("top_k", -1, i64::from(u32::MAX))? {
        s.top_k = k.max(0) as usize; // -1 = off, as in vLLM
    }
    if let Some(p) = o.num("min_p", 0.0, 1.0)? {
        s.min_p = p as f32;
    }
    if let Some(p) = o.num("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p as f32;
    }
    if let Some(p) = o.num("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p as f32;
    }
    if let Some(p) = o.num("repetition_penalty", f64::MIN_POSITIVE, 10.0)? {
        s.repetition_penalty = p as f32;
    }
    s.seed = match o.get("seed") {
        None => random_seed(),
        Some(v) => v
            .as_i64()
            .map(|x| x as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| Obj::wrong("seed", "an integer", v))?,
    };
    s.validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Common {
        sampler: s,
        max_tokens: max_tokens.map(|n| n as usize),
        stop: stop_strings(o)?,
        stream,
        include_usage,
        ignore_eos: o.boolean("ignore_eos")?.unwrap_or(false),
    })
}

const MAX_STOPS: usize = 16;
/// Bytes of one stop string: every generated piece of text is matched against each of them, so
/// their length bounds a request's work (three 1.3 MB stop strings once made a request take 14 s
/// and slowed every other one).
const MAX_STOP_BYTES: usize = 256;

fn stop_strings(o: &Obj) -> Result<Vec<String>, ApiError> {
    let stops = match o.get("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(Obj::wrong("stop", "a string or an array of strings", other)),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(Obj::wrong("stop", "a string or an array of strings", v)),
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOPS} stop strings, got {}", stops.len()),
        ));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop strings are at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ),
        ));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

/// A different seed per unseeded request: the clock mixed with a counter.
fn random_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ N
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Checks the prompt against the context and settles max_tokens (default: the rest of the
/// context). OpenAI refuses prompt + max_tokens beyond the context rather than truncating.
pub fn fit_context(
    prompt_len: usize,
    max_tokens: Option<usize>,
    ctx: usize,
) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_request("the prompt is empty (no tokens)"));
    }
    if prompt_len >= ctx {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {ctx} tokens. However, your prompt has \
             {prompt_len} tokens, which leaves no room for a completion."
        ))
        .with_code("context_length_exceeded"));
    }
    match max_tokens {
        None => Ok(ctx - prompt_len),
        Some(n) if prompt_len + n > ctx => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested \
                 {} tokens ({prompt_len} in the prompt, {n} for the completion).",
                prompt_len + n
            ),
        )
        .with_code("context_length_exceeded")),
        Some(n) => Ok(n),
    }
}
