//! The end of a forward pass, only where a token is generated or scored: final norm and LM head
//! on the last row (and argmax for greedy decoding), or on every row (log-probs); and the
//! read-back of what the caller asked for through one staging buffer created at load.

use super::acts::Acts;
use super::record::Recorder;
use super::weights::Weights;
use super::{gpu_err, LOGIT_ROWS};
use crate::error::EngineError;
use smoe_compute::gpu::{wgpu, Argmax, BufRef, GpuContext, MatVec, MatVecDesc, RmsNorm};

/// Final norm + LM head for one batch size: `last` (the batch's last row, then its argmax) and
/// `all` (every row).
pub(crate) struct Head {
    last: (RmsNorm, MatVec),
    argmax: Argmax,
    /// Batches of at most `LOGIT_ROWS` tokens (the logits buffer's rows).
    all: Option<(RmsNorm, MatVec)>,
}

impl Head {
    pub fn new(
        ctx: &GpuContext,
        w: &Weights,
        a: &Acts,
        eps: f32,
        n: usize,
    ) -> Result<Self, EngineError> {
        let (h, vocab) = (a.d.h, a.d.vocab);
        let (hn, logits) = (BufRef::new(&a.hn), BufRef::new(&a.logits));
        let norm = |x: BufRef, rows| RmsNorm::new(ctx, x, BufRef::new(&w.norm), hn, h, rows, eps);
        let lm = |n_tokens| {
            MatVec::new(
                ctx,
                &MatVecDesc::plain(w.lm_head.w(0), hn, logits, n_tokens),
            )
        };
        let last_row = BufRef::at(&a.x, 4 * ((n - 1) * h) as u64);
        Ok(Head {
            last: (norm(last_row, 1).map_err(gpu_err)?, lm(1).map_err(gpu_err)?),
            argmax: Argmax::new(ctx, logits, BufRef::new(&a.argmax), vocab, 1).map_err(gpu_err)?,
            all: match n <= LOGIT_ROWS {
                true => Some((
                    norm(BufRef::new(&a.x), n).map_err(gpu_err)?,
                    lm(n).map_err(gpu_err)?,
                )),
                false => None,
            },
        })
    }

    /// Logits of the last row into `logits[0]`; with `greedy` also its argmax into `argmax`.
    pub fn record_last(&self, r: &mut Recorder, greedy: bool) {
        r.step("final norm", &self.last.0);
        r.step("lm head", &self.last.1);
        if greedy {
            r.step("argmax", &self.argmax);
        }
    }

    /// Logits of every row into `logits`; the caller splits passes at `LOGIT_ROWS` tokens.
    pub fn record_all(&self, r: &mut Recorder) {
        let (norm, lm) = self
            .all
            .as_ref()
            .expect("passes with all logits ≤ LOGIT_ROWS");
        r.step("final norm", norm);
        r.step("lm head", lm);
    }
}

/// A mappable buffer for results, as large as the largest read (all logits of a batch).
pub(crate) struct Readback {
    staging: wgpu::Buffer,
}

impl Readback {
    pub fn new(ctx: &GpuContext, bytes: u64) -> Self {
        let staging = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes.max(16).next_multiple_of(16),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Readback { staging }
    }

    /// Records the copy of the first `bytes` of `src` (after the compute pass).
    pub fn copy(&self, enc: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, bytes: u64) {
        self.copy_at(enc, src, 0, bytes);
    }

    /// Records the copy of the first `bytes` of `src` to byte `at` (a multiple of 4).
    pub fn copy_at(&self, enc: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, at: u64, bytes: u64) {
        self.copy_from(enc, (src, 0), at, bytes);
    }

    /// Records the copy of `bytes` of `src` from its byte `from` to byte `at` (both multiples
    /// of 4).
    pub fn copy_from(
        &self,
        enc: &mut wgpu::CommandEncoder,
        (src, from): (&wgpu::Buffer, u64),
        at: u64,
        bytes: u64,
    ) {
        enc.copy_buffer_to_buffer(src, from, &self.staging, at, bytes.next_multiple_of(4));
    }

    /// Waits for the submission that copied (the latest one), and hands its first `bytes` to
    /// `f`.
    pub fn read<R>(
        &self,
        ctx: &GpuContext,
        bytes: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, EngineError> {
        self.read_after(ctx, None, bytes, f)
    }

    /// As `read`, waiting only for submission `copied` (later ones may still run).
    pub fn read_after<R>(
        &self,
        ctx: &GpuContext,
        copied: Option<wgpu::SubmissionIndex>,
        bytes: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, EngineError> {
        let slice = self.staging.slice(..bytes.next_multiple_of(4));
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let _ = ctx.device.poll(wgpu::PollType::Wait {
            submission_index: copied,
            timeout: None,
        });
        let fail = |e: String| EngineError::Backend(format!("GPU read-back failed: {e}"));
        rx.recv()
            .map_err(|e| fail(e.to_string()))?
            .map_err(|e| fail(e.to_string()))?;
        let r = {
            let view = slice.get_mapped_range().map_err(|e| fail(e.to_string()))?;
            f(&view[..bytes as usize])
        };
        self.staging.unmap();
        Ok(r)
    }
}

/// Little-endian f32s appended to `out`.
pub(crate) fn extend_f32(out: &mut Vec<f32>, bytes: &[u8]) {
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
}
