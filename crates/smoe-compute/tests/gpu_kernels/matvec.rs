//! matvec (plain, gated, grouped) against `cpu::matmul` on the same stored bytes.

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::{matmul, ops::silu_mul, QMatRef};
use smoe_compute::gpu::{
    BufRef, GpuContext, Grouped, MatVec, MatVecDesc, MatVecTuning, Q4Decode, WeightRef,
};
use smoe_vault::quant::{dequantize_row, quantize_matrix, DType};

const DTYPES: [DType; 4] = [DType::Bf16, DType::Q8, DType::Q4, DType::Q2];

/// Uploads `bytes` at byte offset `pad` of a bigger buffer, so kernels must honour the offset.
fn upload_at(ctx: &GpuContext, bytes: &[u8], pad: usize) -> smoe_compute::gpu::wgpu::Buffer {
    let mut all = vec![0xA5u8; pad];
    all.extend_from_slice(bytes);
    all.extend_from_slice(&[0x5Au8; 48]);
    ctx.upload("weights", &all)
}

/// `n_mats` random matrices ("experts", seeds `seed + m`) quantized, and one buffer holding
/// them at a blob stride of their size plus `pad` bytes (rounded to 16): (matrices, blob, stride).
fn expert_stack(
    dtype: DType,
    rows: usize,
    cols: usize,
    n_mats: usize,
    pad: usize,
    seed: u64,
) -> (Vec<Vec<u8>>, Vec<u8>, usize) {
    let size = dtype.row_stride(cols) * rows;
    let stride = (size + pad).next_multiple_of(16);
    let mats: Vec<Vec<u8>> = (0..n_mats)
        .map(|m| {
            quantize_matrix(
                dtype,
                &rand_vec(rows * cols, seed + m as u64, 1.0),
                rows,
                cols,
            )
        })
        .collect();
    let mut blob = vec![0u8; stride * n_mats];
    for (m, q) in mats.iter().enumerate() {
        blob[m * stride..m * stride + size].copy_from_slice(q);
    }
    (mats, blob, stride)
}

fn run_one(ctx: &GpuContext, dtype: DType, rows: usize, cols: usize, nt: usize, seed: u64) {
    run_tuned(ctx, dtype, rows, cols, nt, seed, MatVecTuning::default());
}

fn run_tuned(
    ctx: &GpuContext,
    dtype: DType,
    rows: usize,
    cols: usize,
    nt: usize,
    seed: u64,
    tune: MatVecTuning,
) {
    let wf = rand_vec(rows * cols, seed, 1.0);
    let q = quantize_matrix(dtype, &wf, rows, cols);
    let x = rand_vec(nt * cols, seed + 1, 1.0);
    let mut want = vec![0f32; nt * rows];
    matmul(QMatRef::new(dtype, rows, cols, &q), &x, nt, &mut want);

    let pad = 16 * (seed as usize % 7);
    let wbuf = upload_at(ctx, &q, pad);
    // x sits after 32 floats of garbage; y after 16 NaNs, to exercise both offsets.
    let mut xh = vec![7.0f32; 32];
    xh.extend_from_slice(&x);
    let xbuf = ctx.upload_f32("x", &xh);
    let ybuf = nan_buffer(ctx, "y", 16 + nt * rows);
    let mv = MatVec::with_tuning(
        ctx,
        &MatVecDesc {
            w: WeightRef {
                buffer: &wbuf,
                offset: pad as u64,
                dtype,
                rows,
                cols,
            },
            up_offset: None,
            x: BufRef::at(&xbuf, 128),
            y: BufRef::at(&ybuf, 64),
            n_tokens: nt,
            grouped: None,
        },
        tune,
    )
    .unwrap();
    let mut enc = ctx.encoder();
    mv.encode(&mut enc);
    ctx.submit_wait(enc);
    let got = ctx.read_f32(&ybuf, 64, nt * rows).unwrap();
    assert_close(
        &format!("{dtype} {rows}x{cols} tokens {nt} {tune:?}"),
        &got,
        &want,
        1e-5,
    );
    let head = ctx.read_f32(&ybuf, 0, 16).unwrap();
    assert!(
        head.iter().all(|v| v.is_nan()),
        "{dtype} {rows}x{cols}: wrote before its offset"
    );
}

