//! The conformance driver, in the spirit of ggml's `test-backend-ops`: every row of the table
//! (`table::rows`) runs its op on a backend and on the CPU twin with the same deterministic
//! inputs, and the outputs are compared — values by NMSE or max-abs against the row's
//! tolerance (never bitwise: GPU reductions reassociate), ids exactly (an expert or a token is
//! right or wrong). One test per op prints a line per row (op, shape, types, backend, error,
//! tolerance, result) and fails listing every failing row.
//!
//! A row its backend cannot run (a feature or a limit the adapter lacks) is reported as not
//! supported; a row with no backend at all (no GPU adapter) as skipped, which fails under
//! `SMOE_REQUIRE_GPU=1`.

use super::{gpu_or_why, gpu_required, nmse, rand_vec, table};
use smoe_compute::gpu::GpuContext;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Instant;

/// The ops of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    MatVec,
    MatMul,
    ExpertSort,
    RmsNorm,
    QkNormRope,
    DecodeAttention,
    PrefillAttention,
    Router,
    RouteTail,
    SumTail,
    NextRoute,
    WeightedSum,
    Eltwise,
    EmbedGather,
    Argmax,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::MatVec => "matvec",
            Op::MatMul => "matmul",
            Op::ExpertSort => "expert_sort",
            Op::RmsNorm => "rms_norm",
            Op::QkNormRope => "qk_norm_rope",
            Op::DecodeAttention => "decode_attention",
            Op::PrefillAttention => "prefill_attention",
            Op::Router => "router",
            Op::RouteTail => "route_tail",
            Op::SumTail => "sum_tail",
            Op::NextRoute => "next_route",
            Op::WeightedSum => "weighted_sum",
            Op::Eltwise => "eltwise",
            Op::EmbedGather => "embed_gather",
            Op::Argmax => "argmax",
        }
    }
}

/// Where a row runs; the CPU twin is always the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The wgpu adapter as the engine opens it (on Vulkan with the fused tails: work a
    /// dispatch's last workgroup does instead of a dispatch of its own).
    Gpu,
    /// The same adapter with every tail in a pass of its own: what Metal and DX12 run. Rows of
    /// the kernels that differ between the two (attention's split merges) run here too.
    GpuTailsApart,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Gpu => "gpu",
            Backend::GpuTailsApart => "gpu-tails-apart",
        }
    }

    /// The device, or why there is none.
    pub fn context(self) -> Result<&'static GpuContext, &'static str> {
        static APART: OnceLock<Result<GpuContext, String>> = OnceLock::new();
        match self {
            Backend::Gpu => gpu_or_why(),
            Backend::GpuTailsApart => {
                let ctx = APART.get_or_init(|| {
                    let tuning = smoe_compute::gpu::GpuTuning {
                        fused_tails: false,
                        ..Default::default()
                    };
                    GpuContext::with_tuning(tuning).map_err(|e| e.to_string())
                });
                ctx.as_ref().map_err(|e| e.as_str())
            }
        }
    }
}

/// How close a row's values must be to the CPU twin's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tol {
    /// Σ(got − want)² / Σ want² at most this.
    Nmse(f64),
    /// |got − want| at most this everywhere (0: a copy).
    MaxAbs(f64),
    /// Rows whose outputs are all ids (a float comparison under it fails the row).
    Exact,
}

impl Tol {
    /// The error of `got` by this measure (NaN anywhere: infinite), and the bound.
    fn error(self, got: &[f32], want: &[f32]) -> Option<(f64, f64)> {
        match self {
            Tol::Nmse(bound) => Some((nmse(got, want), bound)),
            Tol::MaxAbs(bound) => {
                let e = got.iter().zip(want).fold(0f64, |m, (g, w)| {
                    let d = (g - w).abs() as f64;
                    if d.is_nan() {
                        f64::INFINITY
                    } else {
                        m.max(d)
                    }
                });
                Some((e, bound))
            }
            Tol::Exact => None,
        }
    }

