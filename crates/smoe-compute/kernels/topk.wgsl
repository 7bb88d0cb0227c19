// Softmax top-k by rank (CPU twin: cpu::ops::route_softmax_topk), shared by the router kernel and
// the router matvec's fused tail (matvec.wgsl, TAIL 1). The kernel that prepends this fragment
// declares four workgroup arrays: tk_lg (≥ n logits), tk_id and tk_w (≥ k each), tk_red (≥ twice
// the subgroup count).
//
// Selection by rank, not k rounds of argmax: each invocation counts, for its experts, how many
// others beat them ((logit, index) order, so ranks are a permutation), and the experts ranked
// below k write themselves into place. A constant number of barriers whatever k is — the k
// workgroup argmaxes of the first version cost ~10 µs per decode layer on an H200, most of it
// barriers. The router matvec's tail is a tenth of a decode layer, so its chain is kept short:
// four comparisons per step of the rank count, and the two sums in one reduction (H200, `smoe
// bench kernels --shape "30B router"`: 8.4 → 7.4 µs per call; without the tail, 4.2).

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
        // Four comparisons per step: the logits are read from workgroup memory one after
        // another, and independent reads keep more of them in flight.
        var r4 = vec4<u32>(0u);
        let vv = vec4<f32>(v);
        let iv = vec4<u32>(i);
        var j = 0u;
        for (; j + 4u <= n; j += 4u) {
            let u = vec4<f32>(tk_lg[j], tk_lg[j + 1u], tk_lg[j + 2u], tk_lg[j + 3u]);
            let jj = vec4<u32>(j, j + 1u, j + 2u, j + 3u);
            r4 += select(vec4<u32>(0u), vec4<u32>(1u), (u > vv) | ((u == vv) & (jj < iv)));
        }
        var rank = r4.x + r4.y + r4.z + r4.w;
        for (; j < n; j++) {
            let u = tk_lg[j];
            rank += u32(u > v || (u == v && j < i));
        }
        if rank < k {
            tk_id[rank] = i;
            top += e;
        }
    }
    // Both sums in one reduction (whose barriers also publish tk_id).
    let st = vec2<f32>(subgroupAdd(se), subgroupAdd(top));
    workgroupBarrier();
    if lane == 0u {
        tk_red[2u * sg] = st.x;
        tk_red[2u * sg + 1u] = st.y;
    }
    workgroupBarrier();
    var s2 = vec2<f32>(0.0);
    for (var g = 0u; g < nsg; g++) {
        s2 += vec2<f32>(tk_red[2u * g], tk_red[2u * g + 1u]);
    }
    let sum = s2.x;
    let total = s2.y / sum;
    for (var r = li; r < k; r += wg) {
        let pr = exp(tk_lg[tk_id[r]] - mx) / sum;
        tk_w[r] = select(pr, pr / total, normalize);
    }
    workgroupBarrier();
}
