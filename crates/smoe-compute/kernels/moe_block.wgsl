// A decode token's whole MoE block in one dispatch (CPU twin: the engine's MoE block — rms_norm,
// matmul, route_softmax_topk, silu_mul, axpy): x += Σ_s w_s · down_{e_s}(silu(gate_{e_s}(h)) ·
// up_{e_s}(h)), h = RMSNorm(x) · nw, (e_s, w_s) the router's softmax top-k of R · h.
//
// Why one dispatch: on an H200 each dependent dispatch of real work costs ~3.2 µs more than a
// barrier across the workgroups of one dispatch (`bench kernels`, "persistent chain"); the
// chain this replaces is three (router + top-k tail, gate_up, down + sum tail). A fixed number
// of workgroups (`groups`, all co-resident: the host probes that first, `probe` below) runs
// three phases separated by two grid barriers:
//   R  every workgroup normalizes x itself (8 KB from L2) and its subgroups take router rows;
//   G  every workgroup reads the logits and computes the same top-k (no tail, no third
//      barrier), restages h for q4 and its subgroups take (slot, row) items: the gate and up
//      rows of one expert, silu(g) · u into gu;
//   D  its subgroups take output rows: a row's lanes walk the (slot, chunk) pairs of all k
//      experts' down rows (gu staged a tile at a time), weighted by the router, and one lane
//      adds the sum to x.
// Cross-workgroup data (logits, gu) is written and read with atomics (coherent at L2, never a
// stale per-core copy); x is read in R and written in D by the only invocation that owns the
// row. Experts are q4 (chunks decoded two codes at a time, matvec.wgsl's DTYPE 6, `code_pair`
// prepended); the router is bf16. Inputs are staged "chunk-minor" as in matvec.wgsl, so the
// lanes of a subgroup read consecutive vec4s.
//
// The barrier: one atomic word, arrivals in its low 16 bits and a generation above. The last
// arrival adds 2^16 − groups (count back to 0, generation + 1); the others poll until the
// generation moves. So it needs no reset between dispatches. A workgroup that polls spin_limit
// times gives up, counts itself in `sync[0]` (the host's fault flag: the results are then
// wrong and the request fails) and goes on.