    fn describe(self, err: f64) -> String {
        match self {
            Tol::Nmse(b) => format!("nmse {err:9.2e} <= {b:.0e}"),
            Tol::MaxAbs(b) => format!("max|d| {err:9.2e} <= {b:.0e}"),
            Tol::Exact => "exact".into(),
        }
    }
}

/// One comparison of a row: the kernel's output against the CPU twin's, or a promise of the
/// kernel checked on its own buffers (poison around an output left alone).
pub enum Check {
    Values {
        what: String,
        got: Vec<f32>,
        want: Vec<f32>,
        /// The row's tolerance unless set (a copy in a fused kernel: `MaxAbs(0.0)`).
        tol: Option<Tol>,
    },
    Ids {
        what: String,
        got: Vec<u32>,
        want: Vec<u32>,
    },
    Holds {
        what: String,
        ok: bool,
    },
}

impl Check {
    pub fn values(what: impl Into<String>, got: Vec<f32>, want: Vec<f32>) -> Self {
        Check::Values {
            what: what.into(),
            got,
            want,
            tol: None,
        }
    }

    pub fn values_within(what: impl Into<String>, got: Vec<f32>, want: Vec<f32>, tol: Tol) -> Self {
        Check::Values {
            what: what.into(),
            got,
            want,
            tol: Some(tol),
        }
    }

    pub fn ids(what: impl Into<String>, got: Vec<u32>, want: Vec<u32>) -> Self {
        Check::Ids {
            what: what.into(),
            got,
            want,
        }
    }

    pub fn holds(what: impl Into<String>, ok: bool) -> Self {
        Check::Holds {
            what: what.into(),
            ok,
        }
    }
}

/// The backend cannot run this row (a feature or a limit the adapter lacks): reported, not
/// failed. Cases return it only on a capability they checked, never for a kernel's error.
pub struct Unsupported(pub String);

/// An op at one shape and type: it draws its inputs, runs the CPU twin and the kernel on them,
/// and says what to compare.
pub trait Case: Send + Sync {
    fn op(&self) -> Op;
    /// Sizes and layout: what moves the kernel's boundaries.
    fn shape(&self) -> String;
    /// Storage types and the kernel's variant (fused work, tile).
    fn types(&self) -> String;
    /// Inputs from `rng`; the CPU twin's outputs and the kernel's on `ctx`, as checks.
    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported>;
}

/// A row of the table.
pub struct Row {
    pub case: Box<dyn Case>,
    pub tol: Tol,
    pub backend: Backend,
}

impl Row {
    pub fn new(case: impl Case + 'static, tol: Tol) -> Self {
        Row {
            case: Box::new(case),
            tol,
            backend: Backend::Gpu,
        }
    }

    pub fn on(self, backend: Backend) -> Self {
        Row { backend, ..self }
    }

    /// What seeds its inputs: the same on every backend.
    fn key(&self) -> String {
        let c = &self.case;
        format!("{} {} {}", c.op().name(), c.shape(), c.types())
    }
}

/// Deterministic inputs of one row, seeded from its description (so adding a row changes no
/// other row's data).
pub struct Rng(u64);

impl Rng {
    pub fn for_key(key: &str) -> Self {
        // FNV-1a.
        let h = key.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        Rng(h)
    }

    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        self.0 = self.0.wrapping_add(1);
        rand_vec(n, self.0, scale)
    }

    /// `n` ids uniform in `0..of`.
    pub fn ids(&mut self, n: usize, of: usize) -> Vec<u32> {
        let v = self.vec(n, 1.0);
        v.iter()
            .map(|v| (((v + 1.0) / 2.0 * of as f32) as usize).min(of - 1) as u32)
            .collect()
    }

    /// One integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.ids(1, n)[0] as usize
    }
}

#[derive(Debug, PartialEq)]
pub enum Verdict {
    Pass,
    Fail(Vec<String>),
    Unsupported(String),
    Skipped(String),
}

/// A row's result and its printed line.
pub struct Outcome {
    pub line: String,
    pub verdict: Verdict,
}

