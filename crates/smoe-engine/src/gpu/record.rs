//! Recording prepared dispatches into a compute pass, each under a step label, with a GPU
//! timestamp after every step when the decoder is profiling (`GpuDecoder::profile`).

use smoe_compute::gpu::{
    wgpu, Argmax, DecodeAttention, Eltwise, EmbedGather, ExpertSort, IndirectArgs, Launch, MatMul,
    MatVec, QkNormRope, RmsNorm, Router, SlotMap, Timestamps, WeightedSum,
};

/// A prepared dispatch (or a few) that records into a compute pass.
pub(crate) trait Dispatch {
    fn record_into(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch);
}

macro_rules! dispatch {
    ($($t:ty),*) => {$(
        impl Dispatch for $t {
            fn record_into(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
                self.record_with(pass, launch)
            }
        }
    )*};
}
dispatch!(
    MatVec,
    MatMul,
    ExpertSort,
    RmsNorm,
    Eltwise,
    WeightedSum,
    Router,
    Argmax,
    QkNormRope,
    DecodeAttention,
    EmbedGather,
    SlotMap
);

/// An open compute pass; when profiling, the timestamps to mark: after each step (`fine`),
/// or only at the pass's start and end (the GPU's busy time without the cost of a timestamp
/// between every two dispatches); and how the steps launch (indirect in a streaming pass that
/// may halt, `through`).
pub(crate) struct Recorder<'p, 't> {
    pub pass: wgpu::ComputePass<'p>,
    ts: Option<&'t mut Timestamps>,
    fine: bool,
    launch: Launch<'t>,
}

impl<'p, 't> Recorder<'p, 't> {
    /// `first`: the first pass of a forward call, which marks its start.
    pub fn new(
        pass: wgpu::ComputePass<'p>,
        mut ts: Option<&'t mut Timestamps>,
        fine: bool,
        first: bool,
    ) -> Self {
        let mut pass = pass;
        if let Some(t) = ts.as_deref_mut().filter(|_| first) {
            t.mark(&mut pass, "start");
        }
        Recorder {
            pass,
            ts,
            fine,
            launch: Launch::Direct,
        }
    }

    /// A recorder without timestamps whose steps launch from `args` (cleared first), so that a
    /// `SlotMap` can halt the pass.
    pub fn through(pass: wgpu::ComputePass<'p>, args: &'t mut IndirectArgs) -> Self {
        args.clear();
        Recorder {
            pass,
            ts: None,
            fine: false,
            launch: Launch::Indirect(args),
        }
    }

    pub fn step(&mut self, label: &'static str, d: &dyn Dispatch) {
        d.record_into(&mut self.pass, &mut self.launch);
        if let Some(t) = self.ts.as_deref_mut().filter(|_| self.fine) {
            t.mark(&mut self.pass, label);
        }
    }

    /// Ends a coarse profile: the whole pass under one label.
    pub fn end(mut self) {
        if let Some(t) = self.ts.as_deref_mut().filter(|_| !self.fine) {
            t.mark(&mut self.pass, "forward pass (GPU busy)");
        }
    }
}
