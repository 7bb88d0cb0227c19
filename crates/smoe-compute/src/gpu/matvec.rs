//! Wrapper of `kernels/matvec.wgsl`: quantized matrix × activations, plain, gated
//! (silu(G·x)·(U·x)) and grouped (a stack of experts chosen by ids on the GPU).

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::ops::recordable;
use super::parts::{split_rows, PartDispatches};
use smoe_vault::quant::DType;

/// A weight matrix `[rows, cols]` in a vault storage type, stored at `offset` (a multiple of 16)
/// of `buffer`: `rows * dtype.row_stride(cols)` bytes, row after row, exactly as in the vault.
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> WeightRef<'a> {
    /// A matrix at the start of `buffer`.
    pub fn whole(buffer: &'a wgpu::Buffer, dtype: DType, rows: usize, cols: usize) -> Self {
        WeightRef {
            buffer,
            offset: 0,
            dtype,
            rows,
            cols,
        }
    }
}

/// Grouped dispatch: slot `s` multiplies by matrix `ids[s]` of a stack of `n_mats` matrices
/// spaced `mat_stride` bytes apart (an expert section: `WeightRef::offset` is expert 0's tensor,
/// `mat_stride` the blob stride). `ids` holds u32s, e.g. the router's top-k expert ids.
#[derive(Clone, Copy, Debug)]
pub struct Grouped<'a> {
    pub ids: &'a wgpu::Buffer,
    /// Byte offset of slot 0's id (a multiple of 4).
    pub ids_offset: u64,
    pub n_slots: usize,
    pub n_mats: usize,
    pub mat_stride: u64,
    /// Each slot reads its own input (`x + s·n_tokens·cols`, e.g. the down projection after a
    /// grouped gate_up); otherwise every slot reads the same `x` (the gate_up of one token).
    pub x_per_slot: bool,
    /// With `x_per_slot`: this many consecutive slots share one input, slot `s` reading input
    /// `s / slots_per_x` (the gate_up of several tokens, slots `t·k..t·k + k` being token `t`'s k
    /// experts). 0 or 1: every slot its own input.
    pub slots_per_x: usize,
}

/// One matrix product to record. `x` holds `[slots][n_tokens][cols]` f32 (one slot unless
/// `grouped.x_per_slot`), `y` receives `[slots][n_tokens][rows]` f32.
#[derive(Clone, Copy, Debug)]
pub struct MatVecDesc<'a> {
    pub w: WeightRef<'a>,
    /// Gated: byte offset from `w` to an up matrix of the same shape; `y = silu(W·x) · (U·x)`.
    pub up_offset: Option<u64>,
    pub x: BufRef<'a>,
    pub y: BufRef<'a>,
    pub n_tokens: usize,
    pub grouped: Option<Grouped<'a>>,
}

impl<'a> MatVecDesc<'a> {
    /// A plain product `y = W·x` of `n_tokens` tokens: not gated, not grouped (set `up_offset`
    /// or `grouped` on it for those).
    pub fn plain(w: WeightRef<'a>, x: BufRef<'a>, y: BufRef<'a>, n_tokens: usize) -> Self {
        MatVecDesc {
            w,
            up_offset: None,
            x,
            y,
            n_tokens,
            grouped: None,
        }
    }
}

/// Work fused into a matrix product, saving the dependent dispatches it would otherwise take
/// (on an H200 each costs 5–10 µs however small: decode is a chain of them).
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

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
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

/// Launch shape and decoding choices; `Default` is what `MatVec::new` uses. Exposed so that
/// `gpu::bench` can compare variants in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatVecTuning {
    /// Invocations per workgroup (a multiple of the subgroup size; 64..=256).
    pub wg: u32,
    /// Output rows per workgroup (subgroups share them round-robin).
    pub rows: u32,
    /// How q4 codes are turned into products.
    pub q4: Q4Decode,
    /// Items (rows, gate/up rows, or under a reduce (row, slot) pairs) a subgroup loads at once
    /// before multiplying; 0: chosen from the shape (`batch_loads`).
    pub items: u32,
}

