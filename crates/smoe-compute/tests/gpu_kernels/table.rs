//! The conformance table: every op of the GPU backend at the shapes and types that cross its
//! kernel's boundaries (subgroup and workgroup rows, staging tiles, token tiles, splits of the
//! context, GQA groups), each row with the tolerance its CPU twin is held to. To check a new
//! kernel, variant or backend, add rows (docs/testing.md, "Kernel tests").
//!
//! Tolerances (NMSE unless said): matvec products 1e-5 (f32 sums in another order over the
//! same decoded weights); q4 with int8 activations 1e-3 (their quantization noise); the GEMM
//! 1e-9 on the f32 ALUs (on matrix units the case allows 1e-6: weights rounded to f16); norms,
//! attention, RoPE, softmax weights and sums 1e-10 to 1e-12; copies max-abs 0; ids exactly.
//!
//! Not formatted by rustfmt (`#[rustfmt::skip]` on the module): one row a line.

use crate::cases::attention::{Decode, DecodeRope, Heads, Prefill, PrefillTile, QkNormRope};
use crate::cases::matmul::{DenseMatMul, GroupedMatMul, Ids, Sort, Tile};
use crate::cases::matvec::{MatVec, SlotInput::*};
use crate::cases::ops::{
    ArgmaxCase, Elt, EltwiseCase, Embed, Logits, Norm, RouterCase, WeightedSumCase,
};
use crate::cases::tails::{NextRouteCase, RouteTailCase, SumTailCase};
use crate::conformance::{Backend, Case, Row, Tol};
use smoe_compute::gpu::{MatVecTuning, Q4Decode};
use smoe_vault::quant::DType::{self, *};

const QUANTS: [DType; 4] = [Bf16, Q8, Q4, Q2];
/// The backends of rows whose kernels differ between them (attention's split merges).
const BOTH: [Backend; 2] = [Backend::Gpu, Backend::GpuTailsApart];

fn nmse(bound: f64) -> Tol {
    Tol::Nmse(bound)
}

/// The rows being collected.
struct Table(Vec<Row>);

impl Table {
    fn add(&mut self, case: impl Case + 'static, tol: Tol) {
        self.0.push(Row::new(case, tol));
    }

    fn add_on(&mut self, backends: &[Backend], case: impl Case + Clone + 'static, tol: Tol) {
        for &b in backends {
            self.0.push(Row::new(case.clone(), tol).on(b));
        }
    }
}

pub fn rows() -> Vec<Row> {
    let mut t = Table(vec![]);
    matvec(&mut t);
    matvec_fused(&mut t);
    matmul(&mut t);
    matmul_grouped(&mut t);
    expert_sort(&mut t);
    attention(&mut t);
    prefill(&mut t);
    small_ops(&mut t);
    tails(&mut t);
    t.0
}

/// Launch shapes that share rows among subgroups differently, and the q4 decoders (the default
/// is PairsF16; PairsF32 is what a device without f16 arithmetic runs): (invocations, rows,
/// decoder, items a subgroup loads together — 0: the type's default).
const MATVEC_TUNINGS: [(u32, u32, Q4Decode, u32); 8] = [
    (64,  8,  Q4Decode::FloatBits,  2),
    (256, 32, Q4Decode::FloatBits,  0),
    (128, 16, Q4Decode::IntToFloat, 4),
    (256, 64, Q4Decode::IntToFloat, 8),
    (256, 16, Q4Decode::FloatBits,  3),
    (256, 16, Q4Decode::PairsF32,   0),
    (64,  8,  Q4Decode::PairsF32,   2),
    (128, 16, Q4Decode::PairsF16,   4),
];