/// The checks of one row against its tolerance: the worst error (relative to its bound) for
/// the line, and every failure.
pub fn judge(checks: &[Check], tol: Tol) -> (String, Vec<String>) {
    let mut fails = vec![];
    let (mut worst, mut worst_ratio, mut compared) = (tol.describe(0.0), -1f64, false);
    for c in checks {
        match c {
            Check::Values {
                what,
                got,
                want,
                tol: own,
            } => {
                compared = true;
                let t = own.unwrap_or(tol);
                if got.len() != want.len() {
                    fails.push(format!("{what}: {} values, want {}", got.len(), want.len()));
                    continue;
                }
                let Some((err, bound)) = t.error(got, want) else {
                    fails.push(format!("{what}: float values need a tolerance, not Exact"));
                    continue;
                };
                let ratio = if err == 0.0 {
                    0.0
                } else if bound > 0.0 {
                    err / bound
                } else {
                    f64::INFINITY
                };
                if ratio > worst_ratio {
                    (worst, worst_ratio) = (t.describe(err), ratio);
                }
                // NaN fails too.
                let within = err <= bound;
                if !within {
                    // Where it is furthest off (NaN first).
                    let off = |i: usize| match (got[i] - want[i]).abs() {
                        d if d.is_nan() => f32::INFINITY,
                        d => d,
                    };
                    let i = (0..got.len()).max_by(|&a, &b| off(a).total_cmp(&off(b)));
                    let i = i.unwrap_or(0);
                    fails.push(format!(
                        "{what}: {}, furthest at [{i}]: got {}, want {}",
                        t.describe(err).replace("<=", "NOT <="),
                        got.get(i).map_or(f32::NAN, |v| *v),
                        want.get(i).map_or(f32::NAN, |v| *v),
                    ));
                }
            }
            Check::Ids { what, got, want } => {
                compared = true;
                if got != want {
                    let at = got.iter().zip(want).position(|(g, w)| g != w);
                    fails.push(match at {
                        Some(i) => format!("{what}: [{i}] is {}, want {}", got[i], want[i]),
                        None => format!("{what}: {} ids, want {}", got.len(), want.len()),
                    });
                }
            }
            Check::Holds { what, ok } => {
                if !ok {
                    fails.push(format!("broken: {what}"));
                }
            }
        }
    }
    if !compared {
        fails.push("compares nothing".into());
    }
    (worst, fails)
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "panicked".into(),
    }
}

/// Runs one row on its backend; a panic (a kernel that fails to build, a read that fails) fails
/// the row, not the table.
pub fn run_row(row: &Row) -> Outcome {
    let c = &row.case;
    let head = format!(
        "{:<17} {:<46} {:<30} {:<15}",
        c.op().name(),
        c.shape(),
        c.types(),
        row.backend.name()
    );
    let ctx = match row.backend.context() {
        Ok(ctx) => ctx,
        Err(why) => {
            let why = why.to_string();
            return Outcome {
                line: format!("{head} skipped: {why}"),
                verdict: Verdict::Skipped(why),
            };
        }
    };
    let mut rng = Rng::for_key(&row.key());
    let start = Instant::now();
    let ran = catch_unwind(AssertUnwindSafe(|| c.run(ctx, &mut rng)));
    let ms = start.elapsed().as_millis();
    let (err, verdict) = match ran {
        Err(p) => (String::new(), Verdict::Fail(vec![panic_message(&*p)])),
        Ok(Err(Unsupported(why))) => (String::new(), Verdict::Unsupported(why)),
        Ok(Ok(checks)) => match judge(&checks, row.tol) {
            (worst, fails) if fails.is_empty() => (worst, Verdict::Pass),
            (worst, fails) => (worst, Verdict::Fail(fails)),
        },
    };
    let result = match &verdict {
        Verdict::Pass => "ok".to_string(),
        Verdict::Fail(f) => format!("FAIL: {}", f.join("; ")),
        Verdict::Unsupported(why) => format!("not supported: {why}"),
        Verdict::Skipped(why) => format!("skipped: {why}"),
    };
    Outcome {
        line: format!("{head} {err:<26} {result} ({ms} ms)"),
        verdict,
    }
}

