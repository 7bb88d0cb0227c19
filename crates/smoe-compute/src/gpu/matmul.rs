//! Wrapper of `kernels/matmul.wgsl`: token-batched matrix multiply for prefill, dense, gated
//! (silu(G·x)·(U·x)) and grouped by expert (after an `ExpertSort`). Reads each weight tile once
//! per tile of tokens, where `MatVec` reads it once per ≤ 8 tokens (and once per slot for
//! experts). Where the adapter has matrix units (`GpuContext::has_matrix_units`) the product
//! runs on them (`kernels/matmul_coop.wgsl`: f16 inputs, f32 sums); elsewhere, and by choice,
//! on the f32 ALUs (`kernels/matmul.wgsl`).

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError, MatrixUnits};
use super::expert_sort::ExpertSort;
use super::matvec::WeightRef;
use super::ops::recordable;
use super::parts::{split_rows, PartDispatches};
use smoe_vault::quant::DType;

/// Grouped product: the weights are a stack of `sort.n_mats()` matrices `mat_stride` bytes
/// apart (an expert section: `WeightRef::offset` is expert 0's tensor, `mat_stride` the blob
/// stride), and slot `s` is multiplied by the matrix of its expert (as grouped by `sort`). The
/// GEMM's token tile is the sort's (`sort.tile()`): one workgroup per row tile and unit of the
/// sort's work list (one token tile of one expert).
#[derive(Clone, Copy)]
pub struct MatMulGrouped<'a> {
    pub sort: &'a ExpertSort,
    pub mat_stride: u64,
    /// Slots that share one row of `x`: slot `s` reads row `s / x_div`. `k` for the experts'
    /// gate_up, where token `t`'s k slots all read its normed hidden state; 1 for down, where
    /// slot `s` reads its own gate_up output.
    pub x_div: usize,
}

/// One product to record. Dense: `x` is `[n_tokens][cols]` f32 and `y` receives
/// `[n_tokens][rows]` f32. Grouped: `x` is `[ceil(n_slots / x_div)][cols]` and `y` receives
/// `[n_slots][rows]`; `n_tokens` is not used.
#[derive(Clone, Copy)]
pub struct MatMulDesc<'a> {
    pub w: WeightRef<'a>,
    /// Gated: byte offset from `w` to an up matrix of the same shape; `y = silu(W·x) · (U·x)`.
    pub up_offset: Option<u64>,
    pub x: BufRef<'a>,
    pub y: BufRef<'a>,
    pub n_tokens: usize,
    pub grouped: Option<MatMulGrouped<'a>>,
    /// Dense: `y` is three regions, `[n_tokens][a]`, `[n_tokens][b - a]` and `[n_tokens][rows
    /// - b]` one after the other, receiving output rows `..a`, `a..b` and `b..` (q, k and v
    /// from their stacked weights in one GEMM). `None`: `y` is `[n_tokens][rows]`.
    pub y_split: Option<[usize; 2]>,
}

/// Workgroup tile of the GEMM. f32 kernel: each invocation computes 8 rows × 4 tokens, so a
/// workgroup has `bm / 8 · bn / 4` invocations; workgroup memory is `4 · bk · (bm + bn)` bytes
/// plus 8 per token and 16. Matrix units (`coop`): 256 invocations (dense bf16: 128), `bm` 128,
/// `bk` 32 or 64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMulTuning {
    /// On the matrix units (f16 inputs, f32 sums) instead of the f32 ALUs.
    pub coop: bool,
    /// Weight rows per tile: 64 or 128 (gated: half gate rows, half the matching up rows).
    pub bm: u32,
    /// Tokens (grouped: slots of one expert) per tile: a multiple of 16, at most 128.
    pub bn: u32,
    /// Columns per K-step: 16 or 32.
    pub bk: u32,
}

impl MatMulTuning {
    /// What `MatMul::new` uses for `d`: 128-row tiles and a token tile that fits the tokens: up
    /// to 64 dense; grouped, the sort's tile (which must match), normally `grouped_bn`. On the
    /// matrix units where the device has them (64-column steps), else on the f32 ALUs with
    /// 16-column steps: at most 256 invocations and 12.5 KiB of workgroup memory, within
    /// WebGPU's default limits, so valid on every device.
    pub fn default_for(ctx: &GpuContext, d: &MatMulDesc) -> Self {
        let bn = match d.grouped {
            Some(g) => g.sort.tile() as u32,
            None => Self::dense_bn(d.w.rows, d.n_tokens),
        };
        let f32_tile = MatMulTuning {
            coop: false,
            bm: 128,
            bn,
            bk: 16,
        };
        let limit = ctx.limits().max_compute_workgroup_storage_size as u64;
        match ctx.has_matrix_units() {
            true => Self::coop_fitting(bn, limit).unwrap_or(f32_tile),
            false => f32_tile,
        }
    }