struct Params {
    groups: u32,      // workgroups dispatched (each barrier waits for all of them)
    spin_limit: u32,
    probe: u32,       // 1: only the barriers (the host's co-residency probe)
    normalize: u32,   // renormalize the k probabilities
    x_off: u32,       // f32 index of x
    nw_off: u32,      // vec4 index of the norm weight
    eps: f32,
    r_off: u32,       // vec4 index of router row 0
    gate_off: u32,    // vec4 index of expert 0's gate row 0
    up_off: u32,      // vec4s from a gate matrix to its up matrix
    down_off: u32,    // vec4 index of expert 0's down row 0
    mat_stride: u32,  // vec4s between experts
    gu_row: u32,      // vec4s per gate/up row
    gu_pw: u32,       // u32 index within a gate/up row where the f16 scales start
    dn_row: u32,      // vec4s per down row
    dn_pw: u32,
    logits_off: u32,
    gu_off: u32,
    ids_off: u32,
    rw_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

override WG: u32 = 256u;
override H: u32 = 2048u;  // hidden size (a multiple of 64)
override F: u32 = 768u;   // expert width (a multiple of 64)
override E: u32 = 128u;   // experts
override K: u32 = 8u;     // top-k
// q4 chunks (32 inputs) per gate/up row and per down row; bf16 chunks (8 inputs) per router row.
override NCH: u32 = H / 32u;
override NCF: u32 = F / 32u;
override NCR: u32 = H / 8u;
// Staged vec4s: h (R: natural order; G: chunk-minor), or a tile of TC chunks of each of the k
// slots' gu (D): as many chunks as fit beside h, at least one.
override XS_LEN: u32 = max(H, K * 32u) / 4u;
override TC: u32 = max(XS_LEN / (8u * K), 1u);
// Loads a lane keeps in flight (private arrays need a constant size); the host picks the
// override loop bounds below so that they fit: SS is the adapter's smallest subgroup size (a
// larger one only leaves loaded slots unused), PG the chunks per lane of a gate/up row, UG the
// gate/up items a subgroup loads together (UG · PG ≤ LD), PD the units per lane of a down row,
// PR the chunks per lane of a router row.
const LD: u32 = 8u;
override SS: u32 = 32u;
override PG: u32 = min((NCH + SS - 1u) / SS, LD);
override UG: u32 = max(min(2u, LD / PG), 1u);
override PD: u32 = min((K * NCF + SS - 1u) / SS, LD);
override PR: u32 = min((NCR + SS - 1u) / SS, LD);

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wr: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> we: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;
@group(0) @binding(4) var<storage, read> nw: array<vec4<f32>>;
// Logits then gu, as f32 bits.
@group(0) @binding(5) var<storage, read_write> scratch: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> ids: array<u32>;
@group(0) @binding(7) var<storage, read_write> rw: array<f32>;
// [0] workgroups that gave up (the fault count the host reads back), [1] the barrier word.
@group(0) @binding(8) var<storage, read_write> sync: array<atomic<u32>>;

var<workgroup> xs: array<vec4<f32>, XS_LEN>;
var<workgroup> ssq: array<f32, 64>;
var<workgroup> inv_rms: f32;
var<workgroup> tk_lg: array<f32, E>;
var<workgroup> tk_id: array<u32, K>;
var<workgroup> tk_w: array<f32, K>;
var<workgroup> tk_red: array<f32, 128>;

// Waits for every workgroup of the dispatch to arrive (see the header). Uniform control flow.
fn grid_barrier(li: u32) {
    // Publish this workgroup's writes device-wide before counting in.
    storageBarrier();
    if li == 0u {
        let old = atomicAdd(&sync[1], 1u);
        if (old & 0xffffu) + 1u == p.groups {
            atomicAdd(&sync[1], 0x10000u - p.groups);
        } else {
            let gen = old >> 16u;
            var polls = 0u;
            loop {
                if (atomicLoad(&sync[1]) >> 16u) != gen {
                    break;
                }
                if polls >= p.spin_limit {
                    atomicAdd(&sync[0], 1u);
                    break;
                }
                polls++;
            }
        }
    }
    storageBarrier();
}

// Another workgroup's output, after the barrier: an atomic load (coherent at L2). Plain loads
// read stale values on an H200 (the kernel test's x update off by NMSE 1.4e-4).
fn f32_at(i: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&scratch[i]));
}

// Where vec4 i (0..8) of q4 chunk k sits in its row's natural order: byte j of chunk 2g + h
// holds inputs 64g + 16h + j (low nibble) and 64g + 32 + 16h + j (high).
fn natural(k: u32, i: u32) -> u32 {
    return 16u * (k / 2u) + 4u * (k % 2u) + select(i, i + 4u, i >= 4u);
}

// The normed input's vec4 n.
fn h_at(n: u32) -> vec4<f32> {
    let b = p.x_off + 4u * n;
    return vec4<f32>(x[b], x[b + 1u], x[b + 2u], x[b + 3u]) * inv_rms * nw[p.nw_off + n];
}

// Chunk c (row-relative) of a q4 row at vec4 rb with scales from u32 pw0 on, dotted with the
// staged vec4s xb, xb + step, ..., xb + 7·step.
fn q4_dot(q: vec4<u32>, pw: u32, c: u32, xb: u32, step: u32) -> f32 {
    let d = unpack2x16float(pw)[(c / 2u) % 2u];
    let m = vec4<u32>(0x000f000fu);
    let e = vec4<u32>(0x64006400u);
    let lo02 = (q & m) | e;
    let lo13 = ((q >> vec4<u32>(8u)) & m) | e;
    let hi02 = ((q >> vec4<u32>(4u)) & m) | e;
    let hi13 = ((q >> vec4<u32>(12u)) & m) | e;
    var s = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let a = code_pair(lo02[j], 1032.0);
        let b = code_pair(lo13[j], 1032.0);
        let ha = code_pair(hi02[j], 1032.0);
        let hb = code_pair(hi13[j], 1032.0);
        s += dot(vec4<f32>(a.x, b.x, a.y, b.y), xs[xb + j * step])
            + dot(vec4<f32>(ha.x, hb.x, ha.y, hb.y), xs[xb + (j + 4u) * step]);
    }
    return d * s;
}

fn word(rb: u32, i: u32) -> u32 {
    return we[rb + i / 4u][i % 4u];
}

