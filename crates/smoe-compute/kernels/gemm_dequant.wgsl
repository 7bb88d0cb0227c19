// Shared by matmul.wgsl and matmul_coop.wgsl (prepended to both; the kernel declares DTYPE):
// the weight values of one staged piece, a 16-byte chunk of stored codes.

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