fn matvec(t: &mut Table) {
    let default = MatVecTuning::default();
    for dtype in QUANTS {
        // Fewer rows than a subgroup (1, 7) and than a workgroup's; one staging tile and more.
        for rows in [1, 7, 33, 1000] {
            for cols in [64, 192, 320, 2048] {
                for nt in [1, 3] {
                    t.add(MatVec::new(dtype, rows, cols, nt).tuned(default), nmse(1e-5));
                }
            }
        }
        // 4160 columns need several staging tiles; 9 tokens two workgroups along z.
        for (rows, cols, nt) in [(45, 4160, 3), (17, 4160, 1), (20, 256, 9)] {
            t.add(MatVec::new(dtype, rows, cols, nt).tuned(default), nmse(1e-5));
        }
    }
    for (wg, rows, q4, items) in MATVEC_TUNINGS {
        let tune = MatVecTuning { wg, rows, q4, items };
        for dtype in QUANTS {
            for (r, c, nt) in [(1, 64, 1), (33, 320, 3), (1000, 2048, 1), (70, 4160, 2)] {
                t.add(MatVec::new(dtype, r, c, nt).tuned(tune), nmse(1e-5));
            }
        }
    }
    // The opt-in q4 path that quantizes x to int8 per 64 inputs: within the quantization noise
    // of the f32 twin (and within 1e-6 of an int8 twin, which the case checks too).
    let int8 = MatVecTuning { q4: Q4Decode::Int8Dot, ..default };
    let shapes = [(1, 64, 1), (33, 320, 3), (1000, 2048, 1), (45, 4160, 2), (20, 256, 9)];
    for (rows, cols, nt) in shapes {
        t.add(MatVec::new(Q4, rows, cols, nt).tuned(int8), nmse(1e-3));
    }
    for dtype in QUANTS {
        // gate_up: silu(G·x)·(U·x).
        for (rows, cols, nt) in [(33, 192, 1), (7, 320, 3), (96, 2048, 1)] {
            t.add(MatVec::new(dtype, rows, cols, nt).gated(), nmse(1e-5));
        }
        // Six experts at a padded stride, four slots (one expert twice): one x, one per slot,
        // one per pair of slots (two tokens' two experts each).
        for input in [Shared, Own, PerToken(2)] {
            t.add(MatVec::new(dtype, 40, 192, 1).experts(6, &[4, 1, 4, 0], input), nmse(1e-5));
        }
    }
}

/// matvec with work fused in: the input's RMSNorm (the normed input written out too), the
/// residual add, the weighted reduce over each token's experts.
fn matvec_fused(t: &mut Table) {
    for dtype in QUANTS {
        // Widths over one staging tile; plain and gated.
        let mv = |rows, cols, nt| MatVec::new(dtype, rows, cols, nt).normed(true).accumulate();
        t.add(mv(33, 192, 1), nmse(1e-5));
        t.add(mv(70, 4160, 3), nmse(1e-5));
        t.add(mv(40, 320, 2).gated(), nmse(1e-5));
        // Three tokens choosing 3 of six experts (one twice); two tokens choosing 8 of ten over
        // inputs wider than a staging tile; 8 × 1536 inputs, more than any device stages.
        let reduce = |rows, cols, n_mats, ids: &[u32]| {
            MatVec::new(dtype, rows, cols, 1).experts(n_mats, ids, Own).accumulate()
        };
        t.add(reduce(40, 192, 6, &[5, 0, 2, 1, 1, 3, 4, 2, 0]).reduce(3), nmse(1e-5));
        let ten = [9, 0, 2, 1, 7, 3, 4, 5, 8, 6, 5, 4, 3, 2, 1, 0];
        t.add(reduce(33, 768, 10, &ten).reduce(8), nmse(1e-5));
        let nine = [8, 0, 2, 1, 7, 3, 4, 5, 0, 6, 5, 4, 3, 2, 1, 8];
        t.add(reduce(20, 1536, 9, &nine).reduce(8), nmse(1e-5));
        // Grouped gate_up of normed inputs: each token's k = 2 slots share its x, normed per
        // token inside the kernel.
        let mv = MatVec::new(dtype, 24, 256, 1).experts(5, &[3, 1, 4, 3], PerToken(2));
        t.add(mv.gated().normed(false), nmse(1e-5));
    }
}

/// Tiles every variant must agree under: 16- and 32-column steps, 64-row tiles, narrow and
/// wide token tiles (48 is a grouped default); then the matrix units' at every token width,
/// with 64- and 32-column steps (not supported without matrix units).
fn gemm_tiles() -> Vec<Tile> {
    let alus = [
        (128, 64, 16), (128, 64, 32), (128, 48, 16), (64, 64, 32), (64, 32, 16), (128, 128, 16),
        (128, 16, 16),
    ];
    let units = [(16, 64), (32, 64), (48, 64), (64, 64), (16, 32), (48, 32), (64, 32)];
    (alus.map(|(m, n, k)| Tile::Alus(m, n, k)).into_iter())
        .chain(units.map(|(n, k)| Tile::Units(n, k)))
        .collect()
}

