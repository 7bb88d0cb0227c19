//! JSON for templates (`tojson`), spelled as Python's `json.dumps` spells it.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// transformers overrides Jinja's `tojson` with Python's
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: no HTML escaping and `", "`/`": "` separators. Models
/// were trained on that exact spelling, so we reproduce it.
pub(super) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
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
