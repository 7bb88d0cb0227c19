//! RMSNorm, weighted accumulate, argmax, the router and the element-wise ops against their CPU
//! twins.

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::ops;
use smoe_compute::gpu::{Argmax, BufRef, EltOp, Eltwise, RmsNorm, Router, WeightedSum};

#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = gpu() else { return };
    for (n, rows) in [(64, 1), (2048, 3), (4096, 1), (333, 7)] {
        let x = rand_vec(n * rows, n as u64, 3.0);
        let w = rand_vec(n, 7 + n as u64, 1.0);
        let mut want = vec![0f32; n * rows];
        ops::rms_norm(&x, &w, 1e-6, &mut want);
        let (xb, wb) = (ctx.upload_f32("x", &x), ctx.upload_f32("w", &w));
        let yb = nan_buffer(ctx, "y", n * rows);
        let k = RmsNorm::new(
            ctx,
            BufRef::new(&xb),
            BufRef::new(&wb),
            BufRef::new(&yb),
            n,
            rows,
            1e-6,
        )
        .unwrap();
        let mut enc = ctx.encoder();
        k.encode(&mut enc);
        ctx.submit_wait(enc);
        assert_close(
            &format!("rms_norm {n}x{rows}"),
            &ctx.read_f32(&yb, 0, n * rows).unwrap(),
            &want,
            1e-10,
        );
    }
}

#[test]
fn weighted_sum_matches_axpy() {
    let Some(ctx) = gpu() else { return };
    for (n, k, nt) in [(2048, 8, 1), (77, 3, 3), (1, 1, 1)] {
        let acc0 = rand_vec(n * nt, 1 + n as u64, 1.0);
        let y = rand_vec(n * k * nt, 2 + n as u64, 1.0);
        let w = rand_vec(k * nt, 3 + n as u64, 1.0);
        let mut want = acc0.clone();
        for t in 0..nt {
            for s in 0..k {
                let slot = t * k + s;
                ops::axpy(
                    &mut want[t * n..(t + 1) * n],
                    w[slot],
                    &y[slot * n..(slot + 1) * n],
                );
            }
        }
        let (ab, yb, wb) = (
            ctx.upload_f32("acc", &acc0),
            ctx.upload_f32("y", &y),
            ctx.upload_f32("w", &w),
        );
        let kern = WeightedSum::new(
            ctx,
            BufRef::new(&ab),
            BufRef::new(&yb),
            BufRef::new(&wb),
            n,
            k,
            nt,
        )
        .unwrap();
        let mut enc = ctx.encoder();
        kern.encode(&mut enc);
        ctx.submit_wait(enc);
        assert_close(
            &format!("weighted_sum {n} k {k} tokens {nt}"),
            &ctx.read_f32(&ab, 0, n * nt).unwrap(),
            &want,
            1e-10,
        );
    }
}

/// The engine's `sampler::argmax` rule, restated: first maximum, NaN never wins.
fn cpu_argmax(l: &[f32]) -> u32 {
    let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in l.iter().enumerate() {
        if v > bv {
            best = i;
            bv = v;
        }
    }
    best as u32
}

