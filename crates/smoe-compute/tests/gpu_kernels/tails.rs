//! Fused tails (`Fuse::route`, `Fuse::sum_into`, `Fuse::next_route`): the work a matvec's last
//! workgroup does after every workgroup has written its rows — the router's top-k, the experts'
//! weighted sum, the next block's whole router —
//! against the CPU doing the same steps on the GPU's own products, run twice in a row so that a
//! counter left unreset would show.

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::ops::{rms_norm, route_softmax_topk};
use smoe_compute::cpu::{matmul, QMatRef};
use smoe_compute::gpu::{
    BufRef, Fuse, GpuContext, Grouped, MatVec, MatVecDesc, NextRoute, RouteTail, SumTail, WeightRef,
};
use smoe_vault::quant::{quantize_matrix, DType};

fn run_twice(ctx: &GpuContext, mv: &MatVec, reset: impl Fn()) {
    for _ in 0..2 {
        reset();
        let mut enc = ctx.encoder();
        mv.encode(&mut enc);
        ctx.submit_wait(enc);
    }
}

/// The router as the engine runs it in decode: RMSNorm fused in, the normed input written out,
/// the top-k in the last workgroup. Expert counts that are not a multiple of a workgroup's rows,
/// several tokens (one with ties), every storage type.
#[test]
fn route_tail_matches_cpu_top_k() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        eprintln!("skipped: fused tails are off on this adapter");
        return;
    }
    let cases = [
        (DType::Bf16, 128, 256, 8, 1, true),
        (DType::Bf16, 60, 192, 4, 3, false),
        (DType::Q8, 128, 320, 8, 2, true),
        (DType::Q4, 257, 256, 1, 1, false),
        (DType::Q2, 16, 128, 2, 9, true),
    ];
    for (dtype, n_exp, cols, k, nt, normalize) in cases {
        let what = format!("route tail {dtype} {n_exp} experts k {k} tokens {nt}");
        let seed = (n_exp * 31 + cols + k) as u64;
        let wf = rand_vec(n_exp * cols, seed, 1.0);
        let mut q = quantize_matrix(dtype, &wf, n_exp, cols);
        if nt > 1 {
            // Rows 0..4 repeat rows 4..8: token logits tie in pairs, lower index first.
            let stride = dtype.row_stride(cols);
            let (a, b) = q.split_at_mut(4 * stride);
            a.copy_from_slice(&b[..4 * stride]);
        }
        let x = rand_vec(nt * cols, seed + 1, 20.0);
        let nw = rand_vec(cols, seed + 2, 1.5);
        let eps = 1e-6;
        let wbuf = ctx.upload("router", &q);
        let xbuf = ctx.upload_f32("x", &x);
        let nbuf = ctx.upload_f32("norm", &nw);
        let ybuf = nan_buffer(ctx, "logits", nt * n_exp);
        let hbuf = nan_buffer(ctx, "hn", nt * cols);
        // Ids and weights after 8 values of poison, to exercise the offsets.
        let ibuf = ctx.upload("ids", &vec![0xFFu8; 4 * (8 + k * nt)]);
        let rbuf = nan_buffer(ctx, "weights", 8 + k * nt);
        let desc = MatVecDesc::plain(
            WeightRef::whole(&wbuf, dtype, n_exp, cols),
            BufRef::new(&xbuf),
            BufRef::new(&ybuf),
            nt,
        );
        let fuse = Fuse {
            norm: Some((BufRef::new(&nbuf), eps)),
            norm_out: Some(BufRef::new(&hbuf)),
            route: Some(RouteTail {
                ids: BufRef::at(&ibuf, 32),
                weights: BufRef::at(&rbuf, 32),
                k,
                normalize,
            }),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        run_twice(ctx, &mv, || {
            ctx.queue.write_buffer(&ibuf, 32, &vec![0xFFu8; 4 * k * nt]);
            ctx.queue
                .write_buffer(&rbuf, 32, bytemuck::cast_slice(&vec![f32::NAN; k * nt]));
        });
        // The logits themselves, against the CPU's product of the normed input.
        let mut h = vec![0f32; nt * cols];
        rms_norm(&x, &nw, eps, &mut h);
        let mut want = vec![0f32; nt * n_exp];
        matmul(QMatRef::new(dtype, n_exp, cols, &q), &h, nt, &mut want);
        let logits = ctx.read_f32(&ybuf, 0, nt * n_exp).unwrap();
        assert_close(&format!("{what}: logits"), &logits, &want, 1e-5);
        // The choice, against the CPU's top-k of those same logits.
        let ids = ctx.read_u32(&ibuf, 32, k * nt).unwrap();
        let wts = ctx.read_f32(&rbuf, 32, k * nt).unwrap();
        for t in 0..nt {
            let want = route_softmax_topk(&logits[t * n_exp..(t + 1) * n_exp], k, normalize);
            let want_ids: Vec<u32> = want.iter().map(|c| c.0 as u32).collect();
            let want_w: Vec<f32> = want.iter().map(|c| c.1).collect();
            assert_eq!(&ids[t * k..(t + 1) * k], &want_ids[..], "{what}: token {t}");
            let got_w = &wts[t * k..(t + 1) * k];
            assert_close(&format!("{what}: weights"), got_w, &want_w, 1e-10);
        }
        let poison = ctx.read_u32(&ibuf, 0, 8).unwrap();
        assert!(
            poison.iter().all(|&v| v == u32::MAX),
            "{what}: ids before the offset"
        );
    }
}

