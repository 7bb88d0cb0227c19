//! `POST /v1/completions`: continue a text prompt (or token ids), streamed or whole.

use crate::app::{body_rejection, json_ok, submit_error, Shared};
use crate::error::ApiError;
use crate::logprobs::CompletionLogprobs;
use crate::params::{common, fit_context, parse_body, type_name, Obj};
use crate::respond::{collect, new_id, sse, unix_time, StreamFormat, Usage};
use crate::scheduler::{Finish, GenRequest, TokenOut};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use smoe_engine::tokenizer::Tokenizer;

/// OpenAI's limit for the completions `logprobs` count.
const MAX_LOGPROBS: i64 = 5;

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub async fn handle(State(st): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(st: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body.map_err(body_rejection)?;
    let map = parse_body(&body)?;
    let o = Obj(&map);
    let c = common(&o, &st.model_id, &st.defaults)?;
    let prompt = parse_prompt(o.get("prompt"), st.tok.vocab_size())?;
    let logprobs = o.int("logprobs", 0, MAX_LOGPROBS)?.map(|k| k as usize);
    let echo = o.boolean("echo")?.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "echo with logprobs is not supported (no prompt logprobs)",
        ));
    }
    if o.get("suffix").is_some_and(|s| s.as_str() != Some("")) {
        return Err(ApiError::invalid(
            "suffix",
            "'suffix' (fill-in-the-middle) is not supported",
        ));
    }
    let st2 = st.clone();
    let (ids, prompt_text) = tokio::task::spawn_blocking(move || -> Result<_, ApiError> {
        Ok(match prompt {
            Prompt::Text(t) => {
                let ids = st2
                    .tok
                    .encode(&t, true)
                    .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
                (ids, t)
            }
            Prompt::Ids(ids) => {
                let t = st2
                    .tok
                    .decode(&ids, false)
                    .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
                (ids, t)
            }
        })
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing panicked: {e}")))??;
    let max_tokens = fit_context(ids.len(), c.max_tokens, st.sched.ctx)?;
    let req = GenRequest {
        prompt: ids,
        max_tokens,
        sampler: c.sampler.clone(),
        stop_ids: if c.ignore_eos { vec![] } else { st.eos.clone() },
        stop_strings: c.stop.clone(),
        logprobs,
    };
    let rx = st.sched.submit(req).map_err(submit_error)?;
    let (id, created) = (new_id("cmpl"), unix_time());
    let echoed = if echo { prompt_text } else { String::new() };
    if c.stream {
        let fmt = TextStream {
            id,
            created,
            model: st.model_id.clone(),
            tok: st.tok.clone(),
            echo: echoed,
            chars: 0,
            include_usage: c.include_usage,
        };
        return Ok(sse(rx, fmt));
    }
    let done = collect(rx).await?;
    let lp = logprobs.map(|_| {
        let mut l = CompletionLogprobs::default();
        for (t, at) in &done.tokens {
            l.push(&st.tok, t, *at);
        }
        l.take_json()
    });
    Ok(json_ok(&json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": st.model_id,
        "choices": [{"index": 0, "text": echoed + &done.text, "logprobs": lp,
                     "finish_reason": done.finish.as_str()}],
        "usage": done.usage.json(),
    })))
}

/// A string, a list of token ids, or either wrapped in a one-element list.
fn parse_prompt(v: Option<&Value>, vocab: usize) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::invalid("prompt", m);
    match v {
        None => Err(bad("'prompt' is required".into())),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && !a[0].is_number() => {
            parse_prompt(Some(&a[0]), vocab)
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            let ids = a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .filter(|&id| (id as usize) < vocab)
                        .map(|id| id as u32)
                        .ok_or_else(|| {
                            bad(format!(
                                "token id {x} is not in the vocabulary (size {vocab})"
                            ))
                        })
                })
                .collect::<Result<Vec<u32>, _>>()?;
            Ok(Prompt::Ids(ids))
        }
        Some(Value::Array(_)) => Err(bad(
            "several prompts in one request are not supported; send one prompt per request".into(),
        )),
        Some(v) => Err(bad(format!(
            "'prompt' must be a string or an array of token ids, got {}",
            type_name(v)
        ))),
    }
}

struct TextStream {
    id: String,
    created: u64,
    model: String,
    tok: Tokenizer,
    echo: String,
    /// Characters of completion text sent so far (for text_offset).
    chars: usize,
    include_usage: bool,
}

impl TextStream {
    fn chunk(&self, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        let mut c = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl StreamFormat for TextStream {
    fn start(&mut self) -> Vec<Value> {
        if self.echo.is_empty() {
            return vec![];
        }
        let e = std::mem::take(&mut self.echo);
        vec![self.chunk(&e, Value::Null, None)]
    }

    fn text(&mut self, text: &str, token: Option<&TokenOut>) -> Vec<Value> {
        let lp = match token {
            Some(t) => {
                let mut l = CompletionLogprobs::default();
                l.push(&self.tok, t, self.chars);
                l.take_json()
            }
            None => Value::Null,
        };
        self.chars += text.chars().count();
        if text.is_empty() && lp.is_null() {
            return vec![];
        }
        vec![self.chunk(text, lp, None)]
    }

    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value> {
        let mut out = vec![self.chunk("", Value::Null, Some(finish.as_str()))];
        if self.include_usage {
            out.push(json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [], "usage": usage.json(),
            }));
        }
        out
    }
}