/// The end of a run: Err with every failing row, and with every skipped one when a GPU is
/// required.
pub fn conclude(outcomes: &[Outcome], require_gpu: bool) -> Result<(), String> {
    let bad: Vec<&str> = outcomes
        .iter()
        .filter(|o| match &o.verdict {
            Verdict::Fail(_) => true,
            Verdict::Skipped(_) => require_gpu,
            Verdict::Pass | Verdict::Unsupported(_) => false,
        })
        .map(|o| o.line.as_str())
        .collect();
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "{} of {} rows failed{}:\n{}",
            bad.len(),
            outcomes.len(),
            if require_gpu {
                " (SMOE_REQUIRE_GPU=1)"
            } else {
                ""
            },
            bad.join("\n")
        )),
    }
}

/// Every row of `op`, one line each, then a failure listing every failing row.
fn run_op(op: Op) {
    let rows: Vec<Row> = table::rows()
        .into_iter()
        .filter(|r| r.case.op() == op)
        .collect();
    assert!(!rows.is_empty(), "{}: no rows", op.name());
    let outcomes: Vec<Outcome> = rows
        .iter()
        .map(|row| {
            let o = run_row(row);
            // Straight to stdout, whole lines: libtest would swallow println! of a passing
            // test, and tests run side by side.
            let _ = writeln!(std::io::stdout().lock(), "{}", o.line);
            o
        })
        .collect();
    if let Err(e) = conclude(&outcomes, gpu_required()) {
        panic!("{}: {e}", op.name());
    }
}

/// One test per op (so that `cargo test --test gpu_kernels matmul` runs the GEMM's rows, and
/// libtest runs ops side by side), and the list of ops that have one.
macro_rules! op_tests {
    ($($test:ident: $op:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                run_op(Op::$op);
            }
        )*
        const TESTED: &[Op] = &[$(Op::$op),*];
    };
}

op_tests! {
    matvec: MatVec,
    matmul: MatMul,
    expert_sort: ExpertSort,
    rms_norm: RmsNorm,
    qk_norm_rope: QkNormRope,
    decode_attention: DecodeAttention,
    prefill_attention: PrefillAttention,
    router: Router,
    route_tail: RouteTail,
    sum_tail: SumTail,
    next_route: NextRoute,
    weighted_sum: WeightedSum,
    eltwise: Eltwise,
    embed_gather: EmbedGather,
    argmax: Argmax,
}

#[test]
fn every_row_runs_in_a_test() {
    let rows = table::rows();
    for r in &rows {
        assert!(TESTED.contains(&r.case.op()), "no test runs {}", r.key());
    }
    let _ = writeln!(std::io::stdout().lock(), "the table: {} rows", rows.len());
}