/// The experts' down projection per slot, then each token's k slots summed with the router's
/// weights into the residual by each row block's last workgroup; row counts that leave a partial
/// block, one and several tokens, an expert chosen twice.
#[test]
fn sum_tail_matches_cpu_weighted_sum() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        eprintln!("skipped: fused tails are off on this adapter");
        return;
    }
    let configs: [(usize, usize, usize, usize, Vec<u32>); 3] = [
        (40, 192, 6, 3, vec![5, 0, 2, 1, 1, 3, 4, 2, 0]),
        (
            2048,
            768,
            10,
            8,
            vec![9, 0, 2, 1, 7, 3, 4, 5, 8, 6, 5, 4, 3, 2, 1, 0],
        ),
        (33, 256, 4, 1, vec![3]),
    ];
    for dtype in [DType::Bf16, DType::Q8, DType::Q4, DType::Q2] {
        for (rows, cols, n_mats, k, ids) in &configs {
            let (rows, cols, n_mats, k) = (*rows, *cols, *n_mats, *k);
            let what = format!("sum tail {dtype} {rows}x{cols} k {k} slots {}", ids.len());
            let size = dtype.row_stride(cols) * rows;
            let stride = (size + 100).next_multiple_of(16);
            let mut blob = vec![0u8; stride * n_mats];
            let mats: Vec<Vec<u8>> = (0..n_mats)
                .map(|m| {
                    let wf = rand_vec(rows * cols, 700 + m as u64, 1.0);
                    quantize_matrix(dtype, &wf, rows, cols)
                })
                .collect();
            for (m, q) in mats.iter().enumerate() {
                blob[m * stride..m * stride + size].copy_from_slice(q);
            }
            let n_tok = ids.len() / k;
            let x = rand_vec(ids.len() * cols, 710, 1.0);
            let wts = rand_vec(ids.len(), 711, 1.0);
            let acc0 = rand_vec(n_tok * rows, 712, 1.0);
            let wbuf = ctx.upload("experts", &blob);
            let idbuf = ctx.upload("ids", bytemuck::cast_slice(ids));
            let wtbuf = ctx.upload_f32("weights", &wts);
            let xbuf = ctx.upload_f32("x", &x);
            let ybuf = nan_buffer(ctx, "y", ids.len() * rows);
            // The residual after 16 values of poison.
            let mut ah = vec![f32::NAN; 16];
            ah.extend_from_slice(&acc0);
            let abuf = ctx.upload_f32("acc", &ah);
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
                sum_into: Some(SumTail {
                    acc: BufRef::at(&abuf, 64),
                    weights: BufRef::new(&wtbuf),
                    k,
                }),
                ..Default::default()
            };
            let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
            run_twice(ctx, &mv, || {
                ctx.queue
                    .write_buffer(&abuf, 64, bytemuck::cast_slice(&acc0));
            });
            let y = ctx.read_f32(&ybuf, 0, ids.len() * rows).unwrap();
            let mut want_y = vec![0f32; ids.len() * rows];
            for (s, &id) in ids.iter().enumerate() {
                let q = QMatRef::new(dtype, rows, cols, &mats[id as usize]);
                let out = &mut want_y[s * rows..(s + 1) * rows];
                matmul(q, &x[s * cols..(s + 1) * cols], 1, out);
            }
            assert_close(&format!("{what}: per slot"), &y, &want_y, 1e-5);
            // The sum, in weighted_sum's order, of the GPU's own per-slot products.
            let mut want = acc0.clone();
            for t in 0..n_tok {
                for r in 0..rows {
                    for s in t * k..(t + 1) * k {
                        want[t * rows + r] += wts[s] * y[s * rows + r];
                    }
                }
            }
            let got = ctx.read_f32(&abuf, 64, n_tok * rows).unwrap();
            assert_close(&what, &got, &want, 1e-12);
            let poison = ctx.read_f32(&abuf, 0, 16).unwrap();
            assert!(
                poison.iter().all(|v| v.is_nan()),
                "{what}: before the offset"
            );
        }
    }
}

