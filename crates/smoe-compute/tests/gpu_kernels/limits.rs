//! What the kernels refuse, with a message instead of a wrong result, and how they meet the
//! device's limits: error paths, not comparisons, so outside the conformance table.

use super::cases::matmul::DenseMatMul;
use super::conformance::{run_row, Row, Tol, Verdict};
use super::{gpu, nan_buffer, rand_vec};
use smoe_compute::gpu::{
    AttnDesc, BufRef, DecodeAttention, ExpertSort, Fuse, FusedRope, GpuError, Grouped, MatMul,
    MatMulDesc, MatMulGrouped, MatMulTuning, MatVec, MatVecDesc, NextRoute, PrefillAttention,
    PrefillAttnTuning, RouteTail, SumTail, WeightRef,
};
use smoe_vault::quant::{quantize_matrix, DType};

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

/// The default tile drops its key splits where their partial results would not fit one storage
/// binding (a chunk that long then runs unsplit instead of failing), and a scratch buffer smaller
/// than the split tiles need is refused.
#[test]
fn prefill_attention_splits_fit_the_device() {
    let Some(ctx) = gpu() else { return };
    let small = ctx.storage_buffer("small", 256);
    let step = ctx.step_buffer();
    let desc = |n_tokens| AttnDesc {
        q: BufRef::new(&small),
        k_cache: BufRef::new(&small),
        v_cache: BufRef::new(&small),
        out: BufRef::new(&small),
        step: &step,
        n_heads: 32,
        n_kv_heads: 4,
        head_dim: 128,
        n_tokens,
        capacity: n_tokens,
        scale: 1.0,
        window: None,
    };
    let max = ctx.limits().max_storage_buffer_binding_size;
    let short = desc(512);
    let t = PrefillAttnTuning::pick_for(ctx, &short);
    assert!(t.splits > 1, "{t:?}");
    assert!(PrefillAttention::scratch_bytes(&short, t) <= max);
    // Enough tokens for the default tile's partials to pass the device's binding limit (every
    // 8 tokens are one more tile per KV head).
    let per8 = PrefillAttention::scratch_bytes(&desc(8), PrefillAttnTuning::pick(ctx, 128));
    let long = desc((max / per8 + 1) as usize * 8);
    assert!(PrefillAttention::scratch_bytes(&long, PrefillAttnTuning::pick(ctx, 128)) > max);
    let t = PrefillAttnTuning::pick_for(ctx, &long);
    assert_eq!(t.splits, 1, "{t:?}");
    assert_eq!(PrefillAttention::scratch_bytes(&long, t), 0);
    // Too small a scratch for split tiles: refused with the sizes named.
    let q = ctx.storage_buffer("q", 4 * 512 * 32 * 128);
    let kv = ctx.storage_buffer("kv", 4 * 512 * 4 * 128);
    let out = ctx.storage_buffer("out", 4 * 512 * 32 * 128);
    let real = AttnDesc {
        q: BufRef::new(&q),
        k_cache: BufRef::new(&kv),
        v_cache: BufRef::new(&kv),
        out: BufRef::new(&out),
        ..short
    };
    let t = PrefillAttnTuning::pick_for(ctx, &real);
    let err = PrefillAttention::with_scratch(ctx, &real, t, &small)
        .err()
        .unwrap();
    assert!(
        matches!(&err, GpuError::Shape(m) if m.contains("scratch")),
        "{err}"
    );
}

