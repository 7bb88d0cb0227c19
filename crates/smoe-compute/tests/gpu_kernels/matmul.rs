//! Prefill GEMM (dense, gated, grouped by expert) against `cpu::matmul` on the same stored
//! bytes, and the expert sort (and its work list of token tiles) against a stable counting
//! sort, exactly. On an adapter with matrix units every test also runs the tensor-core kernel
//! (`MatMul::new`'s default there, and the `coop` tiles of `tunings`); CI's lavapipe has none,
//! so there only the f32 kernel runs.

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::{matmul, ops::silu_mul, QMatRef};
use smoe_compute::gpu::{
    BufRef, ExpertSort, GpuContext, MatMul, MatMulDesc, MatMulGrouped, MatMulTuning, WeightRef,
};
use smoe_vault::quant::{quantize_matrix, DType};

const DTYPES: [DType; 4] = [DType::Bf16, DType::Q8, DType::Q4, DType::Q2];

/// Tiles (bm, bn, bk) whose every variant must agree: 16- and 32-column steps, 64-row tiles,
/// narrow and wide token tiles (a 48-token tile is a grouped default).
const TUNINGS: [(u32, u32, u32); 7] = [
    (128, 64, 16),
    (128, 64, 32),
    (128, 48, 16),
    (64, 64, 32),
    (64, 32, 16),
    (128, 128, 16),
    (128, 16, 16),
];

/// The f32 kernel's tiles of `TUNINGS`; with matrix units also theirs at every token width.
fn tunings(ctx: &GpuContext) -> Vec<MatMulTuning> {
    let mut v: Vec<MatMulTuning> = TUNINGS
        .iter()
        .map(|&(bm, bn, bk)| MatMulTuning {
            coop: false,
            bm,
            bn,
            bk,
        })
        .collect();
    if ctx.has_matrix_units() {
        v.extend([16, 32, 48, 64].map(MatMulTuning::coop));
        v.extend([16, 48, 64].map(|bn| MatMulTuning {
            bk: 32,
            ..MatMulTuning::coop(bn)
        }));
    }
    v
}

/// NMSE allowed against the CPU twin: f32 products differ only in summation order; on the
/// matrix units the weights are rounded to f16 first (bf16 exact, quantized d·c within 2⁻¹²;
/// x keeps ~22 bits as two f16 halves), ~1e-8 — 1e-6 leaves room for a few-output case.
fn tolerance(t: MatMulTuning) -> f64 {
    if t.coop {
        1e-6
    } else {
        1e-9
    }
}

/// `MatMul::new` (its default tile) or `with_tuning`.
fn build(ctx: &GpuContext, d: &MatMulDesc, tune: Option<MatMulTuning>) -> MatMul {
    match tune {
        Some(t) => MatMul::with_tuning(ctx, d, t),
        None => MatMul::new(ctx, d),
    }
    .unwrap()
}

/// Deterministic ids in `0..n_mats` from `seed`.
fn rand_ids(n: usize, n_mats: usize, seed: u64) -> Vec<u32> {
    rand_vec(n, seed, 1.0)
        .iter()
        .map(|v| (((v + 1.0) / 2.0 * n_mats as f32) as usize).min(n_mats - 1) as u32)
        .collect()
}

/// The CPU twin of the sort: (starts, perm) of a stable counting sort (the GPU's order within
/// an expert is free: compared as sets); ids ≥ n_mats (skipped slots) sort last and are not
/// counted in `starts`.
fn sort_twin(ids: &[u32], n_mats: usize) -> (Vec<u32>, Vec<u32>) {
    let mut starts = vec![0u32; n_mats + 1];
    for &e in ids.iter().filter(|&&e| (e as usize) < n_mats) {
        starts[e as usize + 1] += 1;
    }
    for e in 0..n_mats {
        starts[e + 1] += starts[e];
    }
    let mut perm: Vec<u32> = (0..ids.len() as u32).collect();
    // Stable: ascending slots within an expert.
    perm.sort_by_key(|&s| (ids[s as usize] as usize).min(n_mats));
    (starts, perm)
}

