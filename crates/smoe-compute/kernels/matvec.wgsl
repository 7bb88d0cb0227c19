// Quantized matrix × activations for decode and small batches (CPU twin: cpu::matmul).
//
// y[s, t, r] = Σ_c W_s[r, c] · x[s, t, c] for up to NT tokens per workgroup. W_s is one matrix, or
// (GROUPED) matrix ids[s] of a stack of equal-shaped matrices: all routed experts of a layer in
// one dispatch. GATED computes silu(G·x) · (U·x) from two matrices in one pass over x.
//
// Work split: a workgroup owns ROWS consecutive rows, i.e. a list of items — a row (GATED: its
// gate row and its up row), or under REDUCE a (row, slot) pair. Subgroup sg takes items
// sg·U .. sg·U + U − 1, then nsg·U further on, ... (uniform within a subgroup, so any subgroup
// size works); lane l of an item reads 16-byte chunks l, l + ss, l + 2·ss, ... (ss: the subgroup
// size). A lane first loads S chunks of each of its U items — U·S loads in flight — and only then
// multiplies: decode products are small, and a loop that waited for each item's loads in turn
// was bound by memory latency (the 30B down × 8 experts: 16 items per subgroup, 16 round trips
// to HBM). The inputs are staged in workgroup memory TILE columns at a time, so any width fits. Dequantization is an epilogue per chunk: integer codes are dotted with
// x, then scaled by the group's d (q2: plus m·Σx). Storage layout: smoe_vault::quant.
//
// Fusions (override constants, so an unfused dispatch pays nothing): NORM stages RMSNorm(x)·nw
// instead of x (every workgroup recomputes each token's sum of squares: a read of x it stages
// anyway, instead of a dependent dispatch); ACCUM adds the result to y (a residual add); REDUCE
// (with GROUPED) sums the k slots of each output row with weights rw: y[t] = Σ_j rw[t·k + j] ·
// W_{ids[t·k + j]} · x[t·k + j], the weighted sum of a token's routed experts.
//
// Tails (TAIL, for decode): work that needs every workgroup's output runs in the dispatch's last
// workgroup instead of a dependent dispatch (on an H200 ~4 µs each however small). Each workgroup
// publishes its outputs (storageBarrier: a device-scope release) and counts itself in on a
// counter of `done`; the one that brings it to tail_n reads the others' outputs through `ya` (the
// same buffer as y, read with atomic loads, which never hit a stale per-core cache), runs the
// tail and resets the counter. No workgroup waits for another, so this needs no co-residency.
// TAIL 1 (router): softmax top-k of each token's logits (topk.wgsl) into tids and tacc — the
// router kernel's work. TAIL 2 (experts' down, grouped, one output row block per dispatch x):
// tacc[t, r] += Σ_s rw[t·k + s] · y[t·k + s, r] over the k = tail_k slots of each token for the
// block's rows — the weighted sum of a token's experts into the residual (weighted_sum.wgsl).
// TAIL 3 (one token, ACCUM: the attention's output projection, whose y is the residual stream):
// the next MoE block's router, which would otherwise be its own dispatch after this one. Its
// logits are (W_r · (g ⊙ y)) · inv_rms(y): a sum over y's rows, and each workgroup owns ROWS of
// them, so each writes partial logits of every expert over its rows, and the partial sum of
// squares, to `rp`; the last of each RG workgroups sums their partials into a second level, the
// last of those sums that, scales by inv_rms, runs the softmax top-k into tids / tacc and writes
// the normed row g ⊙ y · inv_rms to hn (the experts' input). Two levels keep each summing
// workgroup's loads few and independent (RG per invocation, all in flight at once) where one
// last workgroup reading every partial would wait on hundreds in turn.
//
// Staged layout: the VPC vec4s of x that chunk k needs are stored "chunk-minor", vec4 i of chunk
// k of token t at (t·VPC + i)·NCH + k, so the lanes of a subgroup, which work on consecutive
// chunks, read consecutive vec4s: no bank conflicts. (In x's natural order a q4 chunk's inputs
// sit 64 bytes apart from the next lane's: 4-way conflicts, 8-way and worse for q2, which made
// the first version bound by workgroup-memory reads — 20 % of copy bandwidth for q4 on an H200.)

struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_stride: u32,   // vec4<u32> per stored row
    w_off: u32,        // vec4 index of row 0 of matrix 0, relative to the binding
    w_mat_stride: u32, // vec4s between stacked matrices (GROUPED)
    w_up_off: u32,     // vec4s from the gate matrix to the up matrix (GATED)
    param_word: u32,   // u32 index within a row where the f16 group parameters start
    x_off: u32,        // vec4 index of x for slot 0, token 0
    x_tok: u32,        // vec4s between tokens
    x_slot: u32,       // vec4s between slots (0: every slot reads the same x)
    y_off: u32,        // f32 index of y for slot 0, token 0
    y_tok: u32,
    y_slot: u32,
    ids_off: u32,
    x_div: u32,        // consecutive slots that share one x (the k experts of one token); >= 1
    nw_off: u32,       // NORM: vec4 index of the norm weight
    eps: f32,          // NORM
    rw_off: u32,       // REDUCE: f32 index of slot 0's weight
    hn_off: u32,       // NORM_OUT: vec4 index of token 0's normed row
    hn_per: u32,       // NORM_OUT: vec4s of the normed rows each workgroup (dispatch x) writes
    tail_n: u32,       // TAIL: workgroups per counter
    tail_k: u32,       // TAIL: k (router), slots per token (sum)
    tail_norm: u32,    // TAIL 1: renormalize the k probabilities
    tail_a: u32,       // TAIL 1: index of token 0's first id in tids; TAIL 2: f32 index of tacc
    tail_b: u32,       // TAIL 1: index of token 0's first weight in tacc
    r_off: u32,        // TAIL 3: u32 index of the router's row 0 (bf16 pairs)
    r_stride: u32,     // TAIL 3: u32s per router row
}

override DTYPE: u32 = 2u; // 0 bf16, 1 q8, 2 q4, 3 q2; q4 variants: 4 float bits, 5 int8 dot, 6 pairs (see chunk)
override NT: u32 = 1u; // tokens per workgroup, at most NT_MAX
override TILE: u32 = 4096u; // columns staged per pass, a multiple of 64
override ROWS: u32 = 16u; // rows per workgroup
override WG: u32 = 128u;
override GATED: bool = false;
override GROUPED: bool = false;
override NORM: bool = false;
override ACCUM: bool = false;
override REDUCE: bool = false;
// With NORM: also write the normed inputs to hn, each workgroup (dispatch x) its share of the
// columns, so that later products of the same input read them instead of renormalizing.
override NORM_OUT: bool = false;
// 0: none; 1: router top-k; 2: weighted sum of the slots into tacc; 3: the next router (see
// the header).
override TAIL: u32 = 0u;
// TAIL 1 and 3: the experts and k the tail's arrays hold.
override TAIL_E: u32 = 1u;
override TAIL_K: u32 = 1u;
// vec4s of x per 16-byte chunk of codes: 8, 16, 32 or 64 inputs.
override VPC: u32 = select(select(select(16u, 8u, DTYPE == 2u || DTYPE >= 4u), 4u, DTYPE == 1u), 2u, DTYPE == 0u);
// Chunks per row and tile.
override NCH: u32 = TILE / (4u * VPC);
// 64-input groups per tile (q4: chunk pairs); at least 1 so that no constant folds to x / 0.
override NG: u32 = max(NCH / 2u, 1u);
override XS_LEN: u32 = NT * TILE / 4u;
override PART_LEN: u32 = ROWS * NT * 2u;
override XS_SUM_LEN: u32 = select(1u, NT * 2u * NCH, DTYPE == 4u || DTYPE == 5u);
override XQ_LEN: u32 = select(1u, XS_LEN, DTYPE == 5u);
override XD_LEN: u32 = select(1u, NT * NG, DTYPE == 5u);
const NT_MAX: u32 = 8u;
// Items per subgroup batch and chunks per lane and item loaded before use (the host picks them
// from the shape and the subgroup size; U·S ≤ LD).
override U: u32 = 1u;
override S: u32 = 2u;
const LD: u32 = 8u;
// An item past the rows.
const NONE: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> rw: array<f32>;
@group(0) @binding(7) var<storage, read_write> hn: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> done: array<atomic<u32>>;
@group(0) @binding(9) var<storage, read_write> tids: array<u32>;
@group(0) @binding(10) var<storage, read_write> tacc: array<f32>;
@group(0) @binding(11) var<storage, read_write> ya: array<atomic<u32>>;
// TAIL 3: the router's bf16 weights, and the partial sums (see the header).
@group(0) @binding(12) var<storage, read> wr: array<u32>;
@group(0) @binding(13) var<storage, read_write> rp: array<atomic<u32>>;
// TAIL 3: workgroups per first-level sum.
const RG: u32 = 16u;

