//! Turning a request's event channel into an HTTP response: server-sent events in OpenAI's chunk
//! format ending with `data: [DONE]`, or one collected result.
//!
//! Dropping the receiver is what cancels a request, and both paths drop it when the client goes
//! away: hyper drops the body stream when a write fails, and the handler future when the
//! connection closes.

use crate::error::ApiError;
use crate::scheduler::{Event, Finish, TokenOut};
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::convert::Infallible;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    pub cached: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// How an endpoint spells its stream chunks.
pub trait StreamFormat: Send + 'static {
    fn start(&mut self) -> Vec<Value>;
    fn text(&mut self, text: &str, token: Option<&TokenOut>) -> Vec<Value>;
    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value>;
}

fn frames(chunks: Vec<Value>) -> String {
    chunks
        .into_iter()
        .map(|c| format!("data: {c}\n\n"))
        .collect()
}

const DONE: &str = "data: [DONE]\n\n";

/// The SSE response for a submitted request.
pub fn sse<F: StreamFormat>(rx: UnboundedReceiver<Event>, fmt: F) -> Response {
    // State: None once the stream has ended.
    let state = Some((rx, fmt, false));
    let stream = futures_util::stream::unfold(state, |state| async move {
        let (mut rx, mut fmt, started) = state?;
        if !started {
            let out = frames(fmt.start());
            return Some((Ok::<_, Infallible>(Bytes::from(out)), Some((rx, fmt, true))));
        }
        // Skip events that produce no bytes: an empty chunk would be read as the end of a
        // chunked body by some clients.
        loop {
            let (out, more) = match rx.recv().await {
                Some(Event::Text { text, token }) => {
                    (frames(fmt.text(&text, token.as_ref())), true)
                }
                Some(Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                }) => {
                    let usage = Usage {
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    };
                    (frames(fmt.done(finish, usage)) + DONE, false)
                }
                Some(Event::Error(msg)) => (error_frame(&msg), false),
                None => (error_frame("the engine dropped the request"), false),
            };
            if out.is_empty() {
                continue;
            }
            let next = more.then_some((rx, fmt, true));
            return Some((Ok(Bytes::from(out)), next));
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// An error after the stream started: OpenAI sends an `error` object as an event.
fn error_frame(msg: &str) -> String {
    format!("data: {}\n\n{DONE}", ApiError::server(msg).body())
}

/// A finished non-streaming request.
pub struct Collected {
    pub text: String,
    /// Tokens with logprobs, each with the length (in chars) of the text before it.
    pub tokens: Vec<(TokenOut, usize)>,
    pub finish: Finish,
    pub usage: Usage,
}

pub async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut chars = 0;
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Text { text: t, token }) => {
                if let Some(tk) = token {
                    tokens.push((tk, chars));
                }
                chars += t.chars().count();
                text.push_str(&t);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                return Ok(Collected {
                    text,
                    tokens,
                    finish,
                    usage: Usage {
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    },
                })
            }
            Some(Event::Error(msg)) => return Err(ApiError::server(msg)),
            None => return Err(ApiError::server("the engine dropped the request")),
        }
    }
}

/// `chatcmpl-…` / `cmpl-…` ids: unique per process and start time.
pub fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    format!(
        "{prefix}-{:x}{:06x}",
        unix_time(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
