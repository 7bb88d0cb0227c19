enable f16;
enable wgpu_cooperative_matrix;
// The K split's epilogue (`park`) branches on the subgroup id around cooperative operations:
// only the subgroup must agree on those, which naga's uniformity analysis (workgroup-wide, under
// the derivative rule) cannot see.
diagnostic(off, derivative_uniformity);

// Token-batched quantized matrix multiply for prefill on the matrix units (tensor cores):
// matmul.wgsl's products (dense, GATED, GROUPED by expert; same Params, bindings and work list)
// with 16 × 16 × 16 f16 cooperative-matrix multiply-adds into f32 sums.
//
// Precision: weights are dequantized as in matmul.wgsl, then rounded to f16 (bf16 weights are
// exact in f16's normal range; a quantized weight d·c carries a relative error below 2^-12). x is
// split into two f16 halves, x = hi + lo with hi = x cut to 11 significant bits and lo =
// f16(x - hi), and both are multiplied (two multiply-adds per pair of tiles), so x keeps ~22
// bits; products and sums are f32. Rounding x
// to one f16 was measured to be too coarse: emulated on the CPU it moved a fixture's log-probs
// by up to 4.98 (router choices flip) and 0.026 with the routers kept f32, against 5e-5 with
// the split. Inputs beyond f16's range (|v| > 65504) would become infinite: the engine's GEMM
// inputs are normed hidden states, attention outputs and the experts' silu(g)·u.
//
// The wrapper uses this kernel only where the adapter lists a 16×16×16 f16 × f16 → f32
// configuration and runs subgroups of exactly 32 invocations.
//
// Tile: 128 weight rows × BN tokens, BK-position K-steps (64 by default: 3,664 against 3,368
// tok/s with 32 for the H200's 30B q4 prefill). The tile's 8 row blocks of 16 rows are shared by
// the workgroup's subgroups: with RB = 2 (dense bf16, 4 subgroups) subgroup s owns row blocks s
// and s + 4 across all the tile's token blocks; otherwise (8 subgroups, KSPLIT below) subgroups
// s and s + 4 both own row blocks s % 4 and s % 4 + 4 and split each K-step between them. GATED, the tile's first 64 rows are gate rows and the next 64 the
// same rows' up weights. Per K-step the weight tile is dequantized once into workgroup memory as
// f16 (row-major) and the x tile staged beside it (token-major, i.e. the B operand
// column-major); for bf16 the next step's raw bytes are loaded into registers before the current
// step is multiplied, as in matmul.wgsl (PREFETCH).
//
// RB = 1 (8 subgroups, 256 invocations) halves each invocation's staging and sums, so twice as
// many subgroups hide each other's load latencies; each B tile is then read by 8 subgroups
// instead of 4. Measured on the H200 (pp512 shapes, µs, against RB = 2): q4 experts gate_up
// 728.9 → 632.9, down 404.0 → 362.5, q_proj 125.7 → 118.3; bf16 gate_up 727.6 → 696.4, down
// 410.5 → 389.3, but bf16 q_proj 107.0 → 137.8, so dense bf16 (the one case with PREFETCH and
// a full token tile) keeps RB = 2. The engine's pp512 (q4): 5,390 → 5,872–5,935 tok/s. (That
// was before the K split, which since has each B tile read by 4 of the 8 subgroups again.)

