// Chunked causal prefill attention (CPU twin: cpu::ops::attention), flash-attention style.
//
// A workgroup owns M rows of one KV head: rows are (query token, q head of the GQA group) pairs,
// head fastest, so a tile holds M / group tokens with all of their group's heads and every K/V
// tile is loaded once for all of them. It walks the keys from the first row's window start to
// the last row's position, BK at a time, with an online softmax per row (running max m, sum l,
// output o rescaled by exp(m_old - m_new)). Rows differ in their causal/window bounds and are
// masked per key.
//
// Invocations form TY = M/4 row groups × TX = 8 columns; invocation (ty, tx) owns rows
// 4ty..4ty+3 throughout:
// - scores S = q·k (scale folded into q): keys 4tx..4tx+3 of the tile, summed over the head
//   dimension DS dims per step, the q and k slices of the step staged transposed (qs[dim][row],
//   ks[dim][key]) so that one vec4 of each gives 16 FMAs;
// - the row max over the tile's keys is merged through workgroup memory (red[tx][row]); each
//   invocation keeps its own partial l (its keys only) and the partials are added at the end;
// - P goes to workgroup memory (ps[key][row]) and o += P·V runs over V chunks of KVC keys
//   (vs[key][dim]), the invocation owning dims 4(tx + 8k).. for k < OD: 4 rows × 4·OD dims of o
//   in registers (64 for head_dim 128).
// q is staged again at every key tile: all of a workgroup's (32 KiB at 64 rows × head_dim 128)
// would not fit beside the tiles; it comes from L1/L2, as many bytes as the K and V tiles.
// Staging areas of the phases share one array (`stage`): they are never live at the same time.
// Workgroup (x, y, z) = (KV head, row tile from the last, unit of its keys): the dispatch order
// runs through the longest tiles of every KV head first (the last rows see the most keys), so
// the short ones fill in behind them instead of one long tile starting last; with SPLITS > 1 a
// long tile's keys are also shared by several workgroups (attn_prefill_common.wgsl, prepended;
// attn_prefill_merge.wgsl combines them).
// f32 throughout, no subgroup operations. `smoe bench kernels --shape attn` times it, in every
// tile shape, beside attn_decode on the same chunk.

// Largest OD: head_dim ≤ 256.
const OD_MAX: u32 = 8u;

override DS: u32 = 16u;    // head dims per score step, a multiple of 8
override OD: u32 = 4u;     // vec4s of o per row and invocation: ceil(head_dim / 32)
override KVC: u32 = 16u;   // keys per V chunk, dividing BK
override STAGE: u32 = 512u; // vec4s of `stage`: ≥ DS·(M + BK)/4, 2M and KVC·8·OD
override WG: u32 = 2u * M; // (M / 4) × TX
// Row vec4s per key (ps, red) and dim steps of q staged per invocation.
override M4: u32 = M / 4u;
override QP: u32 = DS / 8u;
// V chunk row stride in vec4s, padded with zeros past head_dim so the o loop needs no guard.
override VS: u32 = TX * OD;

@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;
// SPLITS > 1: the units' unnormalised outputs (vec4 (unit·M + row)·head_dim/4 + dim/4) and, from
// p.ml_off, their rows' (max, sum, -, -).
@group(0) @binding(6) var<storage, read_write> part: array<vec4<f32>>;
// MERGE: a counter per (KV head, tile), and `part` again for atomic loads.
@group(0) @binding(7) var<storage, read_write> done: array<atomic<u32>>;
@group(0) @binding(8) var<storage, read_write> parta: array<atomic<u32>>;

// Split tiles: the last unit of each tile to finish merges them (merge_tile) instead of
// attn_prefill_merge's pass — as attn_decode's MERGE: publish (storageBarrier), count in on
// done[tile], read the others' partials with atomic loads. Vulkan only.
override MERGE: bool = false;

fn part_vec(i: u32) -> vec4<f32> {
    return vec4<f32>(
        bitcast<f32>(atomicLoad(&parta[4u * i])),
        bitcast<f32>(atomicLoad(&parta[4u * i + 1u])),
        bitcast<f32>(atomicLoad(&parta[4u * i + 2u])),
        bitcast<f32>(atomicLoad(&parta[4u * i + 3u])),
    );
}