/// The CPU twin of the work list: for each expert in order, its token tiles `(e << 20) | i`.
fn units_twin(starts: &[u32], tile: usize) -> Vec<u32> {
    let mut units = vec![];
    for (e, w) in starts.windows(2).enumerate() {
        let tiles = ((w[1] - w[0]) as usize).div_ceil(tile);
        units.extend((0..tiles as u32).map(|i| (e as u32) << 20 | i));
    }
    units
}

/// Uploads `ids` after `pad` garbage words, so the sort must honour the offset.
fn sort_on_gpu(
    ctx: &GpuContext,
    ids: &[u32],
    n_mats: usize,
    tile: usize,
    pad: usize,
) -> ExpertSort {
    let mut words = vec![0xdead_beefu32; pad];
    words.extend_from_slice(ids);
    let buf = ctx.upload("ids", bytemuck::cast_slice(&words));
    let at = BufRef::at(&buf, 4 * pad as u64);
    let sort = ExpertSort::new(ctx, at, ids.len(), n_mats, tile).unwrap();
    let mut enc = ctx.encoder();
    sort.encode(&mut enc);
    ctx.submit_wait(enc);
    sort
}

#[test]
fn expert_sort_matches_counting_sort() {
    let Some(ctx) = gpu() else { return };
    let mut cases: Vec<(Vec<u32>, usize)> = vec![
        (vec![0], 1),
        (vec![3], 5),
        (vec![2, 0, 2, 1, 0], 4),
        (vec![7; 4096], 128), // every slot one expert
        (rand_ids(4096, 128, 1), 128),
        (rand_ids(100, 1024, 2), 1024), // most experts empty
        (rand_ids(1000, 3, 3), 3),
        (rand_ids(777, 60, 4), 64),       // the last 4 experts empty
        (rand_ids(20_000, 128, 12), 128), // more slots than a 512-token chunk
    ];
    // A skewed router: a few hot experts, the rest rare.
    cases.push((rand_ids(512, 8, 5).iter().map(|e| e * e).collect(), 50));
    cases.push((skewed_ids(4096, 128, 6), 128));
    // Skipped slots (ids ≥ n_mats: another round's experts), a third of them, and all.
    let skip = |ids: Vec<u32>, n_mats: u32| -> Vec<u32> {
        let marks = rand_ids(ids.len(), 3, 9);
        (ids.iter().zip(marks))
            .map(|(&e, m)| if m == 0 { n_mats + m + e % 2 * 1000 } else { e })
            .collect()
    };
    cases.push((skip(rand_ids(4096, 128, 10), 128), 128));
    cases.push((skip(rand_ids(300, 16, 11), 16), 16));
    cases.push((vec![u32::MAX; 64], 8));
    for (i, (ids, n_mats)) in cases.iter().enumerate() {
        // Tiles: 1 (a unit per slot), the GEMM's, and one no GEMM takes.
        for tile in [1, 16, 48, 64, 128, 7] {
            let sort = sort_on_gpu(ctx, ids, *n_mats, tile, i % 3);
            let (want_starts, want_perm) = sort_twin(ids, *n_mats);
            let starts = ctx.read_u32(sort.starts(), 0, n_mats + 1).unwrap();
            let perm = ctx.read_u32(sort.perm(), 0, ids.len()).unwrap();
            assert_eq!(starts, want_starts, "case {i}: starts");
            // Within an expert the order is free (the GEMMs compute each slot alone).
            let mut grouped = perm.clone();
            for w in want_starts
                .windows(2)
                .chain([&[want_starts[*n_mats], ids.len() as u32][..]])
            {
                grouped[w[0] as usize..w[1] as usize].sort_unstable();
            }
            assert_eq!(grouped, want_perm, "case {i}: perm");
            let want = units_twin(&want_starts, tile);
            let what = format!("case {i} tile {tile}");
            assert!(want.len() <= sort.max_units(), "{what}: bound");
            let units = ctx.read_u32(sort.units(), 0, 1 + want.len()).unwrap();
            assert_eq!(units[0] as usize, want.len(), "{what}: count");
            assert_eq!(units[1..], want, "{what}: units");
        }
    }
}

