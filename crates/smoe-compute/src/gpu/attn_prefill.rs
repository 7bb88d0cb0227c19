//! Prefill attention (`kernels/attn_prefill.wgsl`): causal GQA attention for a chunk of many
//! query tokens, flash-attention style: a workgroup per kv head and tile of (query, head) rows
//! walks 32-key tiles of the cache (staged once for the GQA group) with an online softmax. Same
//! descriptor and contract as `DecodeAttention` (`AttnDesc`; `pos0` from the step uniform).

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
    /// Head dimensions per step of the scores: 16 or 32 (half the barriers, more workgroup
    /// memory).
    pub dims: usize,
}

/// Keys per tile of the kernel (its `BK`).
const PREFILL_BK: usize = 32;

/// The override constants of a tile shape at `head_dim` on a device with `limit` bytes of
/// workgroup memory, and the bytes they use (over `limit` when the tile does not fit).
fn prefill_consts(
    t: PrefillAttnTuning,
    head_dim: usize,
    limit: u64,
) -> ([(&'static str, f64); 5], u64) {
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
        let wide = PrefillAttnTuning { rows: 64, dims: 32 };
        let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
        if head_dim % 32 == 0 && prefill_consts(wide, head_dim, limit).1 <= limit {
            wide
        } else {
            PrefillAttnTuning { rows: 64, dims: 16 }
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
    _pad: u32,
}

/// Attention of a prefill chunk: the same work as [`DecodeAttention`] on the same descriptor,
/// but each workgroup takes a block of queries (tokens × the heads of one GQA group) through
/// the keys together, so every K/V row is read once per block instead of once per query.
/// `q` and `out` offsets must be multiples of 16 bytes.
pub struct PrefillAttention {
    d: Dispatch,
    tuning: PrefillAttnTuning,
}

impl PrefillAttention {
    pub fn new(ctx: &GpuContext, a: &AttnDesc) -> Result<Self, GpuError> {
        Self::with_tuning(ctx, a, PrefillAttnTuning::pick(ctx, a.head_dim))
    }

    pub fn with_tuning(
        ctx: &GpuContext,
        a: &AttnDesc,
        t: PrefillAttnTuning,
    ) -> Result<Self, GpuError> {
        let hd = a.head_dim;
        if hd == 0
            || hd % 4 != 0
            || hd > PREFILL_MAX_HEAD_DIM
            || a.n_kv_heads == 0
            || a.n_heads % a.n_kv_heads != 0
        {
            return Err(GpuError::Shape(format!(
                "prefill attention: head_dim {hd} (multiple of 4, at most \
                 {PREFILL_MAX_HEAD_DIM}), {} heads over {} kv heads",
                a.n_heads, a.n_kv_heads
            )));
        }
        let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
        let (consts, bytes) = prefill_consts(t, hd, limit);
        if ![32, 64, 128].contains(&t.rows) || ![16, 32].contains(&t.dims) || bytes > limit {
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
        let n_tiles = (a.n_tokens * (a.n_heads / a.n_kv_heads)).div_ceil(t.rows);
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
            _pad: 0,
        };
        let bufs = [Binding::whole(a.step), qb, kb, vb, ob];
        let groups = [a.n_kv_heads, n_tiles, 1];
        let d = Dispatch::new(ctx, "attn_prefill", &consts, &p, &bufs, groups)?;
        Ok(PrefillAttention { d, tuning: t })
    }

    pub fn tuning(&self) -> PrefillAttnTuning {
        self.tuning
    }
}
recordable!(PrefillAttention, "prefill attention", d);
