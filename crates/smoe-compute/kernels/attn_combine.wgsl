// Decode attention, pass 2 of 2: merges the n_split partial results of attn_decode for each
// (head, token): out = Σ_s o_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M), M = max_s m_s.

struct Params {
    n_heads: u32,
    head_dim: u32,
    n_split: u32,
    ml_off: u32,
    out_off: u32, // f32 index of token 0's output (token stride n_heads·head_dim)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let hd = p.head_dim;
    let base = (t * p.n_heads + h) * p.n_split;
    var mx = part[p.ml_off + 2u * base];
    for (var s = 1u; s < p.n_split; s++) {
        mx = max(mx, part[p.ml_off + 2u * (base + s)]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.n_split; s++) {
        l += part[p.ml_off + 2u * (base + s) + 1u] * exp(part[p.ml_off + 2u * (base + s)] - mx);
    }
    let inv_l = 1.0 / l;
    for (var d = li; d < hd; d += 128u) {
        var acc = 0.0;
        for (var s = 0u; s < p.n_split; s++) {
            acc += part[(base + s) * hd + d] * exp(part[p.ml_off + 2u * (base + s)] - mx);
        }
        out[p.out_off + (t * p.n_heads + h) * hd + d] = acc * inv_l;
    }
}