var<workgroup> xs: array<vec4<f32>, XS_LEN>;
// q4 variants: per (token, half, chunk), DTYPE 4: Σx of the chunk's 16 low- or high-nibble
// inputs; DTYPE 5: Σ of their int8 codes.
var<workgroup> xsum: array<f32, XS_SUM_LEN>;
// DTYPE 5: the staged inputs quantized to int8, four to a u32 (same layout as xs), with one
// scale per 64 inputs (per chunk pair).
var<workgroup> xq: array<u32, XQ_LEN>;
var<workgroup> xd: array<f32, XD_LEN>;
// Per (row, token): the gate (or only) sum and the up sum, accumulated over tiles.
var<workgroup> part: array<f32, PART_LEN>;
// NORM: per (token, subgroup) partial sums of squares, then each token's 1/rms.
var<workgroup> ssq: array<f32, SSQ_LEN>;
var<workgroup> inv_rms: array<f32, NT_MAX>;
// REDUCE: per slot, the vec4 index of its expert's matrix and its router weight, read once per
// workgroup rather than from global memory for every (row, slot) item.
var<workgroup> slot_base: array<u32, NT_MAX>;
var<workgroup> slot_w: array<f32, NT_MAX>;
override SSQ_LEN: u32 = select(1u, NT * 64u, NORM);
// TAIL 1's arrays (topk.wgsl) and the tail's election.
var<workgroup> tk_lg: array<f32, TAIL_E>;
var<workgroup> tk_id: array<u32, TAIL_K>;
var<workgroup> tk_w: array<f32, TAIL_K>;
var<workgroup> tk_red: array<f32, TK_RED_LEN>;
override TK_RED_LEN: u32 = select(1u, 128u, TAIL == 1u || TAIL == 3u);
// TAIL 3: the token's sum of squares.
var<workgroup> rt_ss: f32;
var<workgroup> last: u32;

// Where vec4 i of chunk k sits in the tile's natural order (vec4 units).
fn natural(k: u32, i: u32) -> u32 {
    switch DTYPE {
        case 0u, 1u, 3u: { return VPC * k + i; }
        // q4: byte j of chunk k = 2g + h holds inputs 64g + 16h + j (low) and 64g + 32 + 16h + j
        // (high); vec4s 0..3 are the low inputs, 4..7 the high ones.
        default: { return 16u * (k / 2u) + 4u * (k % 2u) + select(i, i + 4u, i >= 4u); }
    }
}

fn xv(t: u32, i: u32, k: u32) -> vec4<f32> {
    return xs[(t * VPC + i) * NCH + k];
}

fn xqv(t: u32, i: u32, k: u32) -> u32 {
    return xq[(t * VPC + i) * NCH + k];
}

fn word(rb: u32, i: u32) -> u32 {
    return w[rb + i / 4u][i % 4u];
}

fn f4(v: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(v);
}

// q4 nibbles to floats without an int→float conversion (a quarter-rate instruction on NVIDIA):
// placing nibble c at bit 19 of 1.0f gives exactly 1 + c/16. `left`/`right` move each byte's
// nibble to bit 19.
fn nib(q: u32, left: vec4<u32>, right: vec4<u32>) -> vec4<f32> {
    let v = ((vec4<u32>(q) << left) >> right) & vec4<u32>(0x00780000u);
    return bitcast<vec4<f32>>(v | vec4<u32>(0x3f800000u));
}

// The u32 holding the f16 group parameters of chunk c (row-relative) of the row at vec4 rb.
fn pword(rb: u32, c: u32) -> u32 {
    switch DTYPE {
        case 0u: { return 0u; }
        // q8: 32-input groups (4 chunks), two f16 scales per word.
        case 1u: { return word(rb, p.param_word + c / 8u); }
        // q2: a chunk is a group, (d, m) in one word.
        case 3u: { return word(rb, p.param_word + c); }
        // q4: 64-input groups (2 chunks), two scales per word.
        default: { return word(rb, p.param_word + c / 4u); }
    }
}

