// Decode attention, pass 1 of 2 (CPU twin: cpu::ops::attention): causal GQA over the KV cache
// for any context length. Workgroup (split s, head h, token t) covers an equal share of token
// t's positions 0..=pos0+t, or the last `window` of them (flash-decoding), tiling it WG positions at a time with an online
// softmax, so no score array ever needs to fit in memory. It writes its partial output with
// its running max m and sum l; attn_combine merges the splits. With one split (DIRECT) the
// workgroup writes the final output itself and no combine pass runs: one dependent dispatch
// less per layer, which is what short-context decoding is made of.
//
// ROPE (one token): q, k and v arrive as the qkv projection wrote them, and the kernel does
// qk_norm_rope.wgsl's work itself, saving that dependent dispatch: each workgroup normalizes and
// rotates its query head into qs and its kv head's new key into kcur (v into vcur), attends to
// the current position from those and to the earlier ones from the caches, and the first split
// of the first query head of each kv group appends kcur and vcur to the caches for the tokens
// that follow. Same rotation code (rope.wgsl), same order of operations: the same results.
//
// What decoding waits for here is memory latency, not bandwidth: a layer's cache was last read a
// whole token earlier and comes from HBM. So the scores take KL lanes per position (each lane's
// chain of a key row's loads a KL-th as long), and with ROPE the query's and key's inputs, norm
// weights and frequencies are loaded together before one reduction (`rope_both`). H200, `smoe
// bench kernels --shape "attn dec"` (caches rotated out of L2), 32/4 heads × 128: at position 63
// 12.6 → 9.3 µs per call; the engine's decode (tg128, with the router's shorter top-k tail) 322
// → 344 tok/s.

struct Params {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    n_split: u32,
    q_off: u32,  // vec4 index of token 0's queries (token stride n_heads·head_dim)
    kc_off: u32, // vec4 index of position 0 of the K cache
    vc_off: u32, // vec4 index of position 0 of the V cache
    ml_off: u32, // f32 index in `part` where the (m, l) pairs start
    scale: f32,
    window: u32, // attend only to the last `window` positions; 0: all
    out_off: u32, // DIRECT: f32 index of token 0's output (token stride n_heads·head_dim)
    // ROPE: f32 indices of the raw k and v, the norm weights, the inverse frequencies.
    k_off: u32,
    v_off: u32,
    qn_off: u32,
    kn_off: u32,
    inv_off: u32,
    rot_dim: u32,
    eps: f32,
    rope_scale: f32,
    has_norm: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override DIRECT: bool = false;
override ROPE: bool = false;
// Several splits: the last split of each (head, token) to finish merges them (attn_merge.wgsl)
// instead of a combine pass — the tail of matvec.wgsl's TAIL modes: publish (storageBarrier),
// count in on done[(t, h)], read the others' partials with atomic loads. Vulkan only.
override MERGE: bool = false;

struct Step {
    pos0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const HD_MAX: u32 = 512u;
// The V sum: invocation li handles vec4 of dims li % 32 (+ 32, 64, 96 for wider heads) over
// every PG-th position of a tile, starting at li / 32; the PG partial sums are added at the end.
// (One invocation per dim looping over all of a tile's positions made a 128-long dependent chain
// per tile: the slowest part of decoding at short contexts.) Up to HD_MAX / 128 = 4 vec4s each.
override PG: u32 = WG / 32u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
// (read_write for ROPE's append; nothing else writes them in this dispatch.)
@group(0) @binding(3) var<storage, read_write> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> part: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
// ROPE: the raw k and v (q is binding 2), q_norm and k_norm weights, inverse frequencies.
@group(0) @binding(7) var<storage, read> kraw: array<f32>;
@group(0) @binding(8) var<storage, read> vraw: array<f32>;
@group(0) @binding(9) var<storage, read> qnw: array<f32>;
@group(0) @binding(10) var<storage, read> knw: array<f32>;
@group(0) @binding(11) var<storage, read> inv: array<f32>;
// MERGE: the counters, and `part` again for atomic loads.
@group(0) @binding(12) var<storage, read_write> done: array<atomic<u32>>;
@group(0) @binding(13) var<storage, read_write> parta: array<atomic<u32>>;

var<workgroup> last: u32;

fn part_at(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&parta[i]));
}

