//! `smoe`: run Mixture-of-Experts language models larger than memory.

mod cmd;
mod common;
mod route_trace;
mod sampling_args;
mod store_args;
mod tuning;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "smoe",
    version,
    about = "Run Mixture-of-Experts language models that are larger than memory"
)]
struct Cli {
    /// More log output (-v info, -vv debug); RUST_LOG also works.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Worker threads for CPU compute (default and most: the machine's cores).
    #[arg(long, global = true, value_name = "N")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory into a .smoe vault.
    Convert(cmd::convert::Args),
    /// Generate text (or token ids) from a prompt.
    Generate(cmd::generate::Args),
    /// Score a token sequence: log-probabilities, argmax and mean NLL.
    Logprobs(cmd::logprobs::Args),
    /// Perplexity of a text file.
    Perplexity(cmd::perplexity::Args),
    /// Show a vault's configuration, tensors, quantization and checksums.
    Inspect(cmd::inspect::Args),
    /// Show the GPU adapter (features, limits) that --backend gpu would use, or that there is none.
    Info(cmd::info::Args),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(cmd::serve::Args),
    /// Chat with the model in the terminal.
    Chat(cmd::chat::Args),
    /// Write a full-size vault with random weights and a real model's shapes (for benchmarks).
    Synth(cmd::synth::Args),
    /// Benchmarks: decode/prefill against the I/O and bandwidth bounds, GPU kernel GB/s.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// Render a vault's expert-usage profile as a heatmap PNG with a text summary.
    Profile(cmd::profile::Args),
}

fn main() {
    let cli = Cli::parse();
    quiet_on_closed_pipe(&cli.command);
    common::init_logging(cli.verbose);
    // A panic is a bug, but the user still gets one line, not a backtrace dump (and nothing
    // at all where stderr is closed: a failed write here would abort).
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        use std::io::Write;
        let line = format!("error: internal error (please report): {msg}{at}");
        let _ = writeln!(std::io::stderr(), "{line}");
    }));
    if let Some(asked) = cli.threads {
        // More workers than cores only adds switching (10,000 made 3 tokens take 49 s).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let n = asked.clamp(1, cores);
        if n != asked {
            tracing::warn!("--threads {asked}: this machine has {cores} cores; using {n}");
        }
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
        {
            eprintln!("error: --threads: {e}");
            std::process::exit(2);
        }
    }
    // The CPU kernels' path and the GPU device's settings, before any command uses them.
    if let Err(e) = tuning::configure_process() {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(2);
    }
    let result = match cli.command {
        Command::Convert(a) => cmd::convert::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Logprobs(a) => cmd::logprobs::run(a),
        Command::Perplexity(a) => cmd::perplexity::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Profile(a) => cmd::profile::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Chat(a) => cmd::chat::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// A command whose stdout is closed early (`smoe inspect M | head -1`) ends quietly, as the
/// SIGPIPE convention has it for command-line tools, instead of failing on a broken pipe.
/// `serve` keeps Rust's default (SIGPIPE ignored): a client that goes away is an error the
/// server handles, not a reason to exit.
fn quiet_on_closed_pipe(command: &Command) {
    #[cfg(unix)]
    if !matches!(command, Command::Serve(_)) {
        // SAFETY: restoring the default disposition of one signal, before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    #[cfg(not(unix))]
    let _ = command;
}

/// The error and its causes on one line, joined by ": ", leaving out a cause whose text the
/// line already holds (a library error that names its source, e.g. "path: No such file or
/// directory", would otherwise repeat it).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string().replace('\n', " ");
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;
    use anyhow::Context;

    #[test]
    fn an_error_line_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        /// Names its source in its own text, as the vault's errors do.
        #[derive(Debug)]
        struct Named {
            source: std::io::Error,
        }
        impl std::fmt::Display for Named {
            fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "/x/y.partial: {}", self.source)
            }
        }
        impl std::error::Error for Named {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.source)
            }
        }
        let e = Err::<(), _>(Named { source: io }).context("writing");
        assert_eq!(
            one_line(&e.unwrap_err()),
            "writing: /x/y.partial: No such file or directory"
        );
        let e = Err::<(), _>(anyhow::anyhow!("a\nb")).context("c");
        assert_eq!(one_line(&e.unwrap_err()), "c: a b");
    }
}
