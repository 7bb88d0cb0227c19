//! Prefill measurements for `gpu::bench`: a chunk of tokens through one projection (dense) or
//! through a layer's experts (grouped, ids from a pseudo-random top-k router, or a Zipf-skewed
//! one for shapes named `… zipf`), by the GEMM and, as the baseline, by the decode matvec the
//! prefill used before (≤ 8 tokens per workgroup, one slot at a time for experts).

use super::timer::Timer;
use super::{fill_weights, BenchShape};
use crate::gpu::buffers::BufRef;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::expert_sort::ExpertSort;
use crate::gpu::matmul::{MatMul, MatMulDesc, MatMulGrouped, MatMulTuning};
use crate::gpu::matvec::{Grouped, MatVec, MatVecDesc, MatVecTuning, WeightRef};
use smoe_vault::quant::DType;

/// What to run on a prefill shape.
#[derive(Clone, Copy, Debug)]
pub(super) enum Kernel {
    MatVec(MatVecTuning),
    /// `None`: the tile `MatMul::new` picks.
    MatMul(Option<MatMulTuning>),
    /// The f32 kernel's default tile, even where `MatMul::new` would use the matrix units.
    MatMulAlu,
    Sort,
}

/// Token `t`'s `k` distinct experts of `n`, from a fixed xorshift stream: routing with no
/// favourites (≈ tokens·k/n slots per expert).
pub fn pseudo_random_ids(tokens: usize, k: usize, n: usize) -> Vec<u32> {
    distinct_draws(tokens, k, n, 0x9E37_79B9_7F4A_7C15, |s| {
        (s % n as u64) as u32
    })
}

/// Token `t`'s `k` distinct experts of `n`, drawn (from a fixed xorshift stream) with weight
/// `1 / (e + 1)` for expert `e`: skewed routing as real routers produce, a few experts taking
/// hundreds of a chunk's slots (512 tokens × top-8 of 128: 429 slots for expert 0, 7 for
/// expert 127), which the balanced grouped GEMM must not serialise.
pub fn zipf_ids(tokens: usize, k: usize, n: usize) -> Vec<u32> {
    // cum[e]: the weights of experts 0..=e.
    let cum: Vec<f64> = (0..n)
        .scan(0.0, |c, e| {
            *c += 1.0 / (e + 1) as f64;
            Some(*c)
        })
        .collect();
    let total = cum[n - 1];
    distinct_draws(tokens, k, n, 0x2545_F491_4F6C_DD1D, |s| {
        let u = (s >> 11) as f64 / (1u64 << 53) as f64 * total;
        cum.partition_point(|&c| c <= u).min(n - 1) as u32
    })
}

/// For each of `tokens` tokens, `min(k, n)` distinct experts: `pick` maps each state of an
/// xorshift stream starting at `seed` to an expert, repeats within a token are skipped.
fn distinct_draws(
    tokens: usize,
    k: usize,
    n: usize,
    seed: u64,
    pick: impl Fn(u64) -> u32,
) -> Vec<u32> {
    let mut s = seed;
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let first = ids.len();
        while ids.len() < first + k.min(n) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let e = pick(s);
            if !ids[first..].contains(&e) {
                ids.push(e);
            }
        }
    }
    ids
}

/// The router ids of a grouped prefill shape: Zipf-skewed when its name ends in "zipf".
fn routing_ids(shape: &BenchShape, tokens: usize, k: usize, n: usize) -> Vec<u32> {
    match shape.name.ends_with("zipf") {
        true => zipf_ids(tokens, k, n),
        false => pseudo_random_ids(tokens, k, n),
    }
}

/// Host copy of one shape's weights (all experts for a grouped shape), made once per dtype.
pub(super) fn host_weights(shape: &BenchShape, dtype: DType) -> Vec<u8> {
    let mats = if shape.experts > 0 { shape.stack } else { 1 };
    let halves = 1 + shape.gated as usize;
    fill_weights(
        dtype,
        shape.rows * halves * mats,
        shape.cols,
        0x5eed + shape.rows as u64,
    )
}

