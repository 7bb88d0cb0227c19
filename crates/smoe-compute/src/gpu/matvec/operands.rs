//! What each dispatch of a product binds besides its weights: the input and output, the norm
//! and slot weights, the normed output and the expert ids (or placeholders where the product
//! has none), and the uniform parameters that say where in them each part's data lies.

use super::fuse::{Fuse, Tail};
use super::MatVecDesc;
use crate::gpu::buffers::{Binding, BufRef};
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::parts::WeightPart;

/// The kernel's uniform parameters (`kernels/matvec.wgsl`), field for field.
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_stride: u32,
    w_off: u32,
    w_mat_stride: u32,
    w_up_off: u32,
    param_word: u32,
    x_off: u32,
    x_tok: u32,
    x_slot: u32,
    y_off: u32,
    y_tok: u32,
    y_slot: u32,
    ids_off: u32,
    x_div: u32,
    nw_off: u32,
    eps: f32,
    rw_off: u32,
    hn_off: u32,
    hn_per: u32,
    tail_n: u32,
    tail_k: u32,
    tail_norm: u32,
    tail_a: u32,
    tail_b: u32,
    r_off: u32,
    r_stride: u32,
}

impl Params {
    /// The parameters every part of `d` shares; `for_part` sets the part's own.
    pub(super) fn shared(
        d: &MatVecDesc,
        f: &Fuse,
        layout: &Layout,
        operands: &Operands,
        tail: &Tail,
    ) -> Params {
        let w = d.w;
        let reduce = f.reduce.is_some();
        Params {
            rows: 0,
            cols: w.cols as u32,
            n_tok: if reduce { layout.reduce_k } else { d.n_tokens } as u32,
            row_stride: (w.dtype.row_stride(w.cols) / 16) as u32,
            w_off: 0,
            w_mat_stride: (layout.mat_stride / 16) as u32,
            w_up_off: (d.up_offset.unwrap_or(0) / 16) as u32,
            param_word: (w.dtype.code_bytes(w.cols) / 4) as u32,
            x_off: operands.x.1,
            // A reduce's "tokens" are its slots.
            x_tok: if reduce {
                layout.x_slot_len / 4
            } else {
                w.cols / 4
            } as u32,
            x_slot: if layout.x_per_slot {
                (layout.x_slot_len / 4) as u32
            } else {
                0
            },
            y_off: operands.y.1,
            y_tok: w.rows as u32,
            y_slot: layout.y_slot_len as u32,
            ids_off: operands.ids.1,
            x_div: layout.slots_per_x as u32,
            nw_off: operands.norm.1,
            eps: operands.norm.2,
            rw_off: operands.slot_weights.1,
            hn_off: operands.normed.1,
            hn_per: 0,
            tail_n: 0,
            tail_k: tail.k,
            tail_norm: tail.normalize,
            tail_a: tail.a_off,
            tail_b: tail.b_off,
            r_off: tail.router.map_or(0, |r| r.1),
            r_stride: tail.router.map_or(0, |r| r.2),
        }
    }

    /// These parameters for `part`, dispatched in blocks of `rows_per_group` rows.
    pub(super) fn for_part(
        &self,
        part: &WeightPart,
        rows_per_group: u64,
        tail_kind: u32,
        out_slots: usize,
    ) -> Params {
        let blocks = part.rows.div_ceil(rows_per_group);
        Params {
            rows: part.rows as u32,
            w_off: part.w_off,
            y_off: self.y_off + part.r0 as u32,
            hn_per: ((self.cols / 4) as usize).div_ceil(blocks as usize) as u32,
            // Router: every row block of a token tile counts in; sum: every slot of a block.
            tail_n: match tail_kind {
                1 | 3 => blocks as u32,
                _ => out_slots as u32,
            },
            ..*self
        }
    }
}

/// How a product's matrices, slots and tokens lie in its buffers.
pub(super) struct Layout {
    pub n_slots: usize,
    pub n_mats: usize,
    /// Bytes from one stacked matrix to the next (0 ungrouped).
    pub mat_stride: u64,
    /// Slots read inputs of their own (`Grouped::x_per_slot`), `slots_per_x` consecutive slots
    /// (at least 1) sharing one.
    pub x_per_slot: bool,
    pub slots_per_x: usize,
    /// Slots a reduce sums into one output; 1 without a reduce.
    pub reduce_k: usize,
    pub out_slots: usize,
    /// Floats of one slot's input and of its output, all tokens.
    pub x_slot_len: usize,
    pub y_slot_len: usize,
}

