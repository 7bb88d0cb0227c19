// Embedding gather (CPU twin: smoe_vault::quant::dequantize_row): y[t] = row ids[t] of a
// matrix stored in a vault type, dequantized to f32. Lets the GPU feed its own argmax back as
// the next token's input, so greedy decoding can queue a pass before the host has read the
// previous token. One invocation per output value; layouts as in smoe_vault::quant (64-input
// groups, codes then f16 parameters per row).

struct Params {
    rows: u32,
    cols: u32,
    row_stride: u32, // u32 words per stored row
    param_word: u32, // u32 index within a row where the f16 parameters start
    w_off: u32,      // u32 index of row 0 in the binding
    ids_off: u32,
    y_off: u32,
    _pad: u32,
}

override DTYPE: u32 = 0u; // 0 bf16, 1 q8, 2 q4, 3 q2, 6 f32

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn byte_at(rb: u32, b: u32) -> u32 {
    return (w[rb + b / 4u] >> (8u * (b % 4u))) & 0xffu;
}

fn half_at(rb: u32, i: u32) -> f32 {
    return unpack2x16float(w[rb + p.param_word + i / 2u])[i % 2u];
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if i >= p.cols {
        return;
    }
    // An id past the matrix (never from the argmax) reads its last row rather than past it.
    let rb = p.w_off + min(ids[p.ids_off + t], p.rows - 1u) * p.row_stride;
    let g = i / 64u;
    let j = i % 64u;
    var v = 0.0;
    switch DTYPE {
        case 0u: {
            let word = w[rb + i / 2u];
            v = bitcast<f32>(select(word << 16u, word & 0xffff0000u, i % 2u == 1u));
        }
        case 1u: {
            v = half_at(rb, g) * f32(bitcast<i32>(byte_at(rb, i) << 24u) >> 24u);
        }
        case 2u: {
            // Byte 32g + j' holds input 64g + j' (low nibble) and 64g + 32 + j' (high).
            let b = byte_at(rb, 32u * g + j % 32u);
            v = half_at(rb, g) * (f32(select(b & 15u, b >> 4u, j >= 32u)) - 8.0);
        }
        case 3u: {
            // Bits 2i'..2i'+2 of byte 16g + j' hold input 64g + 16i' + j'; then d·c + m.
            let c = (byte_at(rb, 16u * g + j % 16u) >> (2u * (j / 16u))) & 3u;
            v = half_at(rb, 2u * g) * f32(c) + half_at(rb, 2u * g + 1u);
        }
        default: {
            v = bitcast<f32>(w[rb + i]);
        }
    }
    y[p.y_off + t * p.cols + i] = v;
}
