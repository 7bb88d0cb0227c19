//! Kernel benchmarks: GB/s of each matvec dtype at real model shapes, beside the GB/s of a plain
//! copy kernel measured in the same run on the same device (DESIGN.md "Performance method").
//! Weights are rotated over enough copies (≥ 512 MiB in all) that they do not sit in cache.
//! Times come from GPU timestamps around one compute pass of many dispatches when the device
//! has TIMESTAMP_QUERY, else from the wall clock around the submission.
//!
//! Prefill shapes (`tokens > 0`) are compute-bound, so their rows report GFLOP/s
//! (2·rows·cols·tokens, ×2 gated) of the GEMM beside the decode matvec's, in a section of
//! their own. So do prefill attention shapes (`BenchShape::prefill_attention`): the decode
//! attention kernel beside the prefill one in each of its tiles.
//!
//! Modules: `shape` (what to measure), `sweep` (the entry points that measure it), `copy` (the
//! reference bandwidth and the dispatch floor), `matvec`, `prefill` and `attention` (one kind
//! of row each), `report` (the rows and their table), `timer`.

mod attention;
mod copy;
mod matvec;
mod prefill;
mod report;
mod shape;
mod sweep;
mod timer;

use smoe_vault::quant::DType;

pub use copy::{copy_gbps, dispatch_floor, DispatchFloor};
pub use prefill::pseudo_random_ids;
pub use report::{device_label, BenchReport, BenchRow};
pub use shape::{qwen3_prefill_shapes, qwen3_shapes, AttnBench, BenchShape, DecodeFusion};
pub use sweep::{bench_gemm_tunings, bench_kernels};

/// Timed repetitions: at least `iters` calls, and the weights rotated over at least this many
/// bytes.
const ROTATE_BYTES: u64 = 512 << 20;

/// Deterministic filler bytes that decode to finite weights: random codes, and for quantized
/// types a fixed small scale in every group's parameters.
fn fill_weights(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let stride = dtype.row_stride(cols);
    let mut out = vec![0u8; rows * stride];
    let mut s = seed | 1;
    for chunk in out.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let b = s.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    let code = dtype.code_bytes(cols);
    for row in out.chunks_mut(stride) {
        match dtype {
            // bf16: keep the exponent small (|v| < 4) so values stay finite.
            DType::Bf16 => row[..code]
                .chunks_mut(2)
                .for_each(|v| v[1] = (v[1] & 0x80) | 0x3f),
            _ => row[code..]
                .chunks_mut(2)
                .for_each(|v| v.copy_from_slice(&0x2c00u16.to_le_bytes())),
        }
    }
    out
}
