//! `MoeBlock`: a decode token's router, top-k, experts and weighted sum in one dispatch of
//! co-resident workgroups, against the CPU doing the same steps; run twice in a row (the second
//! run starts from the first's x, and a barrier word left unreset would hang or fault it).

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::ops::{rms_norm, route_softmax_topk};
use smoe_compute::cpu::{dot_row, matmul, QMatRef};
use smoe_compute::gpu::{BufRef, GridSync, MoeBlock, MoeBlockDesc, WeightRef};
use smoe_vault::quant::{quantize_matrix, DType};

struct Case {
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    normalize: bool,
}

/// The CPU twin: x += Σ_s w_s · down_s(silu(gate_s(h)) · up_s(h)); returns the new x and the
/// choice.
#[allow(clippy::too_many_arguments)]
fn cpu_block(
    c: &Case,
    x: &[f32],
    nw: &[f32],
    router: &[u8],
    blob: &[u8],
    stride: usize,
    (gate_at, up_at, down_at): (usize, usize, usize),
) -> (Vec<f32>, Vec<(usize, f32)>) {
    let mut h = vec![0f32; c.h];
    rms_norm(x, nw, 1e-6, &mut h);
    let mut logits = vec![0f32; c.e];
    matmul(
        QMatRef::new(DType::Bf16, c.e, c.h, router),
        &h,
        1,
        &mut logits,
    );
    let choice = route_softmax_topk(&logits, c.k, c.normalize);
    let (gs, ds) = (DType::Q4.row_stride(c.h), DType::Q4.row_stride(c.f));
    let mut out = x.to_vec();
    for &(e, w) in &choice {
        let b = &blob[e * stride..];
        let gu: Vec<f32> = (0..c.f)
            .map(|r| {
                let g = dot_row(DType::Q4, &b[gate_at + r * gs..][..gs], &h);
                let u = dot_row(DType::Q4, &b[up_at + r * gs..][..gs], &h);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        for (r, o) in out.iter_mut().enumerate() {
            *o += w * dot_row(DType::Q4, &b[down_at + r * ds..][..ds], &gu);
        }
    }
    (out, choice)
}

/// Shapes of the fixtures (hidden 192–320, k 2–8), one with widths that leave lanes of a
/// subgroup without a chunk, and 30B-A3B's hidden size and expert width with fewer experts.
#[test]
fn moe_block_matches_cpu() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        eprintln!("skipped: workgroups cannot wait for each other on this adapter");
        return;
    }
    let cases = [
        Case {
            h: 256,
            f: 128,
            e: 16,
            k: 8,
            normalize: false,
        },
        Case {
            h: 192,
            f: 64,
            e: 8,
            k: 2,
            normalize: true,
        },
        Case {
            h: 320,
            f: 192,
            e: 12,
            k: 4,
            normalize: true,
        },
        Case {
            h: 2048,
            f: 768,
            e: 10,
            k: 8,
            normalize: true,
        },
    ];
    let sync = GridSync::new(ctx);
    for (ci, c) in cases.iter().enumerate() {
        let what = format!("moe block h {} f {} {} experts k {}", c.h, c.f, c.e, c.k);
        let seed = 900 + 10 * ci as u64;
        let (gs, ds) = (DType::Q4.row_stride(c.h), DType::Q4.row_stride(c.f));
        // A blob: gate, up, down, then padding (as a vault's blob stride leaves).
        let (gate_at, up_at, down_at) = (0, c.f * gs, 2 * c.f * gs);
        let stride = (down_at + c.h * ds + 48).next_multiple_of(16);
        let mut blob = vec![0u8; stride * c.e];
        for e in 0..c.e {
            let s = seed + 3 * e as u64;
            let gate = quantize_matrix(DType::Q4, &rand_vec(c.f * c.h, s, 1.0), c.f, c.h);
            let up = quantize_matrix(DType::Q4, &rand_vec(c.f * c.h, s + 1, 1.0), c.f, c.h);
            let down = quantize_matrix(DType::Q4, &rand_vec(c.h * c.f, s + 2, 0.5), c.h, c.f);
            let b = &mut blob[e * stride..];
            b[gate_at..up_at].copy_from_slice(&gate);
            b[up_at..down_at].copy_from_slice(&up);
            b[down_at..down_at + down.len()].copy_from_slice(&down);
        }
        let router = quantize_matrix(DType::Bf16, &rand_vec(c.e * c.h, seed + 7, 1.0), c.e, c.h);
        let x0 = rand_vec(c.h, seed + 8, 2.0);
        let nw = rand_vec(c.h, seed + 9, 1.5);
        let ebuf = ctx.upload("experts", &blob);
        let rbuf = ctx.upload("router", &router);
        let nbuf = ctx.upload_f32("norm", &nw);
        // x after 4 values of poison; ids and weights after 8.
        let mut xh = vec![f32::NAN; 4];
        xh.extend_from_slice(&x0);
        let xbuf = ctx.upload_f32("x", &xh);
        let ibuf = ctx.upload("ids", &vec![0xFFu8; 4 * (8 + c.k)]);
        let wbuf = nan_buffer(ctx, "weights", 8 + c.k);
        let mat = |offset, rows, cols| WeightRef {
            buffer: &ebuf,
            offset: offset as u64,
            dtype: DType::Q4,
            rows,
            cols,
        };
        let desc = MoeBlockDesc {
            x: BufRef::at(&xbuf, 16),
            norm: BufRef::new(&nbuf),
            eps: 1e-6,
            router: WeightRef {
                buffer: &rbuf,
                offset: 0,
                dtype: DType::Bf16,
                rows: c.e,
                cols: c.h,
            },
            gate: mat(gate_at, c.f, c.h),
            up_offset: up_at as u64,
            down: mat(down_at, c.h, c.f),
            stride: stride as u64,
            k: c.k,
            normalize: c.normalize,
            ids: BufRef::at(&ibuf, 32),
            weights: BufRef::at(&wbuf, 32),
        };
        let block = MoeBlock::new(ctx, &desc, &sync).expect("moe block");
        eprintln!("{what}: {} workgroups", block.groups());
        let mut want = x0.clone();
        for run in 0..2 {
            let mut enc = ctx.encoder();
            block.encode(&mut enc);
            ctx.submit_wait(enc);
            let (next, choice) = cpu_block(
                c,
                &want,
                &nw,
                &router,
                &blob,
                stride,
                (gate_at, up_at, down_at),
            );
            let got = ctx.read_f32(&xbuf, 16, c.h).unwrap();
            let delta =
                |v: &[f32]| -> Vec<f32> { v.iter().zip(&want).map(|(a, b)| a - b).collect() };
            assert_close(
                &format!("{what} run {run}: x's update"),
                &delta(&got),
                &delta(&next),
                1e-8,
            );
            let ids = ctx.read_u32(&ibuf, 32, c.k).unwrap();
            let wts = ctx.read_f32(&wbuf, 32, c.k).unwrap();
            let want_ids: Vec<u32> = choice.iter().map(|c| c.0 as u32).collect();
            let want_w: Vec<f32> = choice.iter().map(|c| c.1).collect();
            assert_eq!(ids, want_ids, "{what} run {run}: ids");
            assert_close(&format!("{what} run {run}: weights"), &wts, &want_w, 1e-10);
            assert_eq!(sync.faults(ctx).unwrap(), 0, "{what}: a workgroup gave up");
            want = got;
        }
        let poison = ctx.read_u32(&ibuf, 0, 8).unwrap();
        assert!(
            poison.iter().all(|&v| v == u32::MAX),
            "{what}: ids before the offset"
        );
        let xp = ctx.read_f32(&xbuf, 0, 4).unwrap();
        assert!(xp.iter().all(|v| v.is_nan()), "{what}: x before the offset");
    }
}

