//! Work a product takes over from the dispatches that would follow it, each of which costs a
//! dependent launch however small (decode is a chain of them): a norm of its input, a residual
//! add, a weighted sum of grouped slots, and tails that its last workgroups run (routing from
//! the logits it wrote, summing slots into a residual, the next block's router). `Tail` binds
//! a tail's buffers and checks that the product can carry it.

use super::{MatVecDesc, WeightRef};
use crate::gpu::buffers::{Binding, BufRef};
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::router::{MAX_EXPERTS, MAX_TOP_K};
use smoe_vault::quant::DType;

/// Work fused into a matrix product, saving the dependent dispatches it would otherwise take
/// (each costs several µs however small, and decode is a chain of them).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fuse<'a> {
    /// RMSNorm the input first: `x · rsqrt(mean(x²) + eps) · weight` per token (`weight`: `cols`
    /// f32 at a 16-byte aligned offset). Every workgroup recomputes the token's norm.
    pub norm: Option<(BufRef<'a>, f32)>,
    /// `y += W·x` instead of `y = W·x`: a residual add.
    pub accumulate: bool,
    /// Grouped only: the `k` consecutive slots of each output row are summed with weights
    /// (`[n_slots]` f32, e.g. the router's): `y[t] = Σ_j w[t·k + j] · W_{ids[t·k + j]} · x[t·k + j]`,
    /// so `y` holds `n_slots / k` rows. Not with gated products.
    pub reduce: Option<(BufRef<'a>, usize)>,
    /// With `norm`: also write the normed inputs (`[n_tokens][cols]` f32) here, so that later
    /// products of the same input can read them instead of renormalizing (each workgroup
    /// writes a share of the columns). Not grouped.
    pub norm_out: Option<BufRef<'a>>,
    /// Ungrouped: the dispatch's last workgroup routes each token from the logits it wrote (y:
    /// `[n_tokens][rows]`, rows = experts): what `Router` does, without its dependent dispatch.
    /// Vulkan only (`GpuContext::fused_tails`).
    pub route: Option<RouteTail<'a>>,
    /// Grouped, ungated, one token: after each block of output rows, its last workgroup adds
    /// each token's `k` slots weighted into `acc`: `acc[t] += Σ_j w[t·k + j] · y[t·k + j]` — what
    /// `WeightedSum` does, without its dependent dispatch. Vulkan only.
    pub sum_into: Option<SumTail<'a>>,
    /// One token, ungrouped, ungated, with `accumulate` (y is the residual stream, e.g. the
    /// attention's output projection): the next MoE block's router — RMSNorm of the new y, its
    /// logits, the softmax top-k, the normed row — in the dispatch's last workgroups, instead of
    /// a router dispatch after it. Vulkan only.
    pub next_route: Option<NextRoute<'a>>,
}

/// `Fuse::next_route`: the router that reads the product's output, and where its choice goes.
#[derive(Clone, Copy, Debug)]
pub struct NextRoute<'a> {
    /// `[experts, rows]` bf16 (every converter keeps routers bf16).
    pub router: WeightRef<'a>,
    /// The block's RMSNorm weight (`rows` f32, 16-byte aligned) and epsilon.
    pub norm: (BufRef<'a>, f32),
    /// Receives the normed row (`rows` f32), which the experts read.
    pub normed: BufRef<'a>,
    /// As `RouteTail`.
    pub route: RouteTail<'a>,
}

impl NextRoute<'_> {
    /// Whether `router` can run in the last workgroups of a product with `out_rows` output rows
    /// (`Fuse::next_route`): bf16 over exactly those rows, a multiple of 8 (the kernel reads the
    /// weights of each workgroup's rows in pairs).
    pub fn fits(router: &WeightRef, out_rows: usize) -> bool {
        router.dtype == DType::Bf16 && router.cols == out_rows && out_rows.is_multiple_of(8)
    }
}

