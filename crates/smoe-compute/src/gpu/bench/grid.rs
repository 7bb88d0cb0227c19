//! What a barrier across the workgroups of one dispatch costs (`kernels/grid_sync.wgsl`), beside
//! the dependent-dispatch floor: the step cost of a persistent kernel that would run a decode
//! layer (or token) as one dispatch instead of a chain of six.

use super::timer::Timer;
use crate::gpu::buffers::Binding;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::ops::Dispatch;
use std::fmt;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rounds: u32,
    groups: u32,
    spin_limit: u32,
    _pad: u32,
}

/// Polls a waiting workgroup makes before it gives up: far more than a barrier of co-resident
/// workgroups takes (hundreds), few enough that a device that runs them one after another
/// (lavapipe) gets through in about a second.
pub const SPIN_LIMIT: u32 = 1 << 20;

/// The counters one dispatch left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridRun {
    /// Arrivals at a barrier, over all workgroups and rounds (rounds × groups when all ran).
    pub arrivals: u32,
    /// Workgroups that waited `spin_limit` polls and ended: not all of them ran together.
    pub gave_up: u32,
    /// Neighbour values read after a barrier that were from an earlier round.
    pub stale: u32,
}

struct Grid {
    reset: Dispatch,
    run: Dispatch,
    sync: wgpu::Buffer,
    _vals: wgpu::Buffer,
}

impl Grid {
    /// `dispatched` workgroups that wait for `groups` arrivals per round (a test dispatches
    /// fewer than it waits for, to see the give-up).
    fn new(
        ctx: &GpuContext,
        dispatched: usize,
        groups: usize,
        rounds: usize,
        spin_limit: u32,
    ) -> Result<Self, GpuError> {
        if groups == 0 || rounds == 0 || (rounds + 1) * groups > u32::MAX as usize {
            return Err(GpuError::Shape(format!(
                "grid barrier: {rounds} rounds of {groups} workgroups"
            )));
        }
        let sync = ctx.storage_buffer("grid sync counters", 16);
        let vals = ctx.storage_buffer("grid sync values", 4 * groups.max(dispatched) as u64);
        let p = Params {
            rounds: rounds as u32,
            groups: groups as u32,
            spin_limit,
            _pad: 0,
        };
        let bufs = [Binding::whole(&sync), Binding::whole(&vals)];
        let reset = Dispatch::new(ctx, "grid_sync", &[("RESET", 1.0)], &p, &bufs, [1, 1, 1])?;
        let run = Dispatch::new(ctx, "grid_sync", &[], &p, &bufs, [dispatched, 1, 1])?;
        Ok(Grid {
            reset,
            run,
            sync,
            _vals: vals,
        })
    }

    fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.reset.record(pass);
        self.run.record(pass);
    }

    /// Runs the dispatch once and returns its counters.
    fn run(&self, ctx: &GpuContext) -> Result<GridRun, GpuError> {
        let mut enc = ctx.encoder();
        crate::gpu::in_pass(&mut enc, "grid sync", |pass| self.record(pass));
        ctx.submit_wait(enc);
        self.counters(ctx)
    }

    fn counters(&self, ctx: &GpuContext) -> Result<GridRun, GpuError> {
        let c = ctx.read_u32(&self.sync, 0, 3)?;
        Ok(GridRun {
            arrivals: c[0],
            gave_up: c[1],
            stale: c[2],
        })
    }
}

/// Runs one dispatch of `dispatched` workgroups through `rounds` barriers of `groups` and returns
/// its counters.
pub fn grid_sync_run(
    ctx: &GpuContext,
    dispatched: usize,
    groups: usize,
    rounds: usize,
    spin_limit: u32,
) -> Result<GridRun, GpuError> {
    Grid::new(ctx, dispatched, groups, rounds, spin_limit)?.run(ctx)
}

/// Why the barrier benches measure nothing on this adapter, if they do not: on a CPU adapter
/// (lavapipe) workgroups spinning on each other's counter lost arrivals without giving up and
/// read stale values, so it says nothing of a GPU.
pub(super) fn not_measured(ctx: &GpuContext) -> Option<&'static str> {
    (ctx.info().adapter.device_type == wgpu::DeviceType::Cpu)
        .then_some("not measured on a CPU adapter")
}

/// One workgroup count's result: `None` where its workgroups did not all run together.
#[derive(Clone, Copy, Debug)]
pub struct GridBarrierRow {
    pub groups: usize,
    pub us_per_round: Option<f64>,
    /// Stale neighbour values seen in the timed runs' last dispatch (0 means the barrier also
    /// orders memory, as a persistent kernel needs).
    pub stale: u32,
}

#[derive(Clone, Debug)]
pub struct GridBarrier {
    pub rounds: usize,
    pub rows: Vec<GridBarrierRow>,
    /// Why nothing was measured (a CPU adapter), if so.
    pub skipped: Option<&'static str>,
}

/// Workgroup counts tried: around the H200's 132 SMs, up to four per SM.
const GROUPS: [usize; 4] = [32, 132, 264, 528];

/// µs per barrier round for each of `GROUPS`: a dispatch of `rounds` + 1 rounds against one of
/// a single round, timed like every bench row (the difference over `rounds`). A count whose probe
/// gives up is reported as not co-resident and not timed.
pub fn grid_barrier(ctx: &GpuContext, rounds: usize) -> Result<GridBarrier, GpuError> {
    if let Some(why) = not_measured(ctx) {
        let skipped = Some(why);
        return Ok(GridBarrier {
            rounds,
            rows: vec![],
            skipped,
        });
    }
    let timer = Timer::new(ctx);
    let mut rows = vec![];
    for groups in GROUPS {
        // The one-round dispatch is also the probe of whether the workgroups run together.
        let one = Grid::new(ctx, groups, groups, 1, SPIN_LIMIT)?;
        let probe = one.run(ctx)?;
        if probe.gave_up > 0 {
            rows.push(GridBarrierRow {
                groups,
                us_per_round: None,
                stale: probe.stale,
            });
            continue;
        }
        let many = Grid::new(ctx, groups, groups, rounds + 1, SPIN_LIMIT)?;
        let t1 = timer.time(&|pass| one.record(pass))?;
        let tn = timer.time(&|pass| many.record(pass))?;
        let last = many.counters(ctx)?;
        let us = (last.gave_up == 0).then(|| (tn - t1).max(0.0) / rounds as f64 * 1e6);
        rows.push(GridBarrierRow {
            groups,
            us_per_round: us,
            stale: last.stale,
        });
    }
    Ok(GridBarrier {
        rounds,
        rows,
        skipped: None,
    })
}

impl fmt::Display for GridBarrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "barrier across one dispatch's workgroups ({} rounds):",
            self.rounds
        )?;
        if let Some(why) = self.skipped {
            write!(f, " {why}")?;
        }
        for r in &self.rows {
            match r.us_per_round {
                Some(us) => write!(f, " {:.2} µs ({} workgroups", us, r.groups)?,
                None => write!(f, " not co-resident ({} workgroups", r.groups)?,
            }
            if r.stale > 0 {
                write!(f, ", {} stale reads", r.stale)?;
            }
            write!(f, ")")?;
        }
        Ok(())
    }
}