#[test]
fn argmax_matches_cpu_with_ties_and_nans() {
    let Some(ctx) = gpu() else { return };
    let n = 151_936;
    let mut rows: Vec<Vec<f32>> = (0..3).map(|r| rand_vec(n, 50 + r, 10.0)).collect();
    // Ties: the same maximum at two places; the lower index must win.
    rows[1][90_000] = 20.0;
    rows[1][12_345] = 20.0;
    // NaNs around a maximum, and a row that is all -inf except NaNs (→ 0).
    rows[2][7] = f32::NAN;
    rows[2][100_000] = 30.0;
    let mut odd = vec![f32::NEG_INFINITY; 1000];
    odd[3] = f32::NAN;
    for (i, row) in rows.iter().chain([&odd]).enumerate() {
        let xb = ctx.upload_f32("logits", row);
        let ob = ctx.upload("out", &[0xFFu8; 16]);
        let k = Argmax::new(ctx, BufRef::new(&xb), BufRef::new(&ob), row.len(), 1).unwrap();
        let mut enc = ctx.encoder();
        k.encode(&mut enc);
        ctx.submit_wait(enc);
        assert_eq!(
            ctx.read_u32(&ob, 0, 1).unwrap()[0],
            cpu_argmax(row),
            "row {i}"
        );
    }
    // Several rows in one dispatch.
    let flat: Vec<f32> = rows.concat();
    let xb = ctx.upload_f32("logits", &flat);
    let ob = ctx.upload("out", &[0xFFu8; 16]);
    let k = Argmax::new(ctx, BufRef::new(&xb), BufRef::new(&ob), n, 3).unwrap();
    let mut enc = ctx.encoder();
    k.encode(&mut enc);
    ctx.submit_wait(enc);
    let want: Vec<u32> = rows.iter().map(|r| cpu_argmax(r)).collect();
    assert_eq!(ctx.read_u32(&ob, 0, 3).unwrap(), want);
}

#[test]
fn router_matches_route_softmax_topk() {
    let Some(ctx) = gpu() else { return };
    for (n_exp, k, nt, normalize) in [
        (128, 8, 1, true),
        (128, 8, 3, false),
        (64, 6, 2, true),
        (8, 2, 1, true),
        (257, 1, 1, false),
    ] {
        let mut logits = rand_vec(n_exp * nt, n_exp as u64 + k as u64, 4.0);
        if nt > 1 {
            // Token 1: only five distinct logits, so ties decide (lower index first).
            for (i, v) in logits[n_exp..2 * n_exp].iter_mut().enumerate() {
                *v = ((i * 7) % 5) as f32;
            }
        }
        let lb = ctx.upload_f32("logits", &logits);
        let ib = ctx.upload("ids", &vec![0xFFu8; 4 * k * nt]);
        let wb = nan_buffer(ctx, "weights", k * nt);
        let r = Router::new(
            ctx,
            BufRef::new(&lb),
            BufRef::new(&ib),
            BufRef::new(&wb),
            n_exp,
            k,
            nt,
            normalize,
        )
        .unwrap();
        let mut enc = ctx.encoder();
        r.encode(&mut enc);
        ctx.submit_wait(enc);
        let ids = ctx.read_u32(&ib, 0, k * nt).unwrap();
        let wts = ctx.read_f32(&wb, 0, k * nt).unwrap();
        for t in 0..nt {
            let want = ops::route_softmax_topk(&logits[t * n_exp..(t + 1) * n_exp], k, normalize);
            let want_ids: Vec<u32> = want.iter().map(|x| x.0 as u32).collect();
            let want_w: Vec<f32> = want.iter().map(|x| x.1).collect();
            assert_eq!(
                &ids[t * k..(t + 1) * k],
                &want_ids[..],
                "router {n_exp} k {k} token {t}"
            );
            assert_close(
                &format!("router weights {n_exp} k {k}"),
                &wts[t * k..(t + 1) * k],
                &want_w,
                1e-10,
            );
        }
    }
}

