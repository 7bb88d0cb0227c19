enable f16;
enable wgpu_cooperative_matrix;

// Chunked causal prefill attention on the matrix units (tensor cores): attn_prefill.wgsl's work
// (same Params, bindings and tile order; CPU twin cpu::ops::attention) with 16 × 16 × 16 f16
// cooperative-matrix multiply-adds into f32 sums.
//
// A workgroup (4 subgroups of 32) owns M = 32 rows of one KV head, rows being (query token, q
// head of the GQA group) pairs, head fastest, and walks the keys from the first row's window
// start to the last row's position, NK = 32 at a time, twice:
// - pass 1: S = q·kᵀ per key tile (scale folded into q), and per row the running max and sum
//   of exp over the valid keys (each of 4 invocations per row keeps its own, merged at the end);
// - pass 2: S again, P = exp(S - max) / sum in workgroup memory, and o += P·V with the output
//   block in cooperative-matrix registers for the whole walk. Two passes instead of an online
//   softmax because a cooperative matrix has no per-row access: rescaling o by each row's
//   exp(m_old - m_new) would mean a trip through workgroup memory per key tile.
// S blocks: subgroup s computes row block s / 2 × key block s % 2; o: subgroup s owns row block
// s % 2 and dim blocks (s / 2)·D/32 .. + D/32 (4 accumulators at head_dim 128).
//
// Precision, as in matmul_coop.wgsl: every f32 operand (q, k, v, p) is split into two f16
// halves, hi = the value with its mantissa cut to f16's width (by masking) and lo = f16(value -
// hi), and products take hi·hi + hi·lo + lo·hi (the lo·lo term is below f32's rounding of the
// sum); sums are f32. Inputs beyond f16's range (|v| > 65504) would become infinite.
//
// Every workgroup variable is a multiple of 16 bytes and every cooperative load starts at a
// multiple of 16 bytes (matmul_coop.wgsl says why). Used where the adapter has 16×16×16 f16 →
// f32 cooperative matrices and 32-wide subgroups, for head_dim a multiple of 32 up to 128.

struct Params {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    n_tokens: u32,
    q_off: u32,   // vec4 index of token 0's queries (token stride n_heads·head_dim)
    kc_off: u32,  // vec4 index of position 0 of the K cache
    vc_off: u32,  // vec4 index of position 0 of the V cache
    out_off: u32, // vec4 index of token 0's output (token stride n_heads·head_dim)
    scale: f32,
    window: u32,  // attend only to the last `window` positions; 0: all
    n_tiles: u32, // row tiles per KV head
    _pad: u32,
}

struct Step {
    pos0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const NEG_BIG: f32 = -3.0e38;
const M: u32 = 32u;
const NK: u32 = 32u;
const WG: u32 = 128u;
override D: u32 = 128u; // head_dim: 32, 64, 96 or 128
// Tile row strides in halves (8 of padding spread the rows' 16-byte pieces over the banks).
override QS: u32 = D + 8u;
const PS: u32 = NK + 8u;
// Dim blocks of o per subgroup.
override OB: u32 = D / 32u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// q's halves, row r, dim d at [(r·QS + d) / 2]; the K (then V) tile's, key j at [(j·QS + d) / 2].
var<workgroup> qh: array<vec2<f16>, M * QS / 2u>;
var<workgroup> ql: array<vec2<f16>, M * QS / 2u>;
var<workgroup> kh: array<vec2<f16>, NK * QS / 2u>;
var<workgroup> kl: array<vec2<f16>, NK * QS / 2u>;
// S, key-major (row i, key j at j·M + i); at the end, o's blocks on their way out.
var<workgroup> sc: array<f32, M * NK>;
// P's halves, row i, key j at [(i·PS + j) / 2].
var<workgroup> ph: array<vec2<f16>, M * PS / 2u>;
var<workgroup> pl: array<vec2<f16>, M * PS / 2u>;
// Per invocation: its keys' running max and sum; then per row: the max and 1 / sum.
var<workgroup> part_m: array<f32, WG>;
var<workgroup> part_l: array<f32, WG>;
var<workgroup> row_m: array<f32, M>;
var<workgroup> row_il: array<f32, M>;

fn window_lo(n_ctx: u32) -> u32 {
    if p.window != 0u && n_ctx > p.window {
        return n_ctx - p.window;
    }
    return 0u;
}

// The two f16 halves of four values: hi (mantissa cut by masking, which no compiler folds
// away) and lo, the rest.
fn split_hi(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) & vec4<u32>(0xffffe000u));
}

fn put_k(hi: bool, at: u32, h: vec4<f16>) {
    if hi {
        kh[at / 2u] = h.xy;
        kh[at / 2u + 1u] = h.zw;
    } else {
        kl[at / 2u] = h.xy;
        kl[at / 2u + 1u] = h.zw;
    }
}