fn matmul(t: &mut Table) {
    let exact = nmse(1e-9);
    for dtype in QUANTS {
        for rows in [200, 64] {
            for cols in [192, 320] {
                for nt in [1, 3, 64, 100] {
                    t.add(DenseMatMul::new(dtype, rows, cols, nt), exact);
                }
            }
        }
        for (rows, cols, nt) in [(33, 192, 1), (200, 320, 3), (64, 192, 100), (96, 2048, 17)] {
            t.add(DenseMatMul::new(dtype, rows, cols, nt).gated(), exact);
        }
    }
    // bf16 needs only cols % 8: the last K-step is partial.
    t.add(DenseMatMul::new(Bf16, 70, 8, 5), exact);
    t.add(DenseMatMul::new(Bf16, 70, 40, 5).gated(), exact);
    t.add(DenseMatMul::new(Bf16, 70, 200, 5), exact);
    for tile in gemm_tiles() {
        // Odd rows (a partial row tile) and tokens (a partial token tile).
        for dtype in QUANTS {
            t.add(DenseMatMul::new(dtype, 77, 320, 37).tile(tile), exact);
            t.add(DenseMatMul::new(dtype, 130, 192, 129).gated().tile(tile), exact);
        }
        // q, k and v from one GEMM: regions at row-tile boundaries and between them, empty
        // regions included.
        for dtype in [Q4, Bf16] {
            let regions = [
                (320, 37, [256, 288]), (200, 64, [77, 150]),
                (130, 9, [0, 130]), (96, 100, [96, 96]),
            ];
            for (rows, nt, [a, b]) in regions {
                t.add(DenseMatMul::new(dtype, rows, 192, nt).split(a, b).tile(tile), exact);
            }
        }
    }
}

fn matmul_grouped(t: &mut Table) {
    let exact = nmse(1e-9);
    let grouped = |dtype, rows, cols, n_mats, ids, x_div, gated| GroupedMatMul {
        dtype, rows, cols, n_mats, ids, x_div, gated, tile: Tile::Default,
    };
    for dtype in QUANTS {
        // gate_up: 37 tokens × top-4 of 12 experts (the even ones empty), every slot of a token
        // reading its x row; then down, each slot its own row.
        let odd = Ids::mapped(37 * 4, 6, "as 2e+1 (even experts empty)", |e| 2 * e + 1);
        t.add(grouped(dtype, 70, 192, 12, odd.clone(), 4, true), exact);
        t.add(grouped(dtype, 70, 192, 12, odd.clone(), 4, false), exact);
        t.add(grouped(dtype, 200, 320, 12, odd, 1, false), exact);
        // Every slot one expert: it loops over several token tiles.
        t.add(grouped(dtype, 64, 192, 5, Ids::List(vec![3; 150]), 2, true), exact);
        // One expert takes ~3/4 of the slots (several token tiles, each its own workgroup), the
        // others a few or none.
        t.add(grouped(dtype, 70, 192, 12, Ids::Skewed { n: 80 * 4, of: 12 }, 4, true), exact);
        t.add(grouped(dtype, 130, 256, 12, Ids::Skewed { n: 80 * 4, of: 12 }, 1, false), exact);
    }
    // A streaming GPU runs a batch's experts in rounds: the slots of other rounds' experts
    // carry ids ≥ n_mats, get no work, and keep their outputs.
    let other_rounds = |e| if e % 3 == 0 { u32::MAX - e } else { e };
    let skip = Ids::mapped(200, 12, "every third as MAX - e", other_rounds);
    t.add(grouped(Q4, 64, 128, 12, skip.clone(), 4, true), exact);
    t.add(grouped(Q4, 64, 128, 12, skip, 1, false), exact);
    // One slot; one expert; one row.
    t.add(grouped(Q4, 10, 64, 3, Ids::List(vec![2]), 1, true), exact);
    t.add(grouped(Q4, 1, 64, 1, Ids::List(vec![0; 3]), 1, true), exact);
    // Every tile, on uniform and on skewed routing.
    for (i, tile) in gemm_tiles().into_iter().enumerate() {
        let uniform = grouped(QUANTS[i % 4], 90, 320, 20, Ids::uniform(61 * 8, 20), 8, i % 3 != 1);
        t.add(GroupedMatMul { tile, ..uniform }, exact);
        let ids = Ids::Skewed { n: 53 * 8, of: 9 };
        let skewed = grouped(QUANTS[(i + 1) % 4], 90, 320, 9, ids, 8, i % 2 == 0);
        t.add(GroupedMatMul { tile, ..skewed }, exact);
    }
}

