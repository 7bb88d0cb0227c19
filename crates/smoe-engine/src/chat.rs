//! Hugging Face chat templates, rendered with minijinja.
//!
//! A chat model only behaves if its prompt is byte-for-byte the format it was
//! trained on, and that format is defined by the Jinja template shipped in
//! `tokenizer_config.json`. transformers renders it with Jinja2 (trim_blocks,
//! lstrip_blocks, loop controls) plus a few helpers; we mirror that
//! environment here: `raise_exception`, `strftime_now`, a Python-`json.dumps`
//! compatible `tojson`, and Python string/dict methods via
//! `minijinja_contrib::pycompat`.
//!
//! serde_json and minijinja are built with `preserve_order`, so JSON objects (tool schemas,
//! tool-call arguments) render with their keys in insertion order, as Python's dicts do.
//!
//! The `tojson` filter and `strftime_now` have modules of their own (`tojson`, `strftime`).

mod strftime;
mod tojson;

use std::collections::BTreeMap;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use strftime::strftime_now;
use tojson::tojson;

use crate::tokenizer::TextError;

/// Fallback ChatML template for models that ship none.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message.role + '\\n' + (message.content if message.content is string else '') + '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const NAME: &str = "chat_template";

/// One message of an OpenAI-style conversation. `None` fields are left out of
/// the template context entirely, so `message.tool_calls is defined` behaves
/// as it does in transformers.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            ..Default::default()
        }
    }
}

/// A compiled chat template. Compile once per model; `render` is `&self` and
/// the type is `Send + Sync`, so one instance can serve many requests.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are exposed to the
    /// template as in transformers (only when set).
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| template_error(&e, true))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders a prompt. `tools` is the OpenAI `tools` array (passed as
    /// `none` when absent, like transformers). Keys of `extra` (a JSON object,
    /// e.g. `{"enable_thinking": false}`) become template variables; the
    /// standard variables take precedence over them.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, TextError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        match extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(map)) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            Some(other) => {
                return Err(TextError::TemplateRender {
                    line: None,
                    message: format!("extra template variables must be a JSON object, got {other}"),
                })
            }
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "tools".into(),
            tools.map(Value::from_serialize).unwrap_or(Value::from(())),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(e.as_str()));
        }
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&e, true))?;
        tmpl.render(Value::from(ctx))
            .map_err(|e| template_error(&e, false))
    }
}

fn template_error(e: &Error, compile: bool) -> TextError {
    let message = match (e.kind(), e.detail()) {
        // raise_exception(...) and friends: the template's own words; the
        // variant already says "syntax error".
        (ErrorKind::InvalidOperation | ErrorKind::SyntaxError, Some(d)) => d.to_string(),
        (kind, Some(d)) => format!("{kind}: {d}"),
        (kind, None) => kind.to_string(),
    };
    let line = e.line();
    if compile || e.kind() == ErrorKind::SyntaxError {
        TextError::TemplateSyntax { line, message }
    } else {
        TextError::TemplateRender { line, message }
    }
}

