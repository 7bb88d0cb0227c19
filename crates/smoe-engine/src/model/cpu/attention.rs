//! Softmax attention (`spec::Attention`) on the CPU: q, k, v projections (+ bias) → q/k norm →
//! clip → RoPE; each sequence appends its keys and values to its layer state and attends over
//! them; x += o(attention).

use super::super::{mat, Scratch};
use super::ffn::{add_into, add_rows};
use crate::error::EngineError;
use crate::rope::RopeTable;
use crate::spec::Attention;
use crate::state::{LayerState, SeqState};
use smoe_compute::cpu::{matmul, ops};
use smoe_vault::{TensorData, Vault};

pub(super) struct AttentionW {
    q: TensorData,
    k: TensorData,
    v: TensorData,
    o: TensorData,
    bias: Option<[Vec<f32>; 3]>,
    /// q and k norm weights: `head_dim` long (per head) or the projection's width (whole).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

impl AttentionW {
    pub fn load(vault: &Vault, a: &Attention) -> Result<Self, EngineError> {
        let t = |t: smoe_vault::tensors::Tensor| vault.tensor(&t.name());
        let v = |t: smoe_vault::tensors::Tensor| vault.tensor(&t.name()).map(|t| t.to_f32());
        let [q, k, vp] = a.qkv;
        Ok(AttentionW {
            q: t(q)?,
            k: t(k)?,
            v: t(vp)?,
            o: t(a.o)?,
            bias: match a.bias {
                Some([bq, bk, bv]) => Some([v(bq)?, v(bk)?, v(bv)?]),
                None => None,
            },
            qk_norm: match &a.qk_norm {
                Some(n) => Some((v(n.q)?, v(n.k)?)),
                None => None,
            },
        })
    }

    /// Reads the normed input `s.h`, adds the attention's output to `s.x`.
    pub fn forward(
        &self,
        a: &Attention,
        (l, eps): (usize, f32),
        rope: &RopeTable,
        states: &mut [&mut SeqState],
        spans: &[std::ops::Range<usize>],
        s: &mut Scratch,
    ) {
        let hd = a.head_dim;
        let (qw, kw) = (a.heads * hd, a.kv_heads * hd);
        let t = spans.last().map_or(0, |r| r.end);
        s.q.resize(t * qw, 0.0);
        s.k.resize(t * kw, 0.0);
        s.v.resize(t * kw, 0.0);
        matmul(mat(&self.q), &s.h, t, &mut s.q);
        matmul(mat(&self.k), &s.h, t, &mut s.k);
        matmul(mat(&self.v), &s.h, t, &mut s.v);
        if let Some([bq, bk, bv]) = &self.bias {
            add_rows(&mut s.q, bq);
            add_rows(&mut s.k, bk);
            add_rows(&mut s.v, bv);
        }
        // The norm weight's length says per head or whole projection: rows of that width.
        if let Some((qn, kn)) = &self.qk_norm {
            ops::rms_norm_inplace(&mut s.q, qn, eps);
            ops::rms_norm_inplace(&mut s.k, kn, eps);
        }
        if let Some(clip) = a.clip {
            for x in s.q.iter_mut().chain(s.k.iter_mut()).chain(s.v.iter_mut()) {
                *x = x.clamp(-clip, clip);
            }
        }
        let half = rope.half();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        s.attn.resize(t * qw, 0.0);
        let shape = ops::AttnShape {
            n_heads: a.heads,
            n_kv_heads: a.kv_heads,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
            window: a.window,
        };
        // Each sequence: rotate at its own positions, append to its state, attend over it.
        for (state, span) in states.iter_mut().zip(spans) {
            let pos0 = state.len();
            for (j, i) in span.clone().enumerate() {
                rope.at(pos0 + j, &mut cos, &mut sin);
                ops::rope_inplace(&mut s.q[i * qw..(i + 1) * qw], hd, &cos, &sin);
                ops::rope_inplace(&mut s.k[i * kw..(i + 1) * kw], hd, &cos, &sin);
            }
            let LayerState::Kv { k, v, width } = state.layer_mut(l) else {
                unreachable!("an attention layer's state is a KV cache (spec::Mixer::state)")
            };
            let rows = span.start * kw..span.end * kw;
            k[pos0 * *width..pos0 * *width + rows.len()].copy_from_slice(&s.k[rows.clone()]);
            v[pos0 * *width..pos0 * *width + rows.len()].copy_from_slice(&s.v[rows]);
            let (q, out) = (
                &s.q[span.start * qw..span.end * qw],
                &mut s.attn[span.start * qw..span.end * qw],
            );
            ops::attention(q, k, v, pos0, shape, out);
        }
        s.o.resize(s.h.len(), 0.0);
        matmul(mat(&self.o), &s.attn, t, &mut s.o);
        add_into(&mut s.x, &s.o);
    }
}
