// MoE router (CPU twin: cpu::ops::route_softmax_topk): softmax over the experts' logits, the k
// most probable (ties → lower index), optionally renormalised to sum to one (norm_topk_prob).
// One workgroup per token; writes k u32 expert ids (largest first) and k f32 weights, ready for
// the grouped matvec and weighted_sum.

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

var<workgroup> lg: array<f32, MAX_E>;
var<workgroup> taken: array<u32, MAX_E>;
var<workgroup> chosen: array<u32, MAX_K>;

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
    var mx = NEG_BIG;
    for (var i = li; i < n; i += WG) {
        let v = x[p.x_off + t * n + i];
        lg[i] = v;
        taken[i] = 0u;
        mx = max(mx, v);
    }
    mx = wg_max(mx, sg, nsg, lane);
    var se = 0.0;
    for (var i = li; i < n; i += WG) {
        se += exp(lg[i] - mx);
    }
    let sum = wg_sum(se, sg, nsg, lane);
    // k rounds of a workgroup argmax over the experts not yet taken; probabilities are monotonic
    // in the logits, so picking by logit picks by probability.
    for (var r = 0u; r < p.k; r++) {
        var bv = NEG_BIG;
        var bi = 0xffffffffu;
        for (var i = li; i < n; i += WG) {
            if taken[i] == 0u && (lg[i] > bv || bi == 0xffffffffu) {
                bv = lg[i];
                bi = i;
            }
        }
        let best = wg_argmax(bv, bi, sg, nsg, lane);
        if li == 0u {
            taken[best] = 1u;
            chosen[r] = best;
        }
        workgroupBarrier();
    }
    if li == 0u {
        var total = 0.0;
        for (var r = 0u; r < p.k; r++) {
            total += exp(lg[chosen[r]] - mx) / sum;
        }
        for (var r = 0u; r < p.k; r++) {
            let pr = exp(lg[chosen[r]] - mx) / sum;
            ids[p.ids_off + t * p.k + r] = chosen[r];
            wts[p.w_off + t * p.k + r] = select(pr, pr / total, p.normalize != 0u);
        }
    }
}
