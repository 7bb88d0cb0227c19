//! A measurement mode: GPU timestamps after every step (or around each pass) of the forward
//! passes run between `profile_start` and `profile_take` (`smoe bench decode --breakdown`).

use super::*;

/// Where a forward pass's time goes, accumulated over the passes run while profiling
/// (`GpuDecoder::profile_start` … `profile_take`).
#[derive(Debug, Clone, Default)]
pub struct GpuProfile {
    /// (step, GPU time in ns, dispatch groups recorded), in first-seen order. The GPU time of a
    /// step runs from the previous step's end to its own, so it includes any idle gap before it.
    pub steps: Vec<(&'static str, f64, u64)>,
    /// Host time spent recording and submitting command buffers, ns.
    pub record_ns: f64,
    /// Wall time of the forward calls, ns (host recording, GPU work, waits and read-backs).
    pub wall_ns: f64,
    /// Forward calls.
    pub passes: u64,
    /// Steps not timed because a submission had more than `Timestamps` can hold.
    pub dropped: u64,
}

pub(super) struct Profiling {
    pub(super) ts: Timestamps,
    pub(super) acc: GpuProfile,
    /// A timestamp after every step, or only around each pass.
    pub(super) fine: bool,
}

impl Profiling {
    /// After a submission completed: adds its marks to the totals.
    pub(super) fn collect(&mut self, ctx: &GpuContext, recorded: std::time::Duration) {
        self.acc.record_ns += recorded.as_nanos() as f64;
        self.acc.dropped += self.ts.dropped();
        for (label, ns) in self.ts.collect(ctx) {
            match self.acc.steps.iter_mut().find(|s| s.0 == label) {
                Some(s) => {
                    s.1 += ns;
                    s.2 += 1;
                }
                None => self.acc.steps.push((label, ns, 1)),
            }
        }
    }
}

impl GpuDecoder {
    /// Starts timing the following forward passes on the GPU (timestamp queries): every step
    /// (`fine`), or each pass as a whole. An error when the adapter cannot write timestamps
    /// inside compute passes.
    pub fn profile_start(&self, fine: bool) -> Result<(), EngineError> {
        let ts = Timestamps::new(&self.ctx).ok_or_else(|| {
            EngineError::Backend(
                "GPU: this adapter cannot write timestamps inside compute passes".into(),
            )
        })?;
        *self.profiling.lock().unwrap_or_else(|e| e.into_inner()) = Some(Profiling {
            ts,
            acc: GpuProfile::default(),
            fine,
        });
        Ok(())
    }

    /// Stops profiling and returns what was measured since `profile_start`.
    pub fn profile_take(&self) -> Option<GpuProfile> {
        let p = self
            .profiling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        p.map(|p| p.acc)
    }
}
