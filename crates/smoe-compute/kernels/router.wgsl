// MoE router (CPU twin: cpu::ops::route_softmax_topk): softmax over the experts' logits, the k
// most probable (ties → lower index), optionally renormalised to sum to one (norm_topk_prob).
// One workgroup per token; writes k u32 expert ids (largest first) and k f32 weights, ready for
// the grouped matvec and weighted_sum.
//
// The selection itself is topk.wgsl's (prepended), shared with the router matvec's fused tail.

struct Params {
    n_exp: u32,
    k: u32,
    normalize: u32,
    x_off: u32,
    ids_off: u32,
    w_off: u32,
    _pad0: u32,
    _pad1: u32,
}

const MAX_E: u32 = 1024u;
const MAX_K: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;

override WG: u32 = 256u;

var<workgroup> tk_lg: array<f32, MAX_E>;
var<workgroup> tk_id: array<u32, MAX_K>;
var<workgroup> tk_w: array<f32, MAX_K>;
var<workgroup> tk_red: array<f32, 128>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let t = wid.x;
    let n = p.n_exp;
    for (var i = li; i < n; i += WG) {
        tk_lg[i] = tk_clean(x[p.x_off + t * n + i]);
    }
    softmax_topk(li, WG, sg, nsg, lane, n, p.k, p.normalize != 0u);
    for (var r = li; r < p.k; r += WG) {
        ids[p.ids_off + t * p.k + r] = tk_id[r];
        wts[p.w_off + t * p.k + r] = tk_w[r];
    }
}