var<workgroup> qs: array<vec4<f32>, 128>;
// ROPE: the current position's rotated key and value of this workgroup's kv head.
var<workgroup> kcur: array<vec4<f32>, KCUR_LEN>;
var<workgroup> vcur: array<vec4<f32>, KCUR_LEN>;
override KCUR_LEN: u32 = select(1u, 128u, ROPE);
var<workgroup> vred: array<vec4<f32>, PG * 128u>;
var<workgroup> sc: array<f32, WG>;

// ROPE: where this workgroup's query head and its kv head's new key start (f32 indices of q,
// read as vec4s, and of kraw), and what the query is scaled by.
var<private> q_src: u32;
var<private> k_src: u32;

fn head_in(is_q: bool, i: u32) -> f32 {
    if is_q {
        let j = q_src + i;
        return q[j / 4u][j % 4u];
    }
    return kraw[k_src + i];
}

// The query, scaled, into qs; the key into kcur.
fn head_out(is_q: bool, i: u32, v: f32) {
    if is_q {
        qs[i / 4u][i % 4u] = v * p.scale;
    } else {
        kcur[i / 4u][i % 4u] = v;
    }
}

// ROPE with head_dim ≤ WG: rope_head's work for the query and the key at once, one element of
// each per invocation, every load (inputs, their rotation partners, norm weights, frequency)
// issued before the one reduction of both sums of squares — rope_head twice waits for four
// rounds of loads and two reductions. Same operations per element, so the same results.
fn rope_both(pos: u32, li: u32, sg: u32, nsg: u32, lane: u32) {
    let hd = p.head_dim;
    let half = p.rot_dim / 2u;
    let on = li < hd;
    let i = min(li, hd - 1u);
    let rot = i < p.rot_dim && half > 0u;
    // The element i pairs with in the rotation.
    let j = select(i, select(i - half, i + half, i < half), rot);
    let qa = head_in(true, i);
    let qb = head_in(true, j);
    let ka = head_in(false, i);
    let kb = head_in(false, j);
    let norm = p.has_norm != 0u;
    var wq = vec2<f32>(1.0);
    var wk = vec2<f32>(1.0);
    if norm {
        wq = vec2<f32>(head_norm_w(true, i), head_norm_w(true, j));
        wk = vec2<f32>(head_norm_w(false, i), head_norm_w(false, j));
    }
    var f = 0.0;
    if rot {
        f = inv[p.inv_off + select(j, i, i < half)];
    }
    var r = vec2<f32>(1.0);
    if norm {
        let s2 = select(vec2<f32>(0.0), vec2<f32>(qa * qa, ka * ka), on);
        let t = vec2<f32>(subgroupAdd(s2.x), subgroupAdd(s2.y));
        if lane == 0u {
            red_f[2u * sg] = t.x;
            red_f[2u * sg + 1u] = t.y;
        }
        workgroupBarrier();
        var ss = vec2<f32>(0.0);
        for (var g = 0u; g < nsg; g++) {
            ss += vec2<f32>(red_f[2u * g], red_f[2u * g + 1u]);
        }
        r = 1.0 / sqrt(ss / f32(hd) + p.eps);
    }
    if on {
        var q2 = vec2<f32>(qa, qb);
        var k2 = vec2<f32>(ka, kb);
        if norm {
            q2 = q2 * r.x * wq;
            k2 = k2 * r.y * wk;
        }
        var qo = q2.x;
        var ko = k2.x;
        if rot && i < half {
            qo = rotate(q2.x, q2.y, f, pos, p.rope_scale).x;
            ko = rotate(k2.x, k2.y, f, pos, p.rope_scale).x;
        } else if rot {
            qo = rotate(q2.y, q2.x, f, pos, p.rope_scale).y;
            ko = rotate(k2.y, k2.x, f, pos, p.rope_scale).y;
        }
        head_out(true, i, qo);
        head_out(false, i, ko);
    }
}

