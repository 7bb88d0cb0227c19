//! A chain of matrix-vector products run as one dispatch per step or as one persistent dispatch
//! (`kernels/persist_matvec.wgsl`): what a persistent decode kernel would gain over the chain of
//! dependent dispatches a decode layer is, measured on the same step code.

use super::grid::{not_measured, SPIN_LIMIT};
use super::timer::Timer;
use crate::gpu::buffers::Binding;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::ops::Dispatch;
use std::fmt;

/// Inputs per product and rows per workgroup (the kernel's `COLS` and `R`).
pub const PERSIST_COLS: usize = 2048;
pub const PERSIST_ROWS_PER_GROUP: usize = 16;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    steps: u32,
    step0: u32,
    groups: u32,
    spin_limit: u32,
    _pad: [u32; 3],
}

/// How the chain runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainMode {
    /// One dispatch per step, each depending on the one before (a barrier between).
    Dispatches,
    /// One dispatch, a barrier across its workgroups between steps; `early`: each step's
    /// weights are loaded before the wait for the step before.
    Persistent { early: bool },
    /// One dispatch per step with no barrier between them (`GpuContext::pipeline_unfenced`):
    /// each step's workgroups wait on a counter for the steps before, so a step may start (and
    /// with `early` load its weights) while the one before runs. Needs passthrough shaders.
    Overlapped { early: bool },
}

/// The chain's buffers and recorded dispatches.
pub struct Chain {
    dispatches: Vec<Dispatch>,
    y: wgpu::Buffer,
    sync: wgpu::Buffer,
    steps: usize,
    _w: wgpu::Buffer,
}

impl Chain {
    /// `steps` products of `groups · 16` rows × 2048 bf16 (`w`: the matrices back to back, as
    /// bf16 bits) starting from `x0` (2048 values); rows past `groups · 16` of each step's
    /// output stay 0.
    pub fn new(
        ctx: &GpuContext,
        mode: ChainMode,
        groups: usize,
        steps: usize,
        w: &[u16],
        x0: &[f32],
    ) -> Result<Self, GpuError> {
        let rows = groups * PERSIST_ROWS_PER_GROUP;
        if groups == 0 || rows > PERSIST_COLS || steps == 0 || x0.len() != PERSIST_COLS {
            return Err(GpuError::Shape(format!(
                "persistent chain: {groups} workgroups, {steps} steps, {} inputs",
                x0.len()
            )));
        }
        if w.len() != steps * rows * PERSIST_COLS {
            return Err(GpuError::Shape(format!(
                "persistent chain: {} weights for {steps} matrices of {rows} × {PERSIST_COLS}",
                w.len()
            )));
        }
        let wb = ctx.upload("persist weights", bytemuck::cast_slice(w));
        let mut y0 = vec![0f32; (steps + 1) * PERSIST_COLS];
        y0[..PERSIST_COLS].copy_from_slice(x0);
        let y = ctx.upload_f32("persist y", &y0);
        let sync = ctx.storage_buffer("persist sync", 16);
        let bufs = [
            Binding::whole(&wb),
            Binding::whole(&y),
            Binding::whole(&sync),
            Binding::whole(&y),
        ];
        let params = |steps: usize, step0: usize| Params {
            rows: rows as u32,
            steps: steps as u32,
            step0: step0 as u32,
            groups: groups as u32,
            spin_limit: SPIN_LIMIT,
            _pad: [0; 3],
        };
        let k = "persist_matvec";
        let dispatches = match mode {
            ChainMode::Dispatches => (0..steps)
                .map(|s| Dispatch::new(ctx, k, &[], &params(1, s), &bufs, [groups, 1, 1]))
                .collect::<Result<Vec<_>, _>>()?,
            ChainMode::Persistent { early } => {
                let p = params(steps, 0);
                let reset = Dispatch::new(ctx, k, &[("RESET", 1.0)], &p, &bufs, [1, 1, 1])?;
                let constants = [("PERSIST", 1.0), ("EARLY", early as u8 as f64)];
                let run = Dispatch::new(ctx, k, &constants, &p, &bufs, [groups, 1, 1])?;
                vec![reset, run]
            }
            ChainMode::Overlapped { early } => {
                // The reset is an ordinary dispatch: wgpu fences it from the steps before and
                // after (the buffers' uses change), so a run's counter starts at 0.
                let reset =
                    Dispatch::new(ctx, k, &[("RESET", 1.0)], &params(1, 0), &bufs, [1, 1, 1])?;
                let constants = [("OVERLAP", 1.0), ("EARLY", early as u8 as f64)];
                let pipeline = ctx.pipeline_unfenced(k, &constants)?;
                let mut v = vec![reset];
                for s in 0..steps {
                    let p = params(1, s);
                    v.push(Dispatch::with_pipeline(
                        ctx,
                        k,
                        pipeline.clone(),
                        &p,
                        &bufs,
                        [groups, 1, 1],
                    )?);
                }
                v
            }
        };
        Ok(Chain {
            dispatches,
            y,
            sync,
            steps,
            _w: wb,
        })
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.dispatches.iter().for_each(|d| d.record(pass));
    }