override DTYPE: u32 = 2u; // 0 bf16, 1 q8, 2 q4, 3 q2
override BN: u32 = 64u;   // tokens per tile: 16, 32, 48 or 64
override GATED: bool = false;
override GROUPED: bool = false;
const BM: u32 = 128u;
override BK: u32 = 32u; // step positions per K-step: 32 or 64
// Row blocks per subgroup (see above) and invocations per workgroup.
override RB: u32 = select(1u, 2u, DTYPE == 0u && !GROUPED);
override WG: u32 = 256u / RB;
// K split (every product with RB = 1, i.e. all but dense bf16): subgroups s and s + 4 own the
// same two row blocks (s % 4 and s % 4 + 4) and take alternate 16-position substeps of every
// K-step, so that each B tile (x's two halves) is loaded from workgroup memory by 4 subgroups
// instead of 8 and each A tile feeds twice the multiply-adds: 4 + 4·NB cooperative loads per
// subgroup and step instead of 4 + 8·NB, for the same multiply-adds. The two halves' sums are
// added before they are written. H200, pp512 shapes, µs (same run, without → with): q4 experts
// gate_up 628.3 → 559.1, Zipf 732.3 → 666.8, down 359.6 → 338.2, q_proj 112.3 → 96.9, qkv
// 165.4 → 142.5; q8 and q2 alike. The engine's pp512 (q4): 6,145 and 6,136 → 6,607 and 6,635
// tok/s. Dense bf16 with 8 subgroups and the split: q_proj 117.9 against 107.0 for RB = 2.
// (Derived, not set by the host: with RB = 2 there are only 4 subgroups, one per row-block pair.)
override KSPLIT: bool = RB == 1u;
// Output rows per tile.
override OR: u32 = select(BM, BM / 2u, GATED);
// Token blocks of 16.
override NB: u32 = BN / 16u;
// f16s between tile rows: BK plus 8 of padding, so that the rows' 16-byte pieces spread over
// the banks.
override TS: u32 = BK + 8u;
// Step positions per staging piece: one 16-byte chunk of bf16, else 16 codes (two pieces share
// a q4 chunk, four a q2 one: loading a whole q4 chunk per invocation instead was slower,
// H200 pp512 q4 experts gate_up 908 → 964 µs, down 490 → 526).
override PV: u32 = select(16u, 8u, DTYPE == 0u);
override CPV: u32 = 8u << DTYPE;
override W_PIECES: u32 = BM * BK / PV;
override X_PIECES: u32 = BN * BK / 4u;
override WP: u32 = (W_PIECES + WG - 1u) / WG;
override XP: u32 = (X_PIECES + WG - 1u) / WG;
const MAXP: u32 = 8u;
// Whether a step's global loads are issued before the previous step is multiplied (held in
// registers meanwhile) or at the start of their own step. Measured on the H200 (pp512 shapes,
// µs): bf16 needs the overlap (q_proj 107 against 155 without), the quantized types run faster
// without it (q4 with f16 decoding: q_proj 130 → 126, experts gate_up 785 → 738, down 430 → 408),
// presumably from the registers it frees.
override PREFETCH: bool = DTYPE == 0u;

// Every workgroup variable is a multiple of 16 bytes (`unit` a vec4, not a vec3): the H200's
// driver appears to round a cooperative load's address down to 16 bytes, and placed after a
// 12-byte `unit` the f16 tiles started at 12 mod 16, so loads at non-zero offsets read 6
// elements early (measured: a load at ws[16] returned ws[10..]). Row strides (TS = BK + 8
// halves: 80 bytes, or 144 with BK = 64) and step offsets (16 halves) keep every load 16-byte
// aligned from there.
// The tiles are arrays of f16 pairs, written two halves per store; the cooperative loads read
// them through a pointer to a pair, with strides in pairs (SPIR-V's cooperative load takes a
// pointer to a scalar or vector and counts its stride in those elements; llama.cpp's Vulkan
// GEMM does the same). H200, pp512, µs, against single f16 elements: bf16 q_proj 111.0 → 107.9,
// qkv 165.5 → 160.1, experts gate_up 702.2 → 675.5, down 402.1 → 388.9; q4 q_proj 115.7 →
// 113.3, qkv 172.2 → 167.7, experts unchanged (635 → 638, 368 → 365). (Pairs of pairs, vec4
// stores, made bf16 q_proj slower: 146.9.)
// Weight tile: row i, step position kk at ws[(i * TS + kk) / 2] (kk even).
var<workgroup> ws: array<vec2<f16>, BM * TS / 2u>;
// x tile, high and low halves: token t, step position kk at xs[(t * TS + kk) / 2] and xl[...].
var<workgroup> xs: array<vec2<f16>, BN * TS / 2u>;
var<workgroup> xl: array<vec2<f16>, BN * TS / 2u>;
// One token block's sums, parked: row block b's 16 × 16 block (token-major) at 256 b.
var<workgroup> cs: array<f32, 2048>;
var<workgroup> tok: array<u32, BN>;
var<workgroup> xrow: array<u32, BN>;
var<workgroup> unit: vec4<u32>;