    /// The matrix-unit tile for `bn` tokens within `limit` bytes of workgroup memory: 64-position
    /// steps (H200, 30B q4 pp512: 3,368 → 3,664 tok/s over 32 — half the barriers and exposed
    /// load latencies per product), else 32 (a 32 KiB device), else none.
    fn coop_fitting(bn: u32, limit: u64) -> Option<Self> {
        if bn > 64 {
            return None;
        }
        [64, 32]
            .map(|bk| MatMulTuning {
                bk,
                ..Self::coop(bn)
            })
            .into_iter()
            .find(|t| t.workgroup_bytes() <= limit)
    }

    /// The f32 kernel's tile with the same token tile (16-column steps).
    pub fn on_alus(self) -> Self {
        MatMulTuning {
            coop: false,
            bk: 16,
            ..self
        }
    }

    /// The matrix-unit tile with `bn` tokens (64-position steps).
    pub fn coop(bn: u32) -> Self {
        MatMulTuning {
            coop: true,
            bm: 128,
            bn,
            bk: 64,
        }
    }

    /// The default token tile of a grouped product of `n_slots` slots over `n_mats` experts,
    /// to build its `ExpertSort` with: 1.5× the mean slots per expert, so that most experts
    /// fill one tile most of the way (H200, 512 tokens × top-8 of 128 experts: 48 beat 32 and
    /// 64 by 10–20 %).
    pub fn grouped_bn(n_slots: usize, n_mats: usize) -> usize {
        Self::fit_bn(1.5 * n_slots as f64 / n_mats.max(1) as f64) as usize
    }

    /// A dense product's token tile: `fit_bn`, halved (down to 16) while the product would
    /// have fewer than `MIN_TILES` tiles — matrices of few rows (the k and v projections, a
    /// router) otherwise leave most of a big GPU idle: 512 tokens of a 128-expert router made 8
    /// workgroups.
    pub fn dense_bn(rows: usize, n_tokens: usize) -> u32 {
        const MIN_TILES: usize = 128;
        let mut bn = Self::fit_bn(n_tokens as f64);
        while bn > 16 && rows.div_ceil(128) * n_tokens.div_ceil(bn as usize) < MIN_TILES {
            bn = (bn / 2).next_multiple_of(16);
        }
        bn
    }

    /// The multiple of 16 in 16..=64 that fits `want` tokens (128 × 128 dense gained 5 % on
    /// q_proj but leaves SMs idle on smaller matrices).
    fn fit_bn(want: f64) -> u32 {
        (want.ceil() as u32).next_multiple_of(16).clamp(16, 64)
    }

    /// Workgroup memory the kernel declares with this tile.
    pub fn workgroup_bytes(&self) -> u64 {
        let (bm, bn, bk) = (self.bm as u64, self.bn as u64, self.bk as u64);
        match self.coop {
            // f16 tiles (w, x high, x low) with 8 columns of padding, 4 subgroups × 2 parked
            // 16 × 16 f32 blocks.
            true => 2 * (bk + 8) * (bm + 2 * bn) + 4 * 2048 + 8 * bn + 16,
            // f32 tiles, tok and xrow, and the 16-byte-aligned vec3 `unit`.
            false => 4 * bk * (bm + bn) + 8 * bn + 16,
        }
    }

    /// Invocations per workgroup (on the matrix units: the most the kernel uses, 256; dense
    /// bf16 tiles use 128).
    fn invocations(&self) -> u32 {
        match self.coop {
            true => 256,
            false => self.bm / 8 * (self.bn / 4),
        }
    }

