//! QK-norm + RoPE + KV append, and decode and prefill attention, against the CPU forward's
//! steps.

use super::{assert_close, gpu, nan_buffer, rand_vec};
use smoe_compute::cpu::ops::{self, AttnShape};
use smoe_compute::gpu::{
    AttnDesc, BufRef, DecodeAttention, FusedRope, GpuContext, GpuError, GpuTuning,
    PrefillAttention, PrefillAttnTuning, QkNormRope, QkNormRopeDesc,
};

/// Inverse frequencies as the engine's RopeTable computes them (no YaRN).
fn inv_freq(theta: f64, hd: usize) -> Vec<f32> {
    (0..hd / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / hd as f64) as f32)
        .collect()
}

/// cos/sin at `pos` as the engine computes them: f32 angle, f64 trigonometry, times scale.
fn cos_sin(inv: &[f32], pos: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let a: Vec<f32> = inv.iter().map(|f| f * pos as f32).collect();
    (
        a.iter().map(|a| (*a as f64).cos() as f32 * scale).collect(),
        a.iter().map(|a| (*a as f64).sin() as f32 * scale).collect(),
    )
}

#[test]
fn qk_norm_rope_append_matches_cpu() {
    let Some(ctx) = gpu() else { return };
    // (heads, kv heads, head_dim, tokens, pos0, norm): positions up to 50k check the reduction.
    for (nh, nkv, hd, nt, pos0, norm) in [
        (4, 2, 128, 3, 5, true),
        (32, 4, 128, 1, 40_000, true),
        (8, 8, 64, 2, 0, false),
        (2, 1, 256, 1, 50_000, true),
    ] {
        let cap = pos0 + nt + 3;
        let (qw, kw) = (nh * hd, nkv * hd);
        let seed = (nh * 1000 + pos0) as u64;
        let (q, k, v) = (
            rand_vec(nt * qw, seed, 2.0),
            rand_vec(nt * kw, seed + 1, 2.0),
            rand_vec(nt * kw, seed + 2, 2.0),
        );
        let qn = rand_vec(hd, seed + 3, 1.5);
        let kn = rand_vec(hd, seed + 4, 1.5);
        let inv = inv_freq(1e6, hd);
        let scale = 1.1;
        let (mut qc, mut kc) = (q.clone(), k.clone());
        if norm {
            ops::rms_norm_inplace(&mut qc, &qn, 1e-6);
            ops::rms_norm_inplace(&mut kc, &kn, 1e-6);
        }
        for t in 0..nt {
            let (c, s) = cos_sin(&inv, pos0 + t, scale);
            ops::rope_inplace(&mut qc[t * qw..(t + 1) * qw], hd, &c, &s);
            ops::rope_inplace(&mut kc[t * kw..(t + 1) * kw], hd, &c, &s);
        }

        let (qb, kb, vb) = (
            ctx.upload_f32("q", &q),
            ctx.upload_f32("k", &k),
            ctx.upload_f32("v", &v),
        );
        // K and V caches share one buffer, V after K, as a layer's cache would.
        let cache = nan_buffer(ctx, "kv cache", 2 * cap * kw);
        let norms = ctx.upload_f32("norms", &[qn.clone(), kn.clone()].concat());
        let invb = ctx.upload_f32("inv_freq", &inv);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let kern = QkNormRope::new(
            ctx,
            &QkNormRopeDesc {
                q: BufRef::new(&qb),
                k: BufRef::new(&kb),
                v: BufRef::new(&vb),
                k_cache: BufRef::new(&cache),
                v_cache: BufRef::at(&cache, (4 * cap * kw) as u64),
                norms: norm.then(|| (BufRef::new(&norms), BufRef::at(&norms, 4 * hd as u64))),
                inv_freq: BufRef::new(&invb),
                rot_dim: hd,
                rope_scale: scale,
                eps: 1e-6,
                step: &step,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                n_tokens: nt,
                capacity: cap,
            },
        )
        .unwrap();
        let mut enc = ctx.encoder();
        kern.encode(&mut enc);
        ctx.submit_wait(enc);
        let what = format!("qk_norm_rope {nh}/{nkv}x{hd} pos {pos0}");
        assert_close(
            &format!("{what} q"),
            &ctx.read_f32(&qb, 0, nt * qw).unwrap(),
            &qc,
            1e-10,
        );
        let at = |p: usize| (4 * p * kw) as u64;
        assert_close(
            &format!("{what} k"),
            &ctx.read_f32(&cache, at(pos0), nt * kw).unwrap(),
            &kc,
            1e-10,
        );
        assert_close(
            &format!("{what} v"),
            &ctx.read_f32(&cache, at(cap + pos0), nt * kw).unwrap(),
            &v,
            0.0,
        );
        // Nothing else of the cache was touched.
        assert!(
            ctx.read_f32(&cache, at(pos0 + nt), kw)
                .unwrap()
                .iter()
                .all(|x| x.is_nan()),
            "{what}"
        );
    }
}

