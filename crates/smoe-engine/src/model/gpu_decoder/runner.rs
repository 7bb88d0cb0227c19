//! The GPU executor's runner: a forward pass writes its inputs, replays the recorded dispatches
//! layer by layer (`gpu::LayerOps::record`), submits (every `SUBMIT_LAYERS` layers, at a
//! streaming pass's stops, or once for a greedy chain's pass) and reads back only what the caller
//! asked for. Expert residency attaches at the MoE layers' routes-known point only
//! (`streaming`, `through`).

use super::*;

pub(super) fn nanos(d: std::time::Duration) -> u64 {
    d.as_nanos() as u64
}

/// Adds the disk's idle time since `from` (a reading of `GpuDecoder::disk_idle`) to `to`.
pub(super) fn add_idle(to: &AtomicU64, from: f64, now: f64) {
    to.fetch_add(((now - from).max(0.0) * 1e9) as u64, Ordering::Relaxed);
}

/// Layers per submission on the resident path: the GPU starts on the first layers while the
/// host records the rest, and wgpu's per-dispatch validation and tracking at `finish`/`submit`
/// (≈ 1.5 ms per decoded token of Qwen3-30B-A3B in one submission, H200 host) overlaps GPU
/// work instead of preceding it. Greedy chains (`decode_greedy`) submit each pass whole
/// instead: there the host records a pass while the previous one runs, and fewer submissions
/// won (H200, 30B q4, tg128: 296.2 tok/s whole, 292.3 every 16 layers, 286.3 every 8, 273.2
/// every 4, 250.7 every 2).
pub(super) const SUBMIT_LAYERS: usize = 8;

/// Why recording stopped before the end of a pass.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Stop {
    /// The pass is recorded to its end.
    End,
    /// Resident: a submission ends after this many layers; the next starts at that layer.
    Layer(usize),
    /// Streaming: at this MoE layer's router, to read its choice and fill expert slots.
    Route(usize),
}

/// How a forward pass ends.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum End {
    Logits(Logits),
    Greedy,
}

/// Records the head a pass of this `end` needs (`last`: its last piece): all logits, the last
/// row's, or its argmax.
pub(super) fn record_head(head: &Head, r: &mut Recorder, end: End, last: bool) {
    match end {
        End::Logits(Logits::All) => head.record_all(r),
        End::Logits(Logits::Last) if last => head.record_last(r, false),
        End::Greedy if last => head.record_last(r, true),
        _ => {}
    }
}

