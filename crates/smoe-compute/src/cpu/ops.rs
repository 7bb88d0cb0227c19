//! Element-wise and attention ops on the CPU, in f32. Each is the CPU twin of a GPU kernel.

use rayon::prelude::*;

/// `out[t] = x[t] * rsqrt(mean(x[t]²) + eps) * w` for every row `t` of width `w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
    }
}

/// In-place RMSNorm of every `w.len()`-wide slice (used per attention head for q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_exact_mut(n) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for (v, g) in xr.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

/// Rotary embedding on every head of one token, "rotate half" convention: element `i` pairs
/// with `i + d/2`. `cos`/`sin` hold `d/2` values for this token's position.
pub fn rope_inplace(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for h in x.chunks_exact_mut(head_dim) {
        let (a, b) = h.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// `a[i] = silu(a[i]) * b[i]`.
pub fn silu_mul(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = *x / (1.0 + (-*x).exp()) * y;
    }
}

/// `acc[i] += w * x[i]`.
pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

/// Numerically stable in-place softmax.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Router: softmax over all experts, the `k` largest probabilities (ties → lower index), and
/// optionally renormalised to sum to one. Returns `(expert, weight)` pairs, largest first.
pub fn route_softmax_topk(logits: &[f32], k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let mut p = logits.to_vec();
    softmax_inplace(&mut p);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let sum: f32 = idx.iter().map(|&i| p[i]).sum();
    idx.into_iter()
        .map(|i| (i, if normalize { p[i] / sum } else { p[i] }))
        .collect()
}

/// Shapes for [`attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attend only to the last `window` positions (the current one included); None = all.
    pub window: Option<usize>,
}

/// Causal GQA attention for `T` new tokens whose keys/values are already in the cache.
/// `q`: `[T, n_heads * head_dim]`; `k_cache`/`v_cache`: `[ctx, n_kv_heads * head_dim]`;
/// token `t` sits at position `pos0 + t` and attends to positions `0..=pos0 + t` (or only the
/// last `window` of them).
/// `out`: `[T, n_heads * head_dim]`.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos0: usize,
    s: AttnShape,
    out: &mut [f32],
) {
    let (hd, nh) = (s.head_dim, s.n_heads);
    let group = nh / s.n_kv_heads;
    let kv_stride = s.n_kv_heads * hd;
    let t_count = q.len() / (nh * hd);
    // One task per (token, head): independent, each writes its own slice of `out`.
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        debug_assert!(t < t_count);
        let qh = &q[i * hd..(i + 1) * hd];
        let kvh = h / group;
        let n_ctx = pos0 + t + 1;
        let first = s.window.map_or(0, |w| n_ctx.saturating_sub(w));
        let mut scores: Vec<f32> = (first..n_ctx)
            .map(|p| {
                let k = &k_cache[p * kv_stride + kvh * hd..p * kv_stride + (kvh + 1) * hd];
                qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * s.scale
            })
            .collect();
        softmax_inplace(&mut scores);
        o.fill(0.0);
        for (j, w) in scores.iter().enumerate() {
            let p = first + j;
            let v = &v_cache[p * kv_stride + kvh * hd..p * kv_stride + (kvh + 1) * hd];
            axpy(o, *w, v);
        }
    });
}

/// A streaming layer's expert ids mapped to the VRAM slots that hold them (`table`: expert →
/// slot, `u32::MAX` where none does): `None` when any chosen expert has no slot (the GPU's slot
/// map then halts its pass for the host to fill the slots).
pub fn slot_map(ids: &[u32], table: &[u32]) -> Option<Vec<u32>> {
    slot_map_spec(ids, table).into_iter().collect()
}

/// The speculative slot map (`SlotMapBufs::spec`): each chosen expert's slot, or `None` where
/// no slot holds it (the GPU's map then sends that slot to slot 0 with router weight 0).
pub fn slot_map_spec(ids: &[u32], table: &[u32]) -> Vec<Option<u32>> {
    (ids.iter())
        .map(|&e| table.get(e as usize).copied().filter(|&s| s != u32::MAX))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_picks_top_k_and_normalises() {
        let r = route_softmax_topk(&[0.0, 2.0, 1.0, 2.0], 2, true);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((r[0].1 - 0.5).abs() < 1e-6);
        let r = route_softmax_topk(&[0.0, 2.0, 1.0, 2.0], 2, false);
        let z = 1.0 + 2.0 * 2f32.exp() + 1f32.exp();
        assert!((r[0].1 - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn attention_of_one_position_returns_its_value() {
        let s = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 2,
            scale: 1.0,
            window: None,
        };
        let q = vec![1.0; 8];
        let k = vec![0.5; 4];
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let mut out = vec![f32::NAN; 8];
        attention(&q, &k, &v, 0, s, &mut out);
        assert_eq!(out, vec![1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0]);
    }

    #[test]
    fn attention_is_causal_and_weighted() {
        let s = AttnShape {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 1,
            scale: 1.0,
            window: None,
        };
        // Two tokens at positions 0 and 1; keys 0 and ln 3 → weights 1/4 and 3/4 for token 1.
        let k = vec![0.0, 3f32.ln()];
        let v = vec![1.0, 5.0];
        let mut out = vec![0.0; 2];
        attention(&[1.0, 1.0], &k, &v, 0, s, &mut out);
        assert!((out[0] - 1.0).abs() < 1e-6);
        assert!((out[1] - 4.0).abs() < 1e-6);
        // A window of one position: each token sees only itself.
        let s = AttnShape {
            window: Some(1),
            ..s
        };
        attention(&[1.0, 1.0], &k, &v, 0, s, &mut out);
        assert_eq!(out, vec![1.0, 5.0]);
    }

    #[test]
    fn rms_norm_and_rope() {
        let mut out = vec![0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
        let mut x = vec![1.0, 0.0];
        rope_inplace(&mut x, 2, &[0.0], &[1.0]);
        assert!((x[0]).abs() < 1e-6 && (x[1] - 1.0).abs() < 1e-6);
    }
}