fn put4(at: u32, v: vec4<f32>) {
    put4h(at, vec4<f16>(v));
}

fn put4h(at: u32, h: vec4<f16>) {
    ws[at / 2u] = h.xy;
    ws[at / 2u + 1u] = h.zw;
}

// q8 and q4: dequant4's values computed in f16, two at a time. A code c becomes the f16 1024 + c
// by setting the exponent bits above it (c < 1024 fits the mantissa), the offset is subtracted
// exactly, and the product with the group's f16 scale is rounded once, as the f32 product
// rounded to f16 is (both factors have at most 11 significant bits, so the f32 product is
// exact): the same values as dequant4's, without the conversions. H200 pp512, q4, µs: q_proj
// 157 → 130, experts gate_up 916 → 785, down 493 → 430.
fn dequant4h(q: vec4<u32>, pw: u32, p0: u32, j: u32) -> vec4<f16> {
    let d = f16(unpack2x16float(pw)[(p0 / 64u) % 2u]);
    // Codes of positions p0 + 4j + (0, 2) in a's halves, + (1, 3) in b's, and their offset:
    // q8's signed bytes as c + 128 (the sign bit flipped), q4's nibbles as c (value c - 8).
    var v = q[j];
    var m = 0x00ff00ffu;
    var off = 1152.0h;
    if DTYPE == 2u {
        v = (v >> (4u * ((p0 / 16u) % 2u))) & 0x0f0f0f0fu;
        m = 0x000f000fu;
        off = 1032.0h;
    } else {
        v ^= 0x80808080u;
    }
    // (naga 30 mistypes a bitcast from u32 to vec2<f16>: the f16 pair goes through f32, exactly.)
    let a = vec2<f16>(unpack2x16float((v & m) | 0x64006400u));
    let b = vec2<f16>(unpack2x16float(((v >> 8u) & m) | 0x64006400u));
    return (vec4<f16>(a.x, b.x, a.y, b.y) - vec4<f16>(off)) * d;
}

// Which invocation loads what: consecutive invocations take consecutive pieces of one row
// (weights) or token (x), so that a subgroup's global loads cover whole 32-byte sectors (the
// rows are kilobytes apart). Measured on the H200 against consecutive rows and tokens
// (pp512 shapes; q4 / bf16): q_proj 196.2 → 157.6 / 156.0 → 107.0 µs, experts gate_up
// 988.8 → 908.2 / 947.0 → 727.2, down 528.6 → 490.3 / 526.1 → 410.9.
fn w_piece(d: u32) -> vec2<u32> {
    return vec2<u32>(d / (BK / PV), (d % (BK / PV)) * PV);
}

fn x_piece(d: u32) -> vec2<u32> {
    return vec2<u32>(d / (BK / 4u), 4u * (d % (BK / 4u)));
}

fn store_step(li: u32, c0: u32) {
    for (var n = 0u; n < WP; n++) {
        let d = li + n * WG;
        if d < W_PIECES {
            let wp = w_piece(d);
            let at = wp.x * TS + wp.y;
            for (var j = 0u; j < PV / 4u; j++) {
                if DTYPE == 1u || DTYPE == 2u {
                    put4h(at + 4u * j, dequant4h(wraw[n], wpar[n], c0 + wp.y, j));
                } else {
                    put4(at + 4u * j, dequant4(wraw[n], wpar[n], c0 + wp.y, j));
                }
            }
        }
    }
    for (var n = 0u; n < XP; n++) {
        let d = li + n * WG;
        if d < X_PIECES {
            let xp = x_piece(d);
            let at = xp.x * TS + xp.y;
            // hi: x with its mantissa cut to f16's 10 bits (by masking, which no compiler folds
            // away: f32(f16(x)) was, leaving lo zero); lo: the exact rest, rounded to f16.
            let hb = bitcast<vec4<f32>>(bitcast<vec4<u32>>(xraw[n]) & vec4<u32>(0xffffe000u));
            let h = vec4<f16>(hb);
            let l = vec4<f16>(xraw[n] - hb);
            xs[at / 2u] = h.xy;
            xs[at / 2u + 1u] = h.zw;
            xl[at / 2u] = l.xy;
            xl[at / 2u + 1u] = l.zw;
        }
    }
}