/// Runs `cases` on the shared context and on one without fused tails: split attention merges
/// in its last split's (or unit's) workgroup where tails are fused, in a pass of its own
/// otherwise, and both must match the CPU.
fn with_and_without_fused_tails(cases: fn(&GpuContext)) {
    let Some(shared) = gpu() else { return };
    let tuning = GpuTuning {
        fused_tails: false,
        ..GpuTuning::default()
    };
    let plain = GpuContext::with_tuning(tuning).unwrap();
    for ctx in [shared, &plain] {
        cases(ctx);
    }
}

#[test]
fn decode_attention_matches_cpu_any_context() {
    with_and_without_fused_tails(decode_attention_cases);
}

fn decode_attention_cases(ctx: &GpuContext) {
    // (heads, kv heads, head_dim, tokens, pos0, capacity, window): contexts from 1 to several
    // tiles and splits, GQA groups 1..8, and sliding windows.
    for (nh, nkv, hd, nt, pos0, cap, window) in [
        (4, 2, 64, 1, 0, 16, None),
        (8, 1, 128, 3, 34, 40, None),
        (32, 4, 128, 1, 699, 1500, None),
        (16, 4, 256, 3, 1400, 1500, None),
        (6, 3, 128, 2, 5000, 5003, None),
        (8, 2, 64, 3, 1000, 1100, Some(128)),
        (4, 4, 64, 2, 10, 20, Some(100)),
        // One split (capacity ≤ 512: the direct path, no combine) over several tiles.
        (8, 2, 64, 2, 300, 400, None),
        (8, 2, 128, 1, 450, 512, Some(200)),
        // Short contexts in caches of several splits: some splits have no positions.
        (8, 2, 128, 1, 20, 2000, None),
        (8, 2, 128, 2, 200, 3000, None),
        // Head widths that are not a multiple of 32 (the K dot's 8-vec4 steps leave a rest).
        (4, 2, 36, 2, 20, 40, None),
        (8, 4, 80, 1, 100, 200, None),
        // Wide heads: each invocation sums 3 and 4 vec4s of the output (o0..o3).
        (4, 2, 384, 2, 30, 64, None),
        (2, 1, 512, 1, 700, 800, None),
    ] {
        let kw = nkv * hd;
        let seed = (nh * 7 + pos0) as u64;
        let q = rand_vec(nt * nh * hd, seed, 1.0);
        let kcache = rand_vec(cap * kw, seed + 1, 1.0);
        let vcache = rand_vec(cap * kw, seed + 2, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let n_ctx = pos0 + nt;
        let mut want = vec![0f32; nt * nh * hd];
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale,
            window,
        };
        ops::attention(
            &q,
            &kcache[..n_ctx * kw],
            &vcache[..n_ctx * kw],
            pos0,
            shape,
            &mut want,
        );

        let qb = ctx.upload_f32("q", &q);
        let kb = ctx.upload_f32("k cache", &kcache);
        let vb = ctx.upload_f32("v cache", &vcache);
        let ob = nan_buffer(ctx, "out", nt * nh * hd);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let attn = DecodeAttention::new(
            ctx,
            &AttnDesc {
                q: BufRef::new(&qb),
                k_cache: BufRef::new(&kb),
                v_cache: BufRef::new(&vb),
                out: BufRef::new(&ob),
                step: &step,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                n_tokens: nt,
                capacity: cap,
                scale,
                window,
            },
        )
        .unwrap();
        let mut enc = ctx.encoder();
        attn.encode(&mut enc);
        ctx.submit_wait(enc);
        let got = ctx.read_f32(&ob, 0, nt * nh * hd).unwrap();
        let tails = ctx.fused_tails();
        assert_close(
            &format!(
                "attention {nh}/{nkv}x{hd} tokens {nt} pos0 {pos0} window {window:?} tails {tails}"
            ),
            &got,
            &want,
            1e-10,
        );
    }
}

/// Decode attention with QK-norm, RoPE and the KV append fused in (`DecodeAttention::with_rope`,
/// one token) against the CPU doing those steps, then attention over the updated caches: the
/// output, the appended key and value, and the rest of the cache left alone.
#[test]
fn decode_attention_with_rope_matches_cpu() {
    with_and_without_fused_tails(decode_attention_rope_cases);
}

