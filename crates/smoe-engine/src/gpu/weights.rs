//! The model in GPU memory, uploaded once at load. Matrices keep their vault bytes (the kernels
//! decode bf16/q8/q4/q2 themselves); vectors (norms, biases) become f32. Matrices that one kernel
//! reads together are placed back to back in one buffer: q, k and v (one matvec when the batch
//! is one token), gate and up (the fused gate_up). Each MoE layer's expert blobs sit in one
//! buffer at the vault's blob stride, so a grouped matvec picks experts by the router's ids.

use crate::error::EngineError;
use crate::rope::RopeTable;
use crate::spec::{self, Ffn, LayerSpec, Mixer, ModelSpec};
use smoe_compute::gpu::{wgpu, GpuContext, WeightRef};
use smoe_vault::format::ExpertPart;
use smoe_vault::tensors::Tensor;
use smoe_vault::{DType, TensorData, Vault};

/// A matrix `[rows, cols]` at `offset` of `buf`.
#[derive(Clone, Copy)]
pub(crate) struct MatAt {
    pub offset: u64,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl MatAt {
    fn bytes(&self) -> u64 {
        (self.rows * self.dtype.row_stride(self.cols)) as u64
    }
    pub fn on<'a>(&self, buf: &'a wgpu::Buffer) -> WeightRef<'a> {
        WeightRef {
            buffer: buf,
            offset: self.offset,
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// Matrices back to back in one buffer.
pub(crate) struct Packed {
    pub buf: wgpu::Buffer,
    pub mats: Vec<MatAt>,
}

impl Packed {
    pub fn w(&self, i: usize) -> WeightRef<'_> {
        self.mats[i].on(&self.buf)
    }
    /// All matrices as one (same dtype and width): rows concatenated.
    pub fn fused(&self) -> Option<WeightRef<'_>> {
        let m0 = self.mats[0];
        let same = self
            .mats
            .iter()
            .all(|m| m.dtype == m0.dtype && m.cols == m0.cols);
        same.then(|| {
            let rows = self.mats.iter().map(|m| m.rows).sum();
            MatAt { rows, ..m0 }.on(&self.buf)
        })
    }
}

/// A SwiGLU MLP: `gate_up` holds gate then up (one gated matvec), then down.
pub(crate) struct Mlp {
    pub gate_up: Packed,
    pub down: Packed,
}

impl Mlp {
    /// Byte distance from gate to up.
    pub fn up_offset(&self) -> u64 {
        self.gate_up.mats[1].offset
    }
}

/// One MoE layer's routed experts: blob `e` at `e * stride`, parts as in the vault.
pub(crate) struct ExpertStack {
    pub buf: wgpu::Buffer,
    pub gate: MatAt,
    pub up_offset: u64,
    pub down: MatAt,
    pub stride: u64,
    /// Experts of the layer (the router's width).
    pub n: usize,
    /// Blob slots in `buf`: `n` when resident (slot = expert); fewer when streaming, where the
    /// decoder's slot table maps experts to slots and fills them on demand.
    pub slots: usize,
    /// The host can map `buf` to write blobs into it (streaming; `gpu::slots`).
    pub mappable: bool,
}

pub(crate) enum FfnW {
    Dense(Mlp),
    Moe {
        router: Packed,
        experts: ExpertStack,
        /// The always-on expert and its sigmoid gate (`[1, hidden]`).
        shared: Option<(Mlp, Packed)>,
    },
}

pub(crate) struct LayerW {
    pub input_norm: wgpu::Buffer,
    pub post_norm: wgpu::Buffer,
    /// q, k, v projections.
    pub qkv: Packed,
    pub o: Packed,
    /// `[bq | bk | bv]`, f32.
    pub bias: Option<wgpu::Buffer>,
    /// q and k norm weights and their lengths (head_dim: per head; else the whole projection).
    pub qk_norm: Option<((wgpu::Buffer, usize), (wgpu::Buffer, usize))>,
    pub ffn: FfnW,
}

pub(crate) struct Weights {
    pub layers: Vec<LayerW>,
    pub norm: wgpu::Buffer,
    pub lm_head: Packed,
    /// The input embedding in GPU memory, for greedy chains (`GpuDecoder::decode_greedy`): not
    /// when streaming (a chain needs the host at every router), and not a second copy when it
    /// is tied to the LM head.
    pub embed: Option<Packed>,
    pub inv_freq: wgpu::Buffer,
}

/// Streaming: the VRAM expert slots each MoE layer gets (`Weights::upload`).
#[derive(Clone, Copy, Debug)]
pub struct SlotPlan {
    pub slots: usize,
    /// Mappable by the host where the device allows (`StoreOptions::mapped_slots`).
    pub mapped: bool,
    /// A test hook (`StoreOptions::vram_limit`).
    pub vram_limit: Option<u64>,
}