/// q4 decoding strategies (see `kernels/matvec.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Decode {
    /// Nibble → u32 → f32 conversion: simple, but the conversion is quarter-rate on NVIDIA.
    IntToFloat,
    /// Nibble placed in the mantissa of 1.0f (exactly 1 + c/16): shifts and masks only.
    FloatBits,
    /// Inputs quantized to int8 per 64 in workgroup memory, 4 products per `dot4I8Packed`.
    /// Not exact w.r.t. the f32 CPU twin (NMSE ~1e-5): opt-in.
    Int8Dot,
    /// Two nibbles at a time placed under f16's exponent bits (1024 + c each), the offset
    /// taken off both in one packed f16 subtraction, widened to f32: the same values as the
    /// others with fewer operations per weight (the default; `PairsF32` where the device has no
    /// SHADER_F16).
    PairsF16,
    /// `PairsF16` with the subtraction in f32 (for devices without f16 arithmetic).
    PairsF32,
}

impl Default for MatVecTuning {
    fn default() -> Self {
        MatVecTuning {
            wg: 256,
            rows: 16,
            q4: Q4Decode::PairsF16,
            items: 0,
        }
    }
}

impl MatVecTuning {
    /// What `MatVec::new` uses for `rows` output rows in each of `slots` slots: 256 invocations,
    /// and the most rows per workgroup that still leaves ≥ 256 workgroups to spread over the
    /// GPU (at most 16 for grouped products). From `smoe bench kernels --sweep` on an H200
    /// (2026-11-30): 32 rows for the LM head (45.6 % of copy vs 38.8 % with 16), 8 for a
    /// 2048-row projection, 16 for 8 grouped experts; 256 invocations beat 128 and 64 at every
    /// shape.
    pub fn for_shape(rows: usize, slots: usize, grouped: bool) -> Self {
        Self::for_product(rows, slots, grouped, false)
    }

    /// As `for_shape`, for `out_slots` outputs of `rows` rows; `reduce`: each output sums k
    /// experts' rows, and every workgroup stages all k inputs (k × cols floats), so fewer,
    /// larger workgroups win: 16 rows (≥ 128 workgroups). H200 sweep, 30B down × 8 experts q4:
    /// 18.0 µs at 16 rows, 19.4 at 8, 22.1 at 4, 28.2 at 2, 41.7 at 1.
    pub fn for_product(rows: usize, out_slots: usize, grouped: bool, reduce: bool) -> Self {
        let units = rows * out_slots;
        let (cap, min_groups) = match (grouped, reduce) {
            (_, true) => (16, 128),
            (true, false) => (16, 256),
            (false, false) => (32, 256),
        };
        let rows = [32, 16, 8, 4, 2]
            .into_iter()
            .find(|&r| r <= cap && units / r as usize >= min_groups)
            .unwrap_or(2);
        MatVecTuning {
            rows,
            ..Self::default()
        }
    }
}
/// Loads each lane of the kernel keeps in flight before multiplying (its `LD`).
const LOADS_IN_FLIGHT: usize = 8;

/// The kernel's `U` (items a subgroup loads together) and `S` (chunks per lane and item per
/// round): S rounds of 16-byte chunks cover a tile's row when the subgroup has `ss` lanes (at most
/// `LOADS_IN_FLIGHT`; more rounds run otherwise), and U items fill the rest of the loads in
/// flight, no more than a subgroup has (`tune.items` if set). `ss` is the adapter's largest
/// subgroup size: with a smaller one the kernel just runs more rounds.
///
/// q4 keeps one item at a time: its decoding is ALU-bound, and on an H200 (`smoe bench kernels`,
/// 2026-12-01) four items at once made the 30B LM head 14 % slower and the grouped gate_up 37 %
/// slower, while bf16 and q8 gained (30B down × 8: bf16 23.0 → 16.3 µs, q8 27.4 → 16.1).
fn batch_loads(
    dtype: DType,
    tile: usize,
    tune: MatVecTuning,
    nt: usize,
    gated: bool,
    reduce: bool,
    ss: usize,
) -> (usize, usize) {
    // Inputs per 16-byte chunk of codes.
    let per_chunk = match dtype {
        DType::Bf16 => 8,
        DType::Q8 => 16,
        DType::Q4 => 32,
        _ => 64,
    };
    let steps = (tile / per_chunk).div_ceil(ss).clamp(1, LOADS_IN_FLIGHT);
    let items = tune.rows as usize
        * if reduce {
            nt
        } else if gated {
            2
        } else {
            1
        };
    let subgroups = (tune.wg as usize / ss).max(1);
    let auto = match dtype {
        DType::Q4 => 1,
        _ => LOADS_IN_FLIGHT / steps,
    };
    let want = if tune.items > 0 {
        tune.items as usize
    } else {
        auto
    };
    let u = want
        .min(LOADS_IN_FLIGHT / steps)
        .min(items.div_ceil(subgroups))
        .max(1);
    (u, steps)
}