fn decode_attention_rope_cases(ctx: &GpuContext) {
    // (heads, kv heads, head_dim, pos0, capacity, window, norm, rotated dims): the first
    // position, one split and several, GQA 1–8, a window, no QK-norm, a head width that is not a
    // multiple of 32, partial rotary.
    for (nh, nkv, hd, pos0, cap, window, norm, rot) in [
        (4, 2, 64, 0, 16, None, true, 64),
        (32, 4, 128, 699, 1500, None, true, 128),
        (32, 4, 128, 63, 4096, None, true, 128),
        (8, 8, 128, 300, 400, None, true, 32),
        (8, 2, 64, 1000, 1100, Some(128), false, 64),
        (4, 2, 36, 20, 40, None, true, 36),
        (4, 2, 64, 20, 40, None, false, 16),
        (16, 4, 128, 40_000, 40_010, Some(4096), true, 128),
    ] {
        let what =
            format!("attention+rope {nh}/{nkv}x{hd} (rot {rot}) pos0 {pos0} window {window:?}");
        let (qw, kw) = (nh * hd, nkv * hd);
        let seed = (nh * 13 + pos0) as u64;
        let (q, k, v) = (
            rand_vec(qw, seed, 2.0),
            rand_vec(kw, seed + 1, 2.0),
            rand_vec(kw, seed + 2, 2.0),
        );
        let (qn, kn) = (rand_vec(hd, seed + 3, 1.5), rand_vec(hd, seed + 4, 1.5));
        let inv = inv_freq(1e6, rot);
        let rscale = 1.05;
        let (mut qc, mut kc) = (q.clone(), k.clone());
        if norm {
            ops::rms_norm_inplace(&mut qc, &qn, 1e-6);
            ops::rms_norm_inplace(&mut kc, &kn, 1e-6);
        }
        let (c, sn) = cos_sin(&inv, pos0, rscale);
        // Rotate-half within each head's first `rot` dims; the rest only normalized.
        for head in qc.chunks_exact_mut(hd).chain(kc.chunks_exact_mut(hd)) {
            ops::rope_inplace(&mut head[..rot], rot, &c, &sn);
        }
        // Earlier positions random, the current one appended, later ones poisoned.
        let mut kcache = rand_vec(cap * kw, seed + 5, 1.0);
        let mut vcache = rand_vec(cap * kw, seed + 6, 1.0);
        kcache[pos0 * kw..(pos0 + 1) * kw].copy_from_slice(&kc);
        vcache[pos0 * kw..(pos0 + 1) * kw].copy_from_slice(&v);
        let scale = 1.0 / (hd as f32).sqrt();
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale,
            window,
        };
        let n_ctx = pos0 + 1;
        let mut want = vec![0f32; qw];
        let (kx, vx) = (&kcache[..n_ctx * kw], &vcache[..n_ctx * kw]);
        ops::attention(&qc, kx, vx, pos0, shape, &mut want);

        // q, k, v in one buffer, as the qkv projection writes them.
        let qkv = ctx.upload_f32("qkv", &[q.clone(), k.clone(), v.clone()].concat());
        let poisoned = |mut c: Vec<f32>| {
            c[pos0 * kw..].iter_mut().for_each(|x| *x = f32::NAN);
            c
        };
        let kb = ctx.upload_f32("k cache", &poisoned(kcache.clone()));
        let vb = ctx.upload_f32("v cache", &poisoned(vcache.clone()));
        let ob = nan_buffer(ctx, "out", qw);
        let norms = ctx.upload_f32("norms", &[qn.clone(), kn.clone()].concat());
        let invb = ctx.upload_f32("inv_freq", &inv);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let desc = AttnDesc {
            q: BufRef::new(&qkv),
            k_cache: BufRef::new(&kb),
            v_cache: BufRef::new(&vb),
            out: BufRef::new(&ob),
            step: &step,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            n_tokens: 1,
            capacity: cap,
            scale,
            window,
        };
        let rope = FusedRope {
            k: BufRef::at(&qkv, 4 * qw as u64),
            v: BufRef::at(&qkv, 4 * (qw + kw) as u64),
            norms: norm.then(|| (BufRef::new(&norms), BufRef::at(&norms, 4 * hd as u64))),
            inv_freq: BufRef::new(&invb),
            rot_dim: rot,
            rope_scale: rscale,
            eps: 1e-6,
        };
        let scratch = ctx.storage_buffer("partials", DecodeAttention::scratch_bytes(&desc));
        let attn = DecodeAttention::with_rope(ctx, &desc, &scratch, Some(&rope)).unwrap();
        let mut enc = ctx.encoder();
        attn.encode(&mut enc);
        ctx.submit_wait(enc);
        let got = ctx.read_f32(&ob, 0, qw).unwrap();
        assert_close(&what, &got, &want, 1e-10);
        let at = |p: usize| (4 * p * kw) as u64;
        let kgot = ctx.read_f32(&kb, at(pos0), kw).unwrap();
        assert_close(&format!("{what}: appended k"), &kgot, &kc, 1e-10);
        let vgot = ctx.read_f32(&vb, at(pos0), kw).unwrap();
        assert_close(&format!("{what}: appended v"), &vgot, &v, 0.0);
        if pos0 + 1 < cap {
            let after = ctx.read_f32(&kb, at(pos0 + 1), kw).unwrap();
            assert!(after.iter().all(|x| x.is_nan()), "{what}: wrote past pos0");
        }
        // More than one token is refused.
        let two = AttnDesc {
            n_tokens: 2,
            ..desc
        };
        let scratch2 = ctx.storage_buffer("partials", DecodeAttention::scratch_bytes(&two));
        assert!(DecodeAttention::with_rope(ctx, &two, &scratch2, Some(&rope)).is_err());
    }
}

