// Per-head QK RMSNorm and RoPE, shared by qk_norm_rope.wgsl and the decode attention's fused
// variant (attn_decode.wgsl, ROPE), so both normalize and rotate exactly alike. The kernel
// provides p (head_dim, rot_dim, has_norm, eps, inv_off, rope_scale, qn_off, kn_off), inv (the
// inverse frequencies), qnw and knw (q_norm and k_norm weights), wg_sum (common.wgsl) and two
// accessors: head_in(is_q, i) reads element i of the head's input, head_out(is_q, i, v) stores
// the result of element i.

// cos and sin of a ≥ 0: reduction by π/2 with a three-part constant (Cody–Waite; the first part
// has 8 significant bits, so k·C1 is exact while k < 2^16, i.e. a < ~100k rad), then minimax
// polynomials on [-π/4, π/4] (Cephes sinf/cosf). Drivers' cos/sin lose accuracy for large
// arguments; this follows the CPU's f64 cos/sin of the same f32 angle to ~1e-7.
fn sincos(a: f32) -> vec2<f32> {
    let kf = round(a * 0.63661977236758134);
    let r = ((a - kf * 1.5703125) - kf * 4.837512969970703125e-4) - kf * 7.54978995489188216e-8;
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    switch u32(kf) & 3u {
        case 0u: { return vec2<f32>(c, s); }
        case 1u: { return vec2<f32>(-s, c); }
        case 2u: { return vec2<f32>(-c, -s); }
        default: { return vec2<f32>(s, -c); }
    }
}

// The rotated pair (a, b) = (x[i], x[i + rot/2]) at position pos: (a·c − b·s, b·c + a·s) with
// (c, s) = scale · (cos, sin)(inv_freq · pos).
fn rotate(a: f32, b: f32, inv_freq: f32, pos: u32, scale: f32) -> vec2<f32> {
    let cs = sincos(inv_freq * f32(pos)) * scale;
    return vec2<f32>(a * cs.x - b * cs.y, b * cs.x + a * cs.y);
}

fn head_norm_w(is_q: bool, i: u32) -> f32 {
    if is_q {
        return qnw[p.qn_off + i];
    }
    return knw[p.kn_off + i];
}

// Normalizes (has_norm) and rotates one head at position pos: element i pairs with i + rot/2 for
// i < rot/2 ("rotate half"); elements from rot on are only normalized (partial rotary). Call in
// workgroup-uniform control flow: the norm's reduction has barriers, and every read of the head
// happens before them, so head_out may write the input in place.
fn rope_head(is_q: bool, pos: u32, li: u32, wg: u32, sg: u32, nsg: u32, lane: u32) {
    let hd = p.head_dim;
    var r = 1.0;
    if p.has_norm != 0u {
        var ss = 0.0;
        for (var i = li; i < hd; i += wg) {
            let e = head_in(is_q, i);
            ss += e * e;
        }
        r = 1.0 / sqrt(wg_sum(ss, sg, nsg, lane) / f32(hd) + p.eps);
    }
    let half = p.rot_dim / 2u;
    for (var i = li; i < hd; i += wg) {
        if i >= half && i < p.rot_dim {
            continue;
        }
        var a = head_in(is_q, i);
        if p.has_norm != 0u {
            a = a * r * head_norm_w(is_q, i);
        }
        if i < half {
            var b = head_in(is_q, i + half);
            if p.has_norm != 0u {
                b = b * r * head_norm_w(is_q, i + half);
            }
            let ab = rotate(a, b, inv[p.inv_off + i], pos, p.rope_scale);
            head_out(is_q, i, ab.x);
            head_out(is_q, i + half, ab.y);
        } else {
            head_out(is_q, i, a);
        }
    }
}