/// The attention's output projection added to the residual, with the next MoE block's router in
/// its last workgroups: the new residual, the normed row the experts read, and the top-k, against
/// the CPU's RMSNorm, router product and top-k of the GPU's residual. Shapes with a partial
/// first-level group of workgroups (132 = 8·16 + 4), with more than 16 groups (257), and the
/// 30B's o_proj (256 workgroups of 8 rows).
#[test]
fn next_route_tail_matches_cpu_router() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        eprintln!("skipped: fused tails are off on this adapter");
        return;
    }
    let cases = [
        (DType::Q4, 2048, 512, 128, 8, true),
        (DType::Bf16, 264, 128, 60, 4, false),
        (DType::Q8, 8200, 64, 16, 2, true),
    ];
    for (dtype, rows, cols, n_exp, k, normalize) in cases {
        let what = format!("next route {dtype} {rows}x{cols}, {n_exp} experts k {k}");
        let seed = (rows + cols + n_exp) as u64;
        let q = quantize_matrix(dtype, &rand_vec(rows * cols, seed, 1.0), rows, cols);
        let rq = quantize_matrix(
            DType::Bf16,
            &rand_vec(n_exp * rows, seed + 1, 1.0),
            n_exp,
            rows,
        );
        let x = rand_vec(cols, seed + 2, 1.0);
        let resid = rand_vec(rows, seed + 3, 4.0);
        let g = rand_vec(rows, seed + 4, 1.5);
        let eps = 1e-6;
        // The router after 64 bytes of other data, to exercise its offset.
        let mut rblob = vec![0u8; 64];
        rblob.extend_from_slice(&rq);
        let wbuf = ctx.upload("o proj", &q);
        let rbuf = ctx.upload("router", &rblob);
        let xbuf = ctx.upload_f32("x", &x);
        let gbuf = ctx.upload_f32("norm", &g);
        let ybuf = ctx.upload_f32("residual", &resid);
        let hbuf = nan_buffer(ctx, "hn", rows);
        let ibuf = ctx.upload("ids", &vec![0xFFu8; 4 * (8 + k)]);
        let wtbuf = nan_buffer(ctx, "weights", 8 + k);
        let desc = MatVecDesc::plain(
            WeightRef::whole(&wbuf, dtype, rows, cols),
            BufRef::new(&xbuf),
            BufRef::new(&ybuf),
            1,
        );
        let fuse = Fuse {
            accumulate: true,
            next_route: Some(NextRoute {
                router: WeightRef {
                    buffer: &rbuf,
                    offset: 64,
                    dtype: DType::Bf16,
                    rows: n_exp,
                    cols: rows,
                },
                norm: (BufRef::new(&gbuf), eps),
                normed: BufRef::new(&hbuf),
                route: RouteTail {
                    ids: BufRef::at(&ibuf, 32),
                    weights: BufRef::at(&wtbuf, 32),
                    k,
                    normalize,
                },
            }),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        run_twice(ctx, &mv, || {
            ctx.queue
                .write_buffer(&ybuf, 0, bytemuck::cast_slice(&resid));
            ctx.queue.write_buffer(&ibuf, 32, &vec![0xFFu8; 4 * k]);
            ctx.queue
                .write_buffer(&wtbuf, 32, bytemuck::cast_slice(&vec![f32::NAN; k]));
        });
        let mut want_y = vec![0f32; rows];
        matmul(QMatRef::new(dtype, rows, cols, &q), &x, 1, &mut want_y);
        for (w, r) in want_y.iter_mut().zip(&resid) {
            *w += r;
        }
        let y = ctx.read_f32(&ybuf, 0, rows).unwrap();
        assert_close(&format!("{what}: residual"), &y, &want_y, 1e-5);
        // The router's steps on the GPU's own residual.
        let mut h = vec![0f32; rows];
        rms_norm(&y, &g, eps, &mut h);
        let hn = ctx.read_f32(&hbuf, 0, rows).unwrap();
        assert_close(&format!("{what}: normed row"), &hn, &h, 1e-10);
        let mut logits = vec![0f32; n_exp];
        matmul(
            QMatRef::new(DType::Bf16, n_exp, rows, &rq),
            &h,
            1,
            &mut logits,
        );
        let want = route_softmax_topk(&logits, k, normalize);
        let want_ids: Vec<u32> = want.iter().map(|c| c.0 as u32).collect();
        let want_w: Vec<f32> = want.iter().map(|c| c.1).collect();
        assert_eq!(ctx.read_u32(&ibuf, 32, k).unwrap(), want_ids, "{what}: ids");
        let got_w = ctx.read_f32(&wtbuf, 32, k).unwrap();
        assert_close(&format!("{what}: weights"), &got_w, &want_w, 1e-9);
        let poison = ctx.read_u32(&ibuf, 0, 8).unwrap();
        assert!(
            poison.iter().all(|&v| v == u32::MAX),
            "{what}: ids before the offset"
        );
    }
}