struct Loader<'a> {
    ctx: &'a GpuContext,
    vault: &'a Vault,
    /// Streaming: expert slots per MoE layer (left empty at load).
    slots: Option<usize>,
    /// Streaming: make the slots mappable where the device allows (`StoreOptions::mapped_slots`).
    mapped_slots: bool,
    /// Streaming (only ever set with `slots`), a test hook (`StoreOptions::vram_limit`): slots
    /// of more bytes in all fail as if the GPU were out of memory.
    vram_limit: Option<u64>,
}

impl Loader<'_> {
    fn tensor(&self, t: Tensor) -> Result<TensorData, EngineError> {
        Ok(self.vault.tensor(&t.name())?)
    }

    fn vector(&self, t: Tensor) -> Result<(wgpu::Buffer, usize), EngineError> {
        let v = self.tensor(t)?.to_f32();
        Ok((self.ctx.upload_f32(&t.name(), &v), v.len()))
    }

    /// Uploads tensors back to back into one buffer.
    fn packed(&self, tensors: &[Tensor]) -> Result<Packed, EngineError> {
        let ts = tensors
            .iter()
            .map(|&t| self.tensor(t))
            .collect::<Result<Vec<_>, _>>()?;
        let mut mats = vec![];
        let mut offset = 0u64;
        for t in &ts {
            let (rows, cols) = t.rows_cols();
            let m = MatAt {
                offset,
                dtype: t.dtype(),
                rows,
                cols,
            };
            if m.bytes() != t.bytes().len() as u64 {
                return Err(EngineError::Backend(format!(
                    "GPU: {}: {} bytes, expected {} for {rows}x{cols} {}",
                    t.entry.name,
                    t.bytes().len(),
                    m.bytes(),
                    t.dtype()
                )));
            }
            offset += m.bytes();
            mats.push(m);
        }
        let names: Vec<String> = tensors.iter().map(|t| t.name()).collect();
        let buf = self.buffer(&names.join("+"), offset)?;
        for (t, m) in ts.iter().zip(&mats) {
            self.ctx.queue.write_buffer(&buf, m.offset, t.bytes());
        }
        Ok(Packed { buf, mats })
    }

    fn buffer(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, EngineError> {
        let max = self.ctx.limits().max_buffer_size;
        if bytes > max {
            return Err(EngineError::Backend(format!(
                "GPU: {label} needs {bytes} bytes, the adapter's largest buffer is {max}"
            )));
        }
        Ok(self.ctx.storage_buffer(label, bytes))
    }

    fn mlp(&self, m: &spec::Mlp) -> Result<Mlp, EngineError> {
        let gate_up = self.packed(&[m.gate, m.up])?;
        let (g, u) = (gate_up.mats[0], gate_up.mats[1]);
        if (g.dtype, g.rows, g.cols) != (u.dtype, u.rows, u.cols) {
            return Err(EngineError::Backend(format!(
                "GPU: {}: gate and up differ in type or shape",
                m.gate.name()
            )));
        }
        Ok(Mlp {
            gate_up,
            down: self.packed(&[m.down])?,
        })
    }

    /// All experts of layer `l` in one buffer, each blob verified against its checksum; or, when
    /// streaming, an empty buffer of `slots` blob slots.
    fn experts(&self, l: usize, moe: &spec::Moe) -> Result<ExpertStack, EngineError> {
        let cfg = &self.vault.header.config;
        let sec = self
            .vault
            .expert_section()
            .ok_or_else(|| EngineError::Backend("GPU: the vault has no expert section".into()))?;
        let part = |name: &str| -> Result<&ExpertPart, EngineError> {
            sec.parts
                .iter()
                .find(|p| p.name == name)
                .ok_or_else(|| EngineError::Backend(format!("GPU: expert layout lacks {name}")))
        };
        let at = |p: &ExpertPart| MatAt {
            offset: p.offset,
            dtype: p.dtype,
            rows: p.shape[0],
            cols: p.shape[1],
        };
        let (gate, up, down) = (part("gate_proj")?, part("up_proj")?, part("down_proj")?);
        if up.offset <= gate.offset || up.dtype != gate.dtype || up.shape != gate.shape {
            return Err(EngineError::Backend(
                "GPU: expert up_proj must follow gate_proj with the same type and shape".into(),
            ));
        }
        let n = moe.experts;
        let slots = self.slots.map_or(n, |s| s.clamp(1, n));
        let label = format!("layer {l} experts");
        let bytes = slots as u64 * sec.blob_stride;
        // Streaming slots that do not fit are an error the load can answer with fewer (the
        // test hook says so before allocating).
        let total = bytes * cfg.moe_layers().count() as u64;
        let out_of_memory = || EngineError::SlotsOutOfMemory {
            slots,
            bytes: total,
        };
        if self.vram_limit.is_some_and(|limit| total > limit) {
            return Err(out_of_memory());
        }
        // Streaming slots the host can map and write into (`gpu::slots`), where offered.
        let fits = bytes <= self.ctx.limits().max_buffer_size;
        let mapped = (self.slots.is_some() && self.mapped_slots && fits)
            .then(|| self.ctx.mappable_storage_buffer(&label, bytes))
            .flatten();
        let mappable = mapped.is_some();
        let buf = match (mapped, self.slots) {
            (Some(buf), _) => buf,
            (None, None) => self.buffer(&label, bytes)?,
            (None, Some(_)) => {
                (self.ctx.try_storage_buffer(&label, bytes)).ok_or_else(out_of_memory)?
            }
        };
        for e in (0..n).filter(|_| self.slots.is_none()) {
            let blob = self.vault.expert_entry(l, e)?;
            let bytes = self.vault.expert_bytes_mapped(blob);
            self.vault.verify_expert(blob, bytes)?;
            self.ctx
                .queue
                .write_buffer(&buf, e as u64 * sec.blob_stride, bytes);
        }
        Ok(ExpertStack {
            buf,
            gate: at(gate),
            up_offset: up.offset - gate.offset,
            down: at(down),
            stride: sec.blob_stride,
            n,
            slots,
            mappable,
        })
    }

    fn layer(&self, layer: &LayerSpec) -> Result<LayerW, EngineError> {
        let l = layer.index;
        let ffn = match &layer.ffn {
            Ffn::Dense(m) => FfnW::Dense(self.mlp(m)?),
            Ffn::Moe(moe) => FfnW::Moe {
                router: self.packed(&[moe.router])?,
                experts: self.experts(l, moe)?,
                shared: match &moe.shared {
                    Some(s) => Some((self.mlp(&s.mlp)?, self.packed(&[s.gate])?)),
                    None => None,
                },
            },
        };
        let Mixer::Attention(a) = &layer.mixer;
        let bias = match a.bias {
            Some(tensors) => {
                let mut b = vec![];
                for t in tensors {
                    b.extend(self.tensor(t)?.to_f32());
                }
                Some(self.ctx.upload_f32("qkv bias", &b))
            }
            None => None,
        };
        let qk_norm = match &a.qk_norm {
            Some(n) => Some((self.vector(n.q)?, self.vector(n.k)?)),
            None => None,
        };
        Ok(LayerW {
            input_norm: self.vector(layer.mixer_norm)?.0,
            post_norm: self.vector(layer.ffn_norm)?.0,
            qkv: self.packed(&a.qkv)?,
            o: self.packed(&[a.o])?,
            bias,
            qk_norm,
            ffn,
        })
    }
}