// Writes token block j's sums, parked in cs: row block b's element (row m, token n) at
// 256 b + 16 n + m; GATED, the up sums of output row o are 4 blocks after its gate sums.
// Consecutive invocations write consecutive rows of one token.
fn store_block(li: u32, r0: u32, j: u32) {
    for (var e = li; e < 16u * OR; e += WG) {
        let n = e / OR;
        let o = e % OR;
        let slot = tok[16u * j + n];
        if slot == INVALID || r0 + o >= p.rows {
            continue;
        }
        let at = 256u * (o / 16u) + 16u * n + o % 16u;
        let g = cs[at];
        var v = g;
        if GATED {
            v = g / (1.0 + exp(-g)) * cs[at + 1024u];
        }
        y[y_at(slot, r0 + o)] = v;
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sgid: u32,
) {
    let r0 = wid.x * OR;
    // The token tile (j0, count, expert), through workgroup memory so that the early return,
    // the barriers and the cooperative operations under it are provably uniform.
    if li == 0u {
        var r = vec4<u32>(wid.y * BN, min(BN, p.n_tok - wid.y * BN), 0u, 0u);
        if GROUPED {
            r = vec4<u32>(0u); // past the count: nothing to do
            if wid.y < units[0] {
                let u = units[1u + wid.y];
                let e = u >> 20u;
                let jb = starts[e] + (u & 0xfffffu) * BN;
                r = vec4<u32>(jb, min(jb + BN, starts[e + 1u]) - jb, e, 0u);
            }
        }
        unit = r;
    }
    let r = workgroupUniformLoad(&unit);
    if r.y == 0u {
        return;
    }
    let j0 = r.x;
    let nvalid = r.y;
    let wbase = p.w_off + r.z * p.w_mat_stride;
    stage_tokens(li, j0, nvalid);
    workgroupBarrier();
    // Token blocks past the tile's valid tokens are skipped (uniform: nvalid is).
    let nb = min(NB, (nvalid + 15u) / 16u);
    // g: row block rs's sums per token block; h: row block rs + 4's. Every subgroup owns a
    // row-block pair: subgroup s pair s with RB = 2, pair s % 4 (and K half s / 4) with RB = 1.
    let rs = select(sgid, sgid % 4u, KSPLIT);
    let kh = select(0u, sgid / 4u, KSPLIT);
    let kstep = select(16u, 32u, KSPLIT);
    var g0 = coop_mat16x16<f32, C>();
    var g1 = coop_mat16x16<f32, C>();
    var g2 = coop_mat16x16<f32, C>();
    var g3 = coop_mat16x16<f32, C>();
    var h0 = coop_mat16x16<f32, C>();
    var h1 = coop_mat16x16<f32, C>();
    var h2 = coop_mat16x16<f32, C>();
    var h3 = coop_mat16x16<f32, C>();
    let ts = TS / 2u;
    if PREFETCH {
        load_step(li, 0u, wbase, r0);
    }
    for (var c0 = 0u; c0 < p.cols; c0 += BK) {
        if !PREFETCH {
            load_step(li, c0, wbase, r0);
        }
        workgroupBarrier();
        store_step(li, c0);
        workgroupBarrier();
        if PREFETCH && c0 + BK < p.cols {
            load_step(li, c0 + BK, wbase, r0);
        }
        for (var kb = 0u; kb < BK; kb += kstep) {
            // (Every index a `let` of its own: naga's SPIR-V writer wants them evaluated.)
            let kk = kb + 16u * kh;
            let ia = 16u * rs * TS + kk;
            let ib = (64u + 16u * rs) * TS + kk;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&ws[ia / 2u], ts);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&ws[ib / 2u], ts);
            let i0 = kk;
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&xs[i0 / 2u], ts);
            let l0 = coopLoad<coop_mat16x16<f16, B>>(&xl[i0 / 2u], ts);
            g0 = coopMultiplyAdd(a0, b0, g0);
            g0 = coopMultiplyAdd(a0, l0, g0);
            h0 = coopMultiplyAdd(a1, b0, h0);
            h0 = coopMultiplyAdd(a1, l0, h0);
            if nb > 1u {
                let i1 = 16u * TS + kk;
                let b1 = coopLoad<coop_mat16x16<f16, B>>(&xs[i1 / 2u], ts);
                let l1 = coopLoad<coop_mat16x16<f16, B>>(&xl[i1 / 2u], ts);
                g1 = coopMultiplyAdd(a0, b1, g1);
                g1 = coopMultiplyAdd(a0, l1, g1);
                h1 = coopMultiplyAdd(a1, b1, h1);
                h1 = coopMultiplyAdd(a1, l1, h1);
            }
            if nb > 2u {
                let i2 = 32u * TS + kk;
                let b2 = coopLoad<coop_mat16x16<f16, B>>(&xs[i2 / 2u], ts);
                let l2 = coopLoad<coop_mat16x16<f16, B>>(&xl[i2 / 2u], ts);
                g2 = coopMultiplyAdd(a0, b2, g2);
                g2 = coopMultiplyAdd(a0, l2, g2);
                h2 = coopMultiplyAdd(a1, b2, h2);
                h2 = coopMultiplyAdd(a1, l2, h2);
            }
            if nb > 3u {
                let i3 = 48u * TS + kk;
                let b3 = coopLoad<coop_mat16x16<f16, B>>(&xs[i3 / 2u], ts);
                let l3 = coopLoad<coop_mat16x16<f16, B>>(&xl[i3 / 2u], ts);
                g3 = coopMultiplyAdd(a0, b3, g3);
                g3 = coopMultiplyAdd(a0, l3, g3);
                h3 = coopMultiplyAdd(a1, b3, h3);
                h3 = coopMultiplyAdd(a1, l3, h3);
            }
        }
    }
    // Token block by token block, the subgroups park their sums in cs, then the workgroup
    // writes them out.
    park(g0, h0, rs, kh);
    workgroupBarrier();
    store_block(li, r0, 0u);
    workgroupBarrier();
    if nb > 1u {
        park(g1, h1, rs, kh);
        workgroupBarrier();
        store_block(li, r0, 1u);
        workgroupBarrier();
    }
    if nb > 2u {
        park(g2, h2, rs, kh);
        workgroupBarrier();
        store_block(li, r0, 2u);
        workgroupBarrier();
    }
    if nb > 3u {
        park(g3, h3, rs, kh);
        workgroupBarrier();
        store_block(li, r0, 3u);
    }
}

// Parks one token block's sums in cs: row block rs's at 256 rs, rs + 4's at 256 (rs + 4). Under KSPLIT the second K half's subgroups park first and the first half's add
// their own to what they find (subgroup-uniform branches: cooperative operations need only the
// subgroup to agree).
fn park(g: coop_mat16x16<f32, C>, h: coop_mat16x16<f32, C>, rs: u32, kh: u32) {
    let cg = 256u * rs;
    let ch = cg + 1024u;
    let s16 = 16u;
    if KSPLIT {
        if kh == 1u {
            coopStore(g, &cs[cg], s16);
            coopStore(h, &cs[ch], s16);
        }
        workgroupBarrier();
        if kh == 0u {
            let sg = g + coopLoad<coop_mat16x16<f32, C>>(&cs[cg], s16);
            let sh = h + coopLoad<coop_mat16x16<f32, C>>(&cs[ch], s16);
            coopStore(sg, &cs[cg], s16);
            coopStore(sh, &cs[ch], s16);
        }
    } else {
        coopStore(g, &cs[cg], s16);
        coopStore(h, &cs[ch], s16);
    }
}