    fn check(&self, ctx: &GpuContext, dtype: DType) -> Result<(), String> {
        let l = ctx.limits();
        if self.coop {
            if let MatrixUnits::Unused(why) = ctx.matrix_units() {
                return Err(format!(
                    "tile {self:?}: the matrix units are not available ({why})"
                ));
            }
            if self.bm != 128
                || !matches!(self.bk, 32 | 64)
                || !self.bn.is_multiple_of(16)
                || !(16..=64).contains(&self.bn)
            {
                return Err(format!(
                    "tile {self:?}: on the matrix units bm 128, bk 32 or 64, bn 16..=64 by 16"
                ));
            }
            if self.workgroup_bytes() > l.max_compute_workgroup_storage_size as u64 {
                return Err(format!(
                    "tile {self:?}: {} bytes of workgroup memory, the device has {}",
                    self.workgroup_bytes(),
                    l.max_compute_workgroup_storage_size
                ));
            }
            return Ok(());
        }
        // A group of 32 invocations covers 8 × 4 (row, token) blocks: bm / 8 and bn / 4 are
        // multiples of 8 and 4.
        if !matches!(self.bm, 64 | 128)
            || !self.bn.is_multiple_of(16)
            || !(16..=128).contains(&self.bn)
            || !matches!(self.bk, 16 | 32)
        {
            return Err(format!(
                "tile {self:?}: bm 64 or 128, bn 16..=128 by 16, bk 16 or 32"
            ));
        }
        let wg = self.invocations();
        if wg > l.max_compute_invocations_per_workgroup || wg > l.max_compute_workgroup_size_x {
            return Err(format!(
                "tile {self:?}: {wg} invocations exceed the device's limit"
            ));
        }
        if self.workgroup_bytes() > l.max_compute_workgroup_storage_size as u64 {
            return Err(format!(
                "tile {self:?}: {} bytes of workgroup memory, the device has {}",
                self.workgroup_bytes(),
                l.max_compute_workgroup_storage_size
            ));
        }
        // Staging pieces per invocation, held in registers (MAXP in the kernel).
        let pv = if dtype == DType::Bf16 { 8 } else { 16 };
        let (w_pieces, x_pieces) = (self.bm * self.bk / pv, self.bn * self.bk / 4);
        if w_pieces.div_ceil(wg) > 4 || x_pieces.div_ceil(wg) > 4 {
            return Err(format!(
                "tile {self:?}: more than 4 staging loads per invocation"
            ));
        }
        Ok(())
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_stride: u32,
    w_off: u32,
    w_mat_stride: u32,
    w_up_off: u32,
    param_word: u32,
    x_off: u32,
    x_tok: u32,
    x_div: u32,
    y_off: u32,
    y_tok: u32,
    split1: u32,
    split2: u32,
    _pad: u32,
}

fn dtype_code(d: DType) -> Result<f64, GpuError> {
    Ok(match d {
        DType::Bf16 => 0.0,
        DType::Q8 => 1.0,
        DType::Q4 => 2.0,
        DType::Q2 => 3.0,
        DType::F32 => {
            return Err(GpuError::Shape(
                "matmul: f32 weights are not supported; store bf16".into(),
            ))
        }
    })
}

/// A recorded-at-load GEMM: one dispatch per part (a dense matrix larger than a storage binding
/// is split by rows into parts). A grouped one is recorded after its `ExpertSort`.
pub struct MatMul {
    dispatches: PartDispatches,
    tuning: MatMulTuning,
}

impl MatMul {
    /// The product with `MatMulTuning::default_for`'s tile. If the matrix-unit kernel fails to
    /// build on this device (its SPIR-V goes to the driver unchecked by wgpu), the matrix units
    /// are turned off for the context (`GpuContext::matrix_units` says why) and the f32 kernel
    /// is used, now and for every later product.
    pub fn new(ctx: &GpuContext, d: &MatMulDesc) -> Result<Self, GpuError> {
        let tune = MatMulTuning::default_for(ctx, d);
        match Self::with_tuning(ctx, d, tune) {
            Err(GpuError::Kernel { msg, .. }) if tune.coop => {
                ctx.disable_matrix_units(format!("the kernel failed to build: {msg}"));
                Self::with_tuning(ctx, d, MatMulTuning::default_for(ctx, d))
            }
            r => r,
        }
    }

    /// The tile this product runs with.
    pub fn tuning(&self) -> MatMulTuning {
        self.tuning
    }

