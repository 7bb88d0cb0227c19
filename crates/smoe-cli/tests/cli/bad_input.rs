//! Bad input, as a new user or an attacker would give it: broken checkpoints, bad flags and
//! values, closed pipes, outputs that must not be replaced. Each gets one line that names the
//! real problem (docs/reliability.md).

use super::*;

#[test]
fn bad_input_gives_one_line_errors() {
    let m = demo();
    assert_one_line_error(
        &smoe(&["generate", "-m", "/nonexistent.smoe", "--prompt-ids", "1"]),
        "no such file",
    );
    assert_one_line_error(
        &smoe(&["generate", "-m", &m, "--prompt-ids", "1,x"]),
        "'x' is not a token id",
    );
    assert_one_line_error(
        &smoe(&["generate", "-m", &m, "--prompt-ids", "1,99999"]),
        "out of range",
    );
    assert_one_line_error(
        &smoe(&["logprobs", "-m", &m, "--prompt-ids", ",", "--json"]),
        "no token ids",
    );
    // `--backend gpu` without an adapter: tests/gpu_cli.rs.
    assert_one_line_error(
        &smoe(&["generate", "-m", &m, "--prompt-ids", "1", "--top-p", "0"]),
        "top_p",
    );
    assert_one_line_error(
        &smoe(&["generate", "-m", &m, "--prompt-ids", "1,2,3", "--ctx", "2"]),
        "--ctx",
    );
    // Not a vault.
    let d = tmp("notvault");
    let f = d.join("x.smoe");
    std::fs::write(&f, vec![7u8; 100]).unwrap();
    assert_one_line_error(&smoe(&["inspect", f.to_str().unwrap()]), "not a .smoe file");
    // A vault cut short.
    let bytes = std::fs::read(&m).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    assert_one_line_error(
        &smoe(&["generate", "-m", f.to_str().unwrap(), "--prompt-ids", "1"]),
        "truncated",
    );
    // Clap's own usage errors also exit non-zero.
    assert!(!smoe(&["generate", "-m", &m]).status.success());
}

/// A copy of the tiny-tied fixture checkpoint whose config.json is edited by `edit`.
fn broken_checkpoint(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> ScratchDir {
    let src = smoe_fixtures::checkpoint("tiny-tied").unwrap();
    let d = tmp(name);
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    let cfg_path = d.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    d
}

fn convert(dir: &Path) -> Output {
    let out = dir.join("out.smoe");
    smoe(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--quant",
        "q4",
    ])
}

#[test]
fn convert_reports_bad_checkpoints() {
    let d = broken_checkpoint("missing", |c| c["num_hidden_layers"] = 4.into());
    assert_one_line_error(&convert(&d), "missing, e.g. model.layers.3");
    let d = broken_checkpoint("extra", |c| c["num_hidden_layers"] = 2.into());
    assert_one_line_error(&convert(&d), "unexpected tensor");
    let d = broken_checkpoint("shape", |c| c["moe_intermediate_size"] = 192.into());
    assert_one_line_error(&convert(&d), "expected [192, 192]");
    let d = broken_checkpoint("arch", |c| {
        c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        c["model_type"] = "llama".into();
    });
    assert_one_line_error(
        &convert(&d),
        "architecture 'LlamaForCausalLM' is not supported",
    );
    let d = broken_checkpoint("dim", |c| c["hidden_size"] = 200.into());
    assert_one_line_error(&convert(&d), "not a multiple of 64");
    let d = broken_checkpoint("trunc", |_| {});
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 1000]).unwrap();
    assert_one_line_error(&convert(&d), "truncated");
    assert!(!d.join("out.smoe").exists() && !d.join("out.smoe.partial").exists());
    assert_one_line_error(
        &smoe(&["convert", "/nonexistent-dir", "-o", "/tmp/x.smoe"]),
        "not a directory",
    );
    // A tokenizer that does not load fails the conversion; none at all is warned about.
    let d = broken_checkpoint("tok", |_| {});
    std::fs::write(d.join("tokenizer.json"), "{ not a tokenizer").unwrap();
    assert_one_line_error(&convert(&d), "tokenizer.json does not load");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let r = convert(&d);
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{e}");
    assert!(e.contains("no tokenizer.json"), "{e}");
}