/// One prefill attention shape: (heads, kv heads, head_dim, tokens, capacity, window).
type PrefillCase = (usize, usize, usize, usize, usize, Option<usize>);

/// Runs `PrefillAttention` (the default tile, or `tuning`) recorded once, at each of `pos0s`
/// (set through the step uniform only), against the CPU twin. Cache positions past the chunk
/// hold NaN, as stale or unwritten cache rows may: they must never be read.
fn check_prefill(
    ctx: &GpuContext,
    (nh, nkv, hd, nt, cap, window): PrefillCase,
    pos0s: &[usize],
    tuning: Option<PrefillAttnTuning>,
) -> Result<(), GpuError> {
    let kw = nkv * hd;
    let seed = (nh * 31 + hd * 7 + nt) as u64;
    let q = rand_vec(nt * nh * hd, seed, 1.0);
    // Keys scaled up so that softmaxes are peaked as well as flat.
    let kcache = rand_vec(cap * kw, seed + 1, 3.0);
    let vcache = rand_vec(cap * kw, seed + 2, 1.0);
    let scale = 1.0 / (hd as f32).sqrt();
    let qb = ctx.upload_f32("q", &q);
    let kb = ctx.upload_f32("k cache", &kcache);
    let vb = ctx.upload_f32("v cache", &vcache);
    let ob = nan_buffer(ctx, "out", nt * nh * hd);
    let step = ctx.step_buffer();
    let desc = AttnDesc {
        q: BufRef::new(&qb),
        k_cache: BufRef::new(&kb),
        v_cache: BufRef::new(&vb),
        out: BufRef::new(&ob),
        step: &step,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        n_tokens: nt,
        capacity: cap,
        scale,
        window,
    };
    let attn = match tuning {
        Some(t) => PrefillAttention::with_tuning(ctx, &desc, t)?,
        None => PrefillAttention::new(ctx, &desc)?,
    };
    for &pos0 in pos0s {
        let n_ctx = pos0 + nt;
        assert!(n_ctx <= cap);
        let poison = |c: &[f32]| {
            let mut c = c.to_vec();
            c[n_ctx * kw..].fill(f32::NAN);
            c
        };
        ctx.queue
            .write_buffer(&kb, 0, bytemuck::cast_slice(&poison(&kcache)));
        ctx.queue
            .write_buffer(&vb, 0, bytemuck::cast_slice(&poison(&vcache)));
        ctx.queue
            .write_buffer(&ob, 0, bytemuck::cast_slice(&vec![f32::NAN; nt * nh * hd]));
        ctx.write_step(&step, pos0 as u32);
        let mut want = vec![0f32; nt * nh * hd];
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale,
            window,
        };
        ops::attention(
            &q,
            &kcache[..n_ctx * kw],
            &vcache[..n_ctx * kw],
            pos0,
            shape,
            &mut want,
        );
        let mut enc = ctx.encoder();
        attn.encode(&mut enc);
        ctx.submit_wait(enc);
        let got = ctx.read_f32(&ob, 0, nt * nh * hd).unwrap();
        assert_close(
            &format!(
                "prefill attention {nh}/{nkv}x{hd} tokens {nt} pos0 {pos0} window {window:?} \
                 tile {:?}",
                attn.tuning()
            ),
            &got,
            &want,
            1e-10,
        );
    }
    Ok(())
}

