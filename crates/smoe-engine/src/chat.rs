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
//! Known difference: the workspace builds serde_json and minijinja without
//! `preserve_order`, so JSON objects (tool schemas, tool-call arguments)
//! render with keys sorted, where Python keeps insertion order.

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

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

/// `strftime_now(fmt)`, used by e.g. Llama 3 templates for "Today Date".
/// Always UTC: we carry no time-zone database.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_time(secs, &fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A C-`strftime` subset over a Unix time, UTC. Supports %Y %y %m %d %e %H
/// %I %M %S %p %B %b %A %a %j %% and glibc's `%-d`-style unpadded forms;
/// unknown directives are copied through.
fn format_time(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |v: i64, w: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0w$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&num(h, 2)),
            Some('I') => out.push_str(&num(h12, 2)),
            Some('M') => out.push_str(&num(mi, 2)),
            Some('S') => out.push_str(&num(s, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers overrides Jinja's `tojson` with Python's
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: no HTML escaping and `", "`/`": "` separators. Models
/// were trained on that exact spelling, so we reproduce it.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => Some(" ".repeat(usize::try_from(v)?)),
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators must be a pair",
            ))
        }
        None => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        indent,
        ensure_ascii,
        sort_keys,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn write_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => write_json_str(v.as_str().unwrap_or(""), o.ensure_ascii, out),
        ValueKind::Number => out.push_str(&python_number(v)),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                // JSON keys are strings; Python stringifies numbers/bools.
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => python_number(k),
                };
                write_json_str(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                write_json(&v.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => {
            let s = serde_json::to_string(v).map_err(|e| {
                Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
            })?;
            out.push_str(&s);
        }
    }
    Ok(())
}

/// Python's `repr` of ints and floats: `1.0`, `1e+20`, `1.5e-07`.
fn python_number(v: &Value) -> String {
    let s = serde_json::to_string(v).unwrap_or_else(|_| v.to_string());
    match s.split_once('e') {
        Some((mant, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp.trim_start_matches('+')),
            };
            format!("{mant}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) >= 0x7f) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
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
    fn strftime_subset() {
        assert_eq!(
            format_time(0, "%Y-%m-%d %H:%M:%S %A %b"),
            "1970-01-01 00:00:00 Thursday Jan"
        );
        // 2024-02-29 13:05:09 UTC, a leap day.
        let t = 1_709_164_800 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            format_time(t, "%d %B %Y, %I:%M %p (%a, day %j) %-d/%-m %y %%"),
            "29 February 2024, 01:05 PM (Thu, day 060) 29/2 24 %"
        );
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
