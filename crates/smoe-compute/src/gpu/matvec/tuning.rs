//! How a product is launched: the tunable shape (`MatVecTuning`, chosen per shape or given by
//! a benchmark), the q4 decoding strategy, and the kernel's compile-time constants derived from
//! them and the device (`KernelShape`).

use super::fuse::{tail_kind, Fuse, Tail};
use super::{MatVecDesc, NT_MAX};
use crate::gpu::context::{GpuContext, GpuError};
use smoe_vault::quant::DType;

/// Launch shape and decoding choices; `Default` is what `MatVec::new` uses. Exposed so that
/// `gpu::bench` can compare variants in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatVecTuning {
    /// Invocations per workgroup (a multiple of the subgroup size; 64..=256).
    pub wg: u32,
    /// Output rows per workgroup (subgroups share them round-robin).
    pub rows: u32,
    /// How q4 codes are turned into products.
    pub q4: Q4Decode,
    /// Items (rows, gate/up rows, or under a reduce (row, slot) pairs) a subgroup loads at once
    /// before multiplying; 0: chosen from the shape (`batch_loads`).
    pub items: u32,
}

/// q4 decoding strategies (see `kernels/matvec.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Decode {
    /// Nibble → u32 → f32 conversion: simple, but the conversion is quarter-rate on NVIDIA.
    IntToFloat,
    /// Nibble placed in the mantissa of 1.0f (exactly 1 + c/16): shifts and masks only.
    FloatBits,
    /// Inputs quantized to int8 per 64 in workgroup memory, 4 products per `dot4I8Packed`.
    /// Not exact w.r.t. the f32 CPU twin (NMSE ~1e-5): opt-in.
    Int8Dot,
    /// Two nibbles at a time placed under f16's exponent bits (1024 + c each), the offset
    /// taken off both in one packed f16 subtraction, widened to f32: the same values as the
    /// others with fewer operations per weight (the default; `PairsF32` where the device has no
    /// SHADER_F16).
    PairsF16,
    /// `PairsF16` with the subtraction in f32 (for devices without f16 arithmetic).
    PairsF32,
}

impl Default for MatVecTuning {
    fn default() -> Self {
        MatVecTuning {
            wg: 256,
            rows: 16,
            q4: Q4Decode::PairsF16,
            items: 0,
        }
    }
}

impl MatVecTuning {
    /// What `MatVec::new` uses for `rows` output rows in each of `slots` slots: 256 invocations,
    /// and the most rows per workgroup that still leaves ≥ 256 workgroups to spread over the
    /// GPU (at most 16 for grouped products) — the shapes `smoe bench kernels --sweep` finds
    /// fastest: 32 rows for the LM head, 8 for a 2048-row projection, 16 for 8 grouped experts,
    /// 256 invocations at every shape.
    pub fn for_shape(rows: usize, slots: usize, grouped: bool) -> Self {
        Self::for_product(rows, slots, grouped, false)
    }

    /// As `for_shape`, for `out_slots` outputs of `rows` rows; `reduce`: each output sums k
    /// experts' rows, and every workgroup stages all k inputs (k × cols floats), so fewer,
    /// larger workgroups win: 16 rows (≥ 128 workgroups; each halving of the rows is slower).
    pub fn for_product(rows: usize, out_slots: usize, grouped: bool, reduce: bool) -> Self {
        let units = rows * out_slots;
        let (cap, min_groups) = match (grouped, reduce) {
            (_, true) => (16, 128),
            (true, false) => (16, 256),
            (false, false) => (32, 256),
        };
        let rows = [32, 16, 8, 4, 2]
            .into_iter()
            .find(|&r| r <= cap && units / r as usize >= min_groups)
            .unwrap_or(2);
        MatVecTuning {
            rows,
            ..Self::default()
        }
    }
}

/// Loads each lane of the kernel keeps in flight before multiplying (its `LD`).
const LOADS_IN_FLIGHT: usize = 8;

/// The kernel's `U` (items a subgroup loads together) and `S` (chunks per lane and item per
/// round): S rounds of 16-byte chunks cover a tile's row when the subgroup has `subgroup` lanes
/// (at most `LOADS_IN_FLIGHT`; more rounds run otherwise), and U items fill the rest of the
/// loads in flight, no more than a subgroup has (`tune.items` if set). `subgroup` is the
/// adapter's largest subgroup size: with a smaller one the kernel just runs more rounds.
///
/// q4 keeps one item at a time: its decoding is ALU-bound, and more items in flight slow it
/// down, where bf16 and q8 (bound by their loads) gain from them.
fn batch_loads(
    dtype: DType,
    tile: usize,
    tune: MatVecTuning,
    tokens: usize,
    gated: bool,
    reduce: bool,
    subgroup: usize,
) -> (usize, usize) {
    // Inputs per 16-byte chunk of codes.
    let per_chunk = match dtype {
        DType::Bf16 => 8,
        DType::Q8 => 16,
        DType::Q4 => 32,
        _ => 64,
    };
    let steps = (tile / per_chunk)
        .div_ceil(subgroup)
        .clamp(1, LOADS_IN_FLIGHT);
    let items = tune.rows as usize
        * if reduce {
            tokens
        } else if gated {
            2
        } else {
            1
        };
    let subgroups = (tune.wg as usize / subgroup).max(1);
    let auto = match dtype {
        DType::Q4 => 1,
        _ => LOADS_IN_FLIGHT / steps,
    };
    let want = if tune.items > 0 {
        tune.items as usize
    } else {
        auto
    };
    let u = want
        .min(LOADS_IN_FLIGHT / steps)
        .min(items.div_ceil(subgroups))
        .max(1);
    (u, steps)
}

