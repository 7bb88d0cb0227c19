//! Wrapper of `kernels/slot_map.wgsl`: a streaming pass maps its router's expert ids to VRAM
//! slots on the GPU, or halts where an expert has no slot.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::launch::{IndirectArgs, Launch};
use super::ops::Dispatch;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    layer: u32,
    count: u32,
    experts: u32,
    args_words: u32,
    ids_off: u32,
    table_off: u32,
    chosen_off: u32,
    guess_count: u32,
    guess_off: u32,
    next_off: u32,
    rw_off: u32,
    guess_k: u32,
    guess_keep: u32,
    _pad: u32,
}

/// A slot table entry for an expert that no slot holds.
pub const NO_SLOT: u32 = u32::MAX;

/// Where a `SlotMap` reads and writes.
pub struct SlotMapBufs<'a> {
    /// `[count]` expert ids in (the router's), slots out.
    pub ids: BufRef<'a>,
    /// `[layers][experts]` slot of each expert, or `NO_SLOT`.
    pub table: &'a wgpu::Buffer,
    /// `[layers][row]`: each layer's expert ids (the first `count` of its row), kept for the
    /// host.
    pub chosen: &'a wgpu::Buffer,
    /// The launch counts zeroed on a halt (the whole buffer).
    pub args: &'a IndirectArgs,
    /// `[0]`: 0 while the pass runs on, 1 + the layer that halted it. The host zeroes it
    /// before each submission.
    pub status: &'a wgpu::Buffer,
    /// A lookahead's guesses: one that no slot of its layer holds halts the pass too (so the
    /// host can start reading it).
    pub guess: Option<SlotGuess<'a>>,
    /// A speculative map (`SlotMap` doc): the router weights of the `count` chosen ids, zeroed
    /// where an expert has no slot.
    pub spec: Option<BufRef<'a>>,
}

/// A lookahead's guessed ids for MoE layer `layer`: `count` (as many as the chosen ids), each
/// token's `per_token` in rank order, of which the best `keep` halt the pass where no slot
/// holds them.
pub struct SlotGuess<'a> {
    pub ids: BufRef<'a>,
    pub layer: usize,
    pub per_token: usize,
    pub keep: usize,
}

/// For MoE layer `layer` of `experts`: maps `count` chosen ids (tokens × top-k) to their slots
/// (keeping the ids in row `layer` of `chosen`, `chosen_row` wide; as many guesses, if any)
/// through the slot table, or halts the pass (every indirect dispatch recorded after it runs no
/// workgroups) when one has no slot. It is itself launched directly: a halted pass's later slot
/// maps run and see the halt.
///
/// Speculative (`SlotMapBufs::spec`): never halts and ignores the status; an expert without a
/// slot is left out of the layer (slot 0, router weight 0), so that a pass the host runs while
/// it reads the misses can go on and show which experts later layers would choose.
pub struct SlotMap {
    d: Dispatch,
}

impl SlotMap {
    pub fn new(
        ctx: &GpuContext,
        b: &SlotMapBufs,
        layer: usize,
        experts: usize,
        count: usize,
        chosen_row: usize,
    ) -> Result<Self, GpuError> {
        let shape = |m: String| GpuError::Shape(format!("slot map, layer {layer}: {m}"));
        let rows = |buf: &wgpu::Buffer, per: usize| (buf.size() / 4) as usize / per.max(1);
        if count == 0 || experts == 0 || count > chosen_row {
            return Err(shape(format!(
                "{count} chosen ids of {experts} experts in rows of {chosen_row}"
            )));
        }
        if rows(b.table, experts) <= layer || rows(b.chosen, chosen_row) <= layer {
            return Err(shape(format!(
                "the slot table ({} B) or the chosen ids ({} B) hold no row for it",
                b.table.size(),
                b.chosen.size()
            )));
        }
        let (ib, ids_off) = b.ids.bind(ctx, "slot map ids", count, 4)?;
        let (gb, guess_off, next) = match &b.guess {
            Some(g) => {
                if rows(b.table, experts) <= g.layer {
                    let next = g.layer;
                    return Err(shape(format!("no table row for the guessed layer {next}")));
                }
                if g.per_token == 0 || !count.is_multiple_of(g.per_token) {
                    let k = g.per_token;
                    return Err(shape(format!("{count} guessed ids in tokens of {k}")));
                }
                let (gb, off) = g.ids.bind(ctx, "slot map guesses", count, 4)?;
                (gb, off, Some(g))
            }
            // (Bound but not read; the table, since ids is bound read-write.)
            None => (Binding::whole(b.table), 0, None),
        };
        let (sb, rw_off) = match &b.spec {
            Some(rw) => rw.bind(ctx, "slot map router weights", count, 4)?,
            // (Bound but not written: the kernel refers to it in its speculative branch.)
            None => (Binding::whole(b.status), 0),
        };
        let p = Params {
            layer: layer as u32,
            count: count as u32,
            experts: experts as u32,
            args_words: b.args.capacity_words() as u32,
            ids_off,
            table_off: (layer * experts) as u32,
            chosen_off: (layer * chosen_row) as u32,
            guess_count: next.map_or(0, |_| count as u32),
            guess_off,
            next_off: (next.map_or(0, |g| g.layer) * experts) as u32,
            rw_off,
            guess_k: next.map_or(1, |g| g.per_token) as u32,
            guess_keep: next.map_or(0, |g| g.keep.min(g.per_token)) as u32,
            _pad: 0,
        };
        let bufs = [
            ib,
            Binding::whole(b.table),
            Binding::whole(b.chosen),
            Binding::whole(b.args.buffer()),
            Binding::whole(b.status),
            gb,
            sb,
        ];
        let spec = [("SPEC", 1.0)];
        let constants: &[_] = if b.spec.is_some() { &spec } else { &[] };
        let d = Dispatch::new(ctx, "slot_map", constants, &p, &bufs, [1, 1, 1])?;
        Ok(SlotMap { d })
    }

    /// Records the kernel into an open compute pass.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.d.record(pass);
    }

    /// Records the kernel launched directly, whatever `launch` says: it writes the indirect
    /// launch counts, so it cannot read them in the same dispatch, and after a halt it must
    /// still run to see it.
    pub fn record_with(&self, pass: &mut wgpu::ComputePass<'_>, _launch: &mut Launch) {
        self.d.record(pass);
    }

    /// Records the kernel into its own compute pass of `enc`.
    pub fn encode(&self, enc: &mut wgpu::CommandEncoder) {
        super::in_pass(enc, "slot map", |p| self.record(p));
    }
}
