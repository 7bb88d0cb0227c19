// Shared by matmul.wgsl and matmul_coop.wgsl (prepended to both): their parameters and bindings,
// the token tile, the global loads of a K-step's weight and x pieces, and the weight values of
// one staged piece (a 16-byte chunk of stored codes). Each kernel declares the tile overrides
// used here (DTYPE, BM, BN, BK, GATED, GROUPED, OR, PV, CPV, W_PIECES, X_PIECES, WP, XP, WG,
// MAXP), the workgroup arrays `tok` and `xrow`, and which invocation loads what: `w_piece(d)`,
// the (tile row, step offset) of weight piece d (PV step positions from there), and
// `x_piece(d)`, the (tile token, step offset) of x piece d (4 positions).

// Values at step positions p0 + 4j .. p0 + 4j + 3 of the piece that starts at position p0:
// q is the piece's chunk, pw the u32 that holds its 64-group's f16 parameters. A bf16 piece
// holds 8 positions (j < 2), a quantized one 16 (j < 4).
fn dequant4(q: vec4<u32>, pw: u32, p0: u32, j: u32) -> vec4<f32> {
    switch DTYPE {
        case 0u: {
            // bf16 → f32 is a 16-bit shift; word i holds positions 2i, 2i + 1.
            let a = q[2u * j];
            let b = q[2u * j + 1u];
            return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xffff0000u, b << 16u, b & 0xffff0000u));
        }
        case 1u: {
            let dq = unpack2x16float(pw)[(p0 / 64u) % 2u];
            return dq * vec4<f32>(unpack4xI8(q[j]));
        }
        case 2u: {
            // Positions p0.. are the low (or, for odd p0 / 16, high) nibbles of the chunk.
            let dq = unpack2x16float(pw)[(p0 / 64u) % 2u];
            let sh = 4u * ((p0 / 16u) % 2u);
            let c = vec4<f32>(unpack4xU8((q[j] >> sh) & 0x0f0f0f0fu));
            return dq * (c - 8.0);
        }
        default: {
            // q2: positions p0.. are bits 2i..2i+2 of the group's 16 bytes, i = p0 / 16 % 4.
            let dm = unpack2x16float(pw);
            let sh = 2u * ((p0 / 16u) % 4u);
            let c = vec4<f32>(unpack4xU8((q[j] >> sh) & 0x03030303u));
            return dm.x * c + dm.y;
        }
    }
}

// Column of step position pos (pos a multiple of 4; the 4 columns from there are consecutive):
// the storage order of the codes, which is the column order except for q4, whose byte j of a
// 64-group holds columns j and j + 32 (position p is column p with bits 4 and 5 swapped).
fn column(pos: u32) -> u32 {
    if DTYPE == 2u {
        return (pos & ~0x30u) | ((pos & 0x10u) << 1u) | ((pos & 0x20u) >> 1u);
    }
    return pos;
}

struct Params {
    rows: u32,         // output rows (of this part)
    cols: u32,
    n_tok: u32,        // dense: tokens
    row_stride: u32,   // vec4<u32> per stored row
    w_off: u32,        // vec4 index of row 0 of matrix 0, relative to the binding
    w_mat_stride: u32, // vec4s between stacked matrices (GROUPED)
    w_up_off: u32,     // vec4s from the gate matrix to the up matrix (GATED)
    param_word: u32,   // u32 index within a row where the f16 group parameters start
    x_off: u32,        // vec4 index of x row 0
    x_tok: u32,        // vec4s between x rows
    x_div: u32,        // GROUPED: slots that share one x row (slot s reads row s / x_div); >= 1
    y_off: u32,        // f32 index of y row 0, output row 0 of this part
    y_tok: u32,        // f32s between y rows (of the first region)
    // Dense: output rows split1.. and split2.. go to two more regions of y, each [n_tok][its
    // rows] after the one before (one GEMM over q, k and v stacked writes the three buffers
    // the attention reads). Both are u32::MAX otherwise: one region.
    split1: u32,
    split2: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> starts: array<u32>;
@group(0) @binding(5) var<storage, read> perm: array<u32>;
// units[0]: the count of units; units[1 + u]: unit u = (expert << 20) | token tile index.
@group(0) @binding(6) var<storage, read> units: array<u32>;

const INVALID: u32 = 0xffffffffu;

// Index in y of output row o (of this part) for token (GROUPED: slot) t.
fn y_at(t: u32, o: u32) -> u32 {
    if o < p.split1 {
        return p.y_off + t * p.y_tok + o;
    }
    if o < p.split2 {
        return p.y_off + p.n_tok * p.split1 + t * (p.split2 - p.split1) + o - p.split1;
    }
    return p.y_off + p.n_tok * p.split2 + t * (p.rows - p.split2) + o - p.split2;
}

// The next step's raw bytes, loaded before the current step is multiplied.
var<private> wraw: array<vec4<u32>, MAXP>;
var<private> wpar: array<u32, MAXP>;
var<private> xraw: array<vec4<f32>, MAXP>;

// vec4 index of the stored row behind tile row i.
fn wrow(wbase: u32, r0: u32, i: u32) -> u32 {
    var o = i;
    var up = 0u;
    if GATED && i >= OR {
        o = i - OR;
        up = p.w_up_off;
    }
    // Rows past the end repeat the last row (their sums are never stored): no branch, no
    // read outside the matrix.
    let row = min(r0 + o, p.rows - 1u);
    return wbase + row * p.row_stride + up;
}

// Issues the global loads of the step at position c0.
fn load_step(li: u32, c0: u32, wbase: u32, r0: u32) {
    for (var n = 0u; n < WP; n++) {
        let d = li + n * WG;
        if d < W_PIECES {
            let wp = w_piece(d);
            let i = wp.x;
            let p0 = c0 + wp.y;
            var q = vec4<u32>(0u);
            var pw = 0u;
            // Only bf16 can have a partial last step (cols % 8 == 0); quantized cols are
            // multiples of 64.
            if p0 < p.cols {
                let rb = wrow(wbase, r0, i);
                q = w[rb + p0 / CPV];
                if DTYPE != 0u {
                    let g = p0 / 64u;
                    let wi = p.param_word + select(g / 2u, g, DTYPE == 3u);
                    pw = w[rb + wi / 4u][wi % 4u];
                }
            }
            wraw[n] = q;
            wpar[n] = pw;
        }
    }
    for (var n = 0u; n < XP; n++) {
        let d = li + n * WG;
        if d < X_PIECES {
            let xp = x_piece(d);
            let pos = c0 + xp.y;
            var v = vec4<f32>(0.0);
            if pos < p.cols {
                v = x[xrow[xp.x] + column(pos) / 4u];
            }
            xraw[n] = v;
        }
    }
}

// The token tile: tokens (GROUPED: perm indices) j0..j0 + nvalid, 1 <= nvalid <= BN. tok[t] is
// token t's index (GROUPED: its slot), INVALID past the end; xrow[t] the vec4 index of its x
// row (a valid row even past the end, so staging needs no branch).
fn stage_tokens(li: u32, j0: u32, nvalid: u32) {
    for (var t = li; t < BN; t += WG) {
        let j = j0 + min(t, nvalid - 1u);
        var s = j;
        if GROUPED {
            s = perm[j];
        }
        tok[t] = select(INVALID, s, t < nvalid);
        xrow[t] = p.x_off + (s / p.x_div) * p.x_tok;
    }
}