#[test]
fn prefill_attention_matches_cpu() {
    let Some(ctx) = gpu() else { return };
    // Token counts that are not multiples of a tile, first chunks (pos0 0) and later ones,
    // GQA groups 1..8 (3, 5, 7 included), head dims 36 (not a multiple of the score step) to
    // 256, and sliding windows shorter than the chunk, than the context, and longer than both.
    let cases: &[(PrefillCase, &[usize])] = &[
        ((32, 4, 128, 64, 600, None), &[0, 512]),
        ((8, 2, 128, 300, 700, None), &[0, 333]),
        ((4, 4, 64, 1, 40, None), &[0, 1, 39]),
        ((4, 1, 64, 7, 120, None), &[0, 100]),
        ((6, 3, 48, 100, 300, None), &[0, 37]),
        ((2, 1, 48, 300, 300, Some(1000)), &[0]),
        ((8, 8, 64, 300, 400, Some(64)), &[0, 50]),
        ((16, 2, 128, 100, 400, Some(40)), &[0, 200]),
        ((7, 1, 48, 7, 20, Some(3)), &[0, 13]),
        ((10, 2, 256, 20, 60, None), &[0, 5]),
        ((5, 5, 36, 9, 30, Some(5)), &[0, 3]),
        ((4, 2, 64, 7, 20, Some(100)), &[2]),
    ];
    for &(case, pos0s) in cases {
        check_prefill(ctx, case, pos0s, None).unwrap();
    }
}

/// Every tile shape the device has the workgroup memory for, on the awkward cases.
#[test]
fn prefill_attention_every_tile_matches_cpu() {
    let Some(ctx) = gpu() else { return };
    let cases: &[(PrefillCase, &[usize])] = &[
        ((32, 4, 128, 37, 100, None), &[0, 41]),
        ((6, 3, 48, 100, 200, Some(30)), &[17]),
        ((3, 1, 256, 9, 40, Some(7)), &[0, 20]),
        ((1, 1, 36, 70, 80, None), &[5]),
    ];
    let mut ran = vec![];
    for rows in [32, 64, 128] {
        for dims in [16, 32, 64, 128] {
            let t = PrefillAttnTuning {
                rows,
                dims,
                splits: 1,
            };
            for &(case, pos0s) in cases {
                match check_prefill(ctx, case, pos0s, Some(t)) {
                    Err(GpuError::Shape(m)) if m.contains("workgroup memory") => {}
                    r => {
                        r.unwrap();
                        ran.push((rows, dims));
                    }
                }
            }
        }
    }
    // 32 rows with whole 128-dim score steps take 36 KiB at any head_dim up to 256: every
    // device with 40 KiB of workgroup memory (lavapipe, the H200) runs them on every case.
    if ctx.limits().max_compute_workgroup_storage_size >= 40 << 10 {
        let n = ran.iter().filter(|&&t| t == (32, 128)).count();
        assert_eq!(n, cases.len(), "{ran:?}");
    }
}

/// Long tiles' keys shared by several workgroups and merged: every split count on chunks whose
/// tiles split into 2..16 units, with windows that leave some rows nothing in some units, GQA
/// groups 1 and 8, and a tile of 2,049 keys at 16 splits, whose last units round to no keys at
/// all. Without splits (1) as the reference shape of the same tile. Merged in each tile's last
/// unit where the context fuses tails, in a pass of their own otherwise: both.
#[test]
fn prefill_attention_split_keys_match_cpu() {
    with_and_without_fused_tails(prefill_split_cases);
}

fn prefill_split_cases(ctx: &GpuContext) {
    let cases: &[(PrefillCase, &[usize])] = &[
        ((32, 4, 128, 64, 700, None), &[0, 600]),
        ((8, 2, 64, 300, 700, None), &[0, 333]),
        ((8, 1, 64, 200, 800, Some(300)), &[0, 500]),
        ((4, 4, 48, 150, 600, Some(200)), &[250]),
        ((4, 1, 64, 16, 2100, None), &[2033]),
    ];
    let base = PrefillAttnTuning::pick(ctx, 64);
    for splits in [1, 2, 3, 8, 16] {
        let t = PrefillAttnTuning { splits, ..base };
        for &(case, pos0s) in cases {
            check_prefill(ctx, case, pos0s, Some(t)).unwrap();
        }
    }
    // Refused: no units, or more than the kernel takes.
    for splits in [0, 17] {
        let t = PrefillAttnTuning { splits, ..base };
        let err = check_prefill(ctx, cases[0].0, &[0], Some(t)).unwrap_err();
        assert!(matches!(err, GpuError::Shape(_)), "{err}");
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