/// One copy's kernel, whichever type it is, as the timed pass records it.
type Record = Box<dyn Fn(&mut wgpu::ComputePass<'_>)>;

/// (weight bytes per call, seconds per call, the GEMM's tile) of `kernel` on a prefill shape.
pub(super) fn bench_prefill(
    ctx: &GpuContext,
    timer: &Timer,
    shape: &BenchShape,
    dtype: DType,
    kernel: Kernel,
    host: &[u8],
    iters: usize,
) -> Result<(u64, f64, Option<MatMulTuning>), GpuError> {
    let (rows, cols, tokens) = (shape.rows, shape.cols, shape.tokens);
    let grouped = shape.experts > 0;
    let k = shape.experts.max(1);
    let stride = dtype.row_stride(cols) as u64;
    let mat_bytes = rows as u64 * stride * (1 + shape.gated as u64);
    let n_mats = if grouped { shape.stack } else { 1 };
    let n_slots = if grouped { tokens * k } else { tokens };
    // gate_up: a token's k slots read its row of x; down: each slot its own.
    let x_div = if shape.gated { k } else { 1 };
    let x_rows = if grouped { n_slots / x_div } else { tokens };
    let x = ctx.upload_f32("bench x", &vec![0.01f32; x_rows * cols]);
    let y = ctx.storage_buffer("bench y", 4 * (n_slots * rows) as u64);
    let ids = ctx.upload(
        "bench ids",
        bytemuck::cast_slice(&routing_ids(shape, tokens, k, n_mats)),
    );
    // The sort's work list is cut into the GEMM's token tiles.
    let tile = match kernel {
        Kernel::MatMul(Some(t)) => t.bn as usize,
        _ => MatMulTuning::grouped_bn(n_slots, n_mats),
    };
    let sort = ExpertSort::new(ctx, BufRef::new(&ids), n_slots, n_mats, tile)?;
    if let Kernel::Sort = kernel {
        let secs = timer.time(&|pass| (0..iters).for_each(|_| sort.record(pass)))?;
        return Ok((0, secs / iters as f64, None));
    }
    let mut enc = ctx.encoder();
    sort.encode(&mut enc);
    ctx.submit_wait(enc);
    // Compute-bound: one copy of the weights suffices once it is larger than the L2 cache.
    let buf_bytes = host.len() as u64;
    let copies = super::ROTATE_BYTES.div_ceil(buf_bytes).clamp(1, 16) as usize;
    let mut keep = vec![];
    for _ in 0..copies {
        keep.push(ctx.upload("bench weights", host));
    }
    let mut recs: Vec<Record> = vec![];
    let mut tile = None;
    for wbuf in &keep {
        let w = WeightRef {
            buffer: wbuf,
            offset: 0,
            dtype,
            rows,
            cols,
        };
        let up_offset = shape.gated.then_some(rows as u64 * stride);
        match kernel {
            Kernel::MatVec(t) => {
                let d = MatVecDesc {
                    w,
                    up_offset,
                    x: BufRef::new(&x),
                    y: BufRef::new(&y),
                    n_tokens: if grouped { 1 } else { tokens },
                    grouped: grouped.then_some(Grouped {
                        ids: &ids,
                        ids_offset: 0,
                        n_slots,
                        n_mats,
                        mat_stride: mat_bytes,
                        x_per_slot: true,
                        slots_per_x: x_div,
                    }),
                };
                let mv = MatVec::with_tuning(ctx, &d, t)?;
                recs.push(Box::new(move |p| mv.record(p)));
            }
            Kernel::MatMul(_) | Kernel::MatMulAlu => {
                let d = MatMulDesc {
                    w,
                    up_offset,
                    x: BufRef::new(&x),
                    y: BufRef::new(&y),
                    n_tokens: tokens,
                    grouped: grouped.then_some(MatMulGrouped {
                        sort: &sort,
                        mat_stride: mat_bytes,
                        x_div,
                    }),
                    y_split: None,
                };
                let mm = match kernel {
                    Kernel::MatMul(Some(t)) => MatMul::with_tuning(ctx, &d, t)?,
                    Kernel::MatMulAlu => {
                        let t = MatMulTuning::default_for(ctx, &d).on_alus();
                        MatMul::with_tuning(ctx, &d, t)?
                    }
                    _ => MatMul::new(ctx, &d)?,
                };
                tile = Some(mm.tuning());
                recs.push(Box::new(move |p| mm.record(p)));
            }
            Kernel::Sort => unreachable!(),
        }
    }
    let secs = timer.time(&|pass| (0..iters).for_each(|i| recs[i % copies](pass)))?;
    Ok((buf_bytes, secs / iters as f64, tile))
}

#[cfg(test)]
mod tests {
    use super::{pseudo_random_ids, zipf_ids};

    #[test]
    fn routings_pick_distinct_experts_with_the_documented_skew() {
        for ids in [pseudo_random_ids(512, 8, 128), zipf_ids(512, 8, 128)] {
            assert_eq!(ids.len(), 512 * 8);
            for t in ids.chunks(8) {
                let mut d = t.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), 8, "{t:?}");
            }
        }
        let zipf = zipf_ids(512, 8, 128);
        let count = |e: u32| zipf.iter().filter(|&&x| x == e).count();
        // The numbers quoted where zipf_ids is documented and in docs/performance.md.
        assert_eq!((count(0), count(127)), (429, 7));
        let uniform = pseudo_random_ids(512, 8, 128);
        let most = (0..128u32)
            .map(|e| uniform.iter().filter(|&&x| x == e).count())
            .max();
        assert!(most.unwrap() < 64, "no favourites: {most:?}");
    }
}
