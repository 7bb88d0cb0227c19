//! What `gpu::bench` measures: a `BenchShape` per matrix product or attention step, and the
//! model shapes the reports use (Qwen3-MoE 30B-A3B and 235B-A22B, decode and prefill), so that
//! the CLI, the example and the sweep all measure the same list.

/// One matrix shape to measure; `experts > 0` measures a grouped, gated (gate_up) dispatch of
/// that many experts picked from a stack of `stack` experts, `rows` being gate + up rows.
///
/// Prefill shapes (`tokens > 0`) multiply a chunk of `tokens` tokens: dense, or with
/// `experts > 0` through a layer of `stack` experts with top-`experts` routing
/// (`tokens·experts` slots); there `rows` are output rows and `gated` adds the up matrix.
#[derive(Clone, Debug)]
pub struct BenchShape {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    pub stack: usize,
    pub tokens: usize,
    pub gated: bool,
    /// Decode shapes with `experts > 0`: the down projection instead of gate_up, as the engine
    /// runs it: each slot's `rows` outputs from its own input, then (in the last workgroup of
    /// each row block, `Fuse::sum_into`, where the adapter fuses tails) the token's slots
    /// summed with router weights into a residual.
    pub down: bool,
    /// Causal attention of the chunk instead of a projection (`rows`, `cols` unused).
    pub attention: Option<AttnBench>,
    /// Decode shapes: work fused into the product as the engine's decode layer fuses it.
    pub fused: DecodeFusion,
}

/// What a decode row fuses into its matvec (`Fuse`), as the engine's decode layer does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeFusion {
    #[default]
    None,
    /// The input's RMSNorm (the stacked q, k and v projection).
    Norm,
    /// The router: RMSNorm, the normed input written out for the experts, and the softmax
    /// top-`k` in the last workgroup (where the adapter fuses tails).
    Route { k: usize },
}

/// An attention measurement: a chunk of `BenchShape::tokens` queries at positions `pos0..`
/// over f32 caches holding positions `0..pos0 + tokens`.
#[derive(Clone, Copy, Debug)]
pub struct AttnBench {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub pos0: usize,
    pub window: Option<usize>,
    /// One decoded token with the QK-norm, RoPE and KV append fused in
    /// (`DecodeAttention::with_rope`), as the engine decodes; `pos0` is its position.
    pub rope: bool,
    /// Positions the caches hold (what sets the decode kernel's context splits); at least
    /// `pos0 + tokens`.
    pub capacity: usize,
}

impl BenchShape {
    pub fn dense(name: &str, rows: usize, cols: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts: 0,
            stack: 0,
            tokens: 0,
            gated: false,
            down: false,
            attention: None,
            fused: DecodeFusion::None,
        }
    }
    /// A decode product with `fused` work (`DecodeFusion`).
    pub fn dense_fused(name: &str, rows: usize, cols: usize, fused: DecodeFusion) -> Self {
        BenchShape {
            fused,
            ..Self::dense(name, rows, cols)
        }
    }
    pub fn experts(name: &str, rows: usize, cols: usize, experts: usize, stack: usize) -> Self {
        BenchShape {
            name: name.into(),
            rows,
            cols,
            experts,
            stack,
            tokens: 0,
            gated: false,
            down: false,
            attention: None,
            fused: DecodeFusion::None,
        }
    }
    /// The experts' down projection of one token: `experts` of `stack` experts, each its own
    /// `rows` outputs, summed with router weights into a residual (`BenchShape::down`).
    pub fn experts_down(
        name: &str,
        rows: usize,
        cols: usize,
        experts: usize,
        stack: usize,
    ) -> Self {
        BenchShape {
            down: true,
            ..Self::experts(name, rows, cols, experts, stack)
        }
    }
    /// A dense projection of `tokens` tokens at once.
    pub fn prefill(name: &str, rows: usize, cols: usize, tokens: usize) -> Self {
        BenchShape {
            tokens,
            ..Self::dense(name, rows, cols)
        }
    }
    /// A layer's experts for `tokens` tokens, each routed to `top_k` of `n_experts`; `rows`
    /// output rows per expert (gated: of gate and of up each).
    pub fn prefill_experts(
        name: &str,
        rows: usize,
        cols: usize,
        tokens: usize,
        top_k: usize,
        n_experts: usize,
        gated: bool,
    ) -> Self {
        BenchShape {
            tokens,
            gated,
            ..Self::experts(name, rows, cols, top_k, n_experts)
        }
    }
    /// Causal attention of a `tokens`-token chunk at `pos0` (no window).
    pub fn prefill_attention(
        name: &str,
        tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        pos0: usize,
    ) -> Self {
        BenchShape {
            tokens,
            attention: Some(AttnBench {
                n_heads,
                n_kv_heads,
                head_dim,
                pos0,
                window: None,
                rope: false,
                capacity: pos0 + tokens,
            }),
            ..Self::dense(name, 0, 0)
        }
    }
    /// One decoded token's attention at position `pos` (a context of `pos + 1`) in caches of
    /// `capacity` positions, with the QK-norm, RoPE and KV append fused in, as the engine
    /// decodes.
    pub fn decode_attention(
        name: &str,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        pos: usize,
        capacity: usize,
    ) -> Self {
        BenchShape {
            tokens: 1,
            attention: Some(AttnBench {
                n_heads,
                n_kv_heads,
                head_dim,
                pos0: pos,
                window: None,
                rope: true,
                capacity: capacity.max(pos + 1),
            }),
            ..Self::dense(name, 0, 0)
        }
    }
    /// Multiply-adds ×2 of one call (prefill shapes); attention: of q·k and p·v over the keys
    /// each query sees.
    pub fn flops(&self) -> u64 {
        if let Some(a) = self.attention {
            let keys: usize = (0..self.tokens)
                .map(|t| (a.pos0 + t + 1).min(a.window.unwrap_or(usize::MAX)))
                .sum();
            return 4 * (a.head_dim * a.n_heads * keys) as u64;
        }
        let slots = self.tokens * self.experts.max(1);
        2 * (self.rows * self.cols * slots) as u64 * (1 + self.gated as u64)
    }
}