#[test]
fn eltwise_matches_cpu() {
    // Odd sizes, data at an offset inside the buffer (as the engine's q/k/v regions are).
    let Some(ctx) = gpu() else { return };
    for (rows, len) in [(1, 192), (5, 48), (3, 333)] {
        let n = rows * len;
        let off = 64;
        let y0 = rand_vec(off + n, 50 + n as u64, 8.0);
        let bias = rand_vec(len, 51 + n as u64, 1.0);
        let bb = ctx.upload_f32("bias", &bias);
        let twins: [(&str, EltOp, Box<dyn Fn(usize, f32) -> f32>); 3] = [
            (
                "add_rows",
                EltOp::AddRows {
                    bias: BufRef::new(&bb),
                    len,
                },
                Box::new(|i, v| v + bias[i % len]),
            ),
            (
                "clamp",
                EltOp::Clamp(3.0),
                Box::new(|_, v| v.clamp(-3.0, 3.0)),
            ),
            (
                "sigmoid",
                EltOp::Sigmoid,
                Box::new(|_, v| 1.0 / (1.0 + (-v).exp())),
            ),
        ];
        for (name, op, twin) in twins {
            let yb = ctx.upload_f32("y", &y0);
            let k = Eltwise::new(ctx, BufRef::at(&yb, 4 * off as u64), n, op).unwrap();
            let mut enc = ctx.encoder();
            k.encode(&mut enc);
            ctx.submit_wait(enc);
            let got = ctx.read_f32(&yb, 0, off + n).unwrap();
            let want: Vec<f32> = (0..n).map(|i| twin(i, y0[off + i])).collect();
            assert_eq!(&got[..off], &y0[..off], "{name}: wrote before its range");
            assert_close(&format!("{name} {rows}x{len}"), &got[off..], &want, 1e-12);
        }
    }
}

#[test]
fn embed_gather_matches_dequantize_row() {
    use smoe_compute::gpu::{EmbedGather, WeightRef};
    use smoe_vault::quant::{dequantize_row, quantize_matrix, DType};
    let Some(ctx) = gpu() else { return };
    let (rows, cols) = (37, 192);
    let data = rand_vec(rows * cols, 91, 2.0);
    // Ids in any order, a repeated one, the first and the last row.
    let ids: Vec<u32> = vec![36, 0, 5, 5, 17];
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4, DType::Q2] {
        let bytes = quantize_matrix(dtype, &data, rows, cols);
        let stride = dtype.row_stride(cols);
        // The matrix at an offset inside its buffer, as the engine's tensors are.
        let mut padded = vec![0xABu8; 256];
        padded.extend_from_slice(&bytes);
        let wb = ctx.upload("w", &padded);
        let ib = ctx.upload("ids", bytemuck::cast_slice(&ids));
        let yb = nan_buffer(ctx, "y", 8 + ids.len() * cols);
        let w = WeightRef {
            buffer: &wb,
            offset: 256,
            dtype,
            rows,
            cols,
        };
        let k =
            EmbedGather::new(ctx, &w, BufRef::new(&ib), BufRef::at(&yb, 32), ids.len()).unwrap();
        let mut enc = ctx.encoder();
        k.encode(&mut enc);
        ctx.submit_wait(enc);
        let mut want = vec![0f32; ids.len() * cols];
        for (o, &id) in want.chunks_exact_mut(cols).zip(&ids) {
            let at = id as usize * stride;
            dequantize_row(dtype, &bytes[at..at + stride], o);
        }
        let got = ctx.read_f32(&yb, 32, ids.len() * cols).unwrap();
        assert_close(&format!("embed {dtype}"), &got, &want, 1e-12);
    }
}

