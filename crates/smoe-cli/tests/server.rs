//! `smoe serve` over raw HTTP: every 4xx path answers with an OpenAI-style JSON error (and the
//! server keeps serving), plus one streaming and one non-streaming request; `smoe chat` with
//! piped input.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const KEY: &str = "test-key";

/// A server on a free port, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn demo() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/demo-qwen3-moe.smoe")
        .to_string_lossy()
        .into_owned()
}

fn start() -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args([
            "serve",
            "-m",
            &demo(),
            "--port",
            "0",
            "--ctx",
            "256",
            "--no-profile",
        ])
        .args([
            "--max-concurrent",
            "2",
            "--api-key",
            KEY,
            "--max-body",
            "65536",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start smoe serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read the listening line");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    Server { child, addr }
}

struct Resp {
    status: u16,
    headers: String,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.1 request on a fresh connection (Connection: close), response read to the end.
fn http(s: &Server, method: &str, path: &str, auth: Option<&str>, body: &[u8]) -> Resp {
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        s.addr,
        body.len()
    );
    if let Some(k) = auth {
        // A key given with its scheme ("bearer KEY") is sent as it is.
        match k.split_once(' ') {
            Some(_) => head += &format!("Authorization: {k}\r\n"),
            None => head += &format!("Authorization: Bearer {k}\r\n"),
        }
    }
    head += "\r\n";
    let mut req = head.into_bytes();
    req.extend_from_slice(body);
    // The server may answer (413) before reading a large body: a failed write is not an error.
    let _ = c.write_all(&req);
    let mut raw = Vec::new();
    let _ = c.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (headers, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("bad response: {text:?}"));
    let status = headers
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Resp {
        status,
        headers: headers.to_string(),
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(s: &Server, path: &str, body: &Value) -> Resp {
    http(s, "POST", path, Some(KEY), body.to_string().as_bytes())
}

/// A 4xx whose body is `{"error": {"message", "type", ...}}`, optionally naming `param`.
fn assert_error(r: &Resp, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {}", r.body));
    assert!(v["error"]["type"].is_string(), "{}", r.body);
    assert!(
        msg.to_lowercase().contains(&needle.to_lowercase()),
        "expected '{needle}' in: {msg}"
    );
}

fn chat(extra: Value) -> Value {
    let mut v = json!({"model": "demo-qwen3-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[test]
fn every_bad_request_is_an_openai_error() {
    let s = start();
    const C: &str = "/v1/chat/completions";
    // Authentication.
    let r = http(&s, "GET", "/v1/models", None, b"");
    assert_error(&r, 401, "API key");
    let r = http(
        &s,
        "POST",
        C,
        Some("wrong"),
        chat(json!({})).to_string().as_bytes(),
    );
    assert_error(&r, 401, "Incorrect API key");
    assert_eq!(http(&s, "GET", "/health", None, b"").status, 200);
    // The scheme is case-insensitive.
    for scheme in ["bearer", "BEARER"] {
        let auth = format!("{scheme} {KEY}");
        assert_eq!(http(&s, "GET", "/v1/models", Some(&auth), b"").status, 200);
    }
    let r = http(&s, "GET", "/v1/models", Some(&format!("Basic {KEY}")), b"");
    assert_error(&r, 401, "API key");
    // Body: malformed, not an object, empty, invalid UTF-8, too large.
    assert_error(
        &http(&s, "POST", C, Some(KEY), b"{\"messages\": ["),
        400,
        "not valid JSON",
    );
    assert_error(
        &http(&s, "POST", C, Some(KEY), b"[1, 2]"),
        400,
        "must be a JSON object",
    );
    assert_error(&http(&s, "POST", C, Some(KEY), b""), 400, "empty");
    assert_error(
        &http(&s, "POST", C, Some(KEY), b"{\"model\": \"\xff\xfe\"}"),
        400,
        "UTF-8",
    );
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(70_000));
    assert_error(
        &http(&s, "POST", "/v1/completions", Some(KEY), big.as_bytes()),
        413,
        "too large",
    );
    // Wrong types and ranges.
    let cases = [
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"temperature": 3.5}), "temperature"),
        (json!({"messages": "Hi"}), "messages"),
        (json!({"messages": []}), "empty"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "role",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "content",
        ),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": "ten"}), "max_tokens"),
        (json!({"max_tokens": 100000}), "maximum context length"),
        (json!({"n": 2}), "n = 1"),
        (json!({"stream": "yes"}), "stream"),
        (json!({"stop": 7}), "stop"),
        (json!({"stop": ["x".repeat(257)]}), "at most 256 bytes"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"seed": "x"}), "seed"),
        (json!({"top_logprobs": 2}), "logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 50}),
            "top_logprobs",
        ),
        (json!({"tools": {"x": 1}}), "tools"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ];
    for (extra, needle) in cases {
        let r = post(&s, C, &chat(extra.clone()));
        assert_error(&r, 400, needle);
    }
    // Unknown model.
    let r = post(&s, C, &chat(json!({"model": "gpt-4o"})));
    assert_error(&r, 404, "does not exist");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    // Prompt longer than the context (256).
    let long = "word ".repeat(400);
    let r = post(
        &s,
        C,
        &chat(json!({"messages": [{"role": "user", "content": long}]})),
    );
    assert_error(&r, 400, "maximum context length");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let r = post(&s, "/v1/completions", &json!({"prompt": long}));
    assert_error(&r, 400, "maximum context length");
    // Completions-specific.
    assert_error(&post(&s, "/v1/completions", &json!({})), 400, "prompt");
    assert_error(
        &post(&s, "/v1/completions", &json!({"prompt": ""})),
        400,
        "empty",
    );
    assert_error(
        &post(&s, "/v1/completions", &json!({"prompt": [1, 99999]})),
        400,
        "vocabulary",
    );
    assert_error(
        &post(&s, "/v1/completions", &json!({"prompt": ["a", "b"]})),
        400,
        "one prompt",
    );
    assert_error(
        &post(
            &s,
            "/v1/completions",
            &json!({"prompt": "a", "logprobs": 9}),
        ),
        400,
        "logprobs",
    );
    // Routes.
    assert_error(
        &http(&s, "GET", "/v2/nothing", Some(KEY), b""),
        404,
        "no such endpoint",
    );
    assert_error(&http(&s, "GET", C, Some(KEY), b""), 405, "not allowed");
    assert_error(
        &http(&s, "GET", "/v1/models/other", Some(KEY), b""),
        404,
        "does not exist",
    );
    // Still alive and counting.
    let m = http(&s, "GET", "/metrics", Some(KEY), b"");
    assert_eq!(m.status, 200);
    assert!(
        m.body
            .contains("smoe_http_responses_total{route=\"/v1/chat/completions\",status=\"400\"}"),
        "{}",
        m.body
    );
}

#[test]
fn streaming_and_whole_answers() {
    let s = start();
    let req = chat(
        json!({"max_tokens": 12, "seed": 7, "temperature": 0.8, "logprobs": true, "top_logprobs": 3}),
    );
    let r = post(&s, "/v1/chat/completions", &req);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let whole = choice["message"]["content"].as_str().unwrap().to_string();
    let reason = choice["finish_reason"].as_str().unwrap();
    assert!(reason == "stop" || reason == "length", "{reason}");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"],
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    let lp = choice["logprobs"]["content"].as_array().unwrap();
    assert!(!lp.is_empty() && lp[0]["top_logprobs"].as_array().unwrap().len() == 3);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let r = post(&s, "/v1/chat/completions", &sreq);
    assert_eq!(r.status, 200);
    assert!(
        r.headers.to_lowercase().contains("text/event-stream"),
        "{}",
        r.headers
    );
    let events: Vec<&str> = r.body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{}", r.body);
    let (mut text, mut finish, mut usage) = (String::new(), None, None);
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e.strip_prefix("data: ").expect("data: line")).unwrap();
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].get(0) {
            text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        } else {
            usage = Some(c["usage"].clone());
        }
    }
    // Same seed, same tokens, whether streamed or not.
    assert_eq!(text, whole);
    assert_eq!(finish.as_deref(), Some(reason));
    assert_eq!(usage.unwrap()["completion_tokens"], u["completion_tokens"]);

    let r = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "In Python, a list", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    let m = http(&s, "GET", "/v1/models", Some(KEY), b"").json();
    assert_eq!(m["data"][0]["id"], "demo-qwen3-moe");
}

#[test]
fn chat_reads_piped_input() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(["chat", "-m", &demo(), "-n", "6", "--seed", "1"])
        .args(["--ctx", "512", "--no-profile"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start smoe chat");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            b"/system Be brief.\nWhat is a tuple?\n/reset\n/bogus\nAnd a set?\n/quit\nnot read\n",
        )
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("[system prompt set]") && err.contains("[conversation cleared]"),
        "{err}"
    );
    assert!(err.contains("unknown command /bogus"), "{err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.trim().is_empty(), "no answer printed");
}
