//! NEON kernels (aarch64, where NEON is part of the base ISA).
//!
//! Same scheme as the AVX2 kernels: a group of 64 inputs is decoded in registers, 16 weights at
//! a time (`Codec::quad`, four 4-lane vectors from one 16-byte load), and multiplied straight
//! into per-token partial sums; the group scale is applied once per group in `Codec::fold`, and
//! up to four tokens share each decoded vector.

use super::scalar;
use smoe_vault::quant::{get_f16, DType, GROUP};
use std::arch::aarch64::*;

/// Name reported by `simd_path`.
pub(super) const NAME: &str = "neon";

/// Whether this CPU can run the kernels of this module.
pub(super) fn detected() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// Decoding of one group of 64 inputs of one storage type, 16 inputs at a time.
trait Codec {
    /// What a group needs besides its codes: the broadcast scale (and offset).
    type G: Copy;
    /// Bytes of codes per group.
    const CODE_BYTES: usize;
    /// Reads the parameters of group `g` from the parameter area that follows the codes.
    unsafe fn group(params: &[u8], g: usize) -> Self::G;
    /// Weights (possibly still unscaled) of inputs `16q..16q+16` of the group at `codes`.
    unsafe fn quad(st: Self::G, codes: *const u8, q: usize) -> [float32x4_t; 4];
    /// Adds a group's partial sum `Σ quad · x` into the running total.
    unsafe fn fold(st: Self::G, part: float32x4_t, acc: float32x4_t) -> float32x4_t;
}

/// Converts 16 signed bytes to four f32 vectors, in order.
#[inline(always)]
unsafe fn s8x16_to_f32(v: int8x16_t) -> [float32x4_t; 4] {
    let (lo, hi) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

struct F32;
impl Codec for F32 {
    type G = ();
    const CODE_BYTES: usize = 4 * GROUP;
    #[inline(always)]
    unsafe fn group(_: &[u8], _: usize) {}
    #[inline(always)]
    unsafe fn quad(_: (), codes: *const u8, q: usize) -> [float32x4_t; 4] {
        let p = codes.add(64 * q) as *const f32;
        [
            vld1q_f32(p),
            vld1q_f32(p.add(4)),
            vld1q_f32(p.add(8)),
            vld1q_f32(p.add(12)),
        ]
    }
    #[inline(always)]
    unsafe fn fold(_: (), part: float32x4_t, acc: float32x4_t) -> float32x4_t {
        vaddq_f32(part, acc)
    }
}

struct Bf16;
impl Codec for Bf16 {
    type G = ();
    const CODE_BYTES: usize = 2 * GROUP;
    #[inline(always)]
    unsafe fn group(_: &[u8], _: usize) {}
    /// bf16 is the top half of an f32: widen to 32 bits while shifting left by 16.
    #[inline(always)]
    unsafe fn quad(_: (), codes: *const u8, q: usize) -> [float32x4_t; 4] {
        let p = codes.add(32 * q) as *const u16;
        let (a, b) = (vld1q_u16(p), vld1q_u16(p.add(8)));
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(a))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(a)),
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(b))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(b)),
        ]
    }
    #[inline(always)]
    unsafe fn fold(_: (), part: float32x4_t, acc: float32x4_t) -> float32x4_t {
        vaddq_f32(part, acc)
    }
}

struct Q8;
impl Codec for Q8 {
    type G = float32x4_t;
    const CODE_BYTES: usize = GROUP;
    #[inline(always)]
    unsafe fn group(params: &[u8], g: usize) -> float32x4_t {
        vdupq_n_f32(get_f16(params, g))
    }
    #[inline(always)]
    unsafe fn quad(_: float32x4_t, codes: *const u8, q: usize) -> [float32x4_t; 4] {
        s8x16_to_f32(vld1q_s8(codes.add(16 * q) as *const i8))
    }
    #[inline(always)]
    unsafe fn fold(d: float32x4_t, part: float32x4_t, acc: float32x4_t) -> float32x4_t {
        vfmaq_f32(acc, part, d)
    }
}

struct Q4;
impl Codec for Q4 {
    type G = float32x4_t;
    const CODE_BYTES: usize = GROUP / 2;
    #[inline(always)]
    unsafe fn group(params: &[u8], g: usize) -> float32x4_t {
        vdupq_n_f32(get_f16(params, g))
    }
    /// Inputs 0..32 are the low nibbles of the group's 32 bytes, inputs 32..64 the high ones;
    /// `code − 8` fits an i8, so it is widened like a q8 code and only the scale is left.
    #[inline(always)]
    unsafe fn quad(_: float32x4_t, codes: *const u8, q: usize) -> [float32x4_t; 4] {
        let v = vld1q_u8(codes.add(16 * (q % 2)));
        let c = if q < 2 {
            vandq_u8(v, vdupq_n_u8(15))
        } else {
            vshrq_n_u8::<4>(v)
        };
        s8x16_to_f32(vsubq_s8(vreinterpretq_s8_u8(c), vdupq_n_s8(8)))
    }
    #[inline(always)]
    unsafe fn fold(d: float32x4_t, part: float32x4_t, acc: float32x4_t) -> float32x4_t {
        vfmaq_f32(acc, part, d)
    }
}