// Probabilities of the tile: ps[key][row], 4 rows per vec4.
var<workgroup> ps: array<vec4<f32>, BK * M4>;
// Score step: qs at 0 (vec4 d·M4 + row/4), ks at DS·M4 (vec4 d·BK/4 + key/4).
// Softmax and end: red (vec4 tx·M4 + row/4). V chunk: vs (vec4 c·VS + dim/4).
var<workgroup> stage: array<vec4<f32>, STAGE>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let hd4 = p.head_dim / 4u;
    let kvw4 = p.n_kv * hd4;
    let grp = p.n_heads / p.n_kv;
    let kvh = wid.x;
    // Workgroups in dispatch order (x, then y, then z) take the longest tiles first, and all
    // units of a tile together (the dispatch is n_tiles × SPLITS in y and z).
    let lin = wid.y + wid.z * p.n_tiles;
    let tile = p.n_tiles - 1u - lin / SPLITS;
    let unit = lin % SPLITS;
    let pos0 = step.pos0;
    let tk = tile_keys(tile);
    let r0 = tk.r0;
    let r1 = tk.r1;
    let ty = li / TX;
    let tx = li % TX;
    // This workgroup's unit of the tile's keys: whole key tiles (so no key tile straddles two
    // units), none past the tile's last key.
    if unit >= tk.n_units {
        return;
    }
    let k_end = tk.k_end;
    let kb = min(tk.k_begin + unit * tk.unit_len, k_end);
    let ke = min(kb + tk.unit_len, k_end);
    // This invocation's rows: keys lo[i] <= key < hi[i]; none for rows past the end.
    var lo = vec4<u32>(0u);
    var hi = vec4<u32>(0u);
    for (var i = 0u; i < 4u; i++) {
        let r = r0 + 4u * ty + i;
        if r < r1 {
            hi[i] = pos0 + r / grp + 1u;
            lo[i] = window_lo(hi[i]);
        }
    }
    // The row this invocation stages q for (the same at every step), past the end: none.
    let qrow = li % M;
    let qr = r0 + qrow;
    var qbase = 0xffffffffu;
    if qr < r1 {
        qbase = p.q_off + ((qr / grp) * p.n_heads + kvh * grp + qr % grp) * hd4;
    }
    let kbase = p.kc_off + kvh * hd4;
    let vbase = p.vc_off + kvh * hd4;

    var m = vec4<f32>(NEG_BIG);
    var l = vec4<f32>(0.0);
    // o[i·OD_MAX + k]: row 4ty + i, dims 4(tx + TX·k)..
    var o: array<vec4<f32>, 4u * OD_MAX>;
    // s[i][j]: row 4ty + i, key kt + 4tx + j. Declared out here and cleared explicitly: a
    // declaration inside the loop relies on every backend re-initialising it per iteration.
    var s: array<vec4<f32>, 4>;
    for (var kt = kb; kt < ke; kt += BK) {
        for (var i = 0u; i < 4u; i++) {
            s[i] = vec4<f32>(0.0);
        }
        for (var d0 = 0u; d0 < p.head_dim; d0 += DS) {
            workgroupBarrier(); // the previous step (or tile) is done with stage
            for (var n = 0u; n < QP; n++) {
                let d4 = li / M + 2u * n;
                let g4 = d0 / 4u + d4;
                var v = vec4<f32>(0.0);
                if qbase != 0xffffffffu && g4 < hd4 {
                    v = q[qbase + g4] * p.scale;
                }
                for (var e = 0u; e < 4u; e++) {
                    stage[(4u * d4 + e) * M4 + qrow / 4u][qrow % 4u] = v[e];
                }
            }
            for (var i = li; i < BK * DS / 4u; i += WG) {
                let key = i % BK;
                let d4 = i / BK;
                let g4 = d0 / 4u + d4;
                let pos = kt + key;
                var v = vec4<f32>(0.0);
                // Positions past the last row's are never read: they may not exist.
                if pos < k_end && g4 < hd4 {
                    v = kc[kbase + pos * kvw4 + g4];
                }
                for (var e = 0u; e < 4u; e++) {
                    stage[DS * M4 + (4u * d4 + e) * (BK / 4u) + key / 4u][key % 4u] = v[e];
                }
            }
            workgroupBarrier();
            for (var d = 0u; d < DS; d++) {
                let qv = stage[d * M4 + ty];
                let kv = stage[DS * M4 + d * (BK / 4u) + tx];
                s[0] += qv.x * kv;
                s[1] += qv.y * kv;
                s[2] += qv.z * kv;
                s[3] += qv.w * kv;
            }
        }

        // Online softmax. Masked scores take no part in the max and get p = 0 (not
        // exp(NEG_BIG - NEG_BIG) = 1 while a row has seen no valid key yet).
        let keys = vec4<u32>(kt + 4u * tx) + vec4<u32>(0u, 1u, 2u, 3u);
        var valid: array<vec4<bool>, 4>;
        var mx = vec4<f32>(NEG_BIG);
        for (var i = 0u; i < 4u; i++) {
            valid[i] = (keys >= vec4<u32>(lo[i])) & (keys < vec4<u32>(hi[i]));
            let sv = select(vec4<f32>(NEG_BIG), s[i], valid[i]);
            mx[i] = max(max(sv.x, sv.y), max(sv.z, sv.w));
        }
        workgroupBarrier(); // every invocation has read the last ks
        stage[tx * M4 + ty] = mx;
        workgroupBarrier();
        var mn = m;
        for (var x = 0u; x < TX; x++) {
            mn = max(mn, stage[x * M4 + ty]);
        }
        let alpha = exp(m - mn);
        m = mn;
        var pr: array<vec4<f32>, 4>;
        for (var i = 0u; i < 4u; i++) {
            pr[i] = select(vec4<f32>(0.0), exp(s[i] - mn[i]), valid[i]);
        }
        l = l * alpha + vec4<f32>(
            dot(pr[0], vec4<f32>(1.0)),
            dot(pr[1], vec4<f32>(1.0)),
            dot(pr[2], vec4<f32>(1.0)),
            dot(pr[3], vec4<f32>(1.0)),
        );
        for (var j = 0u; j < 4u; j++) {
            ps[(4u * tx + j) * M4 + ty] = vec4<f32>(pr[0][j], pr[1][j], pr[2][j], pr[3][j]);
        }
        for (var k = 0u; k < OD; k++) {
            o[k] *= alpha.x;
            o[OD_MAX + k] *= alpha.y;
            o[2u * OD_MAX + k] *= alpha.z;
            o[3u * OD_MAX + k] *= alpha.w;
        }

        // o += P·V, KVC keys at a time.
        for (var c0 = 0u; c0 < BK; c0 += KVC) {
            workgroupBarrier(); // ps is written, red and the previous chunk are read
            for (var i = li; i < KVC * VS; i += WG) {
                let c = i / VS;
                let d4 = i % VS;
                let pos = kt + c0 + c;
                var v = vec4<f32>(0.0);
                if pos < k_end && d4 < hd4 {
                    v = vc[vbase + pos * kvw4 + d4];
                }
                stage[i] = v;
            }
            workgroupBarrier();
            for (var c = 0u; c < KVC; c++) {
                let pc = ps[(c0 + c) * M4 + ty];
                for (var k = 0u; k < OD; k++) {
                    let v = stage[c * VS + tx + TX * k];
                    o[k] += pc.x * v;
                    o[OD_MAX + k] += pc.y * v;
                    o[2u * OD_MAX + k] += pc.z * v;
                    o[3u * OD_MAX + k] += pc.w * v;
                }
            }
        }
    }

    // Add up the row sums' partials (each invocation's keys), then normalise and store.
    workgroupBarrier();
    stage[tx * M4 + ty] = l;
    workgroupBarrier();
    var lt = vec4<f32>(0.0);
    for (var x = 0u; x < TX; x++) {
        lt += stage[x * M4 + ty];
    }
    let uid = (kvh * p.n_tiles + tile) * SPLITS + unit;
    for (var i = 0u; i < 4u; i++) {
        let r = r0 + 4u * ty + i;
        if r >= r1 {
            continue;
        }
        if tk.n_units == 1u {
            let ob = p.out_off + ((r / grp) * p.n_heads + kvh * grp + r % grp) * hd4;
            for (var k = 0u; k < OD; k++) {
                let d4 = tx + TX * k;
                if d4 < hd4 {
                    out[ob + d4] = o[i * OD_MAX + k] / lt[i];
                }
            }
        } else {
            // A row that saw no key of this unit leaves (NEG_BIG, 0) and zeros: weight 0.
            let pr = uid * M + 4u * ty + i;
            for (var k = 0u; k < OD; k++) {
                let d4 = tx + TX * k;
                if d4 < hd4 {
                    part[pr * hd4 + d4] = o[i * OD_MAX + k];
                }
            }
            if tx == 0u {
                part[p.ml_off + pr] = vec4<f32>(m[i], lt[i], 0.0, 0.0);
            }
        }
    }
    if MERGE && tk.n_units > 1u {
        // Whether this is the tile's last unit goes through stage[0] (every read of stage is
        // done): a workgroup variable of its own took 4 bytes more workgroup memory (24,580
        // instead of 24,576 at M = 64), and with them every M = 64 tile ran as if fewer
        // workgroups fitted an SM (H200, no splits: 512 tokens 181.8 → 154.9 µs, 512 tokens at
        // position 3,584 1,693.8 → 2,115.8; with 2 units 148.8 → 178.8).
        storageBarrier();
        workgroupBarrier();
        if li == 0u {
            let c = kvh * p.n_tiles + tile;
            let is_last = atomicAdd(&done[c], 1u) + 1u == tk.n_units;
            if is_last {
                atomicStore(&done[c], 0u);
            }
            stage[0] = vec4<f32>(select(0.0, 1.0, is_last));
        }
        if workgroupUniformLoad(&stage[0]).x != 0.0 {
            storageBarrier();
            merge_tile(kvh, tile, tk, li, WG);
        }
    }
}