fn expert_sort(t: &mut Table) {
    let cases = [
        (Ids::List(vec![0]), 1),
        (Ids::List(vec![3]), 5),
        (Ids::List(vec![2, 0, 2, 1, 0]), 4),
        (Ids::List(vec![7; 4096]), 128),              // every slot one expert
        (Ids::uniform(4096, 128), 128),
        (Ids::uniform(100, 1024), 1024),              // most experts empty
        (Ids::uniform(1000, 3), 3),
        (Ids::uniform(777, 60), 64),                  // the last 4 experts empty
        (Ids::uniform(20_000, 128), 128),             // more slots than a 512-token chunk
        (Ids::mapped(512, 8, "squared", |e| e * e), 50), // a few hot experts, the rest rare
        (Ids::Skewed { n: 4096, of: 128 }, 128),
        // Skipped slots (ids ≥ n_mats: another round's experts), a third of them, and all.
        (Ids::OtherRounds { n: 4096, of: 128 }, 128),
        (Ids::OtherRounds { n: 300, of: 16 }, 16),
        (Ids::List(vec![u32::MAX; 64]), 8),
    ];
    for (i, (ids, n_mats)) in cases.into_iter().enumerate() {
        // Tiles: 1 (a unit per slot), the GEMM's, and one no GEMM takes; ids at offsets of
        // 0, 4 and 8 bytes.
        for tile in [1, 16, 48, 64, 128, 7] {
            t.add(Sort { ids: ids.clone(), n_mats, tile, pad: i % 3 }, Tol::Exact);
        }
    }
}

fn attention(t: &mut Table) {
    // Positions up to 50k check the angle's reduction.
    //  heads, tokens, pos0, QK-norm
    let appends = [
        (Heads(4, 2, 128),  3, 5,      true),
        (Heads(32, 4, 128), 1, 40_000, true),
        (Heads(8, 8, 64),   2, 0,      false),
        (Heads(2, 1, 256),  1, 50_000, true),
    ];
    for (heads, tokens, pos0, norm) in appends {
        t.add(QkNormRope { heads, tokens, pos0, norm }, nmse(1e-10));
    }

    // Decode: contexts from 1 to several tiles and splits, GQA groups 1..8, sliding windows.
    //  (heads, kv heads, head_dim), tokens, pos0, capacity, window
    let decode = [
        (Heads(4, 2, 64),   1, 0,    16,   None),
        (Heads(8, 1, 128),  3, 34,   40,   None),
        (Heads(32, 4, 128), 1, 699,  1500, None),
        (Heads(16, 4, 256), 3, 1400, 1500, None),
        (Heads(6, 3, 128),  2, 5000, 5003, None),
        (Heads(8, 2, 64),   3, 1000, 1100, Some(128)),
        (Heads(4, 4, 64),   2, 10,   20,   Some(100)),
        // One split (capacity ≤ 512: the direct path, no combine) over several tiles.
        (Heads(8, 2, 64),   2, 300,  400,  None),
        (Heads(8, 2, 128),  1, 450,  512,  Some(200)),
        // Short contexts in caches of several splits: some splits have no positions.
        (Heads(8, 2, 128),  1, 20,   2000, None),
        (Heads(8, 2, 128),  2, 200,  3000, None),
        // Head widths that are not a multiple of 32 (the K dot's 8-vec4 steps leave a rest).
        (Heads(4, 2, 36),   2, 20,   40,   None),
        (Heads(8, 4, 80),   1, 100,  200,  None),
        // Wide heads: each invocation sums 3 and 4 vec4s of the output.
        (Heads(4, 2, 384),  2, 30,   64,   None),
        (Heads(2, 1, 512),  1, 700,  800,  None),
    ];
    for (heads, tokens, pos0, capacity, window) in decode {
        t.add_on(&BOTH, Decode { heads, tokens, pos0, capacity, window }, nmse(1e-10));
    }
    // With QK-norm, RoPE and the KV append fused in (one token): the first position, one split
    // and several, GQA 1–8, a window, no QK-norm, a head width that is not a multiple of 32,
    // partial rotary.
    //  heads, pos0, capacity, window, QK-norm, rotated dims
    let fused = [
        (Heads(4, 2, 64),   0,      16,     None,       true,  64),
        (Heads(32, 4, 128), 699,    1500,   None,       true,  128),
        (Heads(32, 4, 128), 63,     4096,   None,       true,  128),
        (Heads(8, 8, 128),  300,    400,    None,       true,  32),
        (Heads(8, 2, 64),   1000,   1100,   Some(128),  false, 64),
        (Heads(4, 2, 36),   20,     40,     None,       true,  36),
        (Heads(4, 2, 64),   20,     40,     None,       false, 16),
        (Heads(16, 4, 128), 40_000, 40_010, Some(4096), true,  128),
    ];
    for (heads, pos0, capacity, window, norm, rot) in fused {
        t.add_on(&BOTH, DecodeRope { heads, pos0, capacity, window, norm, rot }, nmse(1e-10));
    }
}