/// The driver itself, without a GPU: a wrong value, a NaN, a wrong id, a broken promise, a row
/// that compares nothing and a float compared exactly each fail; close values pass.
#[test]
fn judge_fails_what_is_wrong() {
    let want: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut close = want.clone();
    close[10] += 1e-4;
    let mut off = want.clone();
    off[500] += 0.5;
    let mut nan = want.clone();
    nan[999] = f32::NAN;
    let fails = |checks: Vec<Check>, tol| judge(&checks, tol).1;
    assert!(fails(
        vec![Check::values("y", close.clone(), want.clone())],
        Tol::Nmse(1e-5)
    )
    .is_empty());
    assert!(fails(
        vec![Check::values("y", close, want.clone())],
        Tol::MaxAbs(1e-3)
    )
    .is_empty());
    assert_eq!(
        fails(
            vec![Check::values("y", off.clone(), want.clone())],
            Tol::Nmse(1e-5)
        )
        .len(),
        1
    );
    assert_eq!(
        fails(
            vec![Check::values("y", off, want.clone())],
            Tol::MaxAbs(0.1)
        )
        .len(),
        1
    );
    assert_eq!(
        fails(
            vec![Check::values("y", nan.clone(), want.clone())],
            Tol::Nmse(1.0)
        )
        .len(),
        1
    );
    assert_eq!(
        fails(
            vec![Check::values("y", nan, want.clone())],
            Tol::MaxAbs(1.0)
        )
        .len(),
        1
    );
    let short = want[..999].to_vec();
    assert_eq!(
        fails(
            vec![Check::values("y", short, want.clone())],
            Tol::Nmse(1.0)
        )
        .len(),
        1
    );
    assert_eq!(
        fails(
            vec![Check::ids("ids", vec![1, 2, 3], vec![1, 3, 2])],
            Tol::Exact
        )
        .len(),
        1
    );
    assert!(fails(
        vec![Check::ids("ids", vec![1, 2, 3], vec![1, 2, 3])],
        Tol::Exact
    )
    .is_empty());
    let broken = vec![
        Check::ids("ids", vec![1], vec![1]),
        Check::holds("poison", false),
    ];
    assert_eq!(fails(broken, Tol::Exact).len(), 1);
    assert_eq!(
        fails(vec![Check::holds("poison", true)], Tol::Exact).len(),
        1
    );
    assert_eq!(fails(vec![], Tol::Nmse(1.0)).len(), 1);
    assert_eq!(
        fails(vec![Check::values("y", want.clone(), want)], Tol::Exact).len(),
        1
    );
}

/// A run with a skipped row fails only when a GPU is required; a failing row always fails it.
#[test]
fn conclude_fails_failures_and_required_skips() {
    let o = |verdict| Outcome {
        line: String::new(),
        verdict,
    };
    let skipped = [o(Verdict::Pass), o(Verdict::Skipped("no GPU".into()))];
    assert!(conclude(&skipped, false).is_ok());
    assert!(conclude(&skipped, true).is_err());
    let unsupported = [o(Verdict::Unsupported("no matrix units".into()))];
    assert!(conclude(&unsupported, true).is_ok());
    let failed = [o(Verdict::Pass), o(Verdict::Fail(vec!["y".into()]))];
    assert!(conclude(&failed, false).is_err());
}

/// The first row of every op with its first comparison spoiled (a value moved by a tenth of
/// the output's norm, an id changed) must fail: the table cannot pass on outputs it does not
/// look at.
#[test]
fn a_spoiled_output_fails_its_row() {
    struct Spoiled(Box<dyn Case>);
    impl Case for Spoiled {
        fn op(&self) -> Op {
            self.0.op()
        }
        fn shape(&self) -> String {
            self.0.shape()
        }
        fn types(&self) -> String {
            self.0.types()
        }
        fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
            let mut checks = self.0.run(ctx, rng)?;
            let first = checks
                .iter_mut()
                .find(|c| !matches!(c, Check::Holds { .. }));
            match first {
                Some(Check::Values { got, want, .. }) => {
                    let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
                    got[want.len() / 2] += 0.1 * norm + 1.0;
                }
                Some(Check::Ids { got, .. }) => got[0] = got[0].wrapping_add(1),
                _ => {}
            }
            Ok(checks)
        }
    }
    let mut seen = vec![];
    for row in table::rows() {
        let op = row.case.op();
        if seen.contains(&op) {
            continue;
        }
        let spoiled = Row {
            case: Box::new(Spoiled(row.case)),
            ..row
        };
        let o = run_row(&spoiled);
        let _ = writeln!(
            std::io::stdout().lock(),
            "spoiled on purpose, must fail: {}",
            o.line
        );
        match o.verdict {
            Verdict::Fail(_) => seen.push(op),
            // Try the op's next row.
            Verdict::Unsupported(_) => {}
            Verdict::Skipped(why) if !gpu_required() => {
                let _ = writeln!(std::io::stderr(), "skipped: {why}");
                return;
            }
            v => panic!("a spoiled row did not fail: {v:?}\n{}", o.line),
        }
    }
    assert_eq!(
        seen.len(),
        TESTED.len(),
        "ops without a failing spoiled row"
    );
}