// Adds chunk c (row-relative; k within the tile), whose 16 bytes are q and whose parameter word
// (`pword`) is pw, to item u's sums in acc. Only tokens ta..tb take part (all NT, or one slot
// under REDUCE); token t adds to acc[u][t − ta].
fn chunk(q: vec4<u32>, pw: u32, c: u32, k: u32, ta: u32, tb: u32, acc: ptr<function, array<array<f32, NT_MAX>, LD>>, u: u32) {
    switch DTYPE {
        case 0u: {
            // bf16 → f32 is a 16-bit shift.
            let a = bitcast<vec4<f32>>(vec4<u32>(q.x << 16u, q.x & 0xffff0000u, q.y << 16u, q.y & 0xffff0000u));
            let b = bitcast<vec4<f32>>(vec4<u32>(q.z << 16u, q.z & 0xffff0000u, q.w << 16u, q.w & 0xffff0000u));
            for (var t = ta; t < tb; t++) {
                (*acc)[u][t - ta] += dot(a, xv(t, 0u, k)) + dot(b, xv(t, 1u, k));
            }
        }
        case 1u: {
            let d = unpack2x16float(pw)[(c / 4u) % 2u];
            let a0 = vec4<f32>(unpack4xI8(q.x));
            let a1 = vec4<f32>(unpack4xI8(q.y));
            let a2 = vec4<f32>(unpack4xI8(q.z));
            let a3 = vec4<f32>(unpack4xI8(q.w));
            for (var t = ta; t < tb; t++) {
                let s = dot(a0, xv(t, 0u, k)) + dot(a1, xv(t, 1u, k)) + dot(a2, xv(t, 2u, k)) + dot(a3, xv(t, 3u, k));
                (*acc)[u][t - ta] += d * s;
            }
        }
        case 2u: {
            let d = unpack2x16float(pw)[(c / 2u) % 2u];
            let lo = q & vec4<u32>(0x0f0f0f0fu);
            let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
            let l0 = f4(unpack4xU8(lo.x));
            let l1 = f4(unpack4xU8(lo.y));
            let l2 = f4(unpack4xU8(lo.z));
            let l3 = f4(unpack4xU8(lo.w));
            let h0 = f4(unpack4xU8(hi.x));
            let h1 = f4(unpack4xU8(hi.y));
            let h2 = f4(unpack4xU8(hi.z));
            let h3 = f4(unpack4xU8(hi.w));
            for (var t = ta; t < tb; t++) {
                let x0 = xv(t, 0u, k);
                let x1 = xv(t, 1u, k);
                let x2 = xv(t, 2u, k);
                let x3 = xv(t, 3u, k);
                let x4 = xv(t, 4u, k);
                let x5 = xv(t, 5u, k);
                let x6 = xv(t, 6u, k);
                let x7 = xv(t, 7u, k);
                let s = dot(l0, x0) + dot(l1, x1) + dot(l2, x2) + dot(l3, x3)
                    + dot(h0, x4) + dot(h1, x5) + dot(h2, x6) + dot(h3, x7);
                let sx = dot(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, vec4<f32>(1.0));
                (*acc)[u][t - ta] += d * (s - 8.0 * sx);
            }
        }
        case 4u: {
            // As case 2, with v = 1 + c/16: Σ(c − 8)·x = 16·Σv·x − 24·Σx, Σx from xsum.
            let d = unpack2x16float(pw)[(c / 2u) % 2u];
            // Low nibble of byte b (bits 8b..8b+3) and high nibble (8b+4..8b+7) to bits 19..22.
            let ll = vec4<u32>(19u, 11u, 3u, 0u);
            let lr = vec4<u32>(0u, 0u, 0u, 5u);
            let hl = vec4<u32>(15u, 7u, 0u, 0u);
            let hr = vec4<u32>(0u, 0u, 1u, 9u);
            let l0 = nib(q.x, ll, lr);
            let l1 = nib(q.y, ll, lr);
            let l2 = nib(q.z, ll, lr);
            let l3 = nib(q.w, ll, lr);
            let h0 = nib(q.x, hl, hr);
            let h1 = nib(q.y, hl, hr);
            let h2 = nib(q.z, hl, hr);
            let h3 = nib(q.w, hl, hr);
            for (var t = ta; t < tb; t++) {
                let s = dot(l0, xv(t, 0u, k)) + dot(l1, xv(t, 1u, k)) + dot(l2, xv(t, 2u, k)) + dot(l3, xv(t, 3u, k))
                    + dot(h0, xv(t, 4u, k)) + dot(h1, xv(t, 5u, k)) + dot(h2, xv(t, 6u, k)) + dot(h3, xv(t, 7u, k));
                let sx = xsum[2u * t * NCH + k] + xsum[(2u * t + 1u) * NCH + k];
                (*acc)[u][t - ta] += d * (16.0 * s - 24.0 * sx);
            }
        }
        case 6u: {
            // As case 2, two codes at a time: a 16-bit half of (q >> s) & 0x000f000f, with
            // f16's exponent bits for 1024 set above it, is the f16 1024 + c, and `code_pair`
            // (code_pair_f16.wgsl or code_pair_f32.wgsl, prepended) takes the offset 1032 off
            // both halves exactly, leaving c − 8 as f32. About 3 operations per weight where
            // case 4 takes 4 and the Σx correction: decode matvecs are bound by these
            // operations, not by memory (H200, q4, same run: 30B experts gate_up x8 12.3 →
            // 11.3 µs, 235B gate_up x8 108.8 → 87.8 µs; the engine's decode 306.6 → 317.4
            // tok/s, 322 in a later run without the Σx staging case 4 needs).
            let d = unpack2x16float(pw)[(c / 2u) % 2u];
            let m = vec4<u32>(0x000f000fu);
            let e = vec4<u32>(0x64006400u);
            // Words j of q: low nibbles of bytes (0, 2) and (1, 3), then the high ones.
            let lo02 = (q & m) | e;
            let lo13 = ((q >> vec4<u32>(8u)) & m) | e;
            let hi02 = ((q >> vec4<u32>(4u)) & m) | e;
            let hi13 = ((q >> vec4<u32>(12u)) & m) | e;
            var l: array<vec4<f32>, 4>;
            var h: array<vec4<f32>, 4>;
            for (var j = 0u; j < 4u; j++) {
                let a = code_pair(lo02[j], 1032.0);
                let b = code_pair(lo13[j], 1032.0);
                let ha = code_pair(hi02[j], 1032.0);
                let hb = code_pair(hi13[j], 1032.0);
                l[j] = vec4<f32>(a.x, b.x, a.y, b.y);
                h[j] = vec4<f32>(ha.x, hb.x, ha.y, hb.y);
            }
            for (var t = ta; t < tb; t++) {
                let s = dot(l[0], xv(t, 0u, k)) + dot(l[1], xv(t, 1u, k)) + dot(l[2], xv(t, 2u, k)) + dot(l[3], xv(t, 3u, k))
                    + dot(h[0], xv(t, 4u, k)) + dot(h[1], xv(t, 5u, k)) + dot(h[2], xv(t, 6u, k)) + dot(h[3], xv(t, 7u, k));
                (*acc)[u][t - ta] += d * s;
            }
        }
        case 5u: {
            // As case 2 on int8-quantized inputs: four products per dot4I8Packed (DP4A), then
            // d·dx·(Σc·xq − 8·Σxq). Opt-in: quantizing x costs accuracy (NMSE ~1e-5).
            let d = unpack2x16float(pw)[(c / 2u) % 2u];
            let lo = q & vec4<u32>(0x0f0f0f0fu);
            let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
            for (var t = ta; t < tb; t++) {
                let s = dot4I8Packed(lo.x, xqv(t, 0u, k)) + dot4I8Packed(lo.y, xqv(t, 1u, k))
                    + dot4I8Packed(lo.z, xqv(t, 2u, k)) + dot4I8Packed(lo.w, xqv(t, 3u, k))
                    + dot4I8Packed(hi.x, xqv(t, 4u, k)) + dot4I8Packed(hi.y, xqv(t, 5u, k))
                    + dot4I8Packed(hi.z, xqv(t, 6u, k)) + dot4I8Packed(hi.w, xqv(t, 7u, k));
                let sq = xsum[2u * t * NCH + k] + xsum[(2u * t + 1u) * NCH + k];
                (*acc)[u][t - ta] += d * xd[t * NG + k / 2u] * (f32(s) - 8.0 * sq);
            }
        }
        default: {
            // q2: the chunk is the whole group; bits 2i..2i+2 of byte j hold input 16i + j, so
            // vec4 4i + j' of the chunk's inputs pairs with word j' shifted by 2i.
            let dm = unpack2x16float(pw);
            var cw: array<vec4<f32>, 16>;
            for (var i = 0u; i < 4u; i++) {
                let b = (q >> vec4<u32>(2u * i)) & vec4<u32>(0x03030303u);
                cw[4u * i] = f4(unpack4xU8(b.x));
                cw[4u * i + 1u] = f4(unpack4xU8(b.y));
                cw[4u * i + 2u] = f4(unpack4xU8(b.z));
                cw[4u * i + 3u] = f4(unpack4xU8(b.w));
            }
            for (var t = ta; t < tb; t++) {
                var s = 0.0;
                var sx = vec4<f32>(0.0);
                for (var i = 0u; i < 16u; i++) {
                    let xi = xv(t, i, k);
                    s += dot(cw[i], xi);
                    sx += xi;
                }
                (*acc)[u][t - ta] += dm.x * s + dm.y * dot(sx, vec4<f32>(1.0));
            }
        }
    }
}