/// Tokens one workgroup multiplies at once (more are spread over dispatch z).
pub const NT_MAX: usize = 8;
/// Staged inputs per workgroup: 16 KiB, WebGPU's default workgroup memory.
const STAGE_FLOATS: usize = 4096;

/// A recorded-at-load matrix product: one dispatch per part (a matrix larger than a storage
/// binding is split by rows into parts).
pub struct MatVec {
    dispatches: PartDispatches,
}

fn dtype_code(d: DType, t: MatVecTuning) -> Result<f64, GpuError> {
    Ok(match d {
        DType::Bf16 => 0.0,
        DType::Q8 => 1.0,
        DType::Q4 => match t.q4 {
            Q4Decode::IntToFloat => 2.0,
            Q4Decode::FloatBits => 4.0,
            Q4Decode::Int8Dot => 5.0,
            Q4Decode::PairsF16 | Q4Decode::PairsF32 => 6.0,
        },
        DType::Q2 => 3.0,
        DType::F32 => {
            return Err(GpuError::Shape(
                "matvec: f32 weights are not supported; store bf16".into(),
            ))
        }
    })
}

/// `TAIL` of the kernel: 0 none, 1 route, 2 sum, 3 the next router.
fn tail_kind(f: &Fuse) -> u32 {
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
struct Tail<'a> {
    kind: u32,
    /// The last-workgroup counters: one per token tile (route) or row block (sum), zeroed at
    /// creation; the last workgroup resets its own. Also bound where a tail has no buffer of its
    /// own (the kernel never touches those bindings then).
    done: wgpu::Buffer,
    ids: Option<Binding<'a>>,
    acc: Option<Binding<'a>>,
    k: u32,
    normalize: u32,
    a_off: u32,
    b_off: u32,
    /// Routing tails (1, 3): the experts the top-k chooses from (the kernel's `TAIL_E`); 0
    /// otherwise.
    experts: usize,
    /// TAIL 3: the router's weights (with its u32 offset and row stride in u32s) and the
    /// partial sums' scratch buffer.
    router: Option<(Binding<'a>, u32, u32)>,
    partials: Option<wgpu::Buffer>,
}

impl<'a> Tail<'a> {
    /// `groups`: the dispatch's workgroups along x (row blocks).
    fn bind(
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
        // The router's choice (route, next_route): its ids and weights for each token.
        let mut choice = |r: RouteTail<'a>, experts: usize| -> Result<(), GpuError> {
            if experts > super::router::MAX_EXPERTS
                || r.k == 0
                || r.k > experts.min(super::router::MAX_TOP_K)
            {
                return Err(err(format!(
                    "routing: {} of {experts} experts (at most {} of {})",
                    r.k,
                    super::router::MAX_TOP_K,
                    super::router::MAX_EXPERTS
                )));
            }
            let (ids, a_off) = r.ids.bind(ctx, "matvec route ids", r.k * d.n_tokens, 4)?;
            let (acc, b_off) = r
                .weights
                .bind(ctx, "matvec route weights", r.k * d.n_tokens, 4)?;
            (tail.ids, tail.acc, tail.a_off, tail.b_off) = (Some(ids), Some(acc), a_off, b_off);
            (tail.k, tail.normalize) = (r.k as u32, r.normalize as u32);
            tail.experts = experts;
            Ok(())
        };
        if let Some(r) = f.route {
            if d.grouped.is_some() || d.up_offset.is_some() || f.accumulate {
                return Err(err("routing needs an ungrouped, ungated product".into()));
            }
            choice(r, d.w.rows)?;
            return Ok(tail);
        }
        if let Some(nr) = f.next_route {
            let rw = nr.router;
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
            choice(nr.route, rw.rows)?;
            let words = rw.rows * rw.cols / 2;
            let (b, off) = BufRef::at(rw.buffer, rw.offset).bind(ctx, "matvec router", words, 4)?;
            tail.router = Some((b, off, (rw.cols / 2) as u32));
            let sums = (groups + groups.div_ceil(ROUTE_GROUP)) * (rw.rows + 1);
            tail.partials = Some(ctx.storage_buffer("matvec router partials", 4 * sums as u64));
            return Ok(tail);
        }
        let t = f.sum_into.expect("kind 2");
        let slots = d.grouped.map_or(0, |g| g.n_slots);
        if d.grouped.is_none() || d.up_offset.is_some() || f.accumulate || d.n_tokens != 1 {
            return Err(err(
                "a sum tail needs a grouped, ungated product of one token".into(),
            ));
        }
        if t.k == 0 || !slots.is_multiple_of(t.k) {
            return Err(err(format!(
                "{slots} slots do not sum in groups of {}",
                t.k
            )));
        }
        let (acc, a_off) = t
            .acc
            .bind(ctx, "matvec sum target", slots / t.k * d.w.rows, 4)?;
        (tail.acc, tail.a_off, tail.k) = (Some(acc), a_off, t.k as u32);
        Ok(tail)
    }
}