#[test]
fn matmul_splits_a_matrix_larger_than_a_binding() {
    // bf16, 64 columns (128 bytes a row): enough rows to pass the storage binding limit. The
    // product through the table's driver (the rows depend on the device's limit).
    let Some(ctx) = gpu() else { return };
    let max = ctx.limits().max_storage_buffer_binding_size;
    let rows = (max / 128 + 1000) as usize;
    if rows * 128 > 600 << 20 {
        eprintln!("skipped: a binding of {max} bytes is too large to exceed here");
        return;
    }
    let row = Row::new(DenseMatMul::new(DType::Bf16, rows, 64, 3), Tol::Nmse(1e-9));
    let o = run_row(&row);
    assert_eq!(o.verdict, Verdict::Pass, "{}", o.line);
    // Output regions need the matrix in one binding (the engine then runs q, k, v apart).
    let wbuf = ctx.storage_buffer("w", (rows * 128) as u64);
    let xbuf = ctx.storage_buffer("x", 3 * 64 * 4);
    let ybuf = ctx.storage_buffer("y", (3 * rows * 4) as u64);
    let d = MatMulDesc {
        w: WeightRef::whole(&wbuf, DType::Bf16, rows, 64),
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

/// matvec takes the vault's storage types; f32 weights are stored bf16.
#[test]
fn matvec_refuses_f32_weights() {
    let Some(ctx) = gpu() else { return };
    let buf = ctx.storage_buffer("w", 1 << 16);
    let desc = MatVecDesc::plain(
        WeightRef::whole(&buf, DType::F32, 8, 64),
        BufRef::new(&buf),
        BufRef::new(&buf),
        1,
    );
    let e = MatVec::new(ctx, &desc).err().expect("f32 weights accepted");
    assert!(e.to_string().contains("store bf16"), "{e}");
}

/// A weighted reduce over a grouped product whose k does not divide its slots.
#[test]
fn matvec_reduce_that_does_not_divide_the_slots_is_refused() {
    let Some(ctx) = gpu() else { return };
    let (rows, cols) = (40, 192);
    let q = quantize_matrix(
        DType::Q4,
        &rand_vec(2 * rows * cols, 1, 1.0),
        2 * rows,
        cols,
    );
    let wbuf = ctx.upload("experts", &q);
    let ids = ctx.upload("ids", bytemuck::cast_slice(&[0u32, 1, 1, 0, 1, 0]));
    let xbuf = ctx.storage_buffer("x", (4 * 6 * cols) as u64);
    let ybuf = ctx.storage_buffer("y", (4 * 6 * rows) as u64);
    let wts = ctx.storage_buffer("weights", 4 * 6);
    let desc = MatVecDesc {
        grouped: Some(Grouped {
            ids: &ids,
            ids_offset: 0,
            n_slots: 6,
            n_mats: 2,
            mat_stride: (q.len() / 2) as u64,
            x_per_slot: true,
            slots_per_x: 1,
        }),
        ..MatVecDesc::plain(
            WeightRef::whole(&wbuf, DType::Q4, rows, cols),
            BufRef::new(&xbuf),
            BufRef::new(&ybuf),
            1,
        )
    };
    for (k, ok) in [(3, true), (5, false), (4, false)] {
        let fuse = Fuse {
            accumulate: true,
            reduce: Some((BufRef::new(&wts), k)),
            ..Default::default()
        };
        assert_eq!(MatVec::fused(ctx, &desc, &fuse).is_ok(), ok, "k {k}");
    }
}

/// Decode attention with RoPE fused in takes one token; prefill attention between 1 and 16 key
/// splits.
#[test]
fn attention_refuses_what_its_kernels_do_not_run() {
    let Some(ctx) = gpu() else { return };
    let (nh, nkv, hd, cap) = (8, 2, 64, 64);
    let buf = ctx.storage_buffer("qkv", 4 * (2 * nh + 2 * nkv) as u64 * hd as u64 * 2);
    let cache = ctx.storage_buffer("cache", 4 * (cap * nkv * hd) as u64);
    let out = ctx.storage_buffer("out", 4 * (2 * nh * hd) as u64);
    let small = ctx.storage_buffer("small", 4 * hd as u64);
    let step = ctx.step_buffer();
    let desc = |n_tokens| AttnDesc {
        q: BufRef::new(&buf),
        k_cache: BufRef::new(&cache),
        v_cache: BufRef::new(&cache),
        out: BufRef::new(&out),
        step: &step,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        n_tokens,
        capacity: cap,
        scale: 0.125,
        window: None,
    };
    let rope = FusedRope {
        k: BufRef::new(&buf),
        v: BufRef::new(&buf),
        norms: None,
        inv_freq: BufRef::new(&small),
        rot_dim: hd,
        rope_scale: 1.0,
        eps: 1e-6,
    };
    for (n_tokens, ok) in [(1, true), (2, false)] {
        let d = desc(n_tokens);
        let scratch = ctx.storage_buffer("partials", DecodeAttention::scratch_bytes(&d));
        let built = DecodeAttention::with_rope(ctx, &d, &scratch, Some(&rope));
        assert_eq!(built.is_ok(), ok, "{n_tokens} tokens with rope");
    }
    let base = PrefillAttnTuning::pick(ctx, hd);
    for (splits, ok) in [(1, true), (16, true), (0, false), (17, false)] {
        let t = PrefillAttnTuning { splits, ..base };
        match PrefillAttention::with_tuning(ctx, &desc(2), t) {
            Ok(_) => assert!(ok, "{splits} splits accepted"),
            Err(e) => assert!(
                !ok && matches!(e, GpuError::Shape(_)),
                "{splits} splits: {e}"
            ),
        }
    }
}