// Stages columns c0.. of up to nt tokens (the tile is tc columns wide) into xs, and for the q4
// variants the sums, int8 codes and scales they use.
// NORM_OUT: this workgroup writes vec4 columns [hlo, hhi) of the normed rows of tokens t0...
fn stage(li: u32, xbase: u32, c0: u32, tc: u32, nt: u32, t0: u32, hlo: u32, hhi: u32) {
    for (var d = li; d < NT * VPC * NCH; d += WG) {
        let k = d % NCH;
        let i = (d / NCH) % VPC;
        let t = d / (NCH * VPC);
        let n = natural(k, i);
        var v = vec4<f32>(0.0);
        if t < nt && n < tc / 4u {
            v = x[xbase + t * p.x_tok + c0 / 4u + n];
            if NORM {
                v *= inv_rms[t] * nw[p.nw_off + c0 / 4u + n];
                let col = c0 / 4u + n;
                if NORM_OUT && col >= hlo && col < hhi {
                    hn[p.hn_off + (t0 + t) * (p.cols / 4u) + col] = v;
                }
            }
        }
        xs[d] = v;
    }
    workgroupBarrier();
    if DTYPE == 4u {
        for (var d = li; d < NT * 2u * NCH; d += WG) {
            let k = d % NCH;
            let h = (d / NCH) % 2u;
            let t = d / (2u * NCH);
            let v = xv(t, 4u * h, k) + xv(t, 4u * h + 1u, k) + xv(t, 4u * h + 2u, k) + xv(t, 4u * h + 3u, k);
            xsum[d] = v.x + v.y + v.z + v.w;
        }
        workgroupBarrier();
    }
    if DTYPE == 5u {
        // One invocation per 64 inputs (chunks 2g, 2g + 1): scale = max|x| / 127, codes rounded
        // to nearest even.
        for (var d = li; d < NT * NG; d += WG) {
            let g = d % NG;
            let t = d / NG;
            var amax = 0.0;
            for (var j = 0u; j < 16u; j++) {
                let a = abs(xv(t, j % 8u, 2u * g + j / 8u));
                amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
            }
            let inv = select(0.0, 127.0 / amax, amax > 0.0);
            for (var j = 0u; j < 4u; j++) {
                let k = 2u * g + j / 2u;
                let h = j % 2u;
                var sq = vec4<i32>(0);
                for (var i = 4u * h; i < 4u * h + 4u; i++) {
                    let qv = vec4<i32>(round(xv(t, i, k) * inv));
                    xq[(t * VPC + i) * NCH + k] = pack4xI8(qv);
                    sq += qv;
                }
                xsum[(2u * t + h) * NCH + k] = f32(sq.x + sq.y + sq.z + sq.w);
            }
            xd[d] = amax / 127.0;
        }
        workgroupBarrier();
    }
}

