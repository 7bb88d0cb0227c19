// MoE router (CPU twin: cpu::ops::route_softmax_topk): softmax over the experts' logits, the k
// most probable (ties → lower index), optionally renormalised to sum to one (norm_topk_prob).
// One workgroup per token; writes k u32 expert ids (largest first) and k f32 weights, ready for
// the grouped matvec and weighted_sum.
//
// Selection by rank, not k rounds of argmax: each invocation counts, for its experts, how many
// others beat them ((logit, index) order, so ranks are a permutation), and the experts ranked
// below k write themselves into place. A constant number of barriers whatever k is — the k
// workgroup argmaxes of the first version cost ~10 µs per decode layer on an H200, most of it
// barriers.

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
        var v = x[p.x_off + t * n + i];
        // A NaN logit ranks last (and keeps the ranks a permutation, so every slot is written).
        v = select(v, NEG_BIG, v != v);
        lg[i] = v;
        mx = max(mx, v);
    }
    // (wg_max's barriers also publish lg.)
    mx = wg_max(mx, sg, nsg, lane);
    var se = 0.0;
    var top = 0.0;
    for (var i = li; i < n; i += WG) {
        let v = lg[i];
        let e = exp(v - mx);
        se += e;
        var rank = 0u;
        for (var j = 0u; j < n; j++) {
            let u = lg[j];
            rank += u32(u > v || (u == v && j < i));
        }
        if rank < p.k {
            chosen[rank] = i;
            top += e;
        }
    }
    let sum = wg_sum(se, sg, nsg, lane);
    // (and its barriers publish chosen.)
    let total = wg_sum(top, sg, nsg, lane) / sum;
    for (var r = li; r < p.k; r += WG) {
        let e = chosen[r];
        let pr = exp(lg[e] - mx) / sum;
        ids[p.ids_off + t * p.k + r] = e;
        wts[p.w_off + t * p.k + r] = select(pr, pr / total, p.normalize != 0u);
    }
}