/// `Fuse::route`: where the router's choice goes, as `Router` writes it.
#[derive(Clone, Copy, Debug)]
pub struct RouteTail<'a> {
    /// `[n_tokens][k]` u32 expert ids, most probable first.
    pub ids: BufRef<'a>,
    /// `[n_tokens][k]` f32 probabilities, renormalised over the k when `normalize`.
    pub weights: BufRef<'a>,
    pub k: usize,
    pub normalize: bool,
}

/// `Fuse::sum_into`: the weighted sum of each token's k slots into a residual.
#[derive(Clone, Copy, Debug)]
pub struct SumTail<'a> {
    /// `[n_slots / k][rows]` f32, added to.
    pub acc: BufRef<'a>,
    /// `[n_slots]` f32, e.g. the router's weights.
    pub weights: BufRef<'a>,
    pub k: usize,
}

/// `TAIL` of the kernel: 0 none, 1 route, 2 sum, 3 the next router.
pub(super) fn tail_kind(f: &Fuse) -> u32 {
    match (
        f.route.is_some(),
        f.sum_into.is_some(),
        f.next_route.is_some(),
    ) {
        (true, _, _) => 1,
        (_, true, _) => 2,
        (_, _, true) => 3,
        _ => 0,
    }
}

/// The kernel's `RG`: workgroups whose router partials one first-level sum adds (TAIL 3).
const ROUTE_GROUP: usize = 16;

/// The bindings and parameters of a fused tail (placeholders without one).
pub(super) struct Tail<'a> {
    pub kind: u32,
    /// The last-workgroup counters: one per token tile (route) or row block (sum), zeroed at
    /// creation; the last workgroup resets its own. Also bound where a tail has no buffer of its
    /// own (the kernel never touches those bindings then).
    pub done: wgpu::Buffer,
    pub ids: Option<Binding<'a>>,
    pub acc: Option<Binding<'a>>,
    pub k: u32,
    pub normalize: u32,
    pub a_off: u32,
    pub b_off: u32,
    /// Routing tails (1, 3): the experts the top-k chooses from (the kernel's `TAIL_E`); 0
    /// otherwise.
    pub experts: usize,
    /// TAIL 3: the router's weights (with its u32 offset and row stride in u32s) and the
    /// partial sums' scratch buffer.
    pub router: Option<(Binding<'a>, u32, u32)>,
    pub partials: Option<wgpu::Buffer>,
}