/// Staged inputs per workgroup: 16 KiB, WebGPU's default workgroup memory.
const STAGE_FLOATS: usize = 4096;

fn dtype_code(d: DType, t: MatVecTuning) -> Result<f64, GpuError> {
    Ok(match d {
        DType::Bf16 => 0.0,
        DType::Q8 => 1.0,
        DType::Q4 => match t.q4 {
            Q4Decode::IntToFloat => 2.0,
            Q4Decode::FloatBits => 4.0,
            Q4Decode::Int8Dot => 5.0,
            Q4Decode::PairsF16 | Q4Decode::PairsF32 => 6.0,
        },
        DType::Q2 => 3.0,
        DType::F32 => {
            return Err(GpuError::Shape(
                "matvec: f32 weights are not supported; store bf16".into(),
            ))
        }
    })
}

/// The kernel's compile-time shape for one product: which entry point, how many tokens a
/// workgroup stages and over how wide a tile of columns, and how a subgroup batches its loads.
pub(super) struct KernelShape {
    pub tune: MatVecTuning,
    pub entry: &'static str,
    /// The kernel's `NT`: tokens (or, under a reduce, slots) one workgroup stages.
    pub tokens: usize,
    /// Staged columns per pass (`TILE`), a multiple of 64.
    pub tile: usize,
    /// `U` and `S` (`batch_loads`).
    pub items: usize,
    pub steps: usize,
}

impl KernelShape {
    /// `reduce_k`: the slots a reduce sums into one output (ignored without a reduce).
    pub fn choose(
        ctx: &GpuContext,
        d: &MatVecDesc,
        f: &Fuse,
        tune: MatVecTuning,
        reduce_k: usize,
    ) -> Self {
        let w = d.w;
        let tokens = match f.reduce {
            Some(_) => reduce_k,
            None => d.n_tokens.min(NT_MAX),
        };
        // A reduce stages k inputs at once: use the workgroup memory the device has (32 KiB
        // on lavapipe, 48 KiB on an H200), less 4 KiB for the kernel's other arrays, so that
        // an expert's whole input (e.g. 8 × 768) fits one tile.
        let stage = match f.reduce {
            // (The int8 path keeps a second, quantized copy of the staged inputs.)
            Some(_) if tune.q4 != Q4Decode::Int8Dot => {
                let have = ctx.limits().max_compute_workgroup_storage_size as usize / 4;
                have.saturating_sub(1024)
                    .clamp(STAGE_FLOATS, 2 * STAGE_FLOATS)
            }
            _ => STAGE_FLOATS,
        };
        let tile = (stage / tokens / 64 * 64).min(w.cols.next_multiple_of(64));
        let subgroup = ctx.info().adapter.subgroup_max_size.max(1) as usize;
        let gated = d.up_offset.is_some();
        let reduce = f.reduce.is_some();
        let (items, steps) = batch_loads(w.dtype, tile, tune, tokens, gated, reduce, subgroup);
        let f16 = ctx.info().features.contains(wgpu::Features::SHADER_F16);
        let entry = match tune.q4 {
            Q4Decode::PairsF16 if f16 && w.dtype == DType::Q4 => "matvec_f16",
            _ => "matvec",
        };
        KernelShape {
            tune,
            entry,
            tokens,
            tile,
            items,
            steps,
        }
    }

    /// The pipeline constants of `d` with `f` fused in and `tail` bound.
    pub fn constants(
        &self,
        d: &MatVecDesc,
        f: &Fuse,
        tail: &Tail,
    ) -> Result<[(&'static str, f64); 16], GpuError> {
        let tune = self.tune;
        Ok([
            ("DTYPE", dtype_code(d.w.dtype, tune)?),
            ("NT", self.tokens as f64),
            ("TILE", self.tile as f64),
            ("ROWS", tune.rows as f64),
            ("WG", tune.wg as f64),
            ("GATED", d.up_offset.is_some() as u8 as f64),
            ("GROUPED", d.grouped.is_some() as u8 as f64),
            ("NORM", f.norm.is_some() as u8 as f64),
            ("ACCUM", f.accumulate as u8 as f64),
            ("REDUCE", f.reduce.is_some() as u8 as f64),
            ("NORM_OUT", f.norm_out.is_some() as u8 as f64),
            ("TAIL", tail_kind(f) as f64),
            ("TAIL_E", tail.experts.max(1) as f64),
            ("TAIL_K", if tail.experts > 0 { tail.k } else { 1 } as f64),
            ("U", self.items as f64),
            ("S", self.steps as f64),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::MatVecTuning;

    /// The launch shapes a kernel sweep chose (docs/performance.md), kept on purpose.
    #[test]
    fn launch_shape_per_size() {
        let rows =
            |r, slots, grouped, reduce| MatVecTuning::for_product(r, slots, grouped, reduce).rows;
        assert_eq!(rows(151_936, 1, false, false), 32, "LM head");
        assert_eq!(rows(8192, 1, false, false), 32, "235B q_proj");
        assert_eq!(rows(4096, 1, false, false), 16, "30B q_proj");
        assert_eq!(rows(2048, 1, false, false), 8, "30B o_proj");
        assert_eq!(rows(768, 8, true, false), 16, "30B gate_up, 8 experts");
        assert_eq!(rows(2048, 1, true, true), 16, "30B down, 8 experts summed");
        assert_eq!(
            rows(128, 1, false, false),
            2,
            "a router: as many workgroups as it can"
        );
        assert!(MatVecTuning::for_shape(64, 1, false).wg == 256);
    }
}