/// Skewed routing of `n` slots over `n_mats` experts: expert 1 takes about 3/4 of the slots,
/// experts 4.. share the rest unevenly, the others (0, 2, 3 and the last) get none.
fn skewed_ids(n: usize, n_mats: usize, seed: u64) -> Vec<u32> {
    rand_vec(n, seed, 1.0)
        .iter()
        .map(|v| {
            let u = (v + 1.0) / 2.0;
            match u < 0.75 {
                true => 1,
                false => (4.0 + ((u - 0.75) * 4.0).powi(2) * (n_mats - 5) as f32) as u32,
            }
        })
        .map(|e| e.min(n_mats as u32 - 2))
        .collect()
}

#[test]
fn expert_sort_rejects_what_it_cannot_hold() {
    let Some(ctx) = gpu() else { return };
    let buf = ctx.upload("ids", &[0u8; 16]);
    assert!(ExpertSort::new(ctx, BufRef::new(&buf), 0, 4, 16).is_err());
    assert!(ExpertSort::new(ctx, BufRef::new(&buf), 4, 0, 16).is_err());
    assert!(ExpertSort::new(ctx, BufRef::new(&buf), 4, 5000, 16).is_err());
    // 4096 experts would leave the skipped slots' bucket no room in a key.
    assert!(ExpertSort::new(ctx, BufRef::new(&buf), 4, 4096, 16).is_err());
    let e = ExpertSort::new(ctx, BufRef::new(&buf), 4, 4, 0)
        .err()
        .unwrap();
    assert!(e.to_string().contains("tile"), "{e}");
    // More ids than the buffer holds.
    assert!(ExpertSort::new(ctx, BufRef::new(&buf), 5, 4, 16).is_err());
    // More experts than workgroup memory holds counters (where the device's is small enough
    // for a 12-bit expert id to reach it).
    let room = ctx.limits().max_compute_workgroup_storage_size as usize / 4;
    if room < 4096 {
        let e = ExpertSort::new(ctx, BufRef::new(&buf), 4, room, 16)
            .err()
            .unwrap();
        assert!(e.to_string().contains("workgroup memory"), "{e}");
    }
    // Many slots need no more of it.
    let big = ctx.storage_buffer("ids", 4 * 20_000);
    assert!(ExpertSort::new(ctx, BufRef::new(&big), 20_000, 128, 48).is_ok());
}

struct Dense {
    dtype: DType,
    rows: usize,
    cols: usize,
    nt: usize,
    gated: bool,
    seed: u64,
    /// Output rows `..a`, `a..b`, `b..` to three regions of y (`MatMulDesc::y_split`).
    split: Option<[usize; 2]>,
}

