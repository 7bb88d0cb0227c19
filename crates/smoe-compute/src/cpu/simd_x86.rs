//! AVX2 + FMA kernels (x86-64), selected at run time.
//!
//! Weights are dequantized in registers, never into memory: each group of 64 inputs is decoded
//! eight lanes at a time (`Codec::chunk`) and multiplied straight into per-token partial sums
//! with FMA. Whatever is common to a group (the scale `d`) is applied once per group in
//! `Codec::fold` rather than once per weight; q2, with only four levels, looks its weights up in
//! a per-group table instead. Several tokens are processed per pass over a row
//! (`NT` ≤ 4), so a decoded chunk feeds up to four FMAs and the row is decoded once per tile.
//! The group scales are f16 and are converted with F16C, which every AVX2 CPU has; it is detected
//! alongside AVX2 and FMA anyway.

use super::scalar;
use smoe_vault::quant::{DType, GROUP};
use std::arch::x86_64::*;

/// Name reported by `simd_path`.
pub(super) const NAME: &str = "avx2+fma";

/// Whether this CPU can run the kernels of this module.
pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Decoding of one group of 64 inputs of one storage type into eight 8-lane vectors.
trait Codec {
    /// What a group needs besides its codes: the broadcast scale (and offset).
    type G: Copy;
    /// Bytes of codes per group.
    const CODE_BYTES: usize;
    /// Reads the parameters of group `g` from the parameter area that follows the codes.
    unsafe fn group(params: *const u8, g: usize) -> Self::G;
    /// Weights (possibly still unscaled) of inputs `8k..8k+8` of the group at `codes`.
    unsafe fn chunk(st: Self::G, codes: *const u8, k: usize) -> __m256;
    /// Adds a group's partial sum `Σ chunk · x` into the running total.
    unsafe fn fold(st: Self::G, part: __m256, acc: __m256) -> __m256;
}

/// Broadcasts the little-endian f16 at `p` as f32 lanes.
#[inline(always)]
unsafe fn f16_bcast(p: *const u8) -> __m256 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// Loads 8 bytes at `p` and zero-extends each into a 32-bit lane.
#[inline(always)]
unsafe fn load_u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

struct F32;
impl Codec for F32 {
    type G = ();
    const CODE_BYTES: usize = 4 * GROUP;
    #[inline(always)]
    unsafe fn group(_: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn chunk(_: (), codes: *const u8, k: usize) -> __m256 {
        _mm256_loadu_ps(codes.add(32 * k) as *const f32)
    }
    #[inline(always)]
    unsafe fn fold(_: (), part: __m256, acc: __m256) -> __m256 {
        _mm256_add_ps(part, acc)
    }
}

struct Bf16;
impl Codec for Bf16 {
    type G = ();
    const CODE_BYTES: usize = 2 * GROUP;
    #[inline(always)]
    unsafe fn group(_: *const u8, _: usize) {}
    /// bf16 is the top half of an f32: widen to 32 bits and shift left by 16.
    #[inline(always)]
    unsafe fn chunk(_: (), codes: *const u8, k: usize) -> __m256 {
        let h = _mm_loadu_si128(codes.add(16 * k) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[inline(always)]
    unsafe fn fold(_: (), part: __m256, acc: __m256) -> __m256 {
        _mm256_add_ps(part, acc)
    }
}

struct Q8;
impl Codec for Q8 {
    type G = __m256;
    const CODE_BYTES: usize = GROUP;
    #[inline(always)]
    unsafe fn group(params: *const u8, g: usize) -> __m256 {
        f16_bcast(params.add(2 * g))
    }
    #[inline(always)]
    unsafe fn chunk(_: __m256, codes: *const u8, k: usize) -> __m256 {
        let c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(codes.add(8 * k) as *const __m128i));
        _mm256_cvtepi32_ps(c)
    }
    #[inline(always)]
    unsafe fn fold(d: __m256, part: __m256, acc: __m256) -> __m256 {
        _mm256_fmadd_ps(part, d, acc)
    }
}

struct Q4;
impl Codec for Q4 {
    type G = __m256;
    const CODE_BYTES: usize = GROUP / 2;
    #[inline(always)]
    unsafe fn group(params: *const u8, g: usize) -> __m256 {
        f16_bcast(params.add(2 * g))
    }
    /// Inputs 0..32 are the low nibbles of the group's 32 bytes, inputs 32..64 the high ones;
    /// the code minus 8 is exact in i32, so only the scale is left for `fold`.
    #[inline(always)]
    unsafe fn chunk(_: __m256, codes: *const u8, k: usize) -> __m256 {
        let v = load_u8x8(codes.add(8 * (k % 4)));
        let c = if k < 4 {
            _mm256_and_si256(v, _mm256_set1_epi32(15))
        } else {
            _mm256_srli_epi32::<4>(v)
        };
        _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8)))
    }
    #[inline(always)]
    unsafe fn fold(d: __m256, part: __m256, acc: __m256) -> __m256 {
        _mm256_fmadd_ps(part, d, acc)
    }
}

