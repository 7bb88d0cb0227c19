//! Chat messages from an OpenAI request into the engine's `ChatMessage`s, checked field by
//! field (roles, text-only content, earlier tool calls).

use crate::error::ApiError;
use crate::params::{type_name, Obj};
use serde_json::{json, Value};
use smoe_engine::chat::ChatMessage;

pub fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let bad = |i: usize, m: String| ApiError::invalid("messages", format!("messages[{i}]: {m}"));
    let list = match v {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "'messages' is empty")),
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("'messages' must be an array, got {}", type_name(v)),
            ))
        }
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(map) = m else {
            return Err(bad(i, format!("must be an object, got {}", type_name(m))));
        };
        let o = Obj(map);
        let role = o.string("role").map_err(|e| bad(i, e.message))?;
        let role = match role {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some(r) => return Err(bad(i, format!("unknown role '{r}'"))),
            None => return Err(bad(i, "'role' is required".into())),
        };
        let content = content_text(o.get("content")).map_err(|e| bad(i, e))?;
        let tool_calls = match o.get("tool_calls") {
            None => None,
            Some(Value::Array(calls)) if role == "assistant" => Some(Value::Array(
                calls
                    .iter()
                    .map(template_call)
                    .collect::<Result<_, _>>()
                    .map_err(|e| bad(i, e))?,
            )),
            Some(_) => {
                return Err(bad(
                    i,
                    "'tool_calls' must be an array on an assistant message".into(),
                ))
            }
        };
        if content.is_none() && tool_calls.is_none() && role != "assistant" {
            return Err(bad(i, format!("a {role} message needs 'content'")));
        }
        let s = |k: &str| {
            o.string(k)
                .map(|v| v.map(str::to_string))
                .map_err(|e| bad(i, e.message))
        };
        out.push(ChatMessage {
            role: role.into(),
            content,
            tool_calls,
            tool_call_id: s("tool_call_id")?,
            name: s("name")?,
            reasoning_content: s("reasoning_content")?,
        });
    }
    Ok(out)
}

/// Message content: a string, or text parts joined (images and audio are refused).
fn content_text(v: Option<&Value>) -> Result<Option<String>, String> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some(other), _) if other != "text" => {
                        return Err(format!(
                            "content part type '{other}' is not supported (text only)"
                        ))
                    }
                    _ => {
                        return Err(
                            "content parts must be {\"type\": \"text\", \"text\": ...}".into()
                        )
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(v) => Err(format!(
            "'content' must be a string or an array of parts, got {}",
            type_name(v)
        )),
    }
}

/// An assistant's earlier tool call as templates expect it: `arguments` as an object (OpenAI
/// sends a JSON string; Hugging Face templates apply `tojson` to a mapping).
fn template_call(c: &Value) -> Result<Value, String> {
    let f = c.get("function").ok_or("each tool call needs 'function'")?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or("each tool call needs 'function.name'")?;
    let args = match f.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => json!({}),
    };
    let mut out = json!({"type": "function", "function": {"name": name, "arguments": args}});
    if let Some(id) = c.get("id") {
        out["id"] = id.clone();
    }
    Ok(out)
}