// NORM: 1/rms of each of the nt tokens' x rows (cols wide) into inv_rms.
fn rms(li: u32, sg: u32, nsg: u32, lane: u32, xbase: u32, nt: u32) {
    for (var t = 0u; t < NT; t++) {
        var acc = 0.0;
        if t < nt {
            for (var i = li; i < p.cols / 4u; i += WG) {
                let v = x[xbase + t * p.x_tok + i];
                acc += dot(v, v);
            }
        }
        let s = subgroupAdd(acc);
        if lane == 0u {
            ssq[t * 64u + sg] = s;
        }
    }
    workgroupBarrier();
    if li < NT {
        var s = 0.0;
        for (var j = 0u; j < nsg; j++) {
            s += ssq[li * 64u + j];
        }
        inv_rms[li] = inverseSqrt(s / f32(p.cols) + p.eps);
    }
    workgroupBarrier();
}

// Item i of the workgroup's list: the vec4 index of its weight row, or NONE past the rows.
fn item_row(i: u32, row0: u32, wbase: u32) -> u32 {
    if REDUCE {
        let row = row0 + i % ROWS;
        if i >= ROWS * NT || row >= p.rows {
            return NONE;
        }
        return slot_base[i / ROWS] + row * p.row_stride;
    }
    let g = select(1u, 2u, GATED);
    let row = row0 + i / g;
    if i >= ROWS * g || row >= p.rows {
        return NONE;
    }
    return wbase + row * p.row_stride + (i % g) * p.w_up_off;
}

// The U items from i0 on, over the tile's chunks: each lane loads S chunks (codes and their
// parameter words) of every item, then multiplies them, until the tile's chunks are done (one
// round when S·ss covers them); the subgroup's sums are added to `part`.
fn items(i0: u32, row0: u32, wbase: u32, cfirst: u32, nchunks: u32, lane: u32, ss: u32) {
    var rbs: array<u32, LD>;
    var acc: array<array<f32, NT_MAX>, LD>;
    for (var u = 0u; u < U; u++) {
        rbs[u] = item_row(i0 + u, row0, wbase);
    }
    for (var cb = 0u; cb < nchunks; cb += S * ss) {
        var q: array<vec4<u32>, LD>;
        var pw: array<u32, LD>;
        for (var u = 0u; u < U; u++) {
            for (var s = 0u; s < S; s++) {
                let k = cb + lane + s * ss;
                if rbs[u] != NONE && k < nchunks {
                    q[u * S + s] = w[rbs[u] + cfirst + k];
                    pw[u * S + s] = pword(rbs[u], cfirst + k);
                }
            }
        }
        for (var u = 0u; u < U; u++) {
            // REDUCE: the item's slot is its one "token".
            var ta = 0u;
            var tb = NT;
            if REDUCE {
                ta = (i0 + u) / ROWS;
                tb = ta + 1u;
            }
            for (var s = 0u; s < S; s++) {
                let k = cb + lane + s * ss;
                if rbs[u] != NONE && k < nchunks {
                    chunk(q[u * S + s], pw[u * S + s], cfirst + k, k, ta, tb, &acc, u);
                }
            }
        }
    }
    for (var u = 0u; u < U; u++) {
        let i = i0 + u;
        if REDUCE {
            let s = subgroupAdd(acc[u][0]);
            if lane == 0u && rbs[u] != NONE {
                let t = i / ROWS;
                part[2u * ((i % ROWS) * NT + t)] += slot_w[t] * s;
            }
        } else {
            let g = select(1u, 2u, GATED);
            for (var t = 0u; t < NT; t++) {
                let s = subgroupAdd(acc[u][t]);
                if lane == 0u && rbs[u] != NONE {
                    part[2u * ((i / g) * NT + t) + i % g] += s;
                }
            }
        }
    }
}