impl MatVec {
    pub fn new(ctx: &GpuContext, d: &MatVecDesc) -> Result<Self, GpuError> {
        Self::fused(ctx, d, &Fuse::default())
    }

    /// A product with `f`'s work fused in, at the launch shape `MatVecTuning::for_shape` picks.
    pub fn fused(ctx: &GpuContext, d: &MatVecDesc, f: &Fuse) -> Result<Self, GpuError> {
        let slots = d.grouped.map_or(1, |g| g.n_slots);
        let out_slots = slots / f.reduce.map_or(1, |r| r.1.max(1));
        let grouped = d.grouped.is_some();
        let tune = MatVecTuning::for_product(d.w.rows, out_slots, grouped, f.reduce.is_some());
        Self::build(ctx, d, f, tune)
    }

    pub fn with_tuning(
        ctx: &GpuContext,
        d: &MatVecDesc,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        Self::build(ctx, d, &Fuse::default(), tune)
    }

    /// `fused` at a given launch shape (for benchmarks).
    pub fn fused_tuned(
        ctx: &GpuContext,
        d: &MatVecDesc,
        f: &Fuse,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        Self::build(ctx, d, f, tune)
    }

    fn build(
        ctx: &GpuContext,
        d: &MatVecDesc,
        f: &Fuse,
        tune: MatVecTuning,
    ) -> Result<Self, GpuError> {
        let w = d.w;
        let err =
            |m: String| GpuError::Shape(format!("matvec {}x{} {}: {m}", w.rows, w.cols, w.dtype));
        w.dtype.check_cols(w.cols).map_err(err)?;
        if !w.cols.is_multiple_of(8)
            || !w.offset.is_multiple_of(16)
            || d.n_tokens == 0
            || w.rows == 0
        {
            return Err(err(
                "cols must be a multiple of 8, offset of 16, rows and tokens > 0".into(),
            ));
        }
        if d.up_offset.is_some_and(|u| u % 16 != 0) {
            return Err(err("up offset must be a multiple of 16".into()));
        }
        let stride = w.dtype.row_stride(w.cols) as u64;
        // A reduce stages its k slots' inputs as the workgroup's "tokens".
        let k_red = match f.reduce {
            Some((_, k)) => {
                let slots = d.grouped.map_or(0, |g| g.n_slots);
                if d.grouped.is_none() || d.up_offset.is_some() || f.norm.is_some() {
                    return Err(err(format!(
                        "a reduce over {k} slots needs a grouped, ungated product without a norm"
                    )));
                }
                if k == 0 || k > NT_MAX || !slots.is_multiple_of(k) || d.n_tokens != 1 {
                    return Err(err(format!(
                        "{slots} slots of {} tokens do not reduce in groups of {k} (1..={NT_MAX})",
                        d.n_tokens
                    )));
                }
                k
            }
            None => 1,
        };
        let nt = match f.reduce {
            Some(_) => k_red,
            None => d.n_tokens.min(NT_MAX),
        };
        // A reduce stages k inputs at once: use the workgroup memory the device has (32 KiB
        // on lavapipe, 48 KiB on an H200), less 4 KiB for the kernel's other arrays, so that
        // an expert's whole input (e.g. 8 × 768) fits one tile.
        let stage = match f.reduce {
            // (The int8 path keeps a second, quantized copy of the staged inputs.)
            Some(_) if tune.q4 != Q4Decode::Int8Dot => {
                let have = ctx.limits().max_compute_workgroup_storage_size as usize / 4;
                have.saturating_sub(1024)
                    .clamp(STAGE_FLOATS, 2 * STAGE_FLOATS)
            }
            _ => STAGE_FLOATS,
        };
        let tile = (stage / nt / 64 * 64).min(w.cols.next_multiple_of(64));
        let ss = ctx.info().adapter.subgroup_max_size.max(1) as usize;
        let gated = d.up_offset.is_some();
        let (items_u, steps) = batch_loads(w.dtype, tile, tune, nt, gated, f.reduce.is_some(), ss);
        let f16 = ctx.info().features.contains(wgpu::Features::SHADER_F16);
        let kernel = match tune.q4 {
            Q4Decode::PairsF16 if f16 && w.dtype == DType::Q4 => "matvec_f16",
            _ => "matvec",
        };
        let groups_x = w.rows.div_ceil(tune.rows as usize);
        let tail = Tail::bind(ctx, d, f, groups_x, &err)?;
        let constants = [
            ("DTYPE", dtype_code(w.dtype, tune)?),
            ("NT", nt as f64),
            ("TILE", tile as f64),
            ("ROWS", tune.rows as f64),
            ("WG", tune.wg as f64),
            ("GATED", d.up_offset.is_some() as u8 as f64),
            ("GROUPED", d.grouped.is_some() as u8 as f64),
            ("NORM", f.norm.is_some() as u8 as f64),
            ("ACCUM", f.accumulate as u8 as f64),
            ("REDUCE", f.reduce.is_some() as u8 as f64),
            ("NORM_OUT", f.norm_out.is_some() as u8 as f64),
            ("TAIL", tail_kind(f) as f64),
            ("TAIL_E", tail.experts.max(1) as f64),
            ("TAIL_K", if tail.experts > 0 { tail.k } else { 1 } as f64),
            ("U", items_u as f64),
            ("S", steps as f64),
        ];
        let pipeline = ctx.pipeline(kernel, &constants)?;
        let (n_slots, n_mats, mat_stride, x_per_slot, x_div) = match d.grouped {
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
        let out_slots = n_slots / k_red;
        let (xs_slot, ys_slot) = (d.n_tokens * w.cols, d.n_tokens * w.rows);
        let x_slots = if x_per_slot {
            n_slots.div_ceil(x_div)
        } else {
            1
        };
        let (xb, x_off) = d.x.bind(ctx, "matvec x", x_slots * xs_slot, 16)?;
        let (yb, y_off) = d.y.bind(ctx, "matvec y", out_slots * ys_slot, 4)?;
        let unused;
        let (nb, nw_off, eps) = match (f.norm, f.next_route) {
            (Some((nw, eps)), _) => {
                let (b, off) = nw.bind(ctx, "matvec norm weight", w.cols, 16)?;
                (b, off, eps)
            }
            (None, Some(nr)) => {
                let (b, off) = nr.norm.0.bind(ctx, "matvec next norm weight", w.rows, 16)?;
                (b, off, nr.norm.1)
            }
            (None, None) => {
                unused = ctx.storage_buffer("matvec (unused)", 16);
                (Binding::whole(&unused), 0, 0.0)
            }
        };
        let (rb, rw_off) = match (f.reduce, f.sum_into) {
            (Some((rw, _)), _) => rw.bind(ctx, "matvec reduce weights", n_slots, 4)?,
            (None, Some(t)) => t.weights.bind(ctx, "matvec sum weights", n_slots, 4)?,
            (None, None) => (nb, 0),
        };
        let hn_unused;
        let (hb, hn_off) = match (f.norm_out, f.next_route) {
            (Some(hn), _) => {
                if f.norm.is_none() || d.grouped.is_some() {
                    return Err(err(
                        "a normed output needs a norm and an ungrouped product".into()
                    ));
                }
                hn.bind(ctx, "matvec normed output", d.n_tokens * w.cols, 16)?
            }
            (None, Some(nr)) => nr.normed.bind(ctx, "matvec next normed row", w.rows, 16)?,
            (None, None) => {
                hn_unused = ctx.storage_buffer("matvec (no normed output)", 16);
                (Binding::whole(&hn_unused), 0)
            }
        };
        let ids_fallback;
        let (ib, ids_off) = match d.grouped {
            Some(g) => BufRef::at(g.ids, g.ids_offset).bind(ctx, "matvec ids", n_slots, 4)?,
            None => {
                ids_fallback = ctx.storage_buffer("matvec ids (unused)", 16);
                (Binding::whole(&ids_fallback), 0)
            }
        };

        // Split rows so that each part's weight range fits one storage binding.
        let extra = (n_mats as u64 - 1) * mat_stride + d.up_offset.unwrap_or(0);
        let split = split_rows(ctx, &w, extra, d.grouped.is_none(), "matvec weights", err)?;
        if tail.kind != 0 && split.len() > 1 {
            return Err(err(
                "a fused tail needs the weights in one storage binding".into()
            ));
        }
        let max_wg = ctx.limits().max_compute_workgroups_per_dimension as u64;
        let mut parts = vec![];
        for part in split {
            let (r0, rows) = (part.r0, part.rows);
            let params = Params {
                rows: rows as u32,
                cols: w.cols as u32,
                n_tok: if f.reduce.is_some() {
                    k_red
                } else {
                    d.n_tokens
                } as u32,
                row_stride: (stride / 16) as u32,
                w_off: part.w_off,
                w_mat_stride: (mat_stride / 16) as u32,
                w_up_off: (d.up_offset.unwrap_or(0) / 16) as u32,
                param_word: (w.dtype.code_bytes(w.cols) / 4) as u32,
                x_off,
                // A reduce's "tokens" are its slots.
                x_tok: if f.reduce.is_some() {
                    xs_slot / 4
                } else {
                    w.cols / 4
                } as u32,
                x_slot: if x_per_slot { (xs_slot / 4) as u32 } else { 0 },
                y_off: y_off + r0 as u32,
                y_tok: w.rows as u32,
                y_slot: ys_slot as u32,
                ids_off,
                x_div: x_div as u32,
                nw_off,
                eps,
                rw_off,
                hn_off,
                hn_per: (w.cols / 4).div_ceil(rows.div_ceil(tune.rows as u64) as usize) as u32,
                // Router: every row block of a token tile counts in; sum: every slot of a block.
                tail_n: match tail.kind {
                    1 | 3 => rows.div_ceil(tune.rows as u64) as u32,
                    _ => out_slots as u32,
                },
                tail_k: tail.k,
                tail_norm: tail.normalize,
                tail_a: tail.a_off,
                tail_b: tail.b_off,
                r_off: tail.router.map_or(0, |r| r.1),
                r_stride: tail.router.map_or(0, |r| r.2),
            };
            let pbuf = ctx.uniform("matvec params", &params);
            let entries = [
                Binding::whole(&pbuf).entry(0),
                part.binding(&w).entry(1),
                xb.entry(2),
                yb.entry(3),
                ib.entry(4),
                nb.entry(5),
                rb.entry(6),
                hb.entry(7),
                Binding::whole(&tail.done).entry(8),
                tail.ids.unwrap_or(Binding::whole(&tail.done)).entry(9),
                tail.acc.unwrap_or(Binding::whole(&tail.done)).entry(10),
                yb.entry(11),
                // (Read-only: without a router, the weights stand in.)
                tail.router.map_or(part.binding(&w), |r| r.0).entry(12),
                Binding::whole(tail.partials.as_ref().unwrap_or(&tail.done)).entry(13),
            ];
            let bind = ctx.bind_group("matvec", &pipeline, &entries)?;
            let groups = [
                rows.div_ceil(tune.rows as u64),
                out_slots as u64,
                if f.reduce.is_some() {
                    1
                } else {
                    d.n_tokens.div_ceil(nt)
                } as u64,
            ];
            if groups.iter().any(|g| *g > max_wg) {
                return Err(err(format!(
                    "dispatch {groups:?} exceeds {max_wg} workgroups per dimension"
                )));
            }
            parts.push((bind, groups.map(|g| g as u32)));
        }
        Ok(MatVec {
            dispatches: PartDispatches { pipeline, parts },
        })
    }
}

recordable!(MatVec, "matvec", dispatches);

#[cfg(test)]
mod tests {
    use super::MatVecTuning;

    /// The launch shapes the H200 sweep chose (docs/performance.md), kept on purpose.
    #[test]
    fn launch_shape_per_size() {
        let rows =
            |r, slots, grouped, reduce| MatVecTuning::for_product(r, slots, grouped, reduce).rows;
        assert_eq!(rows(151_936, 1, false, false), 32, "LM head");
        assert_eq!(rows(8192, 1, false, false), 32, "235B q_proj");
        assert_eq!(rows(4096, 1, false, false), 16, "30B q_proj");
        assert_eq!(rows(2048, 1, false, false), 8, "30B o_proj");
        assert_eq!(rows(768, 8, true, false), 16, "30B gate_up, 8 experts");
        assert_eq!(rows(2048, 1, true, true), 16, "30B down, 8 experts summed");
        assert_eq!(
            rows(128, 1, false, false),
            2,
            "a router: as many workgroups as it can"
        );
        assert!(MatVecTuning::for_shape(64, 1, false).wg == 256);
    }
}