/// The streaming slot map against `cpu::ops::slot_map`: where every chosen expert has a slot,
/// ids become slots and the indirect dispatches after it run; where one has none, the pass
/// halts (status = 1 + layer; the indirect dispatches after it run no workgroups, those before
/// it did); after a halt, a later slot map does nothing. Expert ids are kept for the host in
/// either case. Odd sizes: 60 experts, 2 tokens × top-6 in rows of 24. A lookahead guess that no
/// slot holds halts it too, if among its token's best-ranked kept. A speculative map never
/// halts, even after a halt: an expert without a slot goes to slot 0 with router weight 0.
#[test]
fn slot_map_maps_or_halts_the_pass() {
    use smoe_compute::gpu::{wgpu, IndirectArgs, Launch, SlotGuess, SlotMap, SlotMapBufs, NO_SLOT};
    let Some(ctx) = gpu() else { return };
    let (layers, experts, count, row) = (3, 60, 12, 24);
    // Layer l's table: expert e in slot (e·7 + l) % 40, except every fifth expert of layer 2.
    let table: Vec<u32> = (0..layers * experts)
        .map(|i| {
            let (l, e) = (i / experts, i % experts);
            match l == 2 && e % 5 == 0 {
                true => NO_SLOT,
                false => ((e * 7 + l) % 40) as u32,
            }
        })
        .collect();
    let hits: Vec<u32> = (0..count as u32)
        .map(|j| (j * 11 + 1) % 60)
        .filter(|e| e % 5 != 0)
        .collect();
    let hits = [&hits[..], &hits[..]].concat()[..count].to_vec();
    let mut misses = hits.clone();
    misses[7] = 35; // no slot in layer 2 (the second token's second-ranked)
    let logits = rand_vec(1000, 9, 1.0);
    // (layer, ids, halted before, lookahead guesses for layer 2 and how many per token count)
    let cases = [
        (1usize, &hits, 0u32, None),
        (2, &hits, 0, None),
        (2, &misses, 0, None),
        (1, &hits, 2, None),
        (0, &hits, 0, Some((&hits, 6))),
        (0, &hits, 0, Some((&misses, 6))),
        (0, &hits, 0, Some((&misses, 2))),
        (0, &hits, 0, Some((&misses, 1))),
    ];
    // What a slot map reads and writes: ids, the table, chosen ids (poisoned), the status.
    let upload = |ids: &[u32], status: u32| {
        (
            ctx.upload("ids", bytemuck::cast_slice(ids)),
            ctx.upload("table", bytemuck::cast_slice(&table)),
            ctx.upload("chosen", &vec![0xEE; 4 * layers * row]),
            ctx.upload("status", bytemuck::cast_slice(&[status, 0, 0, 0])),
        )
    };
    for (layer, ids, pre_halted, guess) in cases {
        let what =
            format!("layer {layer}, ids {ids:?}, halted before: {pre_halted}, guess {guess:?}");
        let (idb, tb, cb, sb) = upload(ids, pre_halted);
        let gb = ctx.upload("guess", bytemuck::cast_slice(guess.map_or(ids, |g| g.0)));
        let mut args = IndirectArgs::new(ctx, 8);
        let b = SlotMapBufs {
            ids: BufRef::new(&idb),
            table: &tb,
            chosen: &cb,
            args: &args,
            status: &sb,
            guess: guess.map(|(_, keep)| SlotGuess {
                ids: BufRef::new(&gb),
                layer: 2,
                per_token: 6,
                keep,
            }),
            spec: None,
        };
        let map = SlotMap::new(ctx, &b, layer, experts, count, row).unwrap();
        // An argmax before the slot map and one after it, both launched indirectly.
        let xb = ctx.upload_f32("logits", &logits);
        let (before, after) = (
            ctx.upload("before", &[0xFF; 16]),
            ctx.upload("after", &[0xFF; 16]),
        );
        let am = |out: &wgpu::Buffer| {
            Argmax::new(ctx, BufRef::new(&xb), BufRef::new(out), logits.len(), 1).unwrap()
        };
        let (a0, a1) = (am(&before), am(&after));
        let mut enc = ctx.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            let mut launch = Launch::Indirect(&mut args);
            a0.record_with(&mut pass, &mut launch);
            map.record_with(&mut pass, &mut launch);
            a1.record_with(&mut pass, &mut launch);
        }
        assert_eq!(args.len(), 2, "{what}: the slot map launches directly");
        args.upload(&ctx.queue);
        ctx.submit_wait(enc);
        let read = |buf: &wgpu::Buffer, n: usize| ctx.read_u32(buf, 0, n).unwrap();
        let want = cpu_argmax(&logits);
        assert_eq!(
            read(&before, 1)[0],
            want,
            "{what}: the dispatch before it ran"
        );
        let chosen = read(&cb, layers * row);
        let row_of = |l: usize| &table[l * experts..(l + 1) * experts];
        // A guess of layer 2 that no slot holds halts the pass like a miss, if kept.
        let kept = |(g, keep): (&Vec<u32>, usize)| -> Vec<u32> {
            g.chunks(6).flat_map(|t| &t[..keep]).copied().collect()
        };
        let mapped = ops::slot_map(ids, row_of(layer))
            .filter(|_| guess.is_none_or(|g| ops::slot_map(&kept(g), row_of(2)).is_some()));
        if pre_halted != 0 {
            assert_eq!(read(&sb, 1)[0], pre_halted, "{what}");
            assert_eq!(read(&idb, count), *ids, "{what}: ids left alone");
            assert!(
                chosen.iter().all(|&c| c == 0xEEEE_EEEE),
                "{what}: chosen left alone"
            );
            continue;
        }
        assert_eq!(
            &chosen[layer * row..layer * row + count],
            &ids[..],
            "{what}: chosen ids"
        );
        let others = (0..layers * row).filter(|i| !(layer * row..layer * row + count).contains(i));
        assert!(
            others.into_iter().all(|i| chosen[i] == 0xEEEE_EEEE),
            "{what}: only its row"
        );
        match mapped {
            Some(slots) => {
                assert_eq!(read(&idb, count), slots, "{what}: slots");
                assert_eq!(read(&sb, 1)[0], 0, "{what}: ran on");
                assert_eq!(
                    read(&after, 1)[0],
                    want,
                    "{what}: the dispatch after it ran"
                );
            }
            None => {
                assert_eq!(read(&sb, 1)[0], layer as u32 + 1, "{what}: halted");
                assert_eq!(
                    read(&after, 1)[0],
                    u32::MAX,
                    "{what}: the dispatch after it did not run"
                );
                assert!(
                    read(args.buffer(), 6).iter().all(|&w| w == 0),
                    "{what}: counts zeroed"
                );
            }
        }
    }
    // Speculative, on a pass an earlier layer halted: misses left out, nothing halted.
    let mut ids = misses.clone();
    ids[3] = 99; // not an expert: left out too
    let weights = rand_vec(count, 3, 1.0);
    let (idb, tb, cb, sb) = upload(&ids, 2);
    let wb = ctx.upload_f32("weights", &weights);
    let args = IndirectArgs::new(ctx, 8);
    let b = SlotMapBufs {
        ids: BufRef::new(&idb),
        table: &tb,
        chosen: &cb,
        args: &args,
        status: &sb,
        guess: None,
        spec: Some(BufRef::new(&wb)),
    };
    let map = SlotMap::new(ctx, &b, 2, experts, count, row).unwrap();
    let mut enc = ctx.encoder();
    map.encode(&mut enc);
    ctx.submit_wait(enc);
    let want = ops::slot_map_spec(&ids, &table[2 * experts..3 * experts]);
    assert!(want.iter().filter(|s| s.is_none()).count() >= 2);
    let got_w = ctx.read_f32(&wb, 0, count).unwrap();
    let got_s = ctx.read_u32(&idb, 0, count).unwrap();
    for (j, (&slot, w)) in got_s.iter().zip(got_w).enumerate() {
        let (ws, ww) = match want[j] {
            Some(s) => (s, weights[j]),
            None => (0, 0.0),
        };
        assert_eq!((slot, w), (ws, ww), "speculative, slot {j}");
    }
    let chosen = ctx.read_u32(&cb, 0, layers * row).unwrap();
    assert_eq!(
        &chosen[2 * row..2 * row + count],
        &ids[..],
        "speculative: chosen ids"
    );
    assert_eq!(
        ctx.read_u32(&sb, 0, 1).unwrap()[0],
        2,
        "speculative: status left alone"
    );
    // Shapes it cannot serve are refused.
    let small = ctx.upload("small", &[0; 16]);
    let args = IndirectArgs::new(ctx, 1);
    let b = SlotMapBufs {
        ids: BufRef::new(&small),
        table: &small,
        chosen: &small,
        args: &args,
        status: &small,
        guess: None,
        spec: None,
    };
    assert!(
        SlotMap::new(ctx, &b, 0, 60, 4, 4).is_err(),
        "a table without the layer's row"
    );
    assert!(
        SlotMap::new(ctx, &b, 0, 4, 8, 4).is_err(),
        "more ids than a row holds"
    );
}