/// What the block refuses, with a reason, so that the engine records the matvec chain instead.
#[test]
fn moe_block_refuses_what_it_cannot_run() {
    let Some(ctx) = gpu() else { return };
    if !ctx.fused_tails() {
        return;
    }
    let sync = GridSync::new(ctx);
    let buf = ctx.storage_buffer("weights", 1 << 20);
    let x = ctx.storage_buffer("x", 4096);
    let nw = ctx.storage_buffer("norm", 4096);
    let ids = ctx.storage_buffer("ids", 4096);
    let w = |dtype, rows, cols| WeightRef {
        buffer: &buf,
        offset: 0,
        dtype,
        rows,
        cols,
    };
    let base = MoeBlockDesc {
        x: BufRef::new(&x),
        norm: BufRef::new(&nw),
        eps: 1e-6,
        router: w(DType::Bf16, 8, 256),
        gate: w(DType::Q4, 64, 256),
        up_offset: 64 * 144,
        down: w(DType::Q4, 256, 64),
        stride: 1 << 16,
        k: 2,
        normalize: false,
        ids: BufRef::new(&ids),
        weights: BufRef::at(&ids, 64),
    };
    let q8 = MoeBlockDesc {
        gate: w(DType::Q8, 64, 256),
        ..base
    };
    let e = MoeBlock::new(ctx, &q8, &sync)
        .err()
        .expect("q8 experts refused");
    assert!(e.to_string().contains("q4 experts"), "{e}");
    let wide = MoeBlockDesc { k: 9, ..base };
    assert!(
        MoeBlock::new(ctx, &wide, &sync).is_err(),
        "k > experts refused"
    );
    let past = MoeBlockDesc {
        stride: 1 << 20,
        ..base
    };
    let e = MoeBlock::new(ctx, &past, &sync)
        .err()
        .expect("experts past the buffer refused");
    assert!(e.to_string().contains("storage binding"), "{e}");
    MoeBlock::new(ctx, &base, &sync).expect("the base case builds");
}