// acc plus this invocation's share of a tile's values for vec4 d4 of the head (d4 < hd4):
// positions pg, pg + PG, ... of the tile's cnt, whose probabilities are in sc; vt is the V
// cache's vec4 index of the tile's first position for this KV head.
fn v_pass(acc_in: vec4<f32>, d4: u32, hd4: u32, vt: u32, cnt: u32, has_cur: bool, pg: u32, kvw4: u32) -> vec4<f32> {
    var acc = acc_in;
    if d4 >= hd4 {
        return acc;
    }
    let n_cached = select(cnt, cnt - 1u, has_cur);
    for (var c = pg; c < n_cached; c += PG) {
        acc += sc[c] * vc[vt + d4 + c * kvw4];
    }
    if has_cur && (cnt - 1u) % PG == pg {
        acc += sc[cnt - 1u] * vcur[d4];
    }
    return acc;
}

// Lanes that share a position's key in the score pass.
const KL: u32 = 4u;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) ss: u32,
) {
    let s = wid.x;
    let h = wid.y;
    let t = wid.z;
    let hd = p.head_dim;
    let hd4 = hd / 4u;
    let kvw = p.n_kv * hd;
    let kvh = h / (p.n_heads / p.n_kv);
    let n_ctx = step.pos0 + t + 1u;
    var lo = 0u;
    if p.window != 0u && n_ctx > p.window {
        lo = n_ctx - p.window;
    }
    let chunk = (n_ctx - lo + p.n_split - 1u) / p.n_split;
    let p0 = lo + s * chunk;
    let p1 = min(n_ctx, p0 + chunk);
    let cur = n_ctx - 1u;
    let kvw4 = kvw / 4u;
    if ROPE {
        // v first: its loads are in flight while q and k are normalized and rotated.
        for (var i = li; i < hd4; i += WG) {
            let b = p.v_off + kvh * hd + 4u * i;
            vcur[i] = vec4<f32>(vraw[b], vraw[b + 1u], vraw[b + 2u], vraw[b + 3u]);
        }
        q_src = 4u * p.q_off + h * hd;
        k_src = p.k_off + kvh * hd;
        if hd <= WG {
            rope_both(cur, li, sg, nsg, lane);
        } else {
            rope_head(true, cur, li, WG, sg, nsg, lane);
            rope_head(false, cur, li, WG, sg, nsg, lane);
        }
        workgroupBarrier();
        if s == 0u && h % (p.n_heads / p.n_kv) == 0u {
            for (var i = li; i < hd4; i += WG) {
                kc[p.kc_off + cur * (kvw / 4u) + kvh * hd4 + i] = kcur[i];
                vc[p.vc_off + cur * (kvw / 4u) + kvh * hd4 + i] = vcur[i];
            }
        }
    } else {
        for (var i = li; i < hd4; i += WG) {
            qs[i] = q[p.q_off + (t * p.n_heads + h) * hd4 + i] * p.scale;
        }
        workgroupBarrier();
    }
    var m = NEG_BIG;
    var l = 0.0;
    // The output's vec4s per invocation (up to 4) as four variables, not an array: indexed in a loop
    // the driver did not unroll, the array went to local memory (NVIDIA's pipeline statistics,
    // `examples/pipeline_stats`: 64 bytes per invocation), a round trip through L1 per tile.
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    let dv = li % 32u;
    let pg = li / 32u;
    for (var tile = p0; tile < p1; tile += WG) {
        let pos = tile + li;
        var score = NEG_BIG;
        if ss >= KL {
            // KL consecutive lanes per position, each a KL-th of its key's vec4s (interleaved,
            // so the KL lanes read consecutive 16 bytes): KL times the loads in flight of one
            // lane per position, whose chain of a row's loads was the attention's slowest part
            // with the caches cold. (The previous tile's value pass must be done with sc.) A
            // subgroup too narrow to shuffle within KL lanes takes the path below.
            workgroupBarrier();
            let kl = li % KL;
            for (var r = 0u; r < KL; r++) {
                let j = r * (WG / KL) + li / KL;
                let pj = tile + j;
                var acc = 0.0;
                if pj < p1 {
                    let kb = p.kc_off + pj * kvw4 + kvh * hd4;
                    if ROPE && pj == cur {
                        for (var i = kl; i < hd4; i += KL) {
                            acc += dot(qs[i], kcur[i]);
                        }
                    } else {
                        for (var i = kl; i < hd4; i += KL) {
                            acc += dot(qs[i], kc[kb + i]);
                        }
                    }
                }
                acc += subgroupShuffleXor(acc, 1u);
                acc += subgroupShuffleXor(acc, 2u);
                if kl == 0u {
                    sc[j] = acc;
                }
            }
            workgroupBarrier();
            if pos < p1 {
                score = sc[li];
            }
        } else if pos < p1 {
            let kb = p.kc_off + pos * kvw4 + kvh * hd4;
            var acc = 0.0;
            if ROPE && pos == cur {
                for (var i = 0u; i < hd4; i++) {
                    acc += dot(qs[i], kcur[i]);
                }
            } else {
                for (var i = 0u; i < hd4; i++) {
                    acc += dot(qs[i], kc[kb + i]);
                }
            }
            score = acc;
        }
        let mn = max(m, wg_max(score, sg, nsg, lane));
        let pj = select(0.0, exp(score - mn), pos < p1);
        sc[li] = pj;
        // wg_sum's barriers also publish sc to the whole workgroup.
        let alpha = exp(m - mn);
        l = l * alpha + wg_sum(pj, sg, nsg, lane);
        let cnt = min(WG, p1 - tile);
        // ROPE: the tile that ends at the current position takes its value from vcur, added
        // last as the loop would have (the same order of additions).
        let has_cur = ROPE && tile + cnt == n_ctx;
        let vt = p.vc_off + tile * kvw4 + kvh * hd4;
        o0 = v_pass(o0 * alpha, dv, hd4, vt, cnt, has_cur, pg, kvw4);
        if dv + 32u < hd4 {
            o1 = v_pass(o1 * alpha, dv + 32u, hd4, vt, cnt, has_cur, pg, kvw4);
        }
        if dv + 64u < hd4 {
            o2 = v_pass(o2 * alpha, dv + 64u, hd4, vt, cnt, has_cur, pg, kvw4);
        }
        if dv + 96u < hd4 {
            o3 = v_pass(o3 * alpha, dv + 96u, hd4, vt, cnt, has_cur, pg, kvw4);
        }
        m = mn;
        // The next tile rewrites sc only after its wg_max barriers: no extra barrier needed.
    }
    // Add up the PG position groups' partial sums.
    if dv < hd4 {
        vred[pg * 128u + dv] = o0;
    }
    if dv + 32u < hd4 {
        vred[pg * 128u + dv + 32u] = o1;
    }
    if dv + 64u < hd4 {
        vred[pg * 128u + dv + 64u] = o2;
    }
    if dv + 96u < hd4 {
        vred[pg * 128u + dv + 96u] = o3;
    }
    workgroupBarrier();
    let row = (t * p.n_heads + h) * p.n_split + s;
    for (var d4 = li; d4 < hd4; d4 += WG) {
        var v = vec4<f32>(0.0);
        for (var g = 0u; g < PG; g++) {
            v += vred[g * 128u + d4];
        }
        if DIRECT {
            v /= l;
        }
        for (var e = 0u; e < 4u; e++) {
            let d = 4u * d4 + e;
            if DIRECT {
                out[p.out_off + (t * p.n_heads + h) * hd + d] = v[e];
            } else {
                part[row * hd + d] = v[e];
            }
        }
    }
    if !DIRECT && li == 0u {
        part[p.ml_off + 2u * row] = m;
        part[p.ml_off + 2u * row + 1u] = l;
    }
    if MERGE {
        storageBarrier();
        if li == 0u {
            let c = t * p.n_heads + h;
            let is_last = atomicAdd(&done[c], 1u) + 1u == p.n_split;
            if is_last {
                atomicStore(&done[c], 0u);
            }
            last = u32(is_last);
        }
        if workgroupUniformLoad(&last) != 0u {
            storageBarrier();
            merge_splits(h, t, li, WG);
        }
    }
}
