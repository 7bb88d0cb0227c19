// Softmax top-k by rank (CPU twin: cpu::ops::route_softmax_topk), shared by the router kernel and
// the router matvec's fused tail (matvec.wgsl, TAIL 1). The kernel that prepends this fragment
// declares three workgroup arrays: tk_lg (≥ n logits), tk_id and tk_w (≥ k each), tk_red (≥ the
// subgroup count).
//
// Selection by rank, not k rounds of argmax: each invocation counts, for its experts, how many
// others beat them ((logit, index) order, so ranks are a permutation), and the experts ranked
// below k write themselves into place. A constant number of barriers whatever k is — the k
// workgroup argmaxes of the first version cost ~10 µs per decode layer on an H200, most of it
// barriers.

// Sentinel for a NaN logit: finite, so exp(m − m) stays defined, and ranked last.
const TK_NEG: f32 = -3.0e38;

// A workgroup-wide max (is_max) or sum through tk_red; every invocation gets the same value.
fn tk_reduce(v: f32, is_max: bool, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = select(subgroupAdd(v), subgroupMax(v), is_max);
    workgroupBarrier();
    if lane == 0u {
        tk_red[sg] = s;
    }
    workgroupBarrier();
    var t = tk_red[0];
    for (var i = 1u; i < nsg; i++) {
        t = select(t + tk_red[i], max(t, tk_red[i]), is_max);
    }
    return t;
}

// The logit of expert i as the selection reads it: a NaN becomes TK_NEG (and keeps the ranks a
// permutation, so every slot is written).
fn tk_clean(v: f32) -> f32 {
    return select(v, TK_NEG, v != v);
}

// Call in workgroup-uniform control flow after tk_lg[0..n) holds tk_clean'ed logits (no barrier
// needed before: the first reduction publishes them). On return tk_id[0..k) holds the k most
// probable experts (ties → lower index), largest first, and tk_w[0..k) their softmax
// probabilities, renormalized over the k when `normalize`, visible to the whole workgroup.
fn softmax_topk(li: u32, wg: u32, sg: u32, nsg: u32, lane: u32, n: u32, k: u32, normalize: bool) {
    var mx = TK_NEG;
    for (var i = li; i < n; i += wg) {
        mx = max(mx, tk_lg[i]);
    }
    mx = tk_reduce(mx, true, sg, nsg, lane);
    var se = 0.0;
    var top = 0.0;
    for (var i = li; i < n; i += wg) {
        let v = tk_lg[i];
        let e = exp(v - mx);
        se += e;
        var rank = 0u;
        for (var j = 0u; j < n; j++) {
            let u = tk_lg[j];
            rank += u32(u > v || (u == v && j < i));
        }
        if rank < k {
            tk_id[rank] = i;
            top += e;
        }
    }
    let sum = tk_reduce(se, false, sg, nsg, lane);
    // (and its barriers publish tk_id.)
    let total = tk_reduce(top, false, sg, nsg, lane) / sum;
    for (var r = li; r < k; r += wg) {
        let pr = exp(tk_lg[tk_id[r]] - mx) / sum;
        tk_w[r] = select(pr, pr / total, normalize);
    }
    workgroupBarrier();
}
