//! Tool calls in the Qwen/Hermes format: the model writes
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` and clients expect OpenAI
//! `tool_calls` with the arguments as a JSON string.

use serde_json::{json, Value};
use smoe_engine::chat::ChatMessage;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments object serialized, as OpenAI sends them.
    pub arguments: String,
}

impl ToolCall {
    pub fn to_json(&self, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// Splits model output into content (the text outside tool-call blocks, trimmed) and calls.
/// A block that is not a JSON object with a string "name" stays in the content, so nothing the
/// model wrote is lost. An unclosed block at the end (cut by max_tokens) is tried as well.
pub fn parse_tool_calls(text: &str) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let body_start = at + OPEN.len();
        let (body, next) = match rest[body_start..].find(CLOSE) {
            Some(end) => (
                &rest[body_start..body_start + end],
                body_start + end + CLOSE.len(),
            ),
            None => (&rest[body_start..], rest.len()),
        };
        match parse_call(body) {
            Some(c) => calls.push(c),
            None => content.push_str(&rest[at..next]),
        }
        rest = &rest[next..];
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall {
        id: new_call_id(),
        name,
        arguments,
    })
}

fn new_call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("call_{t:016x}{:08x}", N.fetch_add(1, Ordering::Relaxed))
}

/// Streaming: lets content through as it comes, holds back anything that could be the start of
/// a `<tool_call>`, and buffers everything from the first call on to parse at the end.
#[derive(Default)]
pub struct ToolStream {
    pending: String,
    in_call: bool,
}

impl ToolStream {
    /// Text that can be shown now.
    pub fn push(&mut self, delta: &str) -> String {
        self.pending.push_str(delta);
        if self.in_call {
            return String::new();
        }
        if let Some(at) = self.pending.find(OPEN) {
            self.in_call = true;
            let out = self.pending[..at].to_string();
            self.pending.drain(..at);
            return out;
        }
        let hold = (1..OPEN.len())
            .rev()
            .find(|&n| self.pending.ends_with(&OPEN[..n]))
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    /// The remaining content and the parsed calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let rest = std::mem::take(&mut self.pending);
        if !self.in_call {
            return (rest, vec![]);
        }
        parse_tool_calls(&rest)
    }
}

/// For chat templates that know nothing of tools (plain ChatML, like the demo model's): describe
/// the tools in the system message and write calls and results in Qwen's tags, so the model
/// still sees them in the format Qwen3 was trained on.
pub fn render_tools_into_messages(messages: &mut Vec<ChatMessage>, tools: Option<&Value>) {
    if let Some(Value::Array(list)) = tools {
        if !list.is_empty() {
            let mut block = String::from(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
                 You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
            );
            for t in list {
                block.push('\n');
                block.push_str(&t.to_string());
            }
            block.push_str(
                "\n</tools>\n\nFor each function call, return a json object with function name and \
                 arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
                 {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
            );
            match messages.first_mut() {
                Some(m) if m.role == "system" => {
                    let c = m.content.get_or_insert_with(String::new);
                    c.push_str("\n\n");
                    c.push_str(&block);
                }
                _ => messages.insert(0, ChatMessage::new("system", block)),
            }
        }
    }
    for m in messages.iter_mut() {
        if let Some(Value::Array(calls)) = m.tool_calls.take() {
            let mut text = m.content.take().unwrap_or_default();
            for c in &calls {
                let f = c.get("function").unwrap_or(c);
                let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
            }
            m.content = Some(text);
        }
        if m.role == "tool" {
            m.role = "user".into();
            let c = m.content.take().unwrap_or_default();
            m.content = Some(format!("<tool_response>\n{c}\n</tool_response>"));
            m.tool_call_id = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen3_tool_calls() {
        let out = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(out);
        assert_eq!(content, "I'll check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].arguments).unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(calls[1].arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
        let v = calls[0].to_json(Some(0));
        assert_eq!(v["type"], "function");
        assert_eq!(v["index"], 0);
    }

    #[test]
    fn malformed_blocks_stay_content() {
        let (content, calls) = parse_tool_calls("a <tool_call>not json</tool_call> b");
        assert!(calls.is_empty());
        assert_eq!(content, "a <tool_call>not json</tool_call> b");
        let (content, calls) = parse_tool_calls("plain");
        assert_eq!((content.as_str(), calls.len()), ("plain", 0));
        // Cut by max_tokens: an unclosed but complete call still counts.
        let (_, calls) =
            parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}");
        assert_eq!(calls[0].arguments, "{\"x\":1}");
    }

    #[test]
    fn stream_holds_back_a_possible_tag() {
        let mut s = ToolStream::default();
        let mut shown = String::new();
        for d in [
            "Hel",
            "lo <tool",
            "_ca",
            "ll>\n{\"name\": \"f\", ",
            "\"arguments\": {}}\n</tool_call>",
        ] {
            shown.push_str(&s.push(d));
        }
        let (rest, calls) = s.finish();
        assert_eq!(shown, "Hello ");
        assert_eq!(rest, "");
        assert_eq!(calls.len(), 1);
        let mut s = ToolStream::default();
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("y>"), "<toy>");
        assert_eq!(s.finish(), (String::new(), vec![]));
    }

    #[test]
    fn tools_render_into_plain_templates() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let mut call = ChatMessage::new("assistant", "");
        call.content = None;
        call.tool_calls = Some(json!([{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": {"x": 1}}}]));
        let mut result = ChatMessage::new("tool", "42");
        result.tool_call_id = Some("c".into());
        let mut msgs = vec![ChatMessage::new("user", "hi"), call, result];
        render_tools_into_messages(&mut msgs, Some(&tools));
        assert_eq!(msgs[0].role, "system");
        assert!(msgs[0].content.as_ref().unwrap().contains("\"name\":\"f\""));
        assert!(msgs[2]
            .content
            .as_ref()
            .unwrap()
            .starts_with("<tool_call>\n{"));
        assert_eq!(msgs[3].role, "user");
        assert_eq!(
            msgs[3].content.as_deref(),
            Some("<tool_response>\n42\n</tool_response>")
        );
    }
}
