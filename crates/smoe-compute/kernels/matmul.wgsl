// Token-batched quantized matrix multiply for prefill (CPU twin: cpu::matmul).
//
// y[t, r] = Σ_c W[r, c] · x[t, c]. GATED: silu(G·x) · (U·x) with U at w_up_off from G. GROUPED:
// a stack of matrices (the experts of a layer), slot s reading x row s / x_div and writing y
// row s; workgroup (row tile, u) multiplies expert e by the u-th unit of expert_sort.wgsl's work
// list, one token tile of e's slots perm[starts[e]..starts[e + 1]]. A workgroup per (expert,
// token tile) rather than per expert, so that a popular expert's tiles run in parallel: with
// skewed routing one workgroup looping over an expert's hundreds of slots left the GPU idle.
//
// A register-tiled f32 GEMM (no subgroup operations, so any subgroup size works; on adapters with
// 16 × 16 f16 cooperative matrices matmul_coop.wgsl runs the same products on the matrix units). A workgroup owns BM weight rows × BN tokens; each
// invocation holds an 8-row × 4-token block of sums in registers. Per K-step of BK columns the
// weight tile is dequantized once into workgroup memory (so each weight is decoded once per BN
// tokens, not once per token as in matvec) and the x tile staged beside it; the next step's raw
// bytes are loaded into registers before the current step is multiplied, so global latency
// overlaps arithmetic. Products are f32 × f32 of exactly the CPU twin's dequantized values.
//
// Measured on an H200 (2026-11-30; 512-token chunk, Qwen3-30B shapes; FP32 peak ≈ 67 TFLOP/s):
// 25–27 TFLOP/s dense q_proj, 19–22 for the experts' gate_up and down (≈ 32 slots per
// expert), 2.3–13× the matvec path. Tried and slower there: 8 × 8 blocks per invocation (more
// registers, fewer workgroups per SM), double-buffered tiles (one barrier per step: 15–40 %
// slower), 32-column steps (more prefetch registers: 5–30 % slower).
//
// Layouts (chosen so that no workgroup-memory access conflicts on 32 banks):
// - ws[kk][BM/4] vec4s: weight value of tile row i at step position kk is component i % 4 of
//   vec4 kk·BM/4 + i/4. An invocation's rows are vec4s ir and ir + TR, i.e. rows 4ir..4ir+3 and
//   BM/2 + 4ir..: with GATED the first half of the tile holds G rows and the second the same U
//   rows, so each invocation owns both halves of its outputs.
// - xs[kk][BN/4] vec4s, likewise by token; an invocation's tokens are vec4 it.
// - A group of 32 invocations (one NVIDIA warp) covers 8 row vec4s × 4 token vec4s: per step
//   position, one 128-byte and one 64-byte workgroup read for 32 FMAs per invocation.
// - Step positions follow the storage order of the codes, which is the column order except for
//   q4, whose byte j of a 64-group holds columns j and j + 32: there position p is column p
//   with bits 4 and 5 swapped, and x is staged in that order.

override DTYPE: u32 = 2u; // 0 bf16, 1 q8, 2 q4, 3 q2
override BM: u32 = 128u;  // weight rows per tile: 64 or 128
override BN: u32 = 64u;   // tokens per tile: a multiple of 16, at most 128
override BK: u32 = 16u;   // step positions per K-step: 16 or 32
override GATED: bool = false;
override GROUPED: bool = false;
override TR: u32 = BM / 8u; // invocations along rows (8 rows each)
override TT: u32 = BN / 4u; // invocations along tokens (4 tokens each)
override WG: u32 = TR * TT;
// Output rows per tile.
override OR: u32 = select(BM, BM / 2u, GATED);
// Step positions one staging piece decodes: one 16-byte chunk of bf16, else 16 codes.
override PV: u32 = select(16u, 8u, DTYPE == 0u);
// Step positions per 16-byte chunk of codes.
override CPV: u32 = 8u << DTYPE;
override W_PIECES: u32 = BM * BK / PV;
override X_PIECES: u32 = BN * BK / 4u;
// Pieces per invocation (at most MAXP; the wrapper checks).
override WP: u32 = (W_PIECES + WG - 1u) / WG;
override XP: u32 = (X_PIECES + WG - 1u) / WG;
const MAXP: u32 = 4u;

var<workgroup> ws: array<vec4<f32>, BK * BM / 4u>;
var<workgroup> xs: array<vec4<f32>, BK * BN / 4u>;
// Per token of the tile: its token (GROUPED: slot) index, INVALID past the end; and the vec4
// index of its x row (a valid row even past the end, so staging needs no branch).
var<workgroup> tok: array<u32, BN>;
var<workgroup> xrow: array<u32, BN>;
// GROUPED: this workgroup's perm range and expert.
var<workgroup> unit: vec3<u32>;

fn put4(kk: u32, i: u32, v: vec4<f32>) {
    let at = kk * (BM / 4u) + i / 4u;
    let c = i % 4u;
    ws[at][c] = v.x;
    ws[at + BM / 4u][c] = v.y;
    ws[at + 2u * (BM / 4u)][c] = v.z;
    ws[at + 3u * (BM / 4u)][c] = v.w;
}