#[test]
fn matvec_all_dtypes_odd_sizes() {
    let Some(ctx) = gpu() else { return };
    let mut seed = 1;
    for dtype in DTYPES {
        for rows in [1, 7, 33, 1000] {
            for cols in [64, 192, 320, 2048] {
                for nt in [1, 3] {
                    run_one(ctx, dtype, rows, cols, nt, seed);
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn matvec_wide_rows_and_many_tokens() {
    // 4160 columns need several staging tiles; 9 tokens need two workgroups along z.
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        run_one(ctx, dtype, 45, 4160, 3, 100 + i as u64);
        run_one(ctx, dtype, 17, 4160, 1, 110 + i as u64);
        run_one(ctx, dtype, 20, 256, 9, 120 + i as u64);
    }
}

#[test]
fn matvec_tunings_and_q4_decoders_agree() {
    // Other launch shapes (subgroups sharing rows differently) and the other q4 decoders
    // (the default is PairsF16; PairsF32 is what a device without f16 arithmetic runs).
    let Some(ctx) = gpu() else { return };
    // `items`: rows a subgroup loads together (0: the default for the type).
    for (wg, rows, q4, items) in [
        (64, 8, Q4Decode::FloatBits, 2),
        (256, 32, Q4Decode::FloatBits, 0),
        (128, 16, Q4Decode::IntToFloat, 4),
        (256, 64, Q4Decode::IntToFloat, 8),
        (256, 16, Q4Decode::FloatBits, 3),
        (256, 16, Q4Decode::PairsF32, 0),
        (64, 8, Q4Decode::PairsF32, 2),
        (128, 16, Q4Decode::PairsF16, 4),
    ] {
        let tune = MatVecTuning {
            wg,
            rows,
            q4,
            items,
        };
        for dtype in DTYPES {
            for (r, c, nt) in [(1, 64, 1), (33, 320, 3), (1000, 2048, 1), (70, 4160, 2)] {
                run_tuned(ctx, dtype, r, c, nt, 500 + r as u64 + wg as u64, tune);
            }
        }
    }
}

#[test]
fn matvec_gated_is_silu_gate_times_up() {
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        for (rows, cols, nt) in [(33, 192, 1), (7, 320, 3), (96, 2048, 1)] {
            let seed = 200 + 10 * i as u64 + nt as u64;
            let g = quantize_matrix(dtype, &rand_vec(rows * cols, seed, 1.0), rows, cols);
            let u = quantize_matrix(dtype, &rand_vec(rows * cols, seed + 1, 1.0), rows, cols);
            let x = rand_vec(nt * cols, seed + 2, 1.0);
            let (mut gw, mut uw) = (vec![0f32; nt * rows], vec![0f32; nt * rows]);
            matmul(QMatRef::new(dtype, rows, cols, &g), &x, nt, &mut gw);
            matmul(QMatRef::new(dtype, rows, cols, &u), &x, nt, &mut uw);
            silu_mul(&mut gw, &uw);
            let blob = [g.clone(), u].concat();
            let wbuf = ctx.upload("gate_up", &blob);
            let xbuf = ctx.upload_f32("x", &x);
            let ybuf = nan_buffer(ctx, "y", nt * rows);
            let mv = MatVec::new(
                ctx,
                &MatVecDesc {
                    up_offset: Some(g.len() as u64),
                    ..MatVecDesc::plain(
                        WeightRef::whole(&wbuf, dtype, rows, cols),
                        BufRef::new(&xbuf),
                        BufRef::new(&ybuf),
                        nt,
                    )
                },
            )
            .unwrap();
            let mut enc = ctx.encoder();
            mv.encode(&mut enc);
            ctx.submit_wait(enc);
            let got = ctx.read_f32(&ybuf, 0, nt * rows).unwrap();
            assert_close(
                &format!("gated {dtype} {rows}x{cols} tokens {nt}"),
                &got,
                &gw,
                1e-5,
            );
        }
    }
}

#[test]
fn matvec_grouped_picks_matrices_by_id() {
    // Six "experts" in one buffer with a padded blob stride; slots pick 4 of them (one twice).
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let (rows, cols, n_mats) = (40usize, 192usize, 6usize);
        let seed = 300 + 10 * i as u64;
        let (mats, blob, stride) = expert_stack(dtype, rows, cols, n_mats, 300, seed);
        let ids: Vec<u32> = vec![4, 1, 4, 0];
        // (x_per_slot, slots_per_x): one x; one per slot; one per pair of slots (two tokens'
        // two experts each).
        for (x_per_slot, share) in [(false, 1), (true, 1), (true, 2)] {
            let x_slots = if x_per_slot { ids.len() / share } else { 1 };
            let x = rand_vec(x_slots * cols, 400 + i as u64, 1.0);
            let mut want = vec![0f32; ids.len() * rows];
            for (s, &id) in ids.iter().enumerate() {
                let xs = if x_per_slot {
                    &x[s / share * cols..(s / share + 1) * cols]
                } else {
                    &x[..]
                };
                let q = &mats[id as usize];
                matmul(
                    QMatRef::new(dtype, rows, cols, q),
                    xs,
                    1,
                    &mut want[s * rows..(s + 1) * rows],
                );
            }
            let wbuf = ctx.upload("experts", &blob);
            let idbuf = ctx.upload("ids", bytemuck::cast_slice(&ids));
            let xbuf = ctx.upload_f32("x", &x);
            let ybuf = nan_buffer(ctx, "y", ids.len() * rows);
            let grouped = Grouped {
                ids: &idbuf,
                ids_offset: 0,
                n_slots: ids.len(),
                n_mats,
                mat_stride: stride as u64,
                x_per_slot,
                slots_per_x: share,
            };
            let mv = MatVec::new(
                ctx,
                &MatVecDesc {
                    grouped: Some(grouped),
                    ..MatVecDesc::plain(
                        WeightRef::whole(&wbuf, dtype, rows, cols),
                        BufRef::new(&xbuf),
                        BufRef::new(&ybuf),
                        1,
                    )
                },
            )
            .unwrap();
            let mut enc = ctx.encoder();
            mv.encode(&mut enc);
            ctx.submit_wait(enc);
            let got = ctx.read_f32(&ybuf, 0, ids.len() * rows).unwrap();
            assert_close(
                &format!("grouped {dtype} x_per_slot {x_per_slot} share {share}"),
                &got,
                &want,
                1e-5,
            );
        }
    }
}

/// The opt-in q4 path that quantizes x to int8 per 64 inputs: exact against a twin that does the
/// same (up to rare rounding flips: the GPU's 127/amax may differ by an ulp), and within the
/// expected quantization noise of the f32 twin.
#[test]
fn matvec_q4_int8_activations() {
    let Some(ctx) = gpu() else { return };
    let tune = MatVecTuning {
        q4: Q4Decode::Int8Dot,
        ..Default::default()
    };
    for (rows, cols, nt) in [
        (1, 64, 1),
        (33, 320, 3),
        (1000, 2048, 1),
        (45, 4160, 2),
        (20, 256, 9),
    ] {
        let seed = 600 + rows as u64;
        let q = quantize_matrix(DType::Q4, &rand_vec(rows * cols, seed, 1.0), rows, cols);
        let x = rand_vec(nt * cols, seed + 1, 1.0);
        let mut exact = vec![0f32; nt * rows];
        matmul(QMatRef::new(DType::Q4, rows, cols, &q), &x, nt, &mut exact);
        // x as the kernel sees it: int8 codes times a scale per 64.
        let xq: Vec<f32> = x
            .chunks(64)
            .flat_map(|g| {
                let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                g.iter()
                    .map(move |v| (v * inv).round_ties_even() * (amax / 127.0))
                    .collect::<Vec<_>>()
            })
            .collect();
        let stride = DType::Q4.row_stride(cols);
        let mut w = vec![0f32; cols];
        let mut twin = vec![0f32; nt * rows];
        for r in 0..rows {
            dequantize_row(DType::Q4, &q[r * stride..(r + 1) * stride], &mut w);
            for t in 0..nt {
                twin[t * rows + r] = w
                    .iter()
                    .zip(&xq[t * cols..(t + 1) * cols])
                    .map(|(a, b)| (a * b) as f64)
                    .sum::<f64>() as f32;
            }
        }
        let wbuf = ctx.upload("w", &q);
        let xbuf = ctx.upload_f32("x", &x);
        let ybuf = nan_buffer(ctx, "y", nt * rows);
        let desc = MatVecDesc::plain(
            WeightRef::whole(&wbuf, DType::Q4, rows, cols),
            BufRef::new(&xbuf),
            BufRef::new(&ybuf),
            nt,
        );
        let mv = MatVec::with_tuning(ctx, &desc, tune).unwrap();
        let mut enc = ctx.encoder();
        mv.encode(&mut enc);
        ctx.submit_wait(enc);
        let got = ctx.read_f32(&ybuf, 0, nt * rows).unwrap();
        let what = format!("q4 int8 {rows}x{cols} tokens {nt}");
        assert_close(&format!("{what} vs int8 twin"), &got, &twin, 1e-6);
        assert_close(&format!("{what} vs f32 twin"), &got, &exact, 1e-3);
    }
}

/// Fused work (`MatVec::fused`): RMSNorm of the input, a residual add into y, and the weighted
/// sum of each token's grouped experts, against the CPU doing them as separate steps.
#[test]
fn matvec_fused_norm_accumulate_reduce() {
    use smoe_compute::cpu::ops::rms_norm;
    use smoe_compute::gpu::Fuse;
    let Some(ctx) = gpu() else { return };
    let eps = 1e-6;
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        // Plain and gated products of normed inputs, added to y; widths over one staging tile.
        for (rows, cols, nt, gated) in [
            (33, 192, 1, false),
            (70, 4160, 3, false),
            (40, 320, 2, true),
        ] {
            let seed = 700 + 10 * i as u64 + cols as u64;
            let g = quantize_matrix(dtype, &rand_vec(rows * cols, seed, 1.0), rows, cols);
            let u = quantize_matrix(dtype, &rand_vec(rows * cols, seed + 1, 1.0), rows, cols);
            // Large inputs, so the norm matters.
            let x = rand_vec(nt * cols, seed + 2, 30.0);
            let nw = rand_vec(cols, seed + 3, 2.0);
            let y0 = rand_vec(nt * rows, seed + 4, 1.0);
            let mut h = vec![0f32; nt * cols];
            rms_norm(&x, &nw, eps, &mut h);
            let mut want = vec![0f32; nt * rows];
            matmul(QMatRef::new(dtype, rows, cols, &g), &h, nt, &mut want);
            if gated {
                let mut uw = vec![0f32; nt * rows];
                matmul(QMatRef::new(dtype, rows, cols, &u), &h, nt, &mut uw);
                silu_mul(&mut want, &uw);
            }
            want.iter_mut().zip(&y0).for_each(|(w, y)| *w += y);
            let wbuf = ctx.upload("w", &[g.clone(), u].concat());
            let xbuf = ctx.upload_f32("x", &x);
            let nbuf = ctx.upload_f32("norm", &nw);
            let ybuf = ctx.upload_f32("y", &y0);
            let desc = MatVecDesc {
                up_offset: gated.then_some(g.len() as u64),
                ..MatVecDesc::plain(
                    WeightRef::whole(&wbuf, dtype, rows, cols),
                    BufRef::new(&xbuf),
                    BufRef::new(&ybuf),
                    nt,
                )
            };
            // The normed inputs are also written out (at an offset, after poison).
            let hbuf = nan_buffer(ctx, "hn", 16 + nt * cols);
            let fuse = Fuse {
                norm: Some((BufRef::new(&nbuf), eps)),
                accumulate: true,
                reduce: None,
                norm_out: Some(BufRef::at(&hbuf, 64)),
                ..Default::default()
            };
            let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
            let mut enc = ctx.encoder();
            mv.encode(&mut enc);
            ctx.submit_wait(enc);
            let got = ctx.read_f32(&ybuf, 0, nt * rows).unwrap();
            let what = format!("norm+acc {dtype} {rows}x{cols} nt {nt} gated {gated}");
            assert_close(&what, &got, &want, 1e-5);
            let normed = ctx.read_f32(&hbuf, 64, nt * cols).unwrap();
            assert_close(&format!("{what}: normed output"), &normed, &h, 1e-10);
            let poison = ctx.read_f32(&hbuf, 0, 16).unwrap();
            assert!(
                poison.iter().all(|v| v.is_nan()),
                "{what}: hn before its offset"
            );
        }

        // Grouped, reduced over each token's k slots with router weights, plus y: three tokens
        // choosing 3 of six experts (one twice), and two tokens choosing 8 of ten over inputs
        // wider than one staging tile.
        let configs: [(usize, usize, usize, usize, Vec<u32>); 3] = [
            (40, 192, 6, 3, vec![5, 0, 2, 1, 1, 3, 4, 2, 0]),
            (
                33,
                768,
                10,
                8,
                vec![9, 0, 2, 1, 7, 3, 4, 5, 8, 6, 5, 4, 3, 2, 1, 0],
            ),
            // 8 × 1536 inputs exceed any device's staging: several tiles.
            (
                20,
                1536,
                9,
                8,
                vec![8, 0, 2, 1, 7, 3, 4, 5, 0, 6, 5, 4, 3, 2, 1, 8],
            ),
        ];
        for (rows, cols, n_mats, k, ids) in configs {
            let (mats, blob, stride) = expert_stack(dtype, rows, cols, n_mats, 100, 800);
            let wts = rand_vec(ids.len(), 810 + i as u64, 1.0);
            let x = rand_vec(ids.len() * cols, 820 + i as u64, 1.0);
            let n_tok = ids.len() / k;
            let y0 = rand_vec(n_tok * rows, 830 + i as u64, 1.0);
            let mut want = y0.clone();
            for (s, &id) in ids.iter().enumerate() {
                let mut part = vec![0f32; rows];
                let xs = &x[s * cols..(s + 1) * cols];
                matmul(
                    QMatRef::new(dtype, rows, cols, &mats[id as usize]),
                    xs,
                    1,
                    &mut part,
                );
                let t = s / k;
                for r in 0..rows {
                    want[t * rows + r] += wts[s] * part[r];
                }
            }
            let wbuf = ctx.upload("experts", &blob);
            let idbuf = ctx.upload("ids", bytemuck::cast_slice(&ids));
            let wtbuf = ctx.upload_f32("weights", &wts);
            let xbuf = ctx.upload_f32("x", &x);
            let ybuf = ctx.upload_f32("y", &y0);
            let desc = MatVecDesc {
                grouped: Some(Grouped {
                    ids: &idbuf,
                    ids_offset: 0,
                    n_slots: ids.len(),
                    n_mats,
                    mat_stride: stride as u64,
                    x_per_slot: true,
                    slots_per_x: 1,
                }),
                ..MatVecDesc::plain(
                    WeightRef::whole(&wbuf, dtype, rows, cols),
                    BufRef::new(&xbuf),
                    BufRef::new(&ybuf),
                    1,
                )
            };
            let fuse = Fuse {
                norm: None,
                accumulate: true,
                reduce: Some((BufRef::new(&wtbuf), k)),
                ..Default::default()
            };
            let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
            let mut enc = ctx.encoder();
            mv.encode(&mut enc);
            ctx.submit_wait(enc);
            let got = ctx.read_f32(&ybuf, 0, n_tok * rows).unwrap();
            assert_close(
                &format!("grouped reduce {dtype} k {k} cols {cols}"),
                &got,
                &want,
                1e-5,
            );

            // A reduce that does not divide the slots is refused.
            let bad = Fuse {
                reduce: Some((BufRef::new(&wtbuf), 5)),
                ..Default::default()
            };
            assert!(MatVec::fused(ctx, &desc, &bad).is_err());
        }
    }
}

/// Grouped gate_up of normed inputs: each token's k slots share its x (slots_per_x = k), the
/// norm is computed per token inside the kernel.
#[test]
fn matvec_grouped_gated_with_norm() {
    use smoe_compute::cpu::ops::rms_norm;
    use smoe_compute::gpu::Fuse;
    let Some(ctx) = gpu() else { return };
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let (rows, cols, n_mats, k) = (24usize, 256usize, 5usize, 2usize);
        let size = dtype.row_stride(cols) * rows;
        let stride = (2 * size).next_multiple_of(16);
        let mut blob = vec![0u8; stride * n_mats];
        let mut mats = vec![];
        for m in 0..n_mats {
            let g = quantize_matrix(
                dtype,
                &rand_vec(rows * cols, 900 + 2 * m as u64, 1.0),
                rows,
                cols,
            );
            let u = quantize_matrix(
                dtype,
                &rand_vec(rows * cols, 901 + 2 * m as u64, 1.0),
                rows,
                cols,
            );
            blob[m * stride..m * stride + size].copy_from_slice(&g);
            blob[m * stride + size..m * stride + 2 * size].copy_from_slice(&u);
            mats.push((g, u));
        }
        let ids: Vec<u32> = vec![3, 1, 4, 3];
        let x = rand_vec(2 * cols, 910 + i as u64, 10.0);
        let nw = rand_vec(cols, 911, 1.5);
        let mut h = vec![0f32; 2 * cols];
        rms_norm(&x, &nw, 1e-5, &mut h);
        let mut want = vec![0f32; ids.len() * rows];
        for (s, &id) in ids.iter().enumerate() {
            let (g, u) = &mats[id as usize];
            let xs = &h[s / k * cols..(s / k + 1) * cols];
            let (mut gw, mut uw) = (vec![0f32; rows], vec![0f32; rows]);
            matmul(QMatRef::new(dtype, rows, cols, g), xs, 1, &mut gw);
            matmul(QMatRef::new(dtype, rows, cols, u), xs, 1, &mut uw);
            silu_mul(&mut gw, &uw);
            want[s * rows..(s + 1) * rows].copy_from_slice(&gw);
        }
        let wbuf = ctx.upload("experts", &blob);
        let idbuf = ctx.upload("ids", bytemuck::cast_slice(&ids));
        let xbuf = ctx.upload_f32("x", &x);
        let nbuf = ctx.upload_f32("norm", &nw);
        let ybuf = nan_buffer(ctx, "y", ids.len() * rows);
        let desc = MatVecDesc {
            up_offset: Some(size as u64),
            grouped: Some(Grouped {
                ids: &idbuf,
                ids_offset: 0,
                n_slots: ids.len(),
                n_mats,
                mat_stride: stride as u64,
                x_per_slot: true,
                slots_per_x: k,
            }),
            ..MatVecDesc::plain(
                WeightRef::whole(&wbuf, dtype, rows, cols),
                BufRef::new(&xbuf),
                BufRef::new(&ybuf),
                1,
            )
        };
        let fuse = Fuse {
            norm: Some((BufRef::new(&nbuf), 1e-5)),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        let mut enc = ctx.encoder();
        mv.encode(&mut enc);
        ctx.submit_wait(enc);
        let got = ctx.read_f32(&ybuf, 0, ids.len() * rows).unwrap();
        assert_close(&format!("grouped gated norm {dtype}"), &got, &want, 1e-5);
    }
}
