//! The JSON text of every generated `.json` file: Python's
//! `json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n"`, emulated exactly
//! (floats as Python's `repr`, keys sorted by code point, non-ASCII escaped as `\uXXXX`).

use serde_json::Value;

/// `value` as Python's `json.dumps(value, indent=2, sort_keys=True) + "\n"`.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(value, 0, &mut out);
    out.push('\n');
    out
}

fn indent(level: usize, out: &mut String) {
    for _ in 0..level {
        out.push_str("  ");
    }
}

fn write_value(value: &Value, level: usize, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else {
                out.push_str(&py_float_repr(n.as_f64().expect("a JSON number")));
            }
        }
        Value::String(s) => py_string(s, out),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(",\n");
                }
                indent(level + 1, out);
                write_value(item, level + 1, out);
            }
            out.push('\n');
            indent(level, out);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            // Rust's str order is byte order, which for UTF-8 is Python's code point order.
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push_str("{\n");
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(",\n");
                }
                indent(level + 1, out);
                py_string(key, out);
                out.push_str(": ");
                write_value(&map[key.as_str()], level + 1, out);
            }
            out.push('\n');
            indent(level, out);
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: the shortest round-trip digits (Rust's `{:e}` gives the same digits),
/// fixed notation for decimal exponents -4 <= e < 16, else `d.ddde±XX`.
pub fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if x == 0.0 {
        return format!("{sign}0.0");
    }
    let sci = format!("{:e}", x.abs());
    let (mant, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    // value = 0.DIGITS * 10^decpt
    let decpt = exp + 1;
    let body = if decpt <= -4 || decpt > 16 {
        let mut s = digits[..1].to_string();
        if n > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        s.push_str(&format!("e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs()));
        s
    } else if decpt <= 0 {
        format!("0.{}{}", "0".repeat((-decpt) as usize), digits)
    } else if decpt >= n {
        format!("{}{}.0", digits, "0".repeat((decpt - n) as usize))
    } else {
        format!(
            "{}.{}",
            &digits[..decpt as usize],
            &digits[decpt as usize..]
        )
    };
    format!("{sign}{body}")
}

fn py_string(s: &str, out: &mut String) {
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
            ' '..='~' => out.push(c),
            _ => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_like_python_repr() {
        let cases = [
            (1e-6, "1e-06"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (0.001, "0.001"),
            (0.7, "0.7"),
            (0.0, "0.0"),
            (-2.5, "-2.5"),
            (4.0, "4.0"),
            (10000.0, "10000.0"),
            (1e6, "1000000.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e17, "1.5e+17"),
            (1.2079441541679836, "1.2079441541679836"),
            (123.456, "123.456"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn layout_like_python() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.0], "a": {}, "c": [], "d": {"y": null, "x": "q\"\u00e9\n\ud83d\ude00"}}"#,
        )
        .unwrap();
        let want = "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.0\n  ],\n  \"c\": [],\n  \"d\": {\n    \"x\": \"q\\\"\\u00e9\\n\\ud83d\\ude00\",\n    \"y\": null\n  }\n}\n";
        assert_eq!(canonical_json(&v), want);
    }
}
