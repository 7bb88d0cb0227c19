//! Building the GPU executor: the store and the VRAM expert slots it streams into (or every
//! expert resident), the weights lowered from the model description, the activations, and every
//! batch size's recorded dispatches.

use super::*;

impl GpuDecoder {
    /// Streaming: at most `slot_cap` expert slots per MoE layer (a retry after the budget's did
    /// not fit), within `room` bytes of free GPU memory where known (`vram::room`).
    pub(super) fn build(
        ctx: &Arc<GpuContext>,
        vault: &Vault,
        cfg: ModelConfig,
        store: &StoreOptions,
        (slot_cap, room): (Option<usize>, Option<u64>),
    ) -> Result<Self, EngineError> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let spec = crate::spec::families::describe(&cfg);
        let rope = RopeTable::new(&cfg.rope, cfg.head_dim);
        // On unified memory a host cache beside mapped slots would hold the same experts in
        // the same RAM twice: there disk reads land in the slots themselves (`SlotWriter::
        // target`), the slots take the whole budget, and the store keeps no cache of its own
        // (only what a smaller --vram-cache leaves of --expert-cache).
        let unified = matches!(
            ctx.info().adapter.device_type,
            wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
        );
        let mappable = ctx
            .info()
            .features
            .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let lands = unified && mappable && store.tuning.mapped_slots;
        let budget = store.budget.bytes(vault);
        // The VRAM slots' budget: `--vram-cache`, else the host's (`--expert-cache`).
        // (`load` streams a resident host where a VRAM budget is given.)
        let vram_budget = match vram::given(store) {
            None => budget,
            Some(v) => budget.and(v.bytes(vault).or(Some(u64::MAX))),
        };
        let mut experts = match budget {
            None => {
                let no_profile = StoreOptions {
                    profile: false,
                    ..StoreOptions::default()
                };
                Experts::open(vault, &no_profile)?
            }
            Some(b) => Experts::open(
                vault,
                &StoreOptions {
                    // (Unified memory: what the slots leave of the budget, none unless
                    // --vram-cache took less than --expert-cache.)
                    budget: CacheBudget::Bytes(match lands {
                        true => b.saturating_sub(vram_budget.unwrap_or(b)),
                        false => b,
                    }),
                    ..store.clone()
                },
            )?,
        };
        let k = cfg.num_experts_per_tok.max(1);
        let mut streaming = match (vram_budget, vault.expert_section()) {
            (Some(budget), Some(sec)) if experts.is_streaming() => {
                let moe = cfg.moe_layers().count().max(1) as u64;
                let by_budget = budget / (sec.blob_stride * moe).max(1);
                let slots = (by_budget.min(cfg.num_experts as u64) as usize)
                    .min(slot_cap.unwrap_or(usize::MAX))
                    .max(k)
                    .min(cfg.num_experts);
                let slots = vram::fit_slots(store, room, (slots, k, sec.blob_stride * moe));
                let fit = (slots / k).clamp(1, T_MAX);
                let max_piece = 1 << (usize::BITS - 1 - fit.leading_zeros());
                tracing::info!(
                    "GPU backend: streaming experts, {slots} of {} slots per MoE layer in VRAM; batches of {GEMM_MIN}+ tokens run their experts in rounds of ≤ {slots}, smaller ones ≤ {max_piece} tokens",
                    cfg.num_experts
                );
                Some(Streaming::new(ctx, &cfg, slots, max_piece))
            }
            _ => None,
        };
        // The decode waits for reads with the GPU idle: keep its clock up meanwhile. Before the
        // uploads: the context's VRAM (527 MiB on the H200) is then taken before wgpu allocates
        // the weights and slots, so a card it leaves too small fails the load, not a request.
        if let Some(st) = &mut streaming {
            st.clocks = match ClockHold::acquire(ctx.info()) {
                Ok(hold) => {
                    tracing::info!("GPU backend: clocks held up by a CUDA context while streaming");
                    Some(hold)
                }
                // Worth a line only where it was tried (an NVIDIA GPU).
                Err(why) if ClockHold::applies(ctx.info()).is_ok() => {
                    tracing::info!("GPU backend: clocks left to the driver ({why}); the decode may run at its idle clock");
                    None
                }
                Err(why) => {
                    tracing::debug!("GPU backend: clocks not held ({why})");
                    None
                }
            };
        }
        let weights = Weights::upload(
            ctx,
            vault,
            (&spec, &rope),
            streaming.as_ref().map(|s| SlotPlan {
                slots: s.slots,
                mapped: store.tuning.mapped_slots,
                vram_limit: store.vram_limit,
            }),
        )?;
        if let Some(st) = &mut streaming {
            let mapped =
                (cfg.moe_layers()).all(|l| weights.expert_slots(l).is_some_and(|s| s.mappable));
            st.mapped = mapped;
            st.lands = mapped && lands;
            if lands && !mapped {
                // The slots could not be mapped after all: give the store its cache back.
                experts = Experts::open(vault, store)?;
            }
            tracing::info!(
                "GPU backend: expert slots filled {}",
                match (mapped, st.lands) {
                    (true, true) => "by disk reads landing in them (unified memory: no host cache)",
                    (true, false) =>
                        "by the host through a mapping (one copy per blob, no staging)",
                    (false, _) => "through wgpu's staging memory (write_buffer, then a GPU copy)",
                }
            );
        }
        let acts = Acts::new(ctx, &cfg);
        if let Some(st) = &mut streaming {
            // Speculative passes read guesses into host buffers: on unified memory, where misses
            // land in their slots, that would add a copy, so there they are off by default.
            let depth = match store.tuning.speculate {
                Some(d) => d,
                None if st.lands => 0,
                None => through::SPEC_DEPTH,
            };
            // A speculative pass runs later layers at the current position before the real
            // pass does and leaves their state written there: harmless for KV (the real pass
            // rewrites the same position), not for a state every position folds into.
            let positional = spec.states().iter().all(|s| s.truncatable());
            let depth = if positional { depth } else { 0 };
            let oracle = (store.tuning.route_oracle.as_ref()).map(|o| o.0.clone());
            // Replaying a trace, the oracle's guesses replace the decoder's own.
            let depth = match &oracle {
                Some(o) if o.replays() => 0,
                _ => depth,
            };
            st.lookahead = store.lookahead()?;
            let (piece, lookahead) = (st.max_piece, st.lookahead);
            st.through = Some(Through::new(
                ctx,
                &cfg,
                &acts,
                piece,
                depth,
                lookahead,
                oracle,
                &store.tuning,
            )?);
        }
        let chain = match weights.embedding(cfg.tie_word_embeddings) {
            Some(e) => {
                let (ids, x) = (BufRef::new(&acts.argmax), BufRef::new(&acts.x));
                match EmbedGather::new(ctx, &e, ids, x, 1) {
                    Ok(gather) => Some(Chain {
                        gather,
                        ids: [Readback::new(ctx, 4), Readback::new(ctx, 4)],
                    }),
                    Err(e) => {
                        tracing::debug!("GPU: no greedy chains: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let eps = spec.eps;
        let mut batches = vec![];
        // Streaming: each MoE layer also predicts the next MoE layers' experts (lookahead).
        let depth = streaming.as_ref().map_or(0, |st| st.lookahead.depth);
        let next_routers = |l: usize| -> Vec<&gpu::Packed> {
            (weights.layers[l + 1..].iter())
                .filter_map(|w| match &w.ffn {
                    FfnW::Moe { router, .. } => Some(router),
                    FfnW::Dense(_) => None,
                })
                .take(depth)
                .collect()
        };
        for n in gpu::batch_sizes() {
            let fused_router = store.tuning.fused_router;
            let layers = (spec.layers.iter().zip(&weights.layers).enumerate())
                .map(|(l, lw)| {
                    LayerOps::new(ctx, lw, &acts, eps, n, &next_routers(l), fused_router)
                })
                .collect::<Result<Vec<_>, _>>()?;
            batches.push((layers, Head::new(ctx, &weights, &acts, eps, n)?));
        }
        Ok(GpuDecoder {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            spec,
            embed: vault.tensor("model.embed_tokens.weight")?,
            step: ctx.step_buffer(),
            rope_scale: rope.scale(),
            readback: Readback::new(ctx, 4 * (LOGIT_ROWS * cfg.vocab_size) as u64),
            running: Mutex::new(Vec::with_capacity(T_MAX * cfg.hidden_size)),
            experts,
            streaming,
            profiling: Mutex::new(None),
            chain,
            kv_pool: Arc::default(),
            ctx: ctx.clone(),
            weights,
            acts,
            batches,
            cfg,
        })
    }
}