struct Q2;
impl Codec for Q2 {
    /// The four possible weights `d·c + m` of the group, in both 128-bit halves.
    type G = __m256;
    const CODE_BYTES: usize = GROUP / 4;
    #[inline(always)]
    unsafe fn group(params: *const u8, g: usize) -> __m256 {
        let (d, m) = (
            f16_bcast(params.add(4 * g)),
            f16_bcast(params.add(4 * g + 2)),
        );
        _mm256_add_ps(
            _mm256_mul_ps(_mm256_setr_ps(0., 1., 2., 3., 0., 1., 2., 3.), d),
            m,
        )
    }
    /// Inputs `16s + j` sit in bits `2s..2s+2` of byte `j`; chunk `k` is bit pair `k / 2` of bytes
    /// `8(k % 2)..+8`. With only four levels the weight is a table lookup: `vpermilps` indexes
    /// by the low two bits of each lane, so the shifted bytes need no mask and no conversion.
    #[inline(always)]
    unsafe fn chunk(table: __m256, codes: *const u8, k: usize) -> __m256 {
        let v = load_u8x8(codes.add(8 * (k % 2)));
        let c = _mm256_srlv_epi32(v, _mm256_set1_epi32(2 * (k / 2) as i32));
        _mm256_permutevar_ps(table, c)
    }
    #[inline(always)]
    unsafe fn fold(_: __m256, part: __m256, acc: __m256) -> __m256 {
        _mm256_add_ps(part, acc)
    }
}

/// Repeats `$body` for `$k` = 0..8 as a constant, so chunk selection compiles to fixed offsets.
macro_rules! unroll8 {
    ($k:ident => $body:block) => {{
        {
            const $k: usize = 0;
            $body
        }
        {
            const $k: usize = 1;
            $body
        }
        {
            const $k: usize = 2;
            $body
        }
        {
            const $k: usize = 3;
            $body
        }
        {
            const $k: usize = 4;
            $body
        }
        {
            const $k: usize = 5;
            $body
        }
        {
            const $k: usize = 6;
            $body
        }
        {
            const $k: usize = 7;
            $body
        }
    }};
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `NT` dot products of one row with `NT` consecutive token vectors over the first
/// `groups * 64` inputs. The partial sum of a group starts from zero, so the dependency chain
/// of its eight FMAs ends with the group and consecutive groups overlap in the pipeline.
///
/// Safety: AVX2, FMA and F16C available; `row` holds `groups` groups of codes followed by the
/// parameters of all `cols / 64` groups at `params_at`; `x` holds `NT * cols` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<C: Codec, const NT: usize>(
    row: &[u8],
    params_at: usize,
    x: &[f32],
    cols: usize,
) -> [f32; NT] {
    let (codes, params, xp) = (row.as_ptr(), row.as_ptr().add(params_at), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); NT];
    for g in 0..cols / GROUP {
        let st = C::group(params, g);
        let (cg, xg) = (codes.add(g * C::CODE_BYTES), xp.add(g * GROUP));
        let mut part = [_mm256_setzero_ps(); NT];
        unroll8!(K => {
            let w = C::chunk(st, cg, K);
            for (t, p) in part.iter_mut().enumerate() {
                *p = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg.add(t * cols + 8 * K)), *p);
            }
        });
        for (a, p) in acc.iter_mut().zip(part) {
            *a = C::fold(st, p, *a);
        }
    }
    let mut out = [0f32; NT];
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum(a);
    }
    out
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