impl Layout {
    pub(super) fn of(
        d: &MatVecDesc,
        reduce_k: usize,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<Self, GpuError> {
        let (n_slots, n_mats, mat_stride, x_per_slot, slots_per_x) = match d.grouped {
            Some(g) => (
                g.n_slots,
                g.n_mats,
                g.mat_stride,
                g.x_per_slot,
                g.slots_per_x.max(1),
            ),
            None => (1, 1, 0, false, 1),
        };
        if mat_stride % 16 != 0 || n_slots == 0 {
            return Err(err(
                "group stride must be a multiple of 16 and slots > 0".into()
            ));
        }
        Ok(Layout {
            n_slots,
            n_mats,
            mat_stride,
            x_per_slot,
            slots_per_x,
            reduce_k,
            out_slots: n_slots / reduce_k,
            x_slot_len: d.n_tokens * d.w.cols,
            y_slot_len: d.n_tokens * d.w.rows,
        })
    }

    /// Inputs `x` holds: one per slot (or per `slots_per_x` slots), or one for all.
    fn x_slots(&self) -> usize {
        if self.x_per_slot {
            self.n_slots.div_ceil(self.slots_per_x)
        } else {
            1
        }
    }
}

/// Buffers bound where a product has nothing of its own to bind (the kernel never reads them
/// then), made only for the operands that need one.
pub(super) struct Placeholders {
    norm: Option<wgpu::Buffer>,
    normed: Option<wgpu::Buffer>,
    ids: Option<wgpu::Buffer>,
}

impl Placeholders {
    pub(super) fn new(ctx: &GpuContext, d: &MatVecDesc, f: &Fuse) -> Self {
        let spare = |needed: bool, label| needed.then(|| ctx.storage_buffer(label, 16));
        let no_norm = f.norm.is_none() && f.next_route.is_none();
        let no_normed = f.norm_out.is_none() && f.next_route.is_none();
        Placeholders {
            norm: spare(no_norm, "matvec (unused)"),
            normed: spare(no_normed, "matvec (no normed output)"),
            ids: spare(d.grouped.is_none(), "matvec ids (unused)"),
        }
    }
}

/// The buffers every part of a product binds besides its weights, each with its offset inside
/// the binding (in the units the kernel indexes it by).
pub(super) struct Operands<'b> {
    x: (Binding<'b>, u32),
    y: (Binding<'b>, u32),
    /// The RMSNorm weight (of the input, or of the next router's input) and its epsilon.
    norm: (Binding<'b>, u32, f32),
    /// The reduce's or the sum tail's weight per slot.
    slot_weights: (Binding<'b>, u32),
    /// Where the normed input, or the next router's normed row, goes.
    normed: (Binding<'b>, u32),
    /// A grouped product's matrix id per slot.
    ids: (Binding<'b>, u32),
}

impl<'b> Operands<'b> {
    pub(super) fn bind<'a: 'b>(
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        f: &Fuse<'a>,
        layout: &Layout,
        spare: &'b Placeholders,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<Self, GpuError> {
        let w = d.w;
        let unused =
            |b: &'b Option<wgpu::Buffer>| Binding::whole(b.as_ref().expect("a placeholder"));
        let x =
            d.x.bind(ctx, "matvec x", layout.x_slots() * layout.x_slot_len, 16)?;
        let y = (d.y).bind(ctx, "matvec y", layout.out_slots * layout.y_slot_len, 4)?;
        let norm = match (f.norm, f.next_route) {
            (Some((weight, eps)), _) => {
                let (b, off) = weight.bind(ctx, "matvec norm weight", w.cols, 16)?;
                (b, off, eps)
            }
            (None, Some(next)) => {
                let (b, off) = next
                    .norm
                    .0
                    .bind(ctx, "matvec next norm weight", w.rows, 16)?;
                (b, off, next.norm.1)
            }
            (None, None) => (unused(&spare.norm), 0, 0.0),
        };
        let n_slots = layout.n_slots;
        let slot_weights = match (f.reduce, f.sum_into) {
            (Some((weights, _)), _) => weights.bind(ctx, "matvec reduce weights", n_slots, 4)?,
            (None, Some(sum)) => sum.weights.bind(ctx, "matvec sum weights", n_slots, 4)?,
            (None, None) => (norm.0, 0),
        };
        let normed = match (f.norm_out, f.next_route) {
            (Some(out), _) => {
                if f.norm.is_none() || d.grouped.is_some() {
                    return Err(err(
                        "a normed output needs a norm and an ungrouped product".into()
                    ));
                }
                out.bind(ctx, "matvec normed output", d.n_tokens * w.cols, 16)?
            }
            (None, Some(next)) => next
                .normed
                .bind(ctx, "matvec next normed row", w.rows, 16)?,
            (None, None) => (unused(&spare.normed), 0),
        };
        let ids = match d.grouped {
            Some(g) => BufRef::at(g.ids, g.ids_offset).bind(ctx, "matvec ids", n_slots, 4)?,
            None => (unused(&spare.ids), 0),
        };
        Ok(Operands {
            x,
            y,
            norm,
            slot_weights,
            normed,
            ids,
        })
    }

    /// A part's bind group entries: `params` its uniform, `weights` its rows of the matrix.
    pub(super) fn entries<'e>(
        &'e self,
        params: &'e wgpu::Buffer,
        weights: Binding<'e>,
        tail: &'e Tail<'e>,
    ) -> [wgpu::BindGroupEntry<'e>; 14] {
        let done = Binding::whole(&tail.done);
        [
            Binding::whole(params).entry(0),
            weights.entry(1),
            self.x.0.entry(2),
            self.y.0.entry(3),
            self.ids.0.entry(4),
            self.norm.0.entry(5),
            self.slot_weights.0.entry(6),
            self.normed.0.entry(7),
            done.entry(8),
            tail.ids.unwrap_or(done).entry(9),
            tail.acc.unwrap_or(done).entry(10),
            self.y.0.entry(11),
            // (Read-only: without a router, the weights stand in.)
            tail.router.map_or(weights, |r| r.0).entry(12),
            Binding::whole(tail.partials.as_ref().unwrap_or(&tail.done)).entry(13),
        ]
    }
}
