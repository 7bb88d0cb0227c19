//! Activation buffers, created once at load for the largest batch (`T_MAX` tokens) and reused by
//! every layer and every batch size. Each holds rows `[token][width]` from offset 0; the dispatches
//! of one forward pass run in order (wgpu places barriers between them), so a buffer is reused as
//! soon as its consumer has run. Two operands of one dispatch are always different buffers (a
//! written binding may not alias another binding).

use super::{LOGIT_ROWS, T_MAX};
use smoe_compute::gpu::{wgpu, BufRef, GpuContext};
use smoe_vault::ModelConfig;

/// The widths a forward pass needs, from the config.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub h: usize,
    pub qw: usize,
    pub kw: usize,
    pub k: usize,
    pub vocab: usize,
}

impl Dims {
    pub fn of(c: &ModelConfig) -> Self {
        Dims {
            h: c.hidden_size,
            qw: c.num_heads * c.head_dim,
            kw: c.num_kv_heads * c.head_dim,
            k: c.num_experts_per_tok.max(1),
            vocab: c.vocab_size,
        }
    }
}

pub(crate) struct Acts {
    pub d: Dims,
    /// The residual stream.
    pub x: wgpu::Buffer,
    /// The normed residual: input of attention, FFN and LM head.
    pub hn: wgpu::Buffer,
    /// Projections: q `[n][qw]` at 0, k `[n][kw]` after all q, v after all k. For one token this
    /// is exactly `[q | k | v]`, the output of one fused matvec.
    pub qkv: wgpu::Buffer,
    /// q then k after a separate norm (whole-projection qk-norm, or qk-norm before clip_qkv).
    pub qkn: wgpu::Buffer,
    /// Attention output `[n][qw]`.
    pub attn: wgpu::Buffer,
    /// A projection back to the hidden width (o, dense or shared down) before it is added to x.
    pub tmp: wgpu::Buffer,
    /// Router logits `[n][experts]`, chosen ids and weights `[n][k]`.
    pub rlog: wgpu::Buffer,
    pub ids: wgpu::Buffer,
    pub rw: wgpu::Buffer,
    /// Streaming lookahead: the next MoE layers' routers on this layer's input — their logits,
    /// chosen ids and weights (unused), each shaped as `rlog`, `ids` and `rw`: the j-th next
    /// MoE layer's at row `j · T_MAX` (j < `AHEAD_MAX`).
    pub ahead: [wgpu::Buffer; 3],
    /// silu(gate)·up: `[n][k][moe_inter]` for experts, `[n][inter]` for a dense or shared MLP.
    pub gu: wgpu::Buffer,
    /// Expert outputs `[n][k][h]` (batches; a single token's are summed inside its down matvec).
    pub eo: wgpu::Buffer,
    /// `T_MAX` ones: the weights of a plain residual add (`WeightedSum` with k = 1).
    pub ones: wgpu::Buffer,
    /// The shared expert's gate, one value per token.
    pub sg: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    /// The greedy token id (u32).
    pub argmax: wgpu::Buffer,
}

/// The most MoE layers a streaming lookahead predicts (`Acts::ahead`).
pub const AHEAD_MAX: usize = crate::store::LOOKAHEAD_MAX;

impl Acts {
    pub fn new(ctx: &GpuContext, c: &ModelConfig) -> Self {
        let d = Dims::of(c);
        let t = T_MAX;
        let f = |label: &str, n: usize| ctx.storage_buffer(label, 4 * n.max(1) as u64);
        let inter = (d.k * c.moe_intermediate_size)
            .max(c.intermediate_size)
            .max(c.shared_expert_intermediate_size);
        Acts {
            x: f("x", t * d.h),
            hn: f("hn", t * d.h),
            qkv: f("qkv", t * (d.qw + 2 * d.kw)),
            qkn: f("qkn", t * (d.qw + d.kw)),
            attn: f("attn", t * d.qw),
            tmp: f("tmp", t * d.h),
            rlog: f("router logits", t * c.num_experts),
            ids: f("expert ids", t * d.k),
            rw: f("expert weights", t * d.k),
            ahead: [
                f("lookahead logits", AHEAD_MAX * t * c.num_experts),
                f("lookahead ids", AHEAD_MAX * t * d.k),
                f("lookahead weights", AHEAD_MAX * t * d.k),
            ],
            gu: f("gate_up", t * inter),
            sg: f("shared gate", t),
            eo: f("expert outputs", t * d.k * d.h),
            ones: ctx.upload_f32("ones", &[1.0; T_MAX]),
            logits: f("logits", LOGIT_ROWS * d.vocab),
            argmax: f("argmax", 1),
            d,
        }
    }

    /// Where q, k and v of an n-token batch sit in `qkv`.
    pub fn q(&self, _n: usize) -> BufRef<'_> {
        BufRef::new(&self.qkv)
    }
    pub fn k(&self, n: usize) -> BufRef<'_> {
        BufRef::at(&self.qkv, 4 * (n * self.d.qw) as u64)
    }
    pub fn v(&self, n: usize) -> BufRef<'_> {
        BufRef::at(&self.qkv, 4 * (n * (self.d.qw + self.d.kw)) as u64)
    }
    /// q and k after a separate norm, in `qkn`.
    pub fn qn(&self, _n: usize) -> BufRef<'_> {
        BufRef::new(&self.qkn)
    }
    pub fn kn(&self, n: usize) -> BufRef<'_> {
        BufRef::at(&self.qkn, 4 * (n * self.d.qw) as u64)
    }
}