    /// Runs the chain once; the last step's output (2048 values) and the workgroups that gave
    /// up waiting for the others (not all of them ran together).
    pub fn run(&self, ctx: &GpuContext) -> Result<(Vec<f32>, u32), GpuError> {
        let mut enc = ctx.encoder();
        crate::gpu::in_pass(&mut enc, "persistent chain", |pass| self.record(pass));
        ctx.submit_wait(enc);
        let out = ctx.read_f32(
            &self.y,
            (4 * self.steps * PERSIST_COLS) as u64,
            PERSIST_COLS,
        )?;
        Ok((out, ctx.read_u32(&self.sync, 4, 1)?[0]))
    }
}

/// The chain measured three ways on the same weights.
#[derive(Clone, Debug)]
pub struct PersistentBench {
    pub steps: usize,
    pub groups: usize,
    /// µs per step: a dispatch per step; one persistent dispatch; the same with each step's
    /// weights loaded before its wait. `None` where nothing was measured (`skipped`), and for
    /// the persistent two where the workgroups did not all run together.
    pub dispatch_us: Option<f64>,
    pub persistent_us: Option<f64>,
    pub early_us: Option<f64>,
    /// µs per step as unfenced dispatches waiting on a counter (`ChainMode::Overlapped`), the
    /// weights loaded after / before the wait; `None` where the device has no passthrough
    /// shaders or the workgroups gave up waiting.
    pub overlap_us: Option<f64>,
    pub overlap_early_us: Option<f64>,
    /// Largest |Δ| of the persistent runs' outputs from the dispatch chain's, relative to the
    /// largest output.
    pub max_rel_diff: f64,
    pub skipped: Option<&'static str>,
}

/// Deterministic bf16 weights of about unit gain per product (uniform in ±√(3/2048)).
pub fn chain_weights(n: usize, seed: u64) -> Vec<u16> {
    let a = (3.0f32 / PERSIST_COLS as f32).sqrt();
    // (Straight to bf16: the bench's 48 matrices would be 805 MB as f32 first.)
    let w = super::attention::filler_iter(seed).take(n);
    w.map(|u| ((u * a).to_bits() >> 16) as u16).collect()
}

/// 48 steps (a decode token's layers) of 2048 × 2048 bf16 products (8 MiB each, 384 MiB in
/// all, so the weights come from memory), 128 workgroups.
pub fn persistent_chain(ctx: &GpuContext) -> Result<PersistentBench, GpuError> {
    let (steps, groups) = (48, PERSIST_COLS / PERSIST_ROWS_PER_GROUP);
    if let Some(why) = not_measured(ctx) {
        return Ok(PersistentBench {
            steps,
            groups,
            dispatch_us: None,
            persistent_us: None,
            early_us: None,
            overlap_us: None,
            overlap_early_us: None,
            max_rel_diff: 0.0,
            skipped: Some(why),
        });
    }
    let w = chain_weights(steps * PERSIST_COLS * PERSIST_COLS, 7);
    let x0: Vec<f32> = (0..PERSIST_COLS)
        .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
        .collect();
    let timer = Timer::new(ctx);
    let chain = Chain::new(ctx, ChainMode::Dispatches, groups, steps, &w, &x0)?;
    let (want, _) = chain.run(ctx)?;
    let dispatch_us = Some(timer.time(&|pass| chain.record(pass))? / steps as f64 * 1e6);
    let scale = want
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let mut max_rel_diff = 0f64;
    let mut per_step = |mode| -> Result<Option<f64>, GpuError> {
        let c = match Chain::new(ctx, mode, groups, steps, &w, &x0) {
            Ok(c) => c,
            // No passthrough shaders: no unfenced pipelines.
            Err(_) if matches!(mode, ChainMode::Overlapped { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (got, gave_up) = c.run(ctx)?;
        if gave_up > 0 {
            return Ok(None);
        }
        for (g, v) in got.iter().zip(&want) {
            max_rel_diff = max_rel_diff.max(((g - v).abs() / scale) as f64);
        }
        Ok(Some(
            timer.time(&|pass| c.record(pass))? / steps as f64 * 1e6,
        ))
    };
    let persistent_us = per_step(ChainMode::Persistent { early: false })?;
    let early_us = per_step(ChainMode::Persistent { early: true })?;
    let overlap_us = per_step(ChainMode::Overlapped { early: false })?;
    let overlap_early_us = per_step(ChainMode::Overlapped { early: true })?;
    Ok(PersistentBench {
        steps,
        groups,
        dispatch_us,
        persistent_us,
        early_us,
        overlap_us,
        overlap_early_us,
        max_rel_diff,
        skipped: None,
    })
}

impl fmt::Display for PersistentBench {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} chained 2048x2048 bf16 matvecs ({} workgroups): ",
            self.steps, self.groups
        )?;
        let (Some(dispatch_us), None) = (self.dispatch_us, self.skipped) else {
            return write!(f, "{}", self.skipped.unwrap_or("not measured"));
        };
        let us = |v: Option<f64>| v.map_or("not co-resident".into(), |u| format!("{u:.2} µs"));
        let ov = |v: Option<f64>| v.map_or("not measured".into(), |u| format!("{u:.2} µs"));
        write!(
            f,
            "{:.2} µs per step as dependent dispatches, {} in one persistent dispatch, {} with \
             each step's weights loaded before its barrier; as unfenced dispatches waiting on a \
             counter {}, {} with the weights loaded first (outputs within {:.1e})",
            dispatch_us,
            us(self.persistent_us),
            us(self.early_us),
            ov(self.overlap_us),
            ov(self.overlap_early_us),
            self.max_rel_diff
        )
    }
}