/// A closed stdout (`smoe logprobs … | head -1`, `smoe generate … | head -c 10`) ends smoe
/// quietly: exit 0 or the SIGPIPE convention, never an "internal error" about a broken pipe.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let runs: [&[&str]; 2] = [
        &["logprobs", "--prompt-ids", "1,2,3,4", "--json"],
        &[
            "generate",
            "--prompt",
            "In Python",
            "-n",
            "48",
            "--temperature",
            "0",
        ],
    ];
    for args in runs {
        let mut child = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before smoe writes.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("internal error"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");
        let sigpipe = out.status.signal() == Some(13);
        assert!(
            out.status.success() || sigpipe,
            "{args:?}: {:?} {stderr}",
            out.status
        );
    }
}

/// `--threads` beyond the machine's cores is capped there, with a warning naming both.
#[test]
fn threads_beyond_the_cores_are_capped_with_a_warning() {
    let out = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args([
            "--threads",
            "10000",
            "logprobs",
            "--prompt-ids",
            "1,2,3",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let cores = std::thread::available_parallelism().unwrap().get();
    assert!(
        stderr.contains(&format!(
            "--threads 10000: this machine has {cores} cores; using {cores}"
        )),
        "{stderr}"
    );
}

/// Every flag of every command says what it does (`-h` shows a description beside it).
#[test]
fn every_flag_has_help_text() {
    let commands: [&[&str]; 14] = [
        &["convert"],
        &["generate"],
        &["logprobs"],
        &["perplexity"],
        &["inspect"],
        &["info"],
        &["serve"],
        &["chat"],
        &["synth"],
        &["profile"],
        &["bench", "decode"],
        &["bench", "kernels"],
        &["bench", "disk"],
        &["bench", "serve"],
    ];
    let mut bare = vec![];
    for c in commands {
        let out = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(c)
            .arg("-h")
            .output()
            .unwrap();
        assert!(out.status.success(), "{c:?} -h");
        let help = String::from_utf8_lossy(&out.stdout);
        for line in help.lines().map(str::trim_start) {
            // "-x, --flag <V>  what it does": a flag with nothing after its spec has no help.
            if line.starts_with('-')
                && !line
                    .split_once("  ")
                    .is_some_and(|(_, d)| !d.trim().is_empty())
            {
                bare.push(format!("{c:?}: {line}"));
            }
        }
    }
    assert!(bare.is_empty(), "flags without help:\n{}", bare.join("\n"));
}

/// Bad input found by trying smoe as a new user: each gets one line that names the real
/// problem, and nothing is printed before it.
#[test]
fn bad_input_gets_a_precise_line() {
    let smoe = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
    };
    let (_, e) = smoe(&["generate", "--prompt", "Hi", "-n", "0"]);
    assert!(
        e.contains("at least 1 token") && !e.contains("--ctx"),
        "{e}"
    );
    let (out, e) = smoe(&["generate", "--prompt", "Hi", "--temperature=-1"]);
    assert!(out.is_empty(), "printed before the error: {out:?}");
    assert!(e.contains("temperature"), "{e}");
    let dir = std::env::temp_dir();
    let (_, e) = smoe(&["inspect", dir.to_str().unwrap()]);
    assert!(e.contains("directory"), "{e}");
    assert_eq!(e.matches(dir.to_str().unwrap()).count(), 1, "{e}");
}

/// An output that exists and is not a regular file (a FIFO standing in for a device node such
/// as /dev/full, a folder) is never replaced, even with --force.
#[cfg(unix)]
#[test]
fn outputs_never_replace_what_is_not_a_regular_file() {
    use std::os::unix::fs::FileTypeExt;
    let dir = ScratchDir::new("special-outputs").unwrap();
    let fifo = dir.join("out.smoe");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path and a mode.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for out in [fifo.to_str().unwrap(), dir.to_str().unwrap()] {
        let o = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(["synth", "--preset", "tiny", "--force", "-o", out])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{out}: {e}");
        assert!(e.contains("not a regular file"), "{out}: {e}");
    }
    assert!(
        std::fs::metadata(&fifo).unwrap().file_type().is_fifo(),
        "the FIFO was replaced"
    );
}