// Counts this workgroup in on counter c, which n workgroups share; true (uniformly) in the
// last of them, which then sees all of their storage writes.
fn arrive_n(li: u32, c: u32, n: u32) -> bool {
    // Publish this workgroup's writes device-wide before counting in.
    storageBarrier();
    if li == 0u {
        let is_last = atomicAdd(&done[c], 1u) + 1u == n;
        if is_last {
            // Ready for the next dispatch (dispatches of one kernel never overlap).
            atomicStore(&done[c], 0u);
        }
        last = u32(is_last);
    }
    let l = workgroupUniformLoad(&last) != 0u;
    storageBarrier();
    return l;
}

fn arrive(li: u32, c: u32) -> bool {
    return arrive_n(li, c, p.tail_n);
}

fn rp_at(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&rp[i]));
}

// TAIL 3, in every workgroup after its rows of y are written (their values in part[2r]): its
// partial logits of every expert and partial sum of squares, to rp[wid · (E + 1) ..].
fn route_part(li: u32, wx: u32, row0: u32) {
    let pw = TAIL_E + 1u;
    for (var e = li; e < pw; e += WG) {
        var s = 0.0;
        // Rows in pairs: a u32 holds two bf16 weights (ROWS and row0 are even, rows a multiple
        // of 8).
        for (var r = 0u; r < ROWS; r += 2u) {
            let row = row0 + r;
            if row < p.rows {
                let v = vec2<f32>(part[2u * r], part[2u * r + 2u]);
                if e < TAIL_E {
                    let wd = wr[p.r_off + e * p.r_stride + row / 2u];
                    let wv = bitcast<vec2<f32>>(vec2<u32>(wd << 16u, wd & 0xffff0000u));
                    let g = nw[p.nw_off + row / 4u];
                    let gv = select(g.xy, g.zw, (row & 2u) != 0u);
                    s += dot(wv * gv, v);
                } else {
                    s += dot(v, v);
                }
            }
        }
        atomicStore(&rp[wx * pw + e], bitcast<u32>(s));
    }
}

// Sums `cnt` (≤ RG) partial rows of pw values from rp[base ..] for value e. The loads are
// unconditional (a clamped index, the value masked), so all RG of them are in flight at once.
fn rp_sum(base: u32, pw: u32, e: u32, cnt: u32) -> f32 {
    var s = 0.0;
    for (var g = 0u; g < RG; g++) {
        let v = rp_at(base + min(g, cnt - 1u) * pw + e);
        s += select(0.0, v, g < cnt);
    }
    return s;
}

// TAIL 3 after route_part: the two levels of sums, the top-k and the normed row (see the header).
fn tail_next_route(li: u32, sg: u32, nsg: u32, lane: u32, wx: u32) {
    let pw = TAIL_E + 1u;
    let groups = p.tail_n;
    let c = wx / RG;
    let cnt = min(RG, groups - c * RG);
    if !arrive_n(li, c, cnt) {
        return;
    }
    let n1 = (groups + RG - 1u) / RG;
    let top = groups * pw;
    for (var e = li; e < pw; e += WG) {
        atomicStore(&rp[top + c * pw + e], bitcast<u32>(rp_sum(c * RG * pw, pw, e, cnt)));
    }
    if !arrive_n(li, n1, n1) {
        return;
    }
    for (var e = li; e < pw; e += WG) {
        var s = 0.0;
        for (var c0 = 0u; c0 < n1; c0 += RG) {
            s += rp_sum(top + c0 * pw, pw, e, min(RG, n1 - c0));
        }
        if e < TAIL_E {
            tk_lg[e] = s;
        } else {
            rt_ss = s;
        }
    }
    workgroupBarrier();
    let inv = inverseSqrt(rt_ss / f32(p.rows) + p.eps);
    for (var e = li; e < TAIL_E; e += WG) {
        tk_lg[e] = tk_clean(tk_lg[e] * inv);
    }
    softmax_topk(li, WG, sg, nsg, lane, TAIL_E, p.tail_k, p.tail_norm != 0u);
    for (var r = li; r < p.tail_k; r += WG) {
        tids[p.tail_a + r] = tk_id[r];
        tacc[p.tail_b + r] = tk_w[r];
    }
    for (var i = li; i < p.rows / 4u; i += WG) {
        let j = p.y_off + 4u * i;
        let v = vec4<f32>(y_at(j), y_at(j + 1u), y_at(j + 2u), y_at(j + 3u));
        hn[p.hn_off + i] = v * inv * nw[p.nw_off + i];
    }
}

fn y_at(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&ya[i]));
}

