//! `POST /v1/chat/completions`: messages (and tools) through the model's chat template, then
//! generation, streamed or whole; `<tool_call>` output becomes OpenAI `tool_calls`.

use crate::app::{body_rejection, json_ok, submit_error, Shared};
use crate::error::ApiError;
use crate::logprobs::chat_entry;
use crate::messages::parse_messages;
use crate::params::{common, fit_context, parse_body, type_name, Common, Obj};
use crate::respond::{collect, new_id, sse, unix_time, StreamFormat, Usage};
use crate::scheduler::{Finish, GenRequest, TokenOut};
use crate::tools::{parse_tool_calls, render_tools_into_messages, ToolStream};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use smoe_engine::chat::ChatMessage;
use smoe_engine::tokenizer::Tokenizer;

const MAX_TOP_LOGPROBS: i64 = 20;

/// A validated chat request.
struct Chat {
    common: Common,
    messages: Vec<ChatMessage>,
    /// Present when tools are offered and tool_choice is not "none".
    tools: Option<Value>,
    logprobs: Option<usize>,
    extra: Option<Value>,
}

pub async fn handle(State(st): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(st: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body.map_err(body_rejection)?;
    let chat = parse(&st, &body)?;
    // Rendering and tokenizing a long conversation takes a while: keep it off the I/O threads.
    let st2 = st.clone();
    let (messages, tools, extra) = (chat.messages, chat.tools.clone(), chat.extra);
    let prompt =
        tokio::task::spawn_blocking(move || render(&st2, messages, tools.as_ref(), extra.as_ref()))
            .await
            .map_err(|e| ApiError::server(format!("prompt rendering panicked: {e}")))??;
    let max_tokens = fit_context(prompt.len(), chat.common.max_tokens, st.sched.ctx)?;
    let req = GenRequest {
        prompt,
        max_tokens,
        sampler: chat.common.sampler.clone(),
        stop_ids: if chat.common.ignore_eos {
            vec![]
        } else {
            st.eos.clone()
        },
        stop_strings: chat.common.stop.clone(),
        logprobs: chat.logprobs,
    };
    let rx = st.sched.submit(req).map_err(submit_error)?;
    let (id, created) = (new_id("chatcmpl"), unix_time());
    if chat.common.stream {
        let fmt = ChatStream {
            id,
            created,
            model: st.model_id.clone(),
            tok: st.tok.clone(),
            tools: chat.tools.is_some().then(ToolStream::default),
            include_usage: chat.common.include_usage,
            logprobs: chat.logprobs.is_some(),
        };
        return Ok(sse(rx, fmt));
    }
    let done = collect(rx).await?;
    let (content, calls) = if chat.tools.is_some() {
        parse_tool_calls(&done.text)
    } else {
        (done.text.clone(), vec![])
    };
    // Reasoning (`<think>…</think>`) is returned apart from the answer.
    let (reasoning, content) = crate::reasoning::split_reasoning(&content);
    let mut message = json!({"role": "assistant", "content": content});
    if let Some(r) = reasoning {
        message["reasoning_content"] = Value::String(r);
    }
    let mut finish = done.finish.as_str();
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        let list: Vec<Value> = calls.iter().map(|c| c.to_json(None)).collect();
        message["tool_calls"] = Value::Array(list);
        finish = "tool_calls";
    }
    let logprobs = chat.logprobs.map(|_| {
        let content: Vec<Value> = done
            .tokens
            .iter()
            .map(|(t, _)| chat_entry(&st.tok, t))
            .collect();
        json!({"content": content})
    });
    Ok(json_ok(&json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": st.model_id,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": done.usage.json(),
    })))
}

fn parse(st: &Shared, body: &[u8]) -> Result<Chat, ApiError> {
    let map = parse_body(body)?;
    let o = Obj(&map);
    let common = common(&o, &st.model_id, &st.defaults)?;
    let messages = parse_messages(o.get("messages"))?;
    let tools = match o.get("tools") {
        None => None,
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                let name = t.get("function").and_then(|f| f.get("name"));
                if !name.is_some_and(Value::is_string) {
                    return Err(ApiError::invalid(
                        "tools",
                        format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ));
                }
            }
            (!list.is_empty()).then(|| Value::Array(list.clone()))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "tools",
                format!("'tools' must be an array, got {}", type_name(v)),
            ))
        }
    };
    let tools = match o.get("tool_choice") {
        Some(Value::String(s)) if s == "none" => None,
        None | Some(Value::String(_)) | Some(Value::Object(_)) => tools,
        Some(v) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "'tool_choice' must be a string or an object, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let top = o.int("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
    let logprobs = match (o.boolean("logprobs")?.unwrap_or(false), top) {
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs': true",
            ))
        }
        (false, None) => None,
    };
    if let Some(rf) = o.get("response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::invalid(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported (no JSON mode yet)",
            ));
        }
    }
    let extra = match o.get("chat_template_kwargs") {
        None => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(v) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!(
                    "'chat_template_kwargs' must be an object, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    Ok(Chat {
        common,
        messages,
        tools,
        logprobs,
        extra,
    })
}

fn render(
    st: &Shared,
    mut messages: Vec<ChatMessage>,
    tools: Option<&Value>,
    extra: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let tools = if st.template_has_tools {
        tools
    } else {
        render_tools_into_messages(&mut messages, tools);
        None
    };
    let text = st
        .template
        .render(&messages, tools, true, extra)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    // The template wrote the special tokens itself: add none.
    st.tok
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

struct ChatStream {
    id: String,
    created: u64,
    model: String,
    tok: Tokenizer,
    tools: Option<ToolStream>,
    include_usage: bool,
    logprobs: bool,
}

impl ChatStream {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let mut c = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl StreamFormat for ChatStream {
    fn start(&mut self) -> Vec<Value> {
        vec![self.chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            None,
        )]
    }

    fn text(&mut self, text: &str, token: Option<&TokenOut>) -> Vec<Value> {
        let shown = match &mut self.tools {
            Some(t) => t.push(text),
            None => text.to_string(),
        };
        let lp = match token {
            Some(t) if self.logprobs => json!({"content": [chat_entry(&self.tok, t)]}),
            _ => Value::Null,
        };
        if shown.is_empty() && lp.is_null() {
            return vec![];
        }
        vec![self.chunk(json!({"content": shown}), lp, None)]
    }

    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value> {
        let mut out = vec![];
        let mut reason = finish.as_str();
        if let Some(t) = &mut self.tools {
            let (rest, calls) = t.finish();
            if !rest.is_empty() {
                out.push(self.chunk(json!({"content": rest}), Value::Null, None));
            }
            if !calls.is_empty() {
                let list: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| c.to_json(Some(i)))
                    .collect();
                out.push(self.chunk(json!({"tool_calls": list}), Value::Null, None));
                reason = "tool_calls";
            }
        }
        out.push(self.chunk(json!({}), Value::Null, Some(reason)));
        if self.include_usage {
            out.push(json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage.json(),
            }));
        }
        out
    }
}