impl Weights {
    /// Layer `l`'s expert slots (MoE layers only).
    pub fn expert_slots(&self, l: usize) -> Option<&ExpertStack> {
        match &self.layers[l].ffn {
            FfnW::Moe { experts, .. } => Some(experts),
            FfnW::Dense(_) => None,
        }
    }

    /// The input embedding on the GPU, when it is there (resident models).
    pub fn embedding(&self, tied: bool) -> Option<WeightRef<'_>> {
        match (&self.embed, tied) {
            (Some(e), _) => Some(e.w(0)),
            (None, true) => Some(self.lm_head.w(0)),
            (None, false) => None,
        }
    }

    /// `expert_slots`: `None` uploads every expert; `Some(s)` gives each MoE layer `s.slots`
    /// empty expert slots (streaming). Slots that do not fit fail the upload with
    /// `EngineError::SlotsOutOfMemory`.
    pub fn upload(
        ctx: &GpuContext,
        vault: &Vault,
        (model, rope): (&ModelSpec, &RopeTable),
        expert_slots: Option<SlotPlan>,
    ) -> Result<Self, EngineError> {
        let ld = Loader {
            ctx,
            vault,
            slots: expert_slots.map(|s| s.slots),
            mapped_slots: expert_slots.is_some_and(|s| s.mapped),
            vram_limit: expert_slots.and_then(|s| s.vram_limit),
        };
        let mut layers = vec![];
        for layer in &model.layers {
            layers.push(ld.layer(layer)?);
            // wgpu stages written bytes in host memory until a submission: flush per layer so
            // that staging never holds more than one layer of a large model.
            ctx.submit_wait(ctx.encoder());
        }
        let tied = model.lm_head == model.embed;
        let w = Weights {
            layers,
            norm: ld.vector(model.final_norm)?.0,
            lm_head: ld.packed(&[model.lm_head])?,
            embed: match expert_slots.is_none() && !tied {
                true => Some(ld.packed(&[model.embed])?),
                false => None,
            },
            inv_freq: ctx.upload_f32("rope inv_freq", rope.inv_freq()),
        };
        // Finish the queued uploads here, so that load time includes them, not the first token.
        ctx.submit_wait(ctx.encoder());
        Ok(w)
    }
}