/// Tails the kernel cannot run are refused with a message, not run wrong.
#[test]
fn bad_tails_are_refused() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        return;
    }
    let (rows, cols) = (64usize, 128usize);
    let q = quantize_matrix(DType::Bf16, &rand_vec(rows * cols, 1, 1.0), rows, cols);
    let wbuf = ctx.upload("w", &q);
    let xbuf = ctx.upload_f32("x", &rand_vec(cols, 2, 1.0));
    let ybuf = nan_buffer(ctx, "y", 4 * rows);
    let ids = ctx.upload("ids", &[0u8; 64]);
    let desc = MatVecDesc::plain(
        WeightRef::whole(&wbuf, DType::Bf16, rows, cols),
        BufRef::new(&xbuf),
        BufRef::new(&ybuf),
        1,
    );
    let route = |k| RouteTail {
        ids: BufRef::new(&ids),
        weights: BufRef::new(&ybuf),
        k,
        normalize: true,
    };
    let next = |router_cols| NextRoute {
        router: WeightRef {
            buffer: &wbuf,
            offset: 0,
            dtype: DType::Bf16,
            rows: 8,
            cols: router_cols,
        },
        norm: (BufRef::new(&xbuf), 1e-6),
        normed: BufRef::new(&ybuf),
        route: route(2),
    };
    let sum = SumTail {
        acc: BufRef::new(&ybuf),
        weights: BufRef::new(&xbuf),
        k: 3,
    };
    let bad = [
        // k larger than the experts, and 0.
        Fuse {
            route: Some(route(65)),
            ..Default::default()
        },
        Fuse {
            route: Some(route(0)),
            ..Default::default()
        },
        // A sum over an ungrouped product.
        Fuse {
            sum_into: Some(sum),
            ..Default::default()
        },
        // Both at once.
        Fuse {
            route: Some(route(2)),
            sum_into: Some(sum),
            ..Default::default()
        },
        // The next router: without the residual add, and over the wrong width (its columns
        // must be the product's rows).
        Fuse {
            next_route: Some(next(rows)),
            ..Default::default()
        },
        Fuse {
            accumulate: true,
            next_route: Some(next(cols)),
            ..Default::default()
        },
    ];
    for f in bad {
        let e = MatVec::fused(ctx, &desc, &f);
        assert!(e.is_err(), "{f:?} was accepted");
    }
}