fn prefill(t: &mut Table) {
    let prefill = |(heads, tokens, capacity, window), pos0s: &[usize], tile| Prefill {
        heads, tokens, capacity, window, pos0s: pos0s.to_vec(), tile,
    };
    // Token counts that are not multiples of a tile, first chunks (pos0 0) and later ones, GQA
    // groups 1..8 (3, 5, 7 included), head dims 36 (not a multiple of the score step) to 256,
    // and sliding windows shorter than the chunk, than the context, and longer than both.
    //  ((heads, kv heads, head_dim), tokens, capacity, window), positions of the chunk
    let default: [(_, &[usize]); 12] = [
        ((Heads(4, 4, 64),   1,   40,  None),       &[0, 1, 39]),
        ((Heads(32, 4, 128), 64,  600, None),       &[0, 512]),
        ((Heads(8, 2, 128),  300, 700, None),       &[0, 333]),
        ((Heads(4, 1, 64),   7,   120, None),       &[0, 100]),
        ((Heads(6, 3, 48),   100, 300, None),       &[0, 37]),
        ((Heads(2, 1, 48),   300, 300, Some(1000)), &[0]),
        ((Heads(8, 8, 64),   300, 400, Some(64)),   &[0, 50]),
        ((Heads(16, 2, 128), 100, 400, Some(40)),   &[0, 200]),
        ((Heads(7, 1, 48),   7,   20,  Some(3)),    &[0, 13]),
        ((Heads(10, 2, 256), 20,  60,  None),       &[0, 5]),
        ((Heads(5, 5, 36),   9,   30,  Some(5)),    &[0, 3]),
        ((Heads(4, 2, 64),   7,   20,  Some(100)),  &[2]),
    ];
    for (case, pos0s) in default {
        t.add(prefill(case, pos0s, PrefillTile::Default), nmse(1e-10));
    }
    // Every tile shape on the awkward cases (not supported where the workgroup memory lacks,
    // but 32 rows × 128 dims on every device with 40 KiB).
    let awkward: [(_, &[usize]); 4] = [
        ((Heads(32, 4, 128), 37,  100, None),    &[0, 41]),
        ((Heads(6, 3, 48),   100, 200, Some(30)), &[17]),
        ((Heads(3, 1, 256),  9,   40,  Some(7)),  &[0, 20]),
        ((Heads(1, 1, 36),   70,  80,  None),     &[5]),
    ];
    for rows in [32, 64, 128] {
        for dims in [16, 32, 64, 128] {
            for (case, pos0s) in awkward {
                t.add(prefill(case, pos0s, PrefillTile::Fixed(rows, dims)), nmse(1e-10));
            }
        }
    }
    // Long tiles' keys shared by several workgroups and merged: chunks whose tiles split into
    // 2..16 units, windows that leave some rows nothing in some units, GQA groups 1 and 8, and
    // a tile of 2,049 keys at 16 splits, whose last units round to no keys at all; 1 split is
    // the reference shape of the same tile. Merged in each tile's last unit where tails are
    // fused, in a pass of their own otherwise: both backends.
    let split: [(_, &[usize]); 5] = [
        ((Heads(32, 4, 128), 64,  700,  None),      &[0, 600]),
        ((Heads(8, 2, 64),   300, 700,  None),      &[0, 333]),
        ((Heads(8, 1, 64),   200, 800,  Some(300)), &[0, 500]),
        ((Heads(4, 4, 48),   150, 600,  Some(200)), &[250]),
        ((Heads(4, 1, 64),   16,  2100, None),      &[2033]),
    ];
    for splits in [1, 2, 3, 8, 16] {
        for (case, pos0s) in split {
            t.add_on(&BOTH, prefill(case, pos0s, PrefillTile::Splits(splits)), nmse(1e-10));
        }
    }
}