/// One dense (optionally gated) product against the twin; weights, x and y at offsets.
fn run_dense(ctx: &GpuContext, c: &Dense, tune: Option<MatMulTuning>) {
    let (rows, cols, nt, dtype) = (c.rows, c.cols, c.nt, c.dtype);
    let g = quantize_matrix(dtype, &rand_vec(rows * cols, c.seed, 1.0), rows, cols);
    let x = rand_vec(nt * cols, c.seed + 1, 1.0);
    let mut want = vec![0f32; nt * rows];
    matmul(QMatRef::new(dtype, rows, cols, &g), &x, nt, &mut want);
    let mut blob = g.clone();
    if c.gated {
        let u = quantize_matrix(dtype, &rand_vec(rows * cols, c.seed + 2, 1.0), rows, cols);
        let mut uw = vec![0f32; nt * rows];
        matmul(QMatRef::new(dtype, rows, cols, &u), &x, nt, &mut uw);
        silu_mul(&mut want, &uw);
        blob.extend_from_slice(&u);
    }
    if let Some([a, b]) = c.split {
        // Regions [nt][a], [nt][b - a], [nt][rows - b], one after the other.
        want = [0..a, a..b, b..rows]
            .iter()
            .flat_map(|r| want.chunks(rows).flat_map(|row| row[r.clone()].to_vec()))
            .collect();
    }
    let pad = 16 * (c.seed as usize % 5);
    let mut wbytes = vec![0xA5u8; pad];
    wbytes.extend_from_slice(&blob);
    wbytes.extend_from_slice(&[0x5Au8; 48]);
    let wbuf = ctx.upload("weights", &wbytes);
    let mut xh = vec![7.0f32; 32];
    xh.extend_from_slice(&x);
    let xbuf = ctx.upload_f32("x", &xh);
    let ybuf = nan_buffer(ctx, "y", 16 + nt * rows + 16);
    let mm = build(
        ctx,
        &MatMulDesc {
            w: WeightRef {
                buffer: &wbuf,
                offset: pad as u64,
                dtype,
                rows,
                cols,
            },
            up_offset: c.gated.then_some(g.len() as u64),
            x: BufRef::at(&xbuf, 128),
            y: BufRef::at(&ybuf, 64),
            n_tokens: nt,
            grouped: None,
            y_split: c.split,
        },
        tune,
    );
    let mut enc = ctx.encoder();
    mm.encode(&mut enc);
    ctx.submit_wait(enc);
    let what = format!(
        "{}{dtype} {rows}x{cols} tokens {nt} regions {:?} {:?}",
        if c.gated { "gated " } else { "" },
        c.split,
        mm.tuning()
    );
    let got = ctx.read_f32(&ybuf, 64, nt * rows).unwrap();
    assert_close(&what, &got, &want, tolerance(mm.tuning()));
    let outside = [
        ctx.read_f32(&ybuf, 0, 16).unwrap(),
        ctx.read_f32(&ybuf, 64 + 4 * (nt * rows) as u64, 16)
            .unwrap(),
    ];
    assert!(
        outside.iter().flatten().all(|v| v.is_nan()),
        "{what}: wrote outside y"
    );
}

