//! Prefill attention (`kernels/attn_prefill.wgsl`): causal GQA attention for a chunk of many
//! query tokens, flash-attention style: a workgroup per kv head and tile of (query, head) rows
//! walks 32-key tiles of the cache (staged once for the GQA group) with an online softmax. Same
//! descriptor and contract as `DecodeAttention` (`AttnDesc`; `pos0` from the step uniform).
//! The last tiles of a chunk see the most keys; with `splits > 1` a tile with many keys shares
//! them among several workgroups, whose partial results a second pass merges
//! (`kernels/attn_prefill_merge.wgsl`), so one long tile no longer sets the kernel's time.

use super::attention::{AttnBindings, AttnDesc};
use super::buffers::Binding;
use super::context::{GpuContext, GpuError};
use super::ops::{recordable, Dispatch};

/// Largest head dimension [`PrefillAttention`] takes (its output block lives in registers).
pub const PREFILL_MAX_HEAD_DIM: usize = 256;

/// Tile shape of [`PrefillAttention`]; [`PrefillAttnTuning::pick`] is the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillAttnTuning {
    /// (query token, q head of the group) rows per workgroup: 32, 64 or 128, two invocations
    /// per row. More rows share each K/V tile among more queries but make fewer workgroups.
    pub rows: usize,
    /// Head dimensions per step of the scores: 16, 32, 64 or 128. Each step stages its slice of
    /// q and of the key tile behind two barriers, so wider steps mean fewer round trips and
    /// barriers per key tile (128 at head_dim 128: the whole tile in one) for more workgroup
    /// memory (32 rows × 128 dims: 36 KiB).
    pub dims: usize,
    /// Most workgroups a tile's keys are shared by, 1 to 16 (1: no split and no merge pass).
    /// Each takes at least `PREFILL_UNIT_KEYS` keys, so short tiles stay whole; which tiles
    /// split is decided on the device from the chunk's position.
    pub splits: usize,
}

/// Fewest keys per unit of a split tile (the kernels' `UNIT_KEYS`, a multiple of the key tile).
const PREFILL_UNIT_KEYS: usize = 128;

/// Units per tile by default. H200, `smoe bench kernels --shape "attn pf512"` (Qwen3-30B-A3B's
/// 32/4 heads × 128, 512 tokens from position 0 / at position 3,584), µs: no split 181.8 /
/// 1,693.8, 2 units 148.8 / 1,612.7, 4 units 164.3 / 1,628.8, 8 units 166.5 / 1,670.3. Every unit
/// past a tile's need is a workgroup that starts and returns at once, and those are not free
/// (a dispatch of 4 units per tile where every tile takes one: 201.8 at 512 tokens).
const PREFILL_SPLITS: usize = 2;

/// Keys per tile of the kernel (its `BK`).
const PREFILL_BK: usize = 32;