// R: 1/rms of x, h in natural order, and this workgroup's router rows.
fn router(li: u32, gsg: u32, nsgs: u32, sg: u32, nsg: u32, lane: u32, ss: u32) {
    var acc = 0.0;
    for (var i = li; i < H; i += WG) {
        let v = x[p.x_off + i];
        acc += v * v;
    }
    let s = subgroupAdd(acc);
    if lane == 0u {
        ssq[sg] = s;
    }
    workgroupBarrier();
    if li == 0u {
        var t = 0.0;
        for (var j = 0u; j < nsg; j++) {
            t += ssq[j];
        }
        inv_rms = inverseSqrt(t / f32(H) + p.eps);
    }
    workgroupBarrier();
    for (var n = li; n < H / 4u; n += WG) {
        xs[n] = h_at(n);
    }
    workgroupBarrier();
    for (var r = gsg; r < E; r += nsgs) {
        // All of a lane's chunks loaded before the products (PR of them; the rest after).
        let rb = p.r_off + r * NCR;
        var q: array<vec4<u32>, LD>;
        for (var j = 0u; j < PR; j++) {
            let c = lane + j * ss;
            if c < NCR {
                q[j] = wr[rb + c];
            }
        }
        var acc = 0.0;
        for (var j = 0u; j < PR; j++) {
            let c = lane + j * ss;
            if c < NCR {
                acc += bf16_dot(q[j], c);
            }
        }
        for (var c = lane + PR * ss; c < NCR; c += ss) {
            acc += bf16_dot(wr[rb + c], c);
        }
        let t = subgroupAdd(acc);
        if lane == 0u {
            atomicStore(&scratch[p.logits_off + r], bitcast<u32>(t));
        }
    }
}

// Router chunk c (8 bf16) dotted with the natural-order h.
fn bf16_dot(q: vec4<u32>, c: u32) -> f32 {
    let a = bitcast<vec4<f32>>(vec4<u32>(q.x << 16u, q.x & 0xffff0000u, q.y << 16u, q.y & 0xffff0000u));
    let b = bitcast<vec4<f32>>(vec4<u32>(q.z << 16u, q.z & 0xffff0000u, q.w << 16u, q.w & 0xffff0000u));
    return dot(a, xs[2u * c]) + dot(b, xs[2u * c + 1u]);
}

// G: the top-k (every workgroup the same), h restaged chunk-minor, this workgroup's gate/up items,
// UG at a time per subgroup: each lane loads its chunks of all of them before multiplying.
fn gate_up(li: u32, wid: u32, gsg: u32, nsgs: u32, sg: u32, nsg: u32, lane: u32, ss: u32) {
    for (var e = li; e < E; e += WG) {
        tk_lg[e] = tk_clean(f32_at(p.logits_off + e));
    }
    softmax_topk(li, WG, sg, nsg, lane, E, K, p.normalize != 0u);
    if wid == 0u && li < K {
        ids[p.ids_off + li] = tk_id[li];
        rw[p.rw_off + li] = tk_w[li];
    }
    // (softmax_topk ends in a barrier: nobody still reads the natural-order h.)
    for (var d = li; d < 8u * NCH; d += WG) {
        xs[d] = h_at(natural(d % NCH, d / NCH));
    }
    workgroupBarrier();
    for (var i0 = gsg * UG; i0 < K * F; i0 += nsgs * UG) {
        var qg: array<vec4<u32>, LD>;
        var qu: array<vec4<u32>, LD>;
        var pg: array<u32, LD>;
        var pu: array<u32, LD>;
        var g: array<u32, LD>;
        for (var u = 0u; u < UG; u++) {
            let it = min(i0 + u, K * F - 1u);
            g[u] = p.gate_off + tk_id[it / F] * p.mat_stride + (it % F) * p.gu_row;
            for (var j = 0u; j < PG; j++) {
                let c = lane + j * ss;
                if c < NCH {
                    qg[u * PG + j] = we[g[u] + c];
                    qu[u * PG + j] = we[g[u] + p.up_off + c];
                    pg[u * PG + j] = word(g[u], p.gu_pw + c / 4u);
                    pu[u * PG + j] = word(g[u] + p.up_off, p.gu_pw + c / 4u);
                }
            }
        }
        for (var u = 0u; u < UG; u++) {
            var a = 0.0;
            var b = 0.0;
            for (var j = 0u; j < PG; j++) {
                let c = lane + j * ss;
                if c < NCH {
                    a += q4_dot(qg[u * PG + j], pg[u * PG + j], c, c, NCH);
                    b += q4_dot(qu[u * PG + j], pu[u * PG + j], c, c, NCH);
                }
            }
            // Rows wider than the chunks loaded up front: the rest one chunk at a time.
            for (var c = lane + PG * ss; c < NCH; c += ss) {
                a += q4_dot(we[g[u] + c], word(g[u], p.gu_pw + c / 4u), c, c, NCH);
                b += q4_dot(we[g[u] + p.up_off + c], word(g[u] + p.up_off, p.gu_pw + c / 4u), c, c, NCH);
            }
            a = subgroupAdd(a);
            b = subgroupAdd(b);
            if lane == 0u && i0 + u < K * F {
                atomicStore(&scratch[p.gu_off + i0 + u], bitcast<u32>(a / (1.0 + exp(-a)) * b));
            }
        }
    }
}