#[test]
fn matmul_dense_all_dtypes() {
    let Some(ctx) = gpu() else { return };
    let mut seed = 1;
    for dtype in DTYPES {
        for rows in [200, 64] {
            for cols in [192, 320] {
                for nt in [1, 3, 64, 100] {
                    let c = Dense {
                        dtype,
                        rows,
                        cols,
                        nt,
                        gated: false,
                        seed,
                        split: None,
                    };
                    run_dense(ctx, &c, None);
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn matmul_tunings_agree() {
    // Odd rows (a partial row tile) and tokens (a partial token tile) under every tile shape.
    let Some(ctx) = gpu() else { return };
    for (i, t) in tunings(ctx).into_iter().enumerate() {
        for dtype in DTYPES {
            for (rows, cols, nt, gated) in [(77, 320, 37, false), (130, 192, 129, true)] {
                let c = Dense {
                    dtype,
                    rows,
                    cols,
                    nt,
                    gated,
                    seed: 1000 + 10 * i as u64 + rows as u64,
                    split: None,
                };
                run_dense(ctx, &c, Some(t));
            }
        }
    }
}

/// q, k and v from one GEMM: output rows split into three regions of y, at row-tile
/// boundaries and between them, empty regions included, under every tile shape.
#[test]
fn matmul_writes_row_regions() {
    let Some(ctx) = gpu() else { return };
    for (i, t) in tunings(ctx).into_iter().enumerate() {
        for dtype in [DType::Q4, DType::Bf16] {
            for (rows, nt, split) in [
                (320, 37, [256, 288]),
                (200, 64, [77, 150]),
                (130, 9, [0, 130]),
                (96, 100, [96, 96]),
            ] {
                let c = Dense {
                    dtype,
                    rows,
                    cols: 192,
                    nt,
                    gated: false,
                    seed: 3000 + 10 * i as u64 + rows as u64,
                    split: Some(split),
                };
                run_dense(ctx, &c, Some(t));
            }
        }
    }
}

#[test]
fn matmul_gated_is_silu_gate_times_up() {
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        for (rows, cols, nt) in [(33, 192, 1), (200, 320, 3), (64, 192, 100), (96, 2048, 17)] {
            let c = Dense {
                dtype,
                rows,
                cols,
                nt,
                gated: true,
                seed: 200 + 10 * i as u64 + nt as u64,
                split: None,
            };
            run_dense(ctx, &c, None);
        }
    }
}

#[test]
fn matmul_bf16_cols_not_a_multiple_of_the_step() {
    // bf16 needs only cols % 8: the last K-step is partial.
    let Some(ctx) = gpu() else { return };
    for cols in [8, 40, 200] {
        let c = Dense {
            dtype: DType::Bf16,
            rows: 70,
            cols,
            nt: 5,
            gated: cols == 40,
            seed: 300 + cols as u64,
            split: None,
        };
        run_dense(ctx, &c, None);
    }
}

struct Group {
    dtype: DType,
    rows: usize,
    cols: usize,
    n_mats: usize,
    ids: Vec<u32>,
    x_div: usize,
    gated: bool,
    seed: u64,
}

/// A grouped product after a sort: experts in one buffer with a padded blob stride holding
/// gate then up; slot s multiplies expert ids[s] by x row s / x_div.
fn run_grouped(ctx: &GpuContext, c: &Group, tune: Option<MatMulTuning>) {
    let (rows, cols, dtype) = (c.rows, c.cols, c.dtype);
    let n_slots = c.ids.len();
    let size = dtype.row_stride(cols) * rows;
    let blob_len = if c.gated { 2 * size } else { size };
    let stride = (blob_len + 300).next_multiple_of(16);
    let mut blob = vec![0x77u8; stride * c.n_mats];
    let mut mats = vec![];
    for m in 0..c.n_mats {
        let mut parts = vec![];
        for h in 0..1 + c.gated as usize {
            let seed = c.seed + 10 * m as u64 + h as u64;
            let q = quantize_matrix(dtype, &rand_vec(rows * cols, seed, 1.0), rows, cols);
            blob[m * stride + h * size..m * stride + (h + 1) * size].copy_from_slice(&q);
            parts.push(q);
        }
        mats.push(parts);
    }
    let x_rows = n_slots.div_ceil(c.x_div);
    let x = rand_vec(x_rows * cols, c.seed + 7, 1.0);
    let mut want = vec![0f32; n_slots * rows];
    // Slots with an id ≥ n_mats are skipped: their rows keep the poison.
    let skipped = |s: usize| c.ids[s] as usize >= c.n_mats;
    for (s, &e) in c.ids.iter().enumerate() {
        if skipped(s) {
            continue;
        }
        let xs = &x[s / c.x_div * cols..(s / c.x_div + 1) * cols];
        let out = &mut want[s * rows..(s + 1) * rows];
        let m = &mats[e as usize];
        matmul(QMatRef::new(dtype, rows, cols, &m[0]), xs, 1, out);
        if c.gated {
            let mut up = vec![0f32; rows];
            matmul(QMatRef::new(dtype, rows, cols, &m[1]), xs, 1, &mut up);
            silu_mul(out, &up);
        }
    }
    // The sort cuts its work list into the GEMM's token tiles.
    let tile = match tune {
        Some(t) => t.bn as usize,
        None => MatMulTuning::grouped_bn(n_slots, c.n_mats),
    };
    let sort = sort_on_gpu(ctx, &c.ids, c.n_mats, tile, 1);
    let wbuf = ctx.upload("experts", &blob);
    let xbuf = ctx.upload_f32("x", &x);
    let ybuf = nan_buffer(ctx, "y", n_slots * rows + 16);
    let mm = build(
        ctx,
        &MatMulDesc {
            w: WeightRef {
                buffer: &wbuf,
                offset: 0,
                dtype,
                rows,
                cols,
            },
            up_offset: c.gated.then_some(size as u64),
            x: BufRef::new(&xbuf),
            y: BufRef::new(&ybuf),
            n_tokens: 0,
            grouped: Some(MatMulGrouped {
                sort: &sort,
                mat_stride: stride as u64,
                x_div: c.x_div,
            }),
            y_split: None,
        },
        tune,
    );
    let mut enc = ctx.encoder();
    mm.encode(&mut enc);
    ctx.submit_wait(enc);
    let what = format!(
        "grouped {}{dtype} {rows}x{cols} {n_slots} slots / {} experts x_div {} {:?}",
        if c.gated { "gated " } else { "" },
        c.n_mats,
        c.x_div,
        mm.tuning()
    );
    let all = ctx.read_f32(&ybuf, 0, n_slots * rows).unwrap();
    let (mut got, mut kept) = (vec![], vec![]);
    for s in 0..n_slots {
        let r = s * rows..(s + 1) * rows;
        match skipped(s) {
            true => assert!(all[r].iter().all(|v| v.is_nan()), "{what}: wrote slot {s}"),
            false => {
                got.extend_from_slice(&all[r.clone()]);
                kept.extend_from_slice(&want[r]);
            }
        }
    }
    assert_close(&what, &got, &kept, tolerance(mm.tuning()));
    let tail = ctx
        .read_f32(&ybuf, 4 * (n_slots * rows) as u64, 16)
        .unwrap();
    assert!(tail.iter().all(|v| v.is_nan()), "{what}: wrote past y");
}

/// A streaming GPU runs a batch's experts in rounds: the slots of other rounds' experts carry
/// ids ≥ n_mats, get no work, and keep their outputs.
#[test]
fn matmul_grouped_skips_slots_of_other_rounds() {
    let Some(ctx) = gpu() else { return };
    for (i, (gated, x_div)) in [(true, 4), (false, 1)].into_iter().enumerate() {
        let n_mats = 12;
        let ids: Vec<u32> = rand_ids(200, n_mats, 40 + i as u64)
            .iter()
            .map(|&e| if e % 3 == 0 { u32::MAX - e } else { e })
            .collect();
        let c = Group {
            dtype: DType::Q4,
            rows: 64,
            cols: 128,
            n_mats,
            ids,
            x_div,
            gated,
            seed: 50 + i as u64,
        };
        run_grouped(ctx, &c, None);
    }
}

#[test]
fn matmul_grouped_by_expert() {
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let seed = 400 + 100 * i as u64;
        // gate_up: 37 tokens × top-4 of 12 experts (the even ones empty), every slot of a token
        // reading its x row; then down: each slot its own row.
        let ids: Vec<u32> = rand_ids(37 * 4, 6, seed)
            .iter()
            .map(|e| 2 * e + 1)
            .collect();
        for (x_div, gated, rows, cols) in [
            (4, true, 70, 192),
            (4, false, 70, 192),
            (1, false, 200, 320),
        ] {
            let c = Group {
                dtype,
                rows,
                cols,
                n_mats: 12,
                ids: ids.clone(),
                x_div,
                gated,
                seed,
            };
            run_grouped(ctx, &c, None);
        }
        // Every slot picks one expert: that expert loops over several token tiles.
        let c = Group {
            dtype,
            rows: 64,
            cols: 192,
            n_mats: 5,
            ids: vec![3; 150],
            x_div: 2,
            gated: true,
            seed: seed + 50,
        };
        run_grouped(ctx, &c, None);
    }
}

#[test]
fn matmul_grouped_skewed_routing() {
    // One expert takes ~3/4 of the slots (several token tiles, each its own workgroup), the
    // others a few or none: each tile of the popular expert must land on its own slots.
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let seed = 1500 + 100 * i as u64;
        for (x_div, gated, rows, cols) in [(4, true, 70, 192), (1, false, 130, 256)] {
            let c = Group {
                dtype,
                rows,
                cols,
                n_mats: 12,
                ids: skewed_ids(80 * 4, 12, seed + rows as u64),
                x_div,
                gated,
                seed,
            };
            run_grouped(ctx, &c, None);
        }
    }
    for (i, t) in tunings(ctx).into_iter().enumerate() {
        let seed = 1900 + 10 * i as u64;
        let c = Group {
            dtype: DTYPES[(i + 1) % 4],
            rows: 90,
            cols: 320,
            n_mats: 9,
            ids: skewed_ids(53 * 8, 9, seed),
            x_div: 8,
            gated: i % 2 == 0,
            seed,
        };
        run_grouped(ctx, &c, Some(t));
    }
}

#[test]
fn matmul_grouped_tunings_and_edge_cases() {
    let Some(ctx) = gpu() else { return };
    for (i, t) in tunings(ctx).into_iter().enumerate() {
        let dtype = DTYPES[i % 4];
        let gated = i % 3 != 1;
        let seed = 900 + 10 * i as u64;
        let c = Group {
            dtype,
            rows: 90,
            cols: 320,
            n_mats: 20,
            ids: rand_ids(61 * 8, 20, seed),
            x_div: 8,
            gated,
            seed,
        };
        run_grouped(ctx, &c, Some(t));
    }
    // One slot; one expert; one row.
    for (ids, n_mats, rows) in [(vec![2], 3, 10), (vec![0, 0, 0], 1, 1)] {
        let c = Group {
            dtype: DType::Q4,
            rows,
            cols: 64,
            n_mats,
            ids,
            x_div: 1,
            gated: true,
            seed: 990,
        };
        run_grouped(ctx, &c, None);
    }
}

#[test]
fn matmul_splits_a_matrix_larger_than_a_binding() {
    // bf16, 64 columns (128 bytes a row): enough rows to pass the storage binding limit.
    let Some(ctx) = gpu() else { return };
    let max = ctx.limits().max_storage_buffer_binding_size;
    let rows = (max / 128 + 1000) as usize;
    if rows * 128 > 600 << 20 {
        eprintln!("skipped: a binding of {max} bytes is too large to exceed here");
        return;
    }
    let c = Dense {
        dtype: DType::Bf16,
        rows,
        cols: 64,
        nt: 3,
        gated: false,
        seed: 77,
        split: None,
    };
    run_dense(ctx, &c, None);
    // Output regions need the matrix in one binding (the engine then runs q, k, v apart).
    let wbuf = ctx.storage_buffer("w", (rows * 128) as u64);
    let xbuf = ctx.storage_buffer("x", 3 * 64 * 4);
    let ybuf = ctx.storage_buffer("y", (3 * rows * 4) as u64);
    let d = MatMulDesc {
        w: WeightRef {
            buffer: &wbuf,
            offset: 0,
            dtype: DType::Bf16,
            rows,
            cols: 64,
        },
        up_offset: None,
        x: BufRef::new(&xbuf),
        y: BufRef::new(&ybuf),
        n_tokens: 3,
        grouped: None,
        y_split: Some([1, 2]),
    };
    let e = MatMul::new(ctx, &d)
        .err()
        .expect("regions over a split matrix");
    assert!(
        e.to_string().contains("larger than a storage binding"),
        "{e}"
    );
}

#[test]
fn matmul_rejects_bad_shapes_with_messages() {
    let Some(ctx) = gpu() else { return };
    let wbuf = ctx.storage_buffer("w", 1 << 16);
    let xbuf = ctx.storage_buffer("x", 1 << 16);
    let ybuf = ctx.storage_buffer("y", 1 << 16);
    let desc = |dtype, rows, cols, nt| MatMulDesc {
        w: WeightRef {
            buffer: &wbuf,
            offset: 0,
            dtype,
            rows,
            cols,
        },
        up_offset: None,
        x: BufRef::new(&xbuf),
        y: BufRef::new(&ybuf),
        n_tokens: nt,
        grouped: None,
        y_split: None,
    };
    let msg = |d: &MatMulDesc, t: MatMulTuning| match MatMul::with_tuning(ctx, d, t) {
        Ok(_) => panic!("accepted {:?}", d.w),
        Err(e) => e.to_string(),
    };
    let t = MatMulTuning {
        coop: false,
        bm: 128,
        bn: 64,
        bk: 16,
    };
    assert!(msg(&desc(DType::Q4, 8, 100, 1), t).contains("multiple of 64"));
    assert!(msg(&desc(DType::F32, 8, 64, 1), t).contains("f32"));
    assert!(msg(&desc(DType::Q4, 8, 64, 0), t).contains("tokens"));
    assert!(msg(&desc(DType::Q4, 0, 64, 1), t).contains("rows"));
    assert!(msg(&desc(DType::Bf16, 1000, 64, 1), t).contains("buffer has"));
    assert!(msg(&desc(DType::Q4, 8, 64, 1000), t).contains("matmul x"));
    let bad = MatMulTuning { bm: 96, ..t };
    assert!(msg(&desc(DType::Q4, 8, 64, 1), bad).contains("tile"));
    for split in [[6, 4], [5, 9]] {
        let d = MatMulDesc {
            y_split: Some(split),
            ..desc(DType::Q4, 8, 64, 1)
        };
        assert!(msg(&d, t).contains("output regions"), "{split:?}");
    }
    let big = MatMulTuning {
        coop: false,
        bm: 128,
        bn: 128,
        bk: 32,
    };
    if big.workgroup_bytes() > ctx.limits().max_compute_workgroup_storage_size as u64 {
        assert!(msg(&desc(DType::Q4, 8, 64, 1), big).contains("workgroup memory"));
    }
    // The matrix units: only where the adapter has them, and only their tile shape.
    let coop = MatMulTuning::coop(64);
    if ctx.has_matrix_units() {
        let m = msg(&desc(DType::Q4, 8, 64, 1), MatMulTuning { bk: 16, ..coop });
        assert!(m.contains("on the matrix units"), "{m}");
        let m = msg(&desc(DType::Q4, 8, 64, 1), MatMulTuning { bm: 64, ..coop });
        assert!(m.contains("on the matrix units"), "{m}");
        let m = msg(&desc(DType::Q4, 8, 64, 1), MatMulTuning::coop(80));
        assert!(m.contains("on the matrix units"), "{m}");
    } else {
        let m = msg(&desc(DType::Q4, 8, 64, 1), coop);
        assert!(m.contains("matrix units are not available"), "{m}");
    }
    // Grouped: the GEMM's token tile must be the one the sort's work list was cut into.
    let ids = ctx.upload("ids", bytemuck::cast_slice(&[0u32, 1, 1, 0]));
    for sort_tile in [32, 20] {
        let sort = ExpertSort::new(ctx, BufRef::new(&ids), 4, 2, sort_tile).unwrap();
        let grouped = MatMulDesc {
            grouped: Some(MatMulGrouped {
                sort: &sort,
                mat_stride: 1024,
                x_div: 1,
            }),
            ..desc(DType::Q4, 8, 64, 0)
        };
        let m = msg(&grouped, t);
        assert!(m.contains("sort's tile of"), "{m}");
        if sort_tile == 32 {
            let split = MatMulDesc {
                y_split: Some([2, 4]),
                ..grouped
            };
            let m = msg(&split, MatMulTuning { bn: 32, ..t });
            assert!(m.contains("dense only"), "{m}");
        }
        // MatMul::new takes the sort's tile, which must be a valid bn.
        match MatMul::new(ctx, &grouped) {
            Ok(mm) => assert_eq!(mm.tuning().bn as usize, sort_tile),
            Err(e) => assert!(sort_tile == 20 && e.to_string().contains("tile"), "{e}"),
        }
    }
}