impl GpuDecoder {
    /// As `Decoder::forward`: logits (`[rows, vocab]`) for the positions `want` asks for.
    pub fn forward(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Logits(want), &mut out)?;
        Ok(out)
    }

    /// Runs `tokens` and returns the most likely next token (ties to the lowest id, as
    /// `sampler::argmax`), chosen on the GPU: only its id is read back.
    pub fn forward_greedy(&self, kv: &mut SeqState, tokens: &[u32]) -> Result<u32, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Greedy, &mut out)?
            .ok_or_else(|| EngineError::Invalid("no tokens to run".into()))
    }

    /// Checks that `tokens` fit `kv` and the vocabulary, and that `kv` is this model's GPU
    /// cache (creating its GPU side at the first pass).
    pub(super) fn prepare(&self, kv: &mut SeqState, tokens: &[u32]) -> Result<(), EngineError> {
        let c = &self.cfg;
        kv.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        match &kv.gpu {
            Some(g) if g.owner == self.id => {}
            Some(_) => {
                return Err(EngineError::Backend(
                    "this KV cache belongs to another model".into(),
                ))
            }
            None if !kv.is_empty() => {
                return Err(EngineError::Backend(
                    "this KV cache holds CPU state; create sessions from the GPU model".into(),
                ))
            }
            None => kv.gpu = Some(Box::new(self.kv(kv.capacity())?)),
        }
        Ok(())
    }

    pub(super) fn run(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        end: End,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        self.prepare(kv, tokens)?;
        let gkv = kv.gpu.as_deref().expect("prepared");
        let mut rows = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        let idle_from = self.disk_idle();
        let mut host = std::time::Duration::ZERO;
        let mut prof = self.profiling.lock().unwrap_or_else(|e| e.into_inner());
        let mut greedy = None;
        let mut done = 0;
        while done < tokens.len() {
            let mut n = gpu::piece_len(tokens.len() - done);
            // Streaming: a batch on the GEMM path runs its experts in rounds when they do not
            // fit the slots (`fill_in_rounds`), so a prompt chunk reads each expert once; a
            // smaller batch's experts must fit at once.
            if let Some(st) = &self.streaming {
                if n < GEMM_MIN {
                    n = n.min(st.max_piece);
                }
            }
            if end == End::Logits(Logits::All) {
                n = n.min(LOGIT_ROWS);
            }
            let last = done + n == tokens.len();
            self.write_inputs(&mut rows, &tokens[done..done + n], kv.len() + done);
            let q = &self.ctx.queue;
            let (layers, head) = &self.batches[n.trailing_zeros() as usize];
            // Streaming decode: through the layers whose experts sit in VRAM (`through`).
            let through = (self.streaming.as_ref().filter(|_| prof.is_none()))
                .and_then(|st| Some((st, st.through.as_ref()?)))
                .and_then(|(st, th)| Some((st, th, th.maps(n)?)));
            if let Some((st, th, maps)) = through {
                let ops = (&layers[..], head);
                let id =
                    self.run_through(st, th, maps, gkv, ops, n, (end, last), &mut host, out)?;
                greedy = id.or(greedy);
                done += n;
                continue;
            }
            // Resident: the whole pass is one submission. Streaming: one per MoE layer, each
            // ending at the router (`stop`); the next resumes at the layer's expert dispatches.
            let mut first = true;
            // Records layers `from..` (`resume`: layer `from` resumes at its experts) up to the
            // next stop, with the head when the pass ends there.
            let mut record = |from: usize, resume: bool| {
                let recording = Instant::now();
                let mut enc = self.ctx.encoder();
                let stop;
                {
                    let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("forward"),
                        timestamp_writes: None,
                    });
                    let fine = prof.as_ref().is_some_and(|p| p.fine);
                    let ts = prof.as_mut().map(|p| &mut p.ts);
                    let mut r = Recorder::new(pass, ts, fine, first);
                    first = false;
                    stop = self.record_layers(&mut r, layers, gkv, n, from, resume, SUBMIT_LAYERS);
                    if stop == Stop::End {
                        record_head(head, &mut r, end, last);
                        r.end();
                    }
                }
                (enc, stop, recording.elapsed())
            };
            let mut next = record(0, false);
            let mut enc = loop {
                let (enc, stop, recorded) = next;
                host += recorded;
                match stop {
                    Stop::End => break enc,
                    Stop::Layer(from) => {
                        let submitting = Instant::now();
                        q.submit([enc.finish()]);
                        host += submitting.elapsed();
                        next = record(from, false);
                    }
                    Stop::Route(l) => {
                        let st =
                            (self.streaming.as_ref()).expect("routes stop only when streaming");
                        let resume = || record(l, true);
                        next = self.routes_known(st, enc, (l, n), layers, &mut host, resume)?;
                    }
                }
            };
            // The marks of every submission of this piece, resolved at once.
            if let Some(p) = prof.as_mut() {
                p.ts.resolve(&mut enc);
            }
            let bytes = self.copy_result(&mut enc, end, last, n);
            let submitting = Instant::now();
            q.submit([enc.finish()]);
            host += submitting.elapsed();
            greedy = self.read_result(end, bytes, out)?.or(greedy);
            if let Some(p) = prof.as_mut() {
                if bytes == 0 {
                    // Nothing was read back: wait for the GPU before reading the marks.
                    let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
                }
                p.collect(&self.ctx, host);
            }
            done += n;
        }
        if let Some(p) = prof.as_mut() {
            p.acc.wall_ns += started.elapsed().as_nanos() as f64;
            p.acc.passes += 1;
        }
        kv.advance(tokens.len());
        if let Some(st) = &self.streaming {
            self.experts.tick();
            st.pass_ns
                .fetch_add(nanos(started.elapsed()), Ordering::Relaxed);
            add_idle(&st.idle_pass_ns, idle_from, self.disk_idle());
        }
        Ok(greedy)
    }

    /// The store's disk-idle clock (`Experts::disk_idle_s`; 0 when the experts are resident).
    pub(super) fn disk_idle(&self) -> f64 {
        self.experts.disk_idle_s().unwrap_or(0.0)
    }

    /// Records the copy of what a pass of n tokens returns (`end`; `last`: its last piece) into
    /// the read-back buffer; returns its size (0: nothing).
    pub(super) fn copy_result(
        &self,
        enc: &mut wgpu::CommandEncoder,
        end: End,
        last: bool,
        n: usize,
    ) -> u64 {
        let vocab = self.cfg.vocab_size;
        let (src, bytes) = match end {
            End::Logits(Logits::All) => (&self.acts.logits, 4 * (n * vocab) as u64),
            End::Logits(Logits::Last) if last => (&self.acts.logits, 4 * vocab as u64),
            End::Greedy if last => (&self.acts.argmax, 4),
            _ => (&self.acts.logits, 0),
        };
        if bytes > 0 {
            self.readback.copy(enc, src, bytes);
        }
        bytes
    }

    /// After the submission that copied it (`copy_result`): the greedy id, or the logits
    /// appended to `out`.
    pub(super) fn read_result(
        &self,
        end: End,
        bytes: u64,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        if bytes == 0 {
            return Ok(None);
        }
        if end == End::Greedy {
            return Ok(Some(self.readback.read(&self.ctx, 4, |b| {
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            })?));
        }
        self.readback
            .read(&self.ctx, bytes, |b| gpu::extend_f32(out, b))?;
        Ok(None)
    }

    /// Records layers `from..` of a batch of n tokens until the pass's end, a submission
    /// boundary (every `submit_every` layers) or, streaming, an MoE layer's router. `resume`: layer `from`
    /// stopped at its router and continues at its experts.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_layers(
        &self,
        r: &mut Recorder,
        layers: &[LayerOps],
        gkv: &GpuKv,
        n: usize,
        from: usize,
        mut resume: bool,
        submit_every: usize,
    ) -> Stop {
        for (l, ops) in layers.iter().enumerate().skip(from) {
            if resume {
                resume = false;
                ops.experts().iter().for_each(|op| op.record(r));
            } else {
                let at_routes = match self.streaming {
                    Some(_) => AtRoutes::Stop {
                        lookahead: &ops.lookahead,
                    },
                    None => AtRoutes::Run,
                };
                if !ops.record(r, gkv, (n, l), at_routes) {
                    return Stop::Route(l);
                }
            }
            if (l + 1) % submit_every == 0 && l + 1 < layers.len() {
                return Stop::Layer(l + 1);
            }
        }
        Stop::End
    }

    /// Greedy decoding one pass ahead of the host. Feeds `first` (the token just chosen), then
    /// each token the GPU chooses: pass i + 1 gathers its input from pass i's argmax on the GPU
    /// and is queued before the host reads pass i's id, so wgpu's recording and submission of
    /// a pass (≈ 1.8 ms per token on an H200 for Qwen3-30B-A3B shapes) overlap the previous
    /// pass instead of leaving the GPU idle. `on_token` receives each chosen id in order and
    /// says whether to go on; at most `max_tokens` ids are produced, and `kv` advances by one
    /// position per id produced (a pass queued ahead of a `false` is discarded: it wrote only
    /// the KV position past the sequence's end). Returns the ids fed, in order.
    ///
    /// `None` (nothing run) where a chain cannot run: streaming (the host fills expert slots
    /// at every router), an embedding not on the GPU, or while profiling.
    pub fn decode_greedy(
        &self,
        kv: &mut SeqState,
        first: u32,
        max_tokens: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool, EngineError>,
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let profiling = self.profiling.lock().unwrap_or_else(|e| e.into_inner());
        // A pass queued ahead of the host's `false` writes one position past the sequence's
        // end, which `SeqState::rewind` forgets only where every layer's state is truncatable.
        let chain = (self.chain()).filter(|_| profiling.is_none() && kv.truncatable());
        drop(profiling);
        let Some(chain) = chain else {
            return Ok(None);
        };
        let mut fed = vec![];
        if max_tokens == 0 || kv.check_room(1).is_err() {
            return Ok(Some(fed));
        }
        // The checks and KV cache set-up of a normal pass, with the first token.
        self.prepare(kv, &[first])?;
        // (Out of the state while the chain runs, so the state can count the positions.)
        let gpu = kv.gpu.take().expect("prepared");
        let (start, capacity) = (kv.len(), kv.capacity());
        let mut produced = 0;
        let mut chain_run = || -> Result<(), EngineError> {
            let gkv = &*gpu;
            let mut rows = self.running.lock().unwrap_or_else(|e| e.into_inner());
            let mut queued = std::collections::VecDeque::new();
            self.write_inputs(&mut rows, &[first], start);
            queued.push_back(self.chain_pass(chain, gkv, true, 0)?);
            fed.push(first);
            while let Some(idx) = queued.pop_front() {
                // Queue the next pass (its input is this one's argmax) unless the budget or the
                // cache says this pass is the last.
                let ahead = produced + 1 < max_tokens && start + fed.len() < capacity;
                if ahead {
                    let pass = fed.len();
                    self.ctx.write_step(&self.step, (start + pass) as u32);
                    queued.push_back(self.chain_pass(chain, gkv, false, pass % 2)?);
                }
                let id = chain.ids[produced % 2].read_after(&self.ctx, Some(idx), 4, |b| {
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                })?;
                produced += 1;
                if !on_token(id)? {
                    break;
                }
                if ahead {
                    fed.push(id);
                }
            }
            Ok(())
        };
        let ran = chain_run();
        kv.gpu = Some(gpu);
        kv.advance(produced);
        ran?;
        Ok(Some(fed))
    }

    /// Writes the embedding rows of `tokens` (dequantized on the host into `rows`) as a pass's
    /// input, and its first position.
    pub(super) fn write_inputs(&self, rows: &mut Vec<f32>, tokens: &[u32], pos: usize) {
        let (h, embed) = (self.cfg.hidden_size, mat(&self.embed));
        rows.resize(tokens.len() * h, 0.0);
        for (row, &id) in rows.chunks_exact_mut(h).zip(tokens) {
            smoe_vault::quant::dequantize_row(embed.dtype, embed.row(id as usize), row);
        }
        self.ctx
            .queue
            .write_buffer(&self.acts.x, 0, bytemuck::cast_slice(&rows[..]));
        self.ctx.write_step(&self.step, pos as u32);
    }

    /// One single-token pass of a greedy chain, as one submission (the position is written):
    /// its input was written by the host (`from_host`), or is gathered on the GPU from the
    /// previous pass's argmax; its own argmax is copied into `chain.ids[slot]`.
    pub(super) fn chain_pass(
        &self,
        chain: &Chain,
        gkv: &GpuKv,
        from_host: bool,
        slot: usize,
    ) -> Result<wgpu::SubmissionIndex, EngineError> {
        let (layers, head) = &self.batches[0];
        let mut enc = self.ctx.encoder();
        {
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            let mut r = Recorder::new(pass, None, false, false);
            if !from_host {
                r.step("embedding", &chain.gather);
            }
            // Whole: no submission boundaries, and no router stops (chains are resident).
            let stop = self.record_layers(&mut r, layers, gkv, 1, 0, false, usize::MAX);
            if stop != Stop::End {
                return Err(EngineError::Backend(
                    "GPU: a greedy chain's pass stopped before its end".into(),
                ));
            }
            head.record_last(&mut r, true);
        }
        chain.ids[slot].copy(&mut enc, &self.acts.argmax, 4);
        Ok(self.ctx.queue.submit([enc.finish()]))
    }
}