// D: this workgroup's output rows of the weighted down sum. A row's units are its (slot, chunk)
// pairs, K · NCF of them over the lanes; each lane loads all of its units' codes first, then the
// slots' gu is staged (chunk-minor) TC chunks per slot at a time — all k slots at once would
// take 24 KiB of workgroup memory for 30B-A3B, and two such workgroups did not fit an H200 SM —
// and each lane multiplies the units of the staged tile. Rows go round-robin in uniform rounds,
// so that every subgroup meets the staging barriers.
fn down(li: u32, gsg: u32, nsgs: u32, lane: u32, ss: u32) {
    let units = K * NCF;
    let rounds = (H + nsgs - 1u) / nsgs;
    for (var rr = 0u; rr < rounds; rr++) {
        let row = rr * nsgs + gsg;
        let live = row < H;
        var q: array<vec4<u32>, LD>;
        var pw: array<u32, LD>;
        for (var j = 0u; j < PD; j++) {
            let n = lane + j * ss;
            if live && n < units {
                let rb = p.down_off + tk_id[n / NCF] * p.mat_stride + row * p.dn_row;
                let c = n % NCF;
                q[j] = we[rb + c];
                pw[j] = word(rb, p.dn_pw + c / 4u);
            }
        }
        var acc = 0.0;
        for (var t0 = 0u; t0 < NCF; t0 += TC) {
            let tc = min(TC, NCF - t0);
            // Nobody may still read the previous tile.
            workgroupBarrier();
            for (var d = li; d < K * 8u * tc; d += WG) {
                let k = t0 + d % tc;
                let i = (d / tc) % 8u;
                let slot = d / (8u * tc);
                let b = p.gu_off + slot * F + 4u * natural(k, i);
                xs[(slot * 8u + i) * TC + k - t0] = vec4<f32>(f32_at(b), f32_at(b + 1u), f32_at(b + 2u), f32_at(b + 3u));
            }
            workgroupBarrier();
            for (var j = 0u; j < PD; j++) {
                let n = lane + j * ss;
                let c = n % NCF;
                if live && n < units && c >= t0 && c < t0 + tc {
                    let slot = n / NCF;
                    acc += tk_w[slot] * q4_dot(q[j], pw[j], c, slot * 8u * TC + c - t0, TC);
                }
            }
            // Units past the ones loaded up front (rows wider than LD · SS units).
            for (var n = lane + PD * ss; live && n < units; n += ss) {
                let slot = n / NCF;
                let c = n % NCF;
                if c >= t0 && c < t0 + tc {
                    let rb = p.down_off + tk_id[slot] * p.mat_stride + row * p.dn_row;
                    acc += tk_w[slot] * q4_dot(we[rb + c], word(rb, p.dn_pw + c / 4u), c, slot * 8u * TC + c - t0, TC);
                }
            }
        }
        if live {
            let t = subgroupAdd(acc);
            if lane == 0u {
                x[p.x_off + row] += t;
            }
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
    // Subgroups are numbered across the dispatch; each phase hands out its items round-robin.
    let gsg = wid.x * nsg + sg;
    let nsgs = p.groups * nsg;
    let work = p.probe == 0u;
    if work {
        router(li, gsg, nsgs, sg, nsg, lane, ss);
    }
    grid_barrier(li);
    if work {
        gate_up(li, wid.x, gsg, nsgs, sg, nsg, lane, ss);
    }
    grid_barrier(li);
    if work {
        down(li, gsg, nsgs, lane, ss);
    }
}