/// Qwen3-30B-A3B (hidden 2048, 32×128 q heads, moe_intermediate 768) and Qwen3-235B-A22B
/// (hidden 4096, 64×128 q heads, moe_intermediate 1536) shapes. Expert stacks hold 32 experts
/// (of 128) so that a bf16 stack fits one storage binding; rotation keeps them out of cache.
pub fn qwen3_shapes() -> Vec<BenchShape> {
    vec![
        BenchShape::dense("30B lm_head", 151_936, 2048),
        BenchShape::dense("30B q_proj", 4096, 2048),
        BenchShape::dense("30B o_proj", 2048, 4096),
        // The decode layer's other steps as the engine fuses them: q, k and v stacked with the
        // RMSNorm, the router with its norm and top-k, the attention with its RoPE.
        BenchShape::dense_fused("30B qkv norm", 5120, 2048, DecodeFusion::Norm),
        BenchShape::dense_fused("30B router", 128, 2048, DecodeFusion::Route { k: 8 }),
        // `bench decode`'s sessions hold just their tokens; the server's hold 4,096 positions.
        BenchShape::decode_attention("30B attn dec @63", 32, 4, 128, 63, 129),
        BenchShape::decode_attention("30B attn dec @63 c4096", 32, 4, 128, 63, 4096),
        BenchShape::decode_attention("30B attn dec @1023 c4096", 32, 4, 128, 1023, 4096),
        BenchShape::decode_attention("30B attn dec @4000 c4096", 32, 4, 128, 4000, 4096),
        BenchShape::experts("30B gate_up x8", 1536, 2048, 8, 32),
        BenchShape::experts_down("30B down x8", 2048, 768, 8, 32),
        BenchShape::dense("235B lm_head", 151_936, 4096),
        BenchShape::dense("235B q_proj", 8192, 4096),
        BenchShape::experts("235B gate_up x8", 3072, 4096, 8, 32),
        BenchShape::experts_down("235B down x8", 4096, 1536, 8, 32),
    ]
    .into_iter()
    .chain(qwen3_prefill_shapes())
    .collect()
}

/// Qwen3-30B-A3B prefill of a 512-token chunk: q_proj, q/k/v stacked, and the 128 experts'
/// gate_up and down with top-8 routing (4096 slots, ≈ 32 per expert).
pub fn qwen3_prefill_shapes() -> Vec<BenchShape> {
    vec![
        BenchShape::prefill("30B q_proj pf512", 4096, 2048, 512),
        // q, k and v stacked, as the engine's prefill runs them (one GEMM).
        BenchShape::prefill("30B qkv pf512", 5120, 2048, 512),
        BenchShape::prefill_experts("30B gate_up pf512", 768, 2048, 512, 8, 128, true),
        // Zipf-skewed routing (expert rank r gets weight 1/(r+1)): real routers are skewed, and
        // a popular expert's token tiles must spread over the GPU.
        BenchShape::prefill_experts("30B gate_up pf512 zipf", 768, 2048, 512, 8, 128, true),
        BenchShape::prefill_experts("30B down pf512", 2048, 768, 512, 8, 128, false),
        // Attention of the chunk: the first one of a prompt, and one 3.5k tokens in.
        BenchShape::prefill_attention("30B attn pf512", 512, 32, 4, 128, 0),
        BenchShape::prefill_attention("30B attn pf512 @3584", 512, 32, 4, 128, 3584),
    ]
}