/// transformers' `{% generation %}...{% endgeneration %}` tags only mark
/// assistant spans for training masks; rewrite them to `{% if true %}` /
/// `{% endif %}` (keeping `-` markers and line numbers) so such templates work.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let body = tag[2..].trim_start_matches(['-', '+']).trim_start();
        let word: String = body
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after = body[word.len()..]
            .trim_start()
            .trim_start_matches(['-', '+']);
        let replacement = match word.as_str() {
            "generation" if after.starts_with("%}") => Some("if true"),
            "endgeneration" if after.starts_with("%}") => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let word_at = tag.len() - body.len();
                out.push_str(&tag[..word_at]);
                out.push_str(r);
                rest = &tag[word_at + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const QWEN3: &str = include_str!("../tests/data/qwen3_chat_template.jinja");

    fn qwen3() -> ChatTemplate {
        ChatTemplate::new(QWEN3, None, Some("<|im_end|>".into())).expect("qwen3 template compiles")
    }

    fn render(src: &str, ctx: serde_json::Value) -> Result<String, TextError> {
        ChatTemplate::new(src, None, None)?.render(&[], None, false, Some(&ctx))
    }

    #[test]
    fn qwen3_plain_conversation() {
        let msgs = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello! How can I help?"),
            ChatMessage::new("user", "Tell me a joke."),
        ];
        let out = qwen3().render(&msgs, None, true, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
             <|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_think = qwen3().render(
            &msgs[..2],
            None,
            true,
            Some(&json!({"enable_thinking": false})),
        );
        assert_eq!(
            no_think.unwrap(),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        let no_prompt = qwen3().render(&msgs[1..2], None, false, None).unwrap();
        assert_eq!(no_prompt, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn qwen3_reasoning_kept_only_after_last_query() {
        let think = "<think>\nstep 1\n</think>\n\nAnswer";
        let msgs = [
            ChatMessage::new("user", "Q1"),
            ChatMessage::new("assistant", think),
        ];
        let out = qwen3().render(&msgs, None, false, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nstep 1\n</think>\n\nAnswer<|im_end|>\n"
        );
        let mut more = msgs.to_vec();
        more.push(ChatMessage::new("user", "Q2"));
        let out = qwen3().render(&more, None, false, None).unwrap();
        assert!(
            out.contains("<|im_start|>assistant\nAnswer<|im_end|>\n"),
            "{out}"
        );
        // reasoning_content field is used when given.
        let mut m = ChatMessage::new("assistant", "A");
        m.reasoning_content = Some("why".into());
        let out = qwen3()
            .render(&[ChatMessage::new("user", "Q"), m], None, false, None)
            .unwrap();
        assert!(
            out.ends_with("<|im_start|>assistant\n<think>\nwhy\n</think>\n\nA<|im_end|>\n"),
            "{out}"
        );
    }

    #[test]
    fn qwen3_tools_and_tool_calls() {
        // Keys in alphabetical order so the expected text holds with or
        // without preserve_order.
        let tools = json!([{"function": {"description": "Get weather", "name": "get_weather",
            "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"],
            "type": "object"}}, "type": "function"}]);
        let call = ChatMessage {
            role: "assistant".into(),
            tool_calls: Some(
                json!([{"function": {"arguments": {"city": "Paris"}, "name": "get_weather"},
                "id": "c1", "type": "function"}]),
            ),
            ..Default::default()
        };
        let mut result = ChatMessage::new("tool", "{\"temp\": 20}");
        result.tool_call_id = Some("c1".into());
        let msgs = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Weather in Paris?"),
            call,
            result,
        ];
        let out = qwen3().render(&msgs, Some(&tools), true, None).unwrap();
        let expected = concat!(
            "<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
            r#"{"function": {"description": "Get weather", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, "type": "function"}"#,
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n{\"temp\": 20}\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        assert_eq!(out, expected);
    }

    #[test]
    fn broken_templates_are_errors_with_lines() {
        let err =
            ChatTemplate::new("{% for m in messages %}\n{{ m.content }\n", None, None).unwrap_err();
        match &err {
            TextError::TemplateSyntax { line, .. } => assert_eq!(*line, Some(2), "{err}"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("line 2"), "{err}");
        let raise =
            "{% if x %}\n{{ raise_exception('Conversation roles must alternate') }}{% endif %}";
        let err = render(raise, json!({"x": true})).unwrap_err();
        assert!(
            matches!(err, TextError::TemplateRender { line: Some(2), .. }),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("Conversation roles must alternate"),
            "{err}"
        );
        assert_eq!(render(raise, json!({})).unwrap(), "");
        let err = render("{{ 1 + }}", json!({})).unwrap_err();
        assert!(matches!(err, TextError::TemplateSyntax { .. }));
        assert!(qwen3().render(&[], None, true, Some(&json!([1]))).is_err());
    }

    #[test]
    fn python_helpers() {
        let src = "{{ '  hi '.strip() }}|{{ 'a,b,c'.split(',') | length }}|{{ 'Hello'.startswith('He') }}|\
                   {{ 'x\\n'.rstrip('\\n') }}|{{ 'abc'.upper() }}|{{ 'a-b'.replace('-', '+') }}|{{ d.get('k', 7) }}";
        assert_eq!(
            render(src, json!({"d": {}})).unwrap(),
            "hi|3|True|x|ABC|a+b|7"
        );
        let loops = "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}\
                     {% if i == 1 %}{% continue %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}";
        assert_eq!(render(loops, json!({})).unwrap(), "2");
        // trim_blocks + lstrip_blocks as in transformers.
        assert_eq!(
            render("  {% if true %}\nA\n  {% endif %}\nB", json!({})).unwrap(),
            "A\nB"
        );
        let year = render("{{ strftime_now('%Y') }}", json!({})).unwrap();
        assert!(year.parse::<u32>().unwrap() >= 2024);
        assert_eq!(
            render("{% generation %}x{% endgeneration %}", json!({})).unwrap(),
            "x"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Keys keep insertion order, as Python's dicts (and so HF's prompts) do.
        let v = json!({"v": {"a": [1, 2.5, true, null], "s": "é<&>\"\n", "e": {}, "l": []}});
        assert_eq!(
            render("{{ v | tojson }}", v.clone()).unwrap(),
            r#"{"a": [1, 2.5, true, null], "s": "é<&>\"\n", "e": {}, "l": []}"#
        );
        assert_eq!(
            render("{{ v.a | tojson(indent=2) }}", v.clone()).unwrap(),
            "[\n  1,\n  2.5,\n  true,\n  null\n]"
        );
        assert_eq!(
            render("{{ v.s | tojson(ensure_ascii=True) }}", v.clone()).unwrap(),
            r#""\u00e9<&>\"\n""#
        );
        assert_eq!(
            render("{{ '🦀' | tojson(ensure_ascii=true) }}", v.clone()).unwrap(),
            r#""\ud83e\udd80""#
        );
        assert_eq!(
            render("{{ x | tojson }}", json!({"x": 1e20})).unwrap(),
            "1e+20"
        );
        assert_eq!(
            render("{{ x | tojson }}", json!({"x": 1.0})).unwrap(),
            "1.0"
        );
        assert!(render("{{ v | tojson(bogus=1) }}", v).is_err());
    }

    #[test]
    fn chatml_fallback_and_message_serde() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, None, None).unwrap();
        let call = ChatMessage {
            role: "assistant".into(),
            ..Default::default()
        };
        let out = t
            .render(&[ChatMessage::new("user", "Hi"), call], None, true, None)
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n");
        let m: ChatMessage =
            serde_json::from_value(json!({"role": "user", "content": "x"})).unwrap();
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            json!({"role": "user", "content": "x"})
        );
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ messages[0].name is defined }}",
            Some("<s>".into()),
            None,
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], None, false, None)
                .unwrap(),
            "<s>False"
        ); // Python spelling, as Jinja2
    }
}