/// The override constants of a tile shape at `head_dim` on a device with `limit` bytes of
/// workgroup memory, and the bytes they use (over `limit` when the tile does not fit).
fn prefill_consts(
    t: PrefillAttnTuning,
    head_dim: usize,
    limit: u64,
) -> ([(&'static str, f64); 7], u64) {
    let od = head_dim.div_ceil(32);
    // V chunk rows, in vec4s (zero-padded to whole column invocations).
    let vs = 8 * od;
    let qk = t.dims * (t.rows + PREFILL_BK) / 4;
    // V chunks of up to 16 KiB (a whole key tile up to head_dim 128: two barriers per tile
    // less), else of up to 8 KiB, or as large as the score step's staging is anyway.
    let mut best = None;
    for room in [1024, 512] {
        let room = qk.max(room);
        let kvc = (0..=5)
            .rev()
            .map(|b| 1usize << b)
            .find(|c| c * vs <= room)
            .unwrap_or(1);
        let stage = qk.max(2 * t.rows).max(kvc * vs);
        let bytes = 16 * (stage + PREFILL_BK * t.rows / 4) as u64;
        let consts = [
            ("M", t.rows as f64),
            ("DS", t.dims as f64),
            ("OD", od as f64),
            ("KVC", kvc as f64),
            ("STAGE", stage as f64),
            ("SPLITS", t.splits as f64),
            ("UNIT_KEYS", PREFILL_UNIT_KEYS as f64),
        ];
        best = Some((consts, bytes));
        if bytes <= limit {
            break;
        }
    }
    best.unwrap()
}

impl PrefillAttnTuning {
    /// 64 rows (8 tokens × 8 heads of a Qwen3 GQA group), and 32-dim score steps where the head
    /// dimension is a multiple of 32 and the device has the workgroup memory (20 KiB at
    /// least), else 16 (16 KiB at head_dim ≤ 256).
    pub fn pick(ctx: &GpuContext, head_dim: usize) -> Self {
        let wide = PrefillAttnTuning {
            rows: 64,
            dims: 32,
            splits: PREFILL_SPLITS,
        };
        let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
        if head_dim.is_multiple_of(32) && prefill_consts(wide, head_dim, limit).1 <= limit {
            wide
        } else {
            PrefillAttnTuning { dims: 16, ..wide }
        }
    }

    /// `pick` for the chunk `a`, without key splits where their partial results would not fit
    /// one storage binding of the device (then the longest tiles set the time, as before the
    /// splits, instead of the chunk failing).
    pub fn pick_for(ctx: &GpuContext, a: &AttnDesc) -> Self {
        let t = Self::pick(ctx, a.head_dim);
        let max = ctx.limits().max_storage_buffer_binding_size;
        match PrefillAttention::scratch_bytes(a, t) > max {
            true => PrefillAttnTuning { splits: 1, ..t },
            false => t,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PrefillParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    n_tokens: u32,
    q_off: u32,
    kc_off: u32,
    vc_off: u32,
    out_off: u32,
    scale: f32,
    window: u32,
    n_tiles: u32,
    ml_off: u32,
}

/// Attention of a prefill chunk: the same work as [`DecodeAttention`] on the same descriptor,
/// but each workgroup takes a block of queries (tokens × the heads of one GQA group) through
/// the keys together, so every K/V row is read once per block instead of once per query.
/// `q` and `out` offsets must be multiples of 16 bytes.
pub struct PrefillAttention {
    d: Dispatch,
    /// The units' merge pass, with `splits > 1` where the kernel's last unit of a tile does
    /// not merge them itself (`GpuContext::fused_tails` off).
    merge: Option<Dispatch>,
    tuning: PrefillAttnTuning,
}

/// Row tiles per KV head.
fn n_tiles(a: &AttnDesc, t: PrefillAttnTuning) -> usize {
    (a.n_tokens * (a.n_heads / a.n_kv_heads.max(1))).div_ceil(t.rows)
}

impl PrefillAttention {
    /// Bytes of partial results `a` needs in tile shape `t` (0 without splits): each tile's
    /// `splits` units, each row's output and its (max, sum).
    pub fn scratch_bytes(a: &AttnDesc, t: PrefillAttnTuning) -> u64 {
        match t.splits {
            0 | 1 => 0,
            s => {
                let rows = a.n_kv_heads * n_tiles(a, t) * s * t.rows;
                16 * (rows * (a.head_dim / 4 + 1)) as u64
            }
        }
    }

    /// The default tile, with its own scratch buffer.
    pub fn new(ctx: &GpuContext, a: &AttnDesc) -> Result<Self, GpuError> {
        Self::with_tuning(ctx, a, PrefillAttnTuning::pick_for(ctx, a))
    }

    /// Tile shape `t`, with its own scratch buffer.
    pub fn with_tuning(
        ctx: &GpuContext,
        a: &AttnDesc,
        t: PrefillAttnTuning,
    ) -> Result<Self, GpuError> {
        let bytes = Self::scratch_bytes(a, t).max(16);
        let scratch = ctx.storage_buffer("prefill attention partials", bytes);
        Self::with_scratch(ctx, a, t, &scratch)
    }

    /// Partial results in `scratch` (at least `scratch_bytes(a, t)`), which attention dispatches
    /// that run one after another — the layers of a sequence — can share.
    pub fn with_scratch(
        ctx: &GpuContext,
        a: &AttnDesc,
        t: PrefillAttnTuning,
        scratch: &wgpu::Buffer,
    ) -> Result<Self, GpuError> {
        let hd = a.head_dim;
        if hd == 0
            || !hd.is_multiple_of(4)
            || hd > PREFILL_MAX_HEAD_DIM
            || a.n_kv_heads == 0
            || !a.n_heads.is_multiple_of(a.n_kv_heads)
        {
            return Err(GpuError::Shape(format!(
                "prefill attention: head_dim {hd} (multiple of 4, at most \
                 {PREFILL_MAX_HEAD_DIM}), {} heads over {} kv heads",
                a.n_heads, a.n_kv_heads
            )));
        }
        let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
        let (consts, bytes) = prefill_consts(t, hd, limit);
        if ![32, 64, 128].contains(&t.rows)
            || ![16, 32, 64, 128].contains(&t.dims)
            || !(1..=16).contains(&t.splits)
            || bytes > limit
        {
            return Err(GpuError::Shape(format!(
                "prefill attention: tile {t:?} at head_dim {hd} ({bytes} bytes of workgroup \
                 memory, device {limit})"
            )));
        }
        // The output is written as vec4s: 16-byte aligned.
        let AttnBindings {
            q: (qb, q_off),
            out: (ob, out_off),
            k: (kb, kc_off),
            v: (vb, vc_off),
        } = a.bind(ctx, 16)?;
        let need = Self::scratch_bytes(a, t);
        if scratch.size() < need {
            return Err(GpuError::Shape(format!(
                "prefill attention: scratch of {} bytes, needs {need}",
                scratch.size()
            )));
        }
        let n_tiles = n_tiles(a, t);
        // The (max, sum) rows follow the outputs' rows in the scratch.
        let ml_off = (a.n_kv_heads * n_tiles * t.splits * t.rows * (hd / 4)) as u32;
        let p = PrefillParams {
            n_heads: a.n_heads as u32,
            n_kv: a.n_kv_heads as u32,
            head_dim: hd as u32,
            n_tokens: a.n_tokens as u32,
            q_off,
            kc_off,
            vc_off,
            out_off,
            scale: a.scale,
            window: a.window.unwrap_or(0) as u32,
            n_tiles: n_tiles as u32,
            ml_off,
        };
        let part = Binding::whole(scratch);
        // Split tiles: on Vulkan the last unit of each tile merges them (counters, one per
        // tile, zeroed at creation and by each merge); elsewhere a merge pass follows.
        let fused = t.splits > 1 && ctx.fused_tails();
        let counters = ctx.storage_buffer(
            "prefill attention merge counters",
            match fused {
                true => 4 * (a.n_kv_heads * n_tiles) as u64,
                false => 16,
            },
        );
        let bufs = [
            Binding::whole(a.step),
            qb,
            kb,
            vb,
            ob,
            part,
            Binding::whole(&counters),
            part,
        ];
        let groups = [a.n_kv_heads, n_tiles, t.splits];
        let mut kc: Vec<(&'static str, f64)> = consts.to_vec();
        kc.push(("MERGE", fused as u8 as f64));
        let d = Dispatch::new(ctx, "attn_prefill", &kc, &p, &bufs, groups)?;
        let merge = match t.splits == 1 || fused {
            true => None,
            false => {
                // The merge reads only the tile geometry's constants.
                let mc: Vec<(&'static str, f64)> = consts
                    .iter()
                    .filter(|(k, _)| ["M", "SPLITS", "UNIT_KEYS"].contains(k))
                    .copied()
                    .collect();
                let bufs = [Binding::whole(a.step), part, ob];
                let groups = [a.n_kv_heads, n_tiles, 1];
                Some(Dispatch::new(
                    ctx,
                    "attn_prefill_merge",
                    &mc,
                    &p,
                    &bufs,
                    groups,
                )?)
            }
        };
        Ok(PrefillAttention {
            d,
            merge,
            tuning: t,
        })
    }

    pub fn tuning(&self) -> PrefillAttnTuning {
        self.tuning
    }
}
recordable!(PrefillAttention, "prefill attention", d, merge);