impl<'a> Tail<'a> {
    /// `groups`: the dispatch's workgroups along x (row blocks).
    pub fn bind(
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        f: &Fuse<'a>,
        groups: usize,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<Self, GpuError> {
        let kind = tail_kind(f);
        // At most one counter per token (route) or output row (sum); the next router's: one per
        // first-level group and one above them.
        let counters = match kind {
            1 => d.n_tokens,
            2 => d.w.rows,
            3 => groups.div_ceil(ROUTE_GROUP) + 1,
            _ => 1,
        };
        let done = ctx.storage_buffer("matvec tail counters", 4 * counters as u64);
        let mut tail = Tail {
            kind,
            ids: None,
            acc: None,
            done,
            k: 0,
            normalize: 0,
            a_off: 0,
            b_off: 0,
            experts: 0,
            router: None,
            partials: None,
        };
        if kind == 0 {
            return Ok(tail);
        }
        if !ctx.fused_tails() {
            return Err(err(format!(
                "fused tails are off on this adapter ({})",
                ctx.info().adapter.backend
            )));
        }
        let tails = [
            f.route.is_some(),
            f.sum_into.is_some(),
            f.next_route.is_some(),
        ];
        if tails.iter().filter(|t| **t).count() > 1 || f.reduce.is_some() {
            return Err(err("one tail at a time, and not with a reduce".into()));
        }
        match (f.route, f.next_route) {
            (Some(route), _) => tail.bind_route(ctx, d, f, route, err)?,
            (None, Some(next)) => tail.bind_next_route(ctx, d, f, next, groups, err)?,
            (None, None) => tail.bind_sum(ctx, d, f, f.sum_into.expect("kind 2"), err)?,
        }
        Ok(tail)
    }

    /// The router's choice (route, next_route): its ids and weights for each token, the top-k
    /// over `experts`.
    fn bind_choice(
        &mut self,
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        r: RouteTail<'a>,
        experts: usize,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<(), GpuError> {
        if experts > MAX_EXPERTS || r.k == 0 || r.k > experts.min(MAX_TOP_K) {
            return Err(err(format!(
                "routing: {} of {experts} experts (at most {MAX_TOP_K} of {MAX_EXPERTS})",
                r.k,
            )));
        }
        let (ids, a_off) = r.ids.bind(ctx, "matvec route ids", r.k * d.n_tokens, 4)?;
        let (acc, b_off) = r
            .weights
            .bind(ctx, "matvec route weights", r.k * d.n_tokens, 4)?;
        (self.ids, self.acc, self.a_off, self.b_off) = (Some(ids), Some(acc), a_off, b_off);
        (self.k, self.normalize) = (r.k as u32, r.normalize as u32);
        self.experts = experts;
        Ok(())
    }

    /// `Fuse::route`: the product's rows are the router's logits.
    fn bind_route(
        &mut self,
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        f: &Fuse<'a>,
        route: RouteTail<'a>,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<(), GpuError> {
        if d.grouped.is_some() || d.up_offset.is_some() || f.accumulate {
            return Err(err("routing needs an ungrouped, ungated product".into()));
        }
        self.bind_choice(ctx, d, route, d.w.rows, err)
    }

    /// `Fuse::next_route`: the router's weights and the scratch for its partial sums over the
    /// dispatch's `groups` row blocks.
    fn bind_next_route(
        &mut self,
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        f: &Fuse<'a>,
        next: NextRoute<'a>,
        groups: usize,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<(), GpuError> {
        let rw = next.router;
        if d.grouped.is_some()
            || d.up_offset.is_some()
            || !f.accumulate
            || f.norm.is_some()
            || d.n_tokens != 1
        {
            return Err(err(
                "the next router needs one token's ungrouped, ungated product added to its \
                 output, without a norm of its input"
                    .into(),
            ));
        }
        if !NextRoute::fits(&rw, d.w.rows) {
            return Err(err(format!(
                "the next router must be bf16 over the {} output rows (a multiple of 8), \
                 not {} {}x{}",
                d.w.rows, rw.dtype, rw.rows, rw.cols
            )));
        }
        self.bind_choice(ctx, d, next.route, rw.rows, err)?;
        let words = rw.rows * rw.cols / 2;
        let (b, off) = BufRef::at(rw.buffer, rw.offset).bind(ctx, "matvec router", words, 4)?;
        self.router = Some((b, off, (rw.cols / 2) as u32));
        let sums = (groups + groups.div_ceil(ROUTE_GROUP)) * (rw.rows + 1);
        self.partials = Some(ctx.storage_buffer("matvec router partials", 4 * sums as u64));
        Ok(())
    }

    /// `Fuse::sum_into`: the residual each token's k slots are added to.
    fn bind_sum(
        &mut self,
        ctx: &GpuContext,
        d: &MatVecDesc<'a>,
        f: &Fuse<'a>,
        sum: SumTail<'a>,
        err: &dyn Fn(String) -> GpuError,
    ) -> Result<(), GpuError> {
        let slots = d.grouped.map_or(0, |g| g.n_slots);
        if d.grouped.is_none() || d.up_offset.is_some() || f.accumulate || d.n_tokens != 1 {
            return Err(err(
                "a sum tail needs a grouped, ungated product of one token".into(),
            ));
        }
        if sum.k == 0 || !slots.is_multiple_of(sum.k) {
            return Err(err(format!(
                "{slots} slots do not sum in groups of {}",
                sum.k
            )));
        }
        let (acc, a_off) = sum
            .acc
            .bind(ctx, "matvec sum target", slots / sum.k * d.w.rows, 4)?;
        (self.acc, self.a_off, self.k) = (Some(acc), a_off, sum.k as u32);
        Ok(())
    }
}