// TAIL 1 in the last workgroup of token tile wid.z: route tokens t0..t0 + nt.
fn tail_route(li: u32, sg: u32, nsg: u32, lane: u32, t0: u32, nt: u32) {
    for (var t = t0; t < t0 + nt; t++) {
        for (var e = li; e < p.rows; e += WG) {
            tk_lg[e] = tk_clean(y_at(p.y_off + t * p.y_tok + e));
        }
        softmax_topk(li, WG, sg, nsg, lane, p.rows, p.tail_k, p.tail_norm != 0u);
        for (var r = li; r < p.tail_k; r += WG) {
            tids[p.tail_a + t * p.tail_k + r] = tk_id[r];
            tacc[p.tail_b + t * p.tail_k + r] = tk_w[r];
        }
        // Nobody may still read this token's choice when the next one's logits land.
        workgroupBarrier();
    }
}

// TAIL 2 in the last workgroup of row block wid.x: each token's k slots summed into tacc.
fn tail_sum(li: u32, row0: u32) {
    let k = p.tail_k;
    let n_tok = p.tail_n / k;
    for (var i = li; i < ROWS * n_tok; i += WG) {
        let row = row0 + i % ROWS;
        let t = i / ROWS;
        if row < p.rows {
            let ai = p.tail_a + t * p.rows + row;
            var a = tacc[ai];
            for (var s = 0u; s < k; s++) {
                let slot = t * k + s;
                a += rw[p.rw_off + slot] * y_at(p.y_off + slot * p.y_slot + row);
            }
            tacc[ai] = a;
        }
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) ss: u32,
) {
    // The output row block: one slot, or (REDUCE) one token whose NT = k slots are staged like
    // NT tokens (the host sets x_tok to the slot stride) and summed.
    let oslot = wid.y;
    let t0 = wid.z * NT;
    let nt = min(NT, p.n_tok - t0);
    let row0 = wid.x * ROWS;
    let cv = 4u * VPC;
    for (var i = li; i < PART_LEN; i += WG) {
        part[i] = 0.0;
    }
    var mat = 0u;
    if GROUPED && !REDUCE {
        mat = ids[p.ids_off + oslot];
    }
    let wbase = p.w_off + mat * p.w_mat_stride;
    var xbase = p.x_off + (oslot / p.x_div) * p.x_slot + t0 * p.x_tok;
    if REDUCE {
        xbase = p.x_off + oslot * NT * p.x_tok;
    }
    if REDUCE && li < NT {
        let slot = oslot * NT + li;
        slot_base[li] = p.w_off + ids[p.ids_off + slot] * p.w_mat_stride;
        slot_w[li] = rw[p.rw_off + slot];
    }
    if NORM {
        rms(li, sg, nsg, lane, xbase, nt);
    }
    for (var c0 = 0u; c0 < p.cols; c0 += TILE) {
        let tc = min(TILE, p.cols - c0);
        // Nobody may still read the previous tile's staged inputs.
        workgroupBarrier();
        stage(li, xbase, c0, tc, nt, t0, wid.x * p.hn_per, (wid.x + 1u) * p.hn_per);
        let nchunks = tc / cv;
        let cfirst = c0 / cv;
        let n_items = select(ROWS * select(1u, 2u, GATED), ROWS * NT, REDUCE);
        for (var i0 = sg * U; i0 < n_items; i0 += nsg * U) {
            items(i0, row0, wbase, cfirst, nchunks, lane, ss);
        }
    }
    workgroupBarrier();
    if REDUCE {
        for (var r = li; r < ROWS; r += WG) {
            let row = row0 + r;
            if row < p.rows {
                var v = 0.0;
                for (var t = 0u; t < NT; t++) {
                    v += part[2u * (r * NT + t)];
                }
                let yi = p.y_off + oslot * p.y_slot + row;
                if ACCUM {
                    v += y[yi];
                }
                y[yi] = v;
            }
        }
        return;
    }
    for (var i = li; i < ROWS * NT; i += WG) {
        let r = i / NT;
        let t = i % NT;
        let row = row0 + r;
        if row < p.rows && t < nt {
            var v = part[2u * i];
            if GATED {
                v = v / (1.0 + exp(-v)) * part[2u * i + 1u];
            }
            let yi = p.y_off + oslot * p.y_slot + (t0 + t) * p.y_tok + row;
            if ACCUM {
                v += y[yi];
            }
            y[yi] = v;
            if TAIL == 3u {
                part[2u * i] = v;
            }
        }
    }
    if TAIL == 3u {
        workgroupBarrier();
        route_part(li, wid.x, row0);
        tail_next_route(li, sg, nsg, lane, wid.x);
    }
    if TAIL == 1u && arrive(li, wid.z) {
        tail_route(li, sg, nsg, lane, t0, nt);
    }
    if TAIL == 2u && arrive(li, wid.x) {
        tail_sum(li, row0);
    }
}