    pub fn with_tuning(
        ctx: &GpuContext,
        d: &MatMulDesc,
        tune: MatMulTuning,
    ) -> Result<Self, GpuError> {
        let w = d.w;
        let err =
            |m: String| GpuError::Shape(format!("matmul {}x{} {}: {m}", w.rows, w.cols, w.dtype));
        w.dtype.check_cols(w.cols).map_err(err)?;
        tune.check(ctx, w.dtype).map_err(err)?;
        if !w.cols.is_multiple_of(8) || !w.offset.is_multiple_of(16) || w.rows == 0 {
            return Err(err(
                "cols must be a multiple of 8, offset of 16, rows > 0".into()
            ));
        }
        if d.up_offset.is_some_and(|u| u % 16 != 0) {
            return Err(err("up offset must be a multiple of 16".into()));
        }
        if d.grouped.is_none() && d.n_tokens == 0 {
            return Err(err("tokens must be > 0".into()));
        }
        let (n_slots, n_mats, mat_stride, x_div) = match d.grouped {
            Some(g) => (g.sort.n_slots(), g.sort.n_mats(), g.mat_stride, g.x_div),
            None => (d.n_tokens, 1, 0, 1),
        };
        if let Some(g) = d.grouped {
            if g.sort.tile() != tune.bn as usize {
                return Err(err(format!(
                    "tile {tune:?}: bn differs from the expert sort's tile of {} slots \
                     (build the sort with the GEMM's bn)",
                    g.sort.tile()
                )));
            }
        }
        let [split1, split2] = match d.y_split {
            None => [u32::MAX; 2],
            Some([a, b]) if d.grouped.is_none() && a <= b && b <= w.rows => [a as u32, b as u32],
            Some(s) => {
                return Err(err(format!(
                    "output regions {s:?}: dense only, with 0 <= a <= b <= rows"
                )))
            }
        };
        if mat_stride % 16 != 0 || x_div == 0 {
            return Err(err(
                "group stride must be a multiple of 16 and x_div > 0".into()
            ));
        }
        let gated = d.up_offset.is_some();
        let (flag, grouped) = (gated as u8 as f64, d.grouped.is_some() as u8 as f64);
        let pipeline = match tune.coop {
            true => {
                let consts = [
                    ("DTYPE", dtype_code(w.dtype)?),
                    ("BN", tune.bn as f64),
                    ("BK", tune.bk as f64),
                    ("GATED", flag),
                    ("GROUPED", grouped),
                ];
                ctx.pipeline_spirv("matmul_coop", &consts)?
            }
            false => ctx.pipeline(
                "matmul",
                &[
                    ("DTYPE", dtype_code(w.dtype)?),
                    ("BM", tune.bm as f64),
                    ("BN", tune.bn as f64),
                    ("BK", tune.bk as f64),
                    ("GATED", flag),
                    ("GROUPED", grouped),
                ],
            )?,
        };
        let stride = w.dtype.row_stride(w.cols) as u64;
        let (xb, x_off) =
            d.x.bind(ctx, "matmul x", n_slots.div_ceil(x_div) * w.cols, 16)?;
        let (yb, y_off) = d.y.bind(ctx, "matmul y", n_slots * w.rows, 4)?;
        let unused;
        let (sb, pb, ub) = match d.grouped {
            Some(g) => (
                Binding::whole(g.sort.starts()),
                Binding::whole(g.sort.perm()),
                Binding::whole(g.sort.units()),
            ),
            None => {
                unused = ctx.storage_buffer("matmul starts/perm/units (unused)", 16);
                let u = Binding::whole(&unused);
                (u, u, u)
            }
        };
        let extra = (n_mats as u64 - 1) * mat_stride + d.up_offset.unwrap_or(0);
        let split = split_rows(ctx, &w, extra, d.grouped.is_none(), "matmul weights", err)?;
        if d.y_split.is_some() && split.len() > 1 {
            return Err(err(
                "output regions of a matrix larger than a storage binding".into(),
            ));
        }
        let out_rows = if gated { tune.bm / 2 } else { tune.bm } as u64;
        let max_wg = ctx.limits().max_compute_workgroups_per_dimension as u64;
        let mut parts = vec![];
        for part in split {
            let params = Params {
                rows: part.rows as u32,
                cols: w.cols as u32,
                n_tok: n_slots as u32,
                row_stride: (stride / 16) as u32,
                w_off: part.w_off,
                w_mat_stride: (mat_stride / 16) as u32,
                w_up_off: (d.up_offset.unwrap_or(0) / 16) as u32,
                param_word: (w.dtype.code_bytes(w.cols) / 4) as u32,
                x_off,
                x_tok: (w.cols / 4) as u32,
                x_div: x_div as u32,
                y_off: y_off + part.r0 as u32,
                // The first region's rows (all of them without regions).
                y_tok: d.y_split.map_or(w.rows, |[a, _]| a) as u32,
                split1,
                split2,
                _pad: 0,
            };
            let pbuf = ctx.uniform("matmul params", &params);
            let bind = ctx.bind_group(
                "matmul",
                &pipeline,
                &[
                    Binding::whole(&pbuf).entry(0),
                    part.binding(&w).entry(1),
                    xb.entry(2),
                    yb.entry(3),
                    sb.entry(4),
                    pb.entry(5),
                    ub.entry(6),
                ],
            )?;
            // One workgroup per (row tile, token tile). Grouped: per (row tile, unit of the
            // sort's work list), as many as any routing can need; those past the count that
            // the sort wrote return at once.
            let groups = [
                part.rows.div_ceil(out_rows),
                match d.grouped {
                    Some(g) => g.sort.max_units() as u64,
                    None => n_slots.div_ceil(tune.bn as usize) as u64,
                },
                1,
            ];
            if groups.iter().any(|g| *g > max_wg) {
                return Err(err(format!(
                    "dispatch {groups:?} exceeds {max_wg} workgroups per dimension"
                )));
            }
            parts.push((bind, groups.map(|g| g as u32)));
        }
        Ok(MatMul {
            dispatches: PartDispatches { pipeline, parts },
            tuning: tune,
        })
    }
}

recordable!(MatMul, "matmul", dispatches);

#[cfg(test)]
mod dense_tile_tests {
    use super::MatMulTuning;