// Stages keys kt..kt + NK of the K (is_v false) or V cache into kh/kl, zeros from k_end on.
fn stage_kv(li: u32, is_v: bool, base: u32, kvw4: u32, kt: u32, k_end: u32) {
    let hd4 = D / 4u;
    for (var i = li; i < NK * hd4; i += WG) {
        let j = i / hd4;
        let d4 = i % hd4;
        let pos = kt + j;
        var v = vec4<f32>(0.0);
        if pos < k_end {
            if is_v {
                v = vc[base + pos * kvw4 + d4];
            } else {
                v = kc[base + pos * kvw4 + d4];
            }
        }
        let hb = split_hi(v);
        let at = j * QS + 4u * d4;
        put_k(true, at, vec4<f16>(hb));
        put_k(false, at, vec4<f16>(v - hb));
    }
}

// S of the staged key tile into sc (subgroup s: row block s / 2, key block s % 2).
fn scores(sgid: u32) {
    let rb = sgid / 2u;
    let kb = sgid % 2u;
    let qs = QS / 2u;
    var acc = coop_mat16x16<f32, C>();
    for (var dd = 0u; dd < D; dd += 16u) {
        let ia = 16u * rb * QS + dd;
        let iah = ia / 2u;
        let ib = 16u * kb * QS + dd;
        let ibh = ib / 2u;
        let ah = coopLoadT<coop_mat16x16<f16, A>>(&qh[iah], qs);
        let al = coopLoadT<coop_mat16x16<f16, A>>(&ql[iah], qs);
        let bh = coopLoad<coop_mat16x16<f16, B>>(&kh[ibh], qs);
        let bl = coopLoad<coop_mat16x16<f16, B>>(&kl[ibh], qs);
        acc = coopMultiplyAdd(ah, bh, acc);
        acc = coopMultiplyAdd(ah, bl, acc);
        acc = coopMultiplyAdd(al, bh, acc);
    }
    let at = 16u * kb * M + 16u * rb;
    let ms = M;
    coopStore(acc, &sc[at], ms);
}

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sgid: u32,
) {
    let hd4 = D / 4u;
    let kvw4 = p.n_kv * hd4;
    let grp = p.n_heads / p.n_kv;
    let kvh = wid.x;
    let tile = p.n_tiles - 1u - wid.y;
    let pos0 = step.pos0;
    let r0 = tile * M;
    let r1 = min(r0 + M, p.n_tokens * grp);
    let k_begin = window_lo(pos0 + r0 / grp + 1u);
    let k_end = pos0 + (r1 - 1u) / grp + 1u;
    // The scalar phases: invocation li takes row li / 4 and keys 8·(li % 4) .. + 8 of a tile.
    let srow = li / 4u;
    let sk0 = 8u * (li % 4u);
    var hi = 0u;
    var lo = 0u;
    if r0 + srow < r1 {
        hi = pos0 + (r0 + srow) / grp + 1u;
        lo = window_lo(hi);
    }

    // q, scaled, as two halves (zeros for rows past the end).
    for (var i = li; i < M * hd4; i += WG) {
        let row = i / hd4;
        let d4 = i % hd4;
        let r = r0 + row;
        var v = vec4<f32>(0.0);
        if r < r1 {
            v = q[p.q_off + ((r / grp) * p.n_heads + kvh * grp + r % grp) * hd4 + d4] * p.scale;
        }
        let hb = split_hi(v);
        let at = row * QS + 4u * d4;
        let h = vec4<f16>(hb);
        let lw = vec4<f16>(v - hb);
        qh[at / 2u] = h.xy;
        qh[at / 2u + 1u] = h.zw;
        ql[at / 2u] = lw.xy;
        ql[at / 2u + 1u] = lw.zw;
    }
    let kbase = p.kc_off + kvh * hd4;
    let vbase = p.vc_off + kvh * hd4;

    // Pass 1: each row's max and sum of exp over its valid keys.
    var m = NEG_BIG;
    var l = 0.0;
    for (var kt = k_begin; kt < k_end; kt += NK) {
        stage_kv(li, false, kbase, kvw4, kt, k_end);
        workgroupBarrier();
        scores(sgid);
        workgroupBarrier();
        for (var j = sk0; j < sk0 + 8u; j++) {
            let key = kt + j;
            if key >= lo && key < hi {
                let s = sc[j * M + srow];
                let mn = max(m, s);
                l = l * exp(m - mn) + exp(s - mn);
                m = mn;
            }
        }
        // (The next tile's first barrier orders these reads before sc is written again.)
    }
    part_m[li] = m;
    part_l[li] = l;
    workgroupBarrier();
    if li < M {
        var mx = NEG_BIG;
        for (var k = 0u; k < 4u; k++) {
            mx = max(mx, part_m[4u * li + k]);
        }
        var sum = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let pm = part_m[4u * li + k];
            if pm > NEG_BIG {
                sum += part_l[4u * li + k] * exp(pm - mx);
            }
        }
        row_m[li] = mx;
        row_il[li] = select(0.0, 1.0 / sum, sum > 0.0);
    }
    workgroupBarrier();
    let rm = row_m[srow];
    let ril = row_il[srow];

    // Pass 2: P and o += P·V.
    let orb = sgid % 2u;
    let od0 = (sgid / 2u) * OB;
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    let qs = QS / 2u;
    let pss = PS / 2u;
    for (var kt = k_begin; kt < k_end; kt += NK) {
        stage_kv(li, false, kbase, kvw4, kt, k_end);
        workgroupBarrier();
        scores(sgid);
        workgroupBarrier();
        // P's halves for this invocation's 8 keys, and the V tile over the K tile (every
        // subgroup is done with K: the barrier above follows the scores).
        for (var j = sk0; j < sk0 + 8u; j += 4u) {
            var pv = vec4<f32>(0.0);
            for (var e = 0u; e < 4u; e++) {
                let key = kt + j + e;
                if key >= lo && key < hi {
                    pv[e] = exp(sc[(j + e) * M + srow] - rm) * ril;
                }
            }
            let hb = split_hi(pv);
            let h = vec4<f16>(hb);
            let lw = vec4<f16>(pv - hb);
            let at = srow * PS + j;
            ph[at / 2u] = h.xy;
            ph[at / 2u + 1u] = h.zw;
            pl[at / 2u] = lw.xy;
            pl[at / 2u + 1u] = lw.zw;
        }
        stage_kv(li, true, vbase, kvw4, kt, k_end);
        workgroupBarrier();
        for (var kk = 0u; kk < NK; kk += 16u) {
            let ia = 16u * orb * PS + kk;
            let iah = ia / 2u;
            let ah = coopLoadT<coop_mat16x16<f16, A>>(&ph[iah], pss);
            let al = coopLoadT<coop_mat16x16<f16, A>>(&pl[iah], pss);
            // V as B (key × dim), row-major: key kk + k, dim 16·db + n at (kk + k)·QS + 16·db + n.
            let i0 = kk * QS + 16u * od0;
            let i0h = i0 / 2u;
            let b0h = coopLoadT<coop_mat16x16<f16, B>>(&kh[i0h], qs);
            let b0l = coopLoadT<coop_mat16x16<f16, B>>(&kl[i0h], qs);
            o0 = coopMultiplyAdd(ah, b0h, o0);
            o0 = coopMultiplyAdd(ah, b0l, o0);
            o0 = coopMultiplyAdd(al, b0h, o0);
            if OB > 1u {
                let i1 = i0 + 16u;
                let i1h = i1 / 2u;
                let b1h = coopLoadT<coop_mat16x16<f16, B>>(&kh[i1h], qs);
                let b1l = coopLoadT<coop_mat16x16<f16, B>>(&kl[i1h], qs);
                o1 = coopMultiplyAdd(ah, b1h, o1);
                o1 = coopMultiplyAdd(ah, b1l, o1);
                o1 = coopMultiplyAdd(al, b1h, o1);
            }
            if OB > 2u {
                let i2 = i0 + 32u;
                let i2h = i2 / 2u;
                let b2h = coopLoadT<coop_mat16x16<f16, B>>(&kh[i2h], qs);
                let b2l = coopLoadT<coop_mat16x16<f16, B>>(&kl[i2h], qs);
                o2 = coopMultiplyAdd(ah, b2h, o2);
                o2 = coopMultiplyAdd(ah, b2l, o2);
                o2 = coopMultiplyAdd(al, b2h, o2);
            }
            if OB > 3u {
                let i3 = i0 + 48u;
                let i3h = i3 / 2u;
                let b3h = coopLoadT<coop_mat16x16<f16, B>>(&kh[i3h], qs);
                let b3l = coopLoadT<coop_mat16x16<f16, B>>(&kl[i3h], qs);
                o3 = coopMultiplyAdd(ah, b3h, o3);
                o3 = coopMultiplyAdd(ah, b3l, o3);
                o3 = coopMultiplyAdd(al, b3h, o3);
            }
        }
        workgroupBarrier(); // every subgroup is done with V and P before the next tile
    }

    // o out, one accumulator per subgroup at a time through sc (subgroup s's block at 256 s,
    // row-major), consecutive invocations writing consecutive dims of a row.
    put_out(li, o0, sgid, 0u, r0, r1, grp, kvh, hd4);
    if OB > 1u {
        put_out(li, o1, sgid, 1u, r0, r1, grp, kvh, hd4);
    }
    if OB > 2u {
        put_out(li, o2, sgid, 2u, r0, r1, grp, kvh, hd4);
    }
    if OB > 3u {
        put_out(li, o3, sgid, 3u, r0, r1, grp, kvh, hd4);
    }
}

fn put_out(li: u32, o: coop_mat16x16<f32, C>, sgid: u32, u: u32, r0: u32, r1: u32, grp: u32, kvh: u32, hd4: u32) {
    let s16 = 16u;
    let at = 256u * sgid;
    coopStoreT(o, &sc[at], s16);
    workgroupBarrier();
    for (var e = li; e < 1024u; e += WG) {
        let s = e / 256u;
        let i = (e % 256u) / 16u;
        let c = e % 16u;
        let row = 16u * (s % 2u) + i;
        let r = r0 + row;
        let dim = 16u * ((s / 2u) * OB + u) + c;
        if r < r1 {
            let ob = 4u * (p.out_off + ((r / grp) * p.n_heads + kvh * grp + r % grp) * hd4);
            out[ob + dim] = sc[e];
        }
    }
    workgroupBarrier();
}