// Piece d's tile row and step offset: consecutive invocations, consecutive rows (so that the
// stores below touch consecutive banks).
fn w_piece(d: u32) -> vec2<u32> {
    return vec2<u32>(d % BM, (d / BM) * PV);
}

// Position 4·(d / BN).., token d % BN: consecutive invocations, consecutive tokens.
fn x_piece(d: u32) -> vec2<u32> {
    return vec2<u32>(d % BN, 4u * (d / BN));
}

// Decodes the loaded step (at position c0) into ws and xs.
fn store_step(li: u32, c0: u32) {
    for (var n = 0u; n < WP; n++) {
        let d = li + n * WG;
        if d < W_PIECES {
            let wp = w_piece(d);
            let i = wp.x;
            let kk = wp.y;
            let p0 = c0 + kk;
            for (var j = 0u; j < PV / 4u; j++) {
                put4(kk + 4u * j, i, dequant4(wraw[n], wpar[n], p0, j));
            }
        }
    }
    for (var n = 0u; n < XP; n++) {
        let d = li + n * WG;
        if d < X_PIECES {
            let xp = x_piece(d);
            let t = xp.x;
            let at = xp.y * (BN / 4u) + t / 4u;
            let c = t % 4u;
            let v = xraw[n];
            xs[at][c] = v.x;
            xs[at + BN / 4u][c] = v.y;
            xs[at + 2u * (BN / 4u)][c] = v.z;
            xs[at + 3u * (BN / 4u)][c] = v.w;
        }
    }
}

// Writes the sums of token vec4 tv: acc[i] for i < 4 are rows r0 + 4ir + i, the others BM/2
// further (GATED: the up sums of the same rows). Rows and tokens past the end are dropped.
fn store_sums(r0: u32, tv: u32, ir: u32, acc: array<vec4<f32>, 8>) {
    for (var c = 0u; c < 4u; c++) {
        let s = tok[4u * tv + c];
        if s == INVALID {
            continue;
        }
        for (var i = 0u; i < 4u; i++) {
            let o = r0 + 4u * ir + i;
            if GATED {
                if o < p.rows {
                    let g = acc[i][c];
                    y[y_at(s, o)] = g / (1.0 + exp(-g)) * acc[i + 4u][c];
                }
            } else {
                if o < p.rows {
                    y[y_at(s, o)] = acc[i][c];
                }
                if o + BM / 2u < p.rows {
                    y[y_at(s, o + BM / 2u)] = acc[i + 4u][c];
                }
            }
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // Invocation → (row vec4 ir, token vec4 it), 32 consecutive invocations covering 8 × 4.
    let lane = li % 32u;
    let blk = li / 32u;
    let ir = lane % 8u + 8u * (blk % (TR / 8u));
    let it = lane / 8u + 4u * (blk / (TR / 8u));
    let r0 = wid.x * OR;
    var wbase = p.w_off;
    // The token tile: tokens (GROUPED: perm indices) j0..j0 + nvalid, 1 <= nvalid <= BN.
    var j0 = wid.y * BN;
    var nvalid = min(BN, p.n_tok - j0);
    if GROUPED {
        if li == 0u {
            var r = vec3<u32>(0u); // past the count: nothing to do
            if wid.y < units[0] {
                let w = units[1u + wid.y];
                let e = w >> 20u;
                let jb = starts[e] + (w & 0xfffffu) * BN;
                r = vec3<u32>(jb, min(jb + BN, starts[e + 1u]) - jb, e);
            }
            unit = r;
        }
        // Through workgroup memory so that the early return and the barriers after it are
        // provably uniform.
        let r = workgroupUniformLoad(&unit);
        if r.y == 0u {
            return;
        }
        j0 = r.x;
        nvalid = r.y;
        wbase += r.z * p.w_mat_stride;
    }
    stage_tokens(li, j0, nvalid);
    workgroupBarrier();
    // Sums: *0..*3 the rows 4ir.., *4..*7 the rows BM/2 + 4ir.. (GATED: their up sums).
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    load_step(li, 0u, wbase, r0);
    for (var c0 = 0u; c0 < p.cols; c0 += BK) {
        // Nobody may still read the previous step's tiles.
        workgroupBarrier();
        store_step(li, c0);
        workgroupBarrier();
        if c0 + BK < p.cols {
            load_step(li, c0 + BK, wbase, r0);
        }
        // Invocations whose 4 tokens are all past the end skip the arithmetic: in a partly
        // filled tile (an expert with few slots) whole warps then idle and leave the SM to
        // other workgroups.
        if 4u * it < nvalid {
            for (var kk = 0u; kk < BK; kk++) {
                let wa = ws[kk * (BM / 4u) + ir];
                let wb = ws[kk * (BM / 4u) + ir + TR];
                let xa = xs[kk * (BN / 4u) + it];
                a0 += wa.x * xa;
                a1 += wa.y * xa;
                a2 += wa.z * xa;
                a3 += wa.w * xa;
                a4 += wb.x * xa;
                a5 += wb.y * xa;
                a6 += wb.z * xa;
                a7 += wb.w * xa;
            }
        }
    }
    store_sums(r0, it, ir, array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7));
}