    #[test]
    fn few_rows_take_smaller_token_tiles() {
        // 30B shapes at 512 tokens: q_proj keeps 64; k/v (512 rows) and the router (128) shrink.
        assert_eq!(MatMulTuning::dense_bn(4096, 512), 64);
        assert_eq!(MatMulTuning::dense_bn(512, 512), 16);
        assert_eq!(MatMulTuning::dense_bn(128, 512), 16);
        assert_eq!(MatMulTuning::dense_bn(2048, 512), 64);
        // Few tokens: the smallest tile that fits them.
        assert_eq!(MatMulTuning::dense_bn(4096, 8), 16);
    }
}

#[cfg(test)]
mod tests {
    use super::MatMulTuning;

    #[test]
    fn the_coop_tile_fits_the_workgroup_memory() {
        // 48 KiB (NVIDIA): 64-position steps at every token width.
        for bn in [16, 32, 48, 64] {
            assert_eq!(MatMulTuning::coop_fitting(bn, 48 << 10).unwrap().bk, 64);
        }
        // 32 KiB: 32-position steps where 64 do not fit.
        assert_eq!(MatMulTuning::coop_fitting(64, 32 << 10).unwrap().bk, 32);
        assert_eq!(MatMulTuning::coop_fitting(16, 32 << 10).unwrap().bk, 64);
        // 16 KiB, or wider than the kernel's 64 tokens: the f32 kernel.
        assert!(MatMulTuning::coop_fitting(16, 16 << 10).is_none());
        assert!(MatMulTuning::coop_fitting(128, 48 << 10).is_none());
    }

    /// Bytes of workgroup memory `kernel` declares with `constants` (naga's layout of each
    /// workgroup variable, summed).
    fn declared_workgroup_bytes(kernel: &str, constants: &[(&str, f64)]) -> u64 {
        let src = crate::gpu::kernel_source(kernel).unwrap();
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap();
        let mut consts = naga::back::PipelineConstants::default();
        consts.extend(constants.iter().map(|(k, v)| (k.to_string(), *v)));
        let (module, _) =
            naga::back::pipeline_constants::process_overrides(&module, &info, None, &consts)
                .unwrap();
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).unwrap();
        module
            .global_variables
            .iter()
            .filter(|(_, v)| v.space == naga::AddressSpace::WorkGroup)
            .map(|(_, v)| layouter[v.ty].size as u64)
            .sum()
    }

    /// The wrapper refuses tiles by `workgroup_bytes`, so it must count what the kernels
    /// declare: the tensor-core kernel goes to the driver as passthrough SPIR-V, which wgpu
    /// does not check, and a tile over the device's limit is not refused there (on the H200 a
    /// variant declaring 1.7 KiB more than the wrapper counted hung the device's run).
    #[test]
    fn workgroup_bytes_counts_what_the_kernels_declare() {
        for bn in [16u32, 32, 48, 64] {
            for (bk, dtype) in [(32u32, 0.0), (64, 2.0), (64, 0.0)] {
                let t = MatMulTuning {
                    bk,
                    ..MatMulTuning::coop(bn)
                };
                let consts = [("DTYPE", dtype), ("BN", bn as f64), ("BK", bk as f64)];
                assert_eq!(
                    declared_workgroup_bytes("matmul_coop", &consts),
                    t.workgroup_bytes(),
                    "{t:?}"
                );
            }
            for (bm, bk) in [(64u32, 16u32), (128, 16), (128, 32)] {
                let t = MatMulTuning {
                    coop: false,
                    bm,
                    bn,
                    bk,
                };
                let consts = [("BM", bm as f64), ("BN", bn as f64), ("BK", bk as f64)];
                assert!(
                    declared_workgroup_bytes("matmul", &consts) <= t.workgroup_bytes(),
                    "{t:?}"
                );
            }
        }
    }
}