fn small_ops(t: &mut Table) {
    for (n, rows) in [(64, 1), (2048, 3), (4096, 1), (333, 7)] {
        t.add(Norm { n, rows }, nmse(1e-10));
    }
    for (n, k, tokens) in [(2048, 8, 1), (77, 3, 3), (1, 1, 1)] {
        t.add(WeightedSumCase { n, k, tokens }, nmse(1e-10));
    }
    // silu·mul has no kernel of its own: the gated matvec and matmul rows check it.
    for (rows, len) in [(1, 192), (5, 48), (3, 333)] {
        for op in [Elt::AddRows, Elt::Clamp(3.0), Elt::Sigmoid] {
            t.add(EltwiseCase { op, rows, len }, nmse(1e-12));
        }
    }
    // Ids in any order, a repeated one, the first and the last row.
    for dtype in [F32, Bf16, Q8, Q4, Q2] {
        t.add(Embed { dtype, rows: 37, cols: 192, ids: vec![36, 0, 5, 5, 17] }, nmse(1e-12));
    }
    // Qwen3's vocabulary: plain, tied maxima, NaNs; a short row of -inf and a NaN; three rows
    // in one dispatch.
    let vocab = 151_936;
    for logits in [Logits::Random, Logits::Tied, Logits::Nans] {
        t.add(ArgmaxCase { n: vocab, rows: vec![logits] }, Tol::Exact);
    }
    t.add(ArgmaxCase { n: 1000, rows: vec![Logits::NegInfAndNan] }, Tol::Exact);
    let three = vec![Logits::Random, Logits::Tied, Logits::Nans];
    t.add(ArgmaxCase { n: vocab, rows: three }, Tol::Exact);
    // Softmax top-k, renormalized or not; several tokens (one with ties).
    t.add(RouterCase { experts: 128, k: 8, tokens: 1, normalize: true },  nmse(1e-10));
    t.add(RouterCase { experts: 128, k: 8, tokens: 3, normalize: false }, nmse(1e-10));
    t.add(RouterCase { experts: 64,  k: 6, tokens: 2, normalize: true },  nmse(1e-10));
    t.add(RouterCase { experts: 8,   k: 2, tokens: 1, normalize: true },  nmse(1e-10));
    t.add(RouterCase { experts: 257, k: 1, tokens: 1, normalize: false }, nmse(1e-10));
}

fn tails(t: &mut Table) {
    // The router matvec's top-k: expert counts that are not a multiple of a workgroup's rows,
    // several tokens (one with ties), every storage type.
    let route = |dtype, experts, cols, k, tokens, normalize| {
        RouteTailCase { dtype, experts, cols, k, tokens, normalize }
    };
    t.add(route(Bf16, 128, 256, 8, 1, true),  nmse(1e-5));
    t.add(route(Bf16, 60,  192, 4, 3, false), nmse(1e-5));
    t.add(route(Q8,   128, 320, 8, 2, true),  nmse(1e-5));
    t.add(route(Q4,   257, 256, 1, 1, false), nmse(1e-5));
    t.add(route(Q2,   16,  128, 2, 9, true),  nmse(1e-5));
    // The experts' weighted sum into the residual: row counts that leave a partial block, one
    // and several tokens, an expert chosen twice.
    for dtype in QUANTS {
        let sum = |rows, cols, n_mats, k, ids: &[u32]| {
            SumTailCase { dtype, rows, cols, n_mats, k, ids: ids.to_vec() }
        };
        t.add(sum(40, 192, 6, 3, &[5, 0, 2, 1, 1, 3, 4, 2, 0]), nmse(1e-5));
        t.add(sum(2048, 768, 10, 8, &[9, 0, 2, 1, 7, 3, 4, 5, 8, 6, 5, 4, 3, 2, 1, 0]), nmse(1e-5));
        t.add(sum(33, 256, 4, 1, &[3]), nmse(1e-5));
    }
    // The next block's router after the output projection: a partial first-level group of
    // workgroups (132 = 8·16 + 4), more than 16 groups (257), and the 30B's o_proj (256
    // workgroups of 8 rows).
    let next = |dtype, rows, cols, experts, k, normalize| {
        NextRouteCase { dtype, rows, cols, experts, k, normalize }
    };
    t.add(next(Q4,   2048, 512, 128, 8, true),  nmse(1e-5));
    t.add(next(Bf16, 264,  128, 60,  4, false), nmse(1e-5));
    t.add(next(Q8,   8200, 64,  16,  2, true),  nmse(1e-5));
}
