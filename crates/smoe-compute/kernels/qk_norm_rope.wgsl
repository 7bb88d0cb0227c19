// Per-head q/k RMSNorm + RoPE + KV append, one workgroup per (head, token) (CPU twins:
// cpu::ops::rms_norm_inplace, then rope_inplace with cos/sin scaled by the attention factor,
// then the KV cache write). Heads 0..nh are query heads (normalised with q_norm, rotated in
// place), nh..nh+nkv key heads (k_norm, rotated, written to the K cache at pos0 + t), and the
// last nkv are value heads (copied to the V cache). Rotate-half convention: element i pairs with
// i + rot/2 for i < rot/2; elements from rot on are only normalised (partial rotary).
// All buffers are read_write bindings so that q/k/v may share one buffer and K/V another.

struct Params {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    rot_dim: u32,
    q_off: u32,  // f32 index of token 0's q (token stride n_heads·head_dim)
    k_off: u32,  // token stride n_kv·head_dim
    v_off: u32,
    kc_off: u32, // f32 index of position 0 in the K cache (position stride n_kv·head_dim)
    vc_off: u32,
    qn_off: u32, // q_norm weights in `qnw`, k_norm in `knw`
    kn_off: u32,
    inv_off: u32, // rot_dim/2 inverse frequencies in `inv`
    eps: f32,
    rope_scale: f32, // multiplies cos and sin (YaRN attention factor; 1 otherwise)
    has_norm: u32,
    _pad: u32,
}

struct Step {
    pos0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read_write> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> k: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> kc: array<f32>;
@group(0) @binding(6) var<storage, read_write> vc: array<f32>;
@group(0) @binding(7) var<storage, read> qnw: array<f32>;
@group(0) @binding(8) var<storage, read> knw: array<f32>;
@group(0) @binding(9) var<storage, read> inv: array<f32>;

// The head this invocation works on: where its input starts (q or k) and where its output goes
// (q in place, or the K cache at its position).
var<private> src: u32;
var<private> dst: u32;

fn head_in(is_q: bool, i: u32) -> f32 {
    if is_q {
        return q[src + i];
    }
    return k[src + i];
}

fn head_out(is_q: bool, i: u32, v: f32) {
    if is_q {
        q[src + i] = v;
    } else {
        kc[dst + i] = v;
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.x;
    let t = wid.y;
    let hd = p.head_dim;
    let kvw = p.n_kv * hd;
    let pos = step.pos0 + t;
    if h >= p.n_heads + p.n_kv {
        let vh = h - p.n_heads - p.n_kv;
        for (var i = li; i < hd; i += WG) {
            vc[p.vc_off + pos * kvw + vh * hd + i] = v[p.v_off + t * kvw + vh * hd + i];
        }
        return;
    }
    let is_q = h < p.n_heads;
    if is_q {
        src = p.q_off + t * p.n_heads * hd + h * hd;
    } else {
        src = p.k_off + t * kvw + (h - p.n_heads) * hd;
    }
    dst = p.kc_off + pos * kvw + (h - p.n_heads) * hd;
    rope_head(is_q, pos, li, WG, sg, nsg, lane);
}