struct Q2;
impl Codec for Q2 {
    type G = (float32x4_t, float32x4_t);
    const CODE_BYTES: usize = GROUP / 4;
    #[inline(always)]
    unsafe fn group(params: &[u8], g: usize) -> (float32x4_t, float32x4_t) {
        (
            vdupq_n_f32(get_f16(params, 2 * g)),
            vdupq_n_f32(get_f16(params, 2 * g + 1)),
        )
    }
    /// Inputs `16q + j` sit in bits `2q..2q+2` of byte `j`. The offset `m` is per weight, so the
    /// weights are fully decoded (`d·c + m`) here, once for all tokens of the tile.
    #[inline(always)]
    unsafe fn quad((d, m): Self::G, codes: *const u8, q: usize) -> [float32x4_t; 4] {
        let v = vld1q_u8(codes);
        let c = vandq_u8(vshlq_u8(v, vdupq_n_s8(-2 * q as i8)), vdupq_n_u8(3));
        s8x16_to_f32(vreinterpretq_s8_u8(c)).map(|c| vfmaq_f32(m, c, d))
    }
    #[inline(always)]
    unsafe fn fold(_: Self::G, part: float32x4_t, acc: float32x4_t) -> float32x4_t {
        vaddq_f32(part, acc)
    }
}

/// `NT` dot products of one row with `NT` consecutive token vectors over the first
/// `cols / 64 * 64` inputs. Each token has two partial sums per group, so no chain of dependent
/// FMAs is longer than eight.
///
/// Safety: `row` holds `cols / 64` groups of codes followed by their parameters at `params_at`;
/// `x` holds `NT * cols` values.
unsafe fn tile<C: Codec, const NT: usize>(
    row: &[u8],
    params_at: usize,
    x: &[f32],
    cols: usize,
) -> [f32; NT] {
    let (codes, params, xp) = (row.as_ptr(), &row[params_at..], x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); NT];
    for g in 0..cols / GROUP {
        let st = C::group(params, g);
        let (cg, xg) = (codes.add(g * C::CODE_BYTES), xp.add(g * GROUP));
        let mut part = [[vdupq_n_f32(0.0); 2]; NT];
        for q in 0..4 {
            let w = C::quad(st, cg, q);
            for (t, p) in part.iter_mut().enumerate() {
                let xq = xg.add(t * cols + 16 * q);
                for (i, w) in w.iter().enumerate() {
                    p[i % 2] = vfmaq_f32(p[i % 2], *w, vld1q_f32(xq.add(4 * i)));
                }
            }
        }
        for (a, p) in acc.iter_mut().zip(part) {
            *a = C::fold(st, vaddq_f32(p[0], p[1]), *a);
        }
    }
    acc.map(|a| vaddvq_f32(a))
}

/// Dot products of one stored row with `NT` consecutive tokens (`x` is `NT * cols` values).
///
/// Safety: only call when `detected()` returned true.
pub(super) unsafe fn dot_tile<const NT: usize>(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    cols: usize,
) -> [f32; NT] {
    // These checks make the pointer arithmetic in `tile` stay inside the slices.
    assert!(row.len() >= dtype.row_stride(cols) && x.len() == NT * cols);
    assert!(dtype.check_cols(cols).is_ok());
    let code_bytes = dtype.code_bytes(cols);
    let mut r = match dtype {
        DType::F32 => tile::<F32, NT>(row, code_bytes, x, cols),
        DType::Bf16 => tile::<Bf16, NT>(row, code_bytes, x, cols),
        DType::Q8 => tile::<Q8, NT>(row, code_bytes, x, cols),
        DType::Q4 => tile::<Q4, NT>(row, code_bytes, x, cols),
        DType::Q2 => tile::<Q2, NT>(row, code_bytes, x, cols),
    };
    let body = cols - cols % GROUP;
    if body < cols {
        // Only f32 / bf16 rows can end in a partial block; it is shorter than 64 inputs.
        for (t, r) in r.iter_mut().enumerate() {
            *r += scalar::dot_plain_from(dtype, row, &x[t * cols..(t + 1) * cols], body);
        }
    }
    r
}
