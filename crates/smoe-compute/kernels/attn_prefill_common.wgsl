// Shared by attn_prefill.wgsl and attn_prefill_merge.wgsl: the chunk's parameters, the rows and
// keys of a row tile, and how a tile's keys are split into units.
//
// A tile's keys run from its first row's window start to its last row's position, so the last
// tiles of a long chunk walk many more keys than the first: at 512 tokens from position 0 the
// last tile of each KV head walks 16 key tiles and the first one, and that one long workgroup
// set the kernel's time. With SPLITS > 1 the keys of a tile with at least 2·UNIT_KEYS of them
// are split into up to SPLITS units of whole key tiles, one workgroup each (the dispatch's z);
// each writes its unnormalised output with its row max and sum to `part`, and `merge_tile`
// combines them (out = Σ_u o_u·e^(m_u − M) / Σ_u l_u·e^(m_u − M)): on Vulkan in the tile's last
// unit to finish (attn_prefill's MERGE tail), elsewhere in a pass of its own
// (attn_prefill_merge.wgsl). A tile of one unit writes its output directly, as without splits.
// The kernel that prepends this defines `part_vec(i)`, the partials' vec4 i, and binds `out`.

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
    ml_off: u32,  // vec4 index in `part` of the units' (max, sum) rows
}

struct Step {
    pos0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// As in common.wgsl: a finite "minus infinity", so exp(m - m) and max() stay well defined.
const NEG_BIG: f32 = -3.0e38;
const TX: u32 = 8u;
// Keys per tile: 4 per column invocation.
const BK: u32 = 4u * TX;

override M: u32 = 64u;          // rows per workgroup, a multiple of 4
override SPLITS: u32 = 1u;      // most units per tile (1: no split, no merge)
override UNIT_KEYS: u32 = 128u; // fewest keys per unit, a multiple of BK

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;

// First position a query at position n_ctx - 1 attends to.
fn window_lo(n_ctx: u32) -> u32 {
    if p.window != 0u && n_ctx > p.window {
        return n_ctx - p.window;
    }
    return 0u;
}

struct TileKeys {
    r0: u32,       // first row
    r1: u32,       // one past the last row
    k_begin: u32,  // first key any row sees
    k_end: u32,    // one past the last key any row sees
    n_units: u32,  // units the keys are split into
    unit_len: u32, // keys per unit (the last may have fewer, or none), a multiple of BK
}

fn tile_keys(tile: u32) -> TileKeys {
    let grp = p.n_heads / p.n_kv;
    let r0 = tile * M;
    let r1 = min(r0 + M, p.n_tokens * grp);
    let k_begin = window_lo(step.pos0 + r0 / grp + 1u);
    let k_end = step.pos0 + (r1 - 1u) / grp + 1u;
    let span = k_end - k_begin;
    let n = clamp(span / UNIT_KEYS, 1u, SPLITS);
    let len = ((span + n - 1u) / n + BK - 1u) / BK * BK;
    return TileKeys(r0, r1, k_begin, k_end, n, len);
}

// Merges the units of row tile `tile` of KV head `kvh` (n_units > 1) into `out`, `wg`
// invocations from `li`.
fn merge_tile(kvh: u32, tile: u32, tk: TileKeys, li: u32, wg: u32) {
    let hd4 = p.head_dim / 4u;
    let grp = p.n_heads / p.n_kv;
    let base = (kvh * p.n_tiles + tile) * SPLITS;
    // Invocations take consecutive vec4s of a row: rows in order, so the first one past the
    // tile's last row ends the loop.
    for (var i = li; i < M * hd4; i += wg) {
        let rr = i / hd4;
        let d4 = i % hd4;
        let r = tk.r0 + rr;
        if r >= tk.r1 {
            break;
        }
        var mx = NEG_BIG;
        for (var u = 0u; u < tk.n_units; u++) {
            mx = max(mx, part_vec(p.ml_off + (base + u) * M + rr).x);
        }
        var l = 0.0;
        var acc = vec4<f32>(0.0);
        for (var u = 0u; u < tk.n_units; u++) {
            let pr = (base + u) * M + rr;
            let ml = part_vec(p.ml_off + pr);
            let w = exp(ml.x - mx);
            l += ml.y * w;
            acc += part_vec(pr * hd4 + d4) * w;
        }
        out[p.out_off + ((r / grp) * p.n_heads + kvh * grp + r % grp) * hd4 + d4] = acc / l;
    }
}
