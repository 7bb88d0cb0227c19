// Decode attention's merge of the n_split partial results of attn_decode for each (head, token):
// out = Σ_s o_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M), M = max_s m_s. Shared by attn_combine.wgsl
// (a pass of its own) and attn_decode.wgsl's MERGE tail; each defines part_at(i), the partial
// results' f32 i, and binds p (n_heads, head_dim, n_split, ml_off, out_off) and out.

fn merge_splits(h: u32, t: u32, li: u32, wg: u32) {
    let hd = p.head_dim;
    let base = (t * p.n_heads + h) * p.n_split;
    var mx = part_at(p.ml_off + 2u * base);
    for (var s = 1u; s < p.n_split; s++) {
        mx = max(mx, part_at(p.ml_off + 2u * (base + s)));
    }
    var l = 0.0;
    for (var s = 0u; s < p.n_split; s++) {
        l += part_at(p.ml_off + 2u * (base + s) + 1u) * exp(part_at(p.ml_off + 2u * (base + s)) - mx);
    }
    let inv_l = 1.0 / l;
    for (var d = li; d < hd; d += wg) {
        var acc = 0.0;
        for (var s = 0u; s < p.n_split; s++) {
            acc += part_at((base + s) * hd + d) * exp(part_at(p.ml_off + 2u * (base + s)) - mx);
        }
        out[p.out_off + (t * p.n_heads + h) * hd + d] = acc * inv_l;
    }
}
