//! RMSNorm, the weighted sum of experts, the element-wise ops, the embedding gather, argmax and
//! the router against their CPU twins (`cpu::ops`, `quant::dequantize_row`, the sampler's
//! argmax rule).

use super::{
    guarded, poisoned, read_guarded, read_u32_guarded, submit, upload_at, upload_u32_at, AT,
};
use crate::conformance::{Case, Check, Op, Rng, Unsupported};
use smoe_compute::cpu::ops;
use smoe_compute::gpu::{
    Argmax, BufRef, EltOp, EmbedGather, GpuContext, RmsNorm, Router, WeightRef, WeightedSum,
};
use smoe_vault::quant::{dequantize_row, quantize_matrix, DType};

/// `rows` rows of `n` values normed with one weight.
#[derive(Clone, Debug)]
pub struct Norm {
    pub n: usize,
    pub rows: usize,
}

impl Case for Norm {
    fn op(&self) -> Op {
        Op::RmsNorm
    }
    fn shape(&self) -> String {
        format!("{} x{}", self.n, self.rows)
    }
    fn types(&self) -> String {
        "f32".into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (n, rows) = (self.n, self.rows);
        let (x, w) = (rng.vec(n * rows, 3.0), rng.vec(n, 1.0));
        let mut want = vec![0f32; n * rows];
        ops::rms_norm(&x, &w, 1e-6, &mut want);
        let (xb, wb, yb) = (
            guarded(ctx, "x", &x),
            ctx.upload_f32("w", &w),
            poisoned(ctx, "y", n * rows),
        );
        let (x, y) = (BufRef::at(&xb, AT), BufRef::at(&yb, AT));
        let k = RmsNorm::new(ctx, x, BufRef::new(&wb), y, n, rows, 1e-6).unwrap();
        submit(ctx, |enc| k.encode(enc));
        let (got, guards) = read_guarded(ctx, &yb, n * rows);
        Ok(vec![
            Check::values("y", got, want),
            Check::holds("nothing written around y", guards),
        ])
    }
}

/// `acc[t] += Σ_j w[t·k + j] · y[t·k + j]` (`cpu::ops::axpy` per slot): each token's `k`
/// experts' outputs of `n` values into the residual.
#[derive(Clone, Debug)]
pub struct WeightedSumCase {
    pub n: usize,
    pub k: usize,
    pub tokens: usize,
}

impl Case for WeightedSumCase {
    fn op(&self) -> Op {
        Op::WeightedSum
    }
    fn shape(&self) -> String {
        format!("{} k{} t{}", self.n, self.k, self.tokens)
    }
    fn types(&self) -> String {
        "f32".into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (n, k, nt) = (self.n, self.k, self.tokens);
        let (acc0, y, w) = (
            rng.vec(n * nt, 1.0),
            rng.vec(n * k * nt, 1.0),
            rng.vec(k * nt, 1.0),
        );
        let mut want = acc0.clone();
        for (slot, ys) in y.chunks_exact(n).enumerate() {
            ops::axpy(&mut want[slot / k * n..][..n], w[slot], ys);
        }
        let (ab, yb, wb) = (
            guarded(ctx, "acc", &acc0),
            guarded(ctx, "y", &y),
            guarded(ctx, "w", &w),
        );
        let [acc, ys, ws] = [&ab, &yb, &wb].map(|b| BufRef::at(b, AT));
        let kern = WeightedSum::new(ctx, acc, ys, ws, n, k, nt).unwrap();
        submit(ctx, |enc| kern.encode(enc));
        let (got, guards) = read_guarded(ctx, &ab, n * nt);
        Ok(vec![
            Check::values("acc", got, want),
            Check::holds("nothing written around acc", guards),
        ])
    }
}

/// An element-wise op in place.
#[derive(Clone, Copy, Debug)]
pub enum Elt {
    /// A bias of one row's length added to every row.
    AddRows,
    Clamp(f32),
    Sigmoid,
}

/// `op` on `rows` rows of `len` values at an offset inside the buffer (as the engine's q/k/v
/// regions are).
#[derive(Clone, Debug)]
pub struct EltwiseCase {
    pub op: Elt,
    pub rows: usize,
    pub len: usize,
}

impl Case for EltwiseCase {
    fn op(&self) -> Op {
        Op::Eltwise
    }
    fn shape(&self) -> String {
        format!("{}x{}", self.rows, self.len)
    }
    fn types(&self) -> String {
        format!("f32 {:?}", self.op)
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (len, n) = (self.len, self.rows * self.len);
        let (y0, bias) = (rng.vec(n, 8.0), rng.vec(len, 1.0));
        let want: Vec<f32> = (y0.iter().enumerate())
            .map(|(i, &v)| match self.op {
                Elt::AddRows => v + bias[i % len],
                Elt::Clamp(c) => v.clamp(-c, c),
                Elt::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            })
            .collect();
        let bb = ctx.upload_f32("bias", &bias);
        let op = match self.op {
            Elt::AddRows => EltOp::AddRows {
                bias: BufRef::new(&bb),
                len,
            },
            Elt::Clamp(c) => EltOp::Clamp(c),
            Elt::Sigmoid => EltOp::Sigmoid,
        };
        let yb = guarded(ctx, "y", &y0);
        let k = smoe_compute::gpu::Eltwise::new(ctx, BufRef::at(&yb, AT), n, op).unwrap();
        submit(ctx, |enc| k.encode(enc));
        let (got, guards) = read_guarded(ctx, &yb, n);
        Ok(vec![
            Check::values("y", got, want),
            Check::holds("nothing written around y", guards),
        ])
    }
}

/// Rows `ids` of a `rows × cols` table stored in `dtype` (at an offset inside its buffer),
/// dequantized: ids in any order, repeated, the first and the last row.
#[derive(Clone, Debug)]
pub struct Embed {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub ids: Vec<u32>,
}

impl Case for Embed {
    fn op(&self) -> Op {
        Op::EmbedGather
    }
    fn shape(&self) -> String {
        format!("{}x{} ids {:?}", self.rows, self.cols, self.ids)
    }
    fn types(&self) -> String {
        self.dtype.to_string()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (rows, cols, dtype, ids) = (self.rows, self.cols, self.dtype, &self.ids);
        let bytes = quantize_matrix(dtype, &rng.vec(rows * cols, 2.0), rows, cols);
        let stride = dtype.row_stride(cols);
        let mut want = vec![0f32; ids.len() * cols];
        for (o, &id) in want.chunks_exact_mut(cols).zip(ids) {
            dequantize_row(dtype, &bytes[id as usize * stride..][..stride], o);
        }
        let wb = upload_at(ctx, "table", &bytes, 256);
        let ib = upload_u32_at(ctx, "ids", ids);
        let yb = poisoned(ctx, "y", ids.len() * cols);
        let w = WeightRef {
            buffer: &wb,
            offset: 256,
            dtype,
            rows,
            cols,
        };
        let (id_ref, y) = (BufRef::at(&ib, AT), BufRef::at(&yb, AT));
        let k = EmbedGather::new(ctx, &w, id_ref, y, ids.len()).unwrap();
        submit(ctx, |enc| k.encode(enc));
        let (got, guards) = read_guarded(ctx, &yb, ids.len() * cols);
        Ok(vec![
            Check::values("rows", got, want),
            Check::holds("nothing written around y", guards),
        ])
    }
}

/// The engine's `sampler::argmax` rule, restated: first maximum, NaN never wins.
pub fn cpu_argmax(l: &[f32]) -> u32 {
    let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in l.iter().enumerate() {
        if v > bv {
            best = i;
            bv = v;
        }
    }
    best as u32
}

/// A row of logits for argmax.
#[derive(Clone, Copy, Debug)]
pub enum Logits {
    Random,
    /// The same maximum at two places: the lower index wins.
    Tied,
    /// NaNs around a maximum.
    Nans,
    /// All -inf but a NaN (→ 0).
    NegInfAndNan,
}

impl Logits {
    fn draw(self, n: usize, rng: &mut Rng) -> Vec<f32> {
        let mut row = rng.vec(n, 10.0);
        match self {
            Logits::Random => {}
            Logits::Tied => {
                row[n * 3 / 5] = 20.0;
                row[n / 12] = 20.0;
            }
            Logits::Nans => {
                row[7] = f32::NAN;
                row[n * 2 / 3] = 30.0;
            }
            Logits::NegInfAndNan => {
                row.fill(f32::NEG_INFINITY);
                row[3] = f32::NAN;
            }
        }
        row
    }
}

/// Argmax of each row of `n` logits, all rows in one dispatch.
#[derive(Clone, Debug)]
pub struct ArgmaxCase {
    pub n: usize,
    pub rows: Vec<Logits>,
}

impl Case for ArgmaxCase {
    fn op(&self) -> Op {
        Op::Argmax
    }
    fn shape(&self) -> String {
        format!("{} x{} {:?}", self.n, self.rows.len(), self.rows)
    }
    fn types(&self) -> String {
        "f32".into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let rows: Vec<Vec<f32>> = self.rows.iter().map(|l| l.draw(self.n, rng)).collect();
        let want: Vec<u32> = rows.iter().map(|r| cpu_argmax(r)).collect();
        let xb = guarded(ctx, "logits", &rows.concat());
        let ob = upload_u32_at(ctx, "out", &vec![u32::MAX; rows.len()]);
        let (x, out) = (BufRef::at(&xb, AT), BufRef::at(&ob, AT));
        let k = Argmax::new(ctx, x, out, self.n, rows.len()).unwrap();
        submit(ctx, |enc| k.encode(enc));
        let (got, guards) = read_u32_guarded(ctx, &ob, rows.len());
        Ok(vec![
            Check::ids("argmax", got, want),
            Check::holds("nothing written around the ids", guards),
        ])
    }
}

/// Softmax top-k of `experts` logits per token (`cpu::ops::route_softmax_topk`), renormalized
/// over the k or not; with several tokens, token 1 has only five distinct logits, so ties
/// decide (lower index first).
#[derive(Clone, Debug)]
pub struct RouterCase {
    pub experts: usize,
    pub k: usize,
    pub tokens: usize,
    pub normalize: bool,
}

/// The CPU's choice for each token of `logits`: (ids, weights).
pub fn route_twin(
    logits: &[f32],
    experts: usize,
    k: usize,
    normalize: bool,
) -> (Vec<u32>, Vec<f32>) {
    let chosen: Vec<(usize, f32)> = (logits.chunks_exact(experts))
        .flat_map(|l| ops::route_softmax_topk(l, k, normalize))
        .collect();
    (
        chosen.iter().map(|c| c.0 as u32).collect(),
        chosen.iter().map(|c| c.1).collect(),
    )
}

impl Case for RouterCase {
    fn op(&self) -> Op {
        Op::Router
    }
    fn shape(&self) -> String {
        format!("{} experts k{} t{}", self.experts, self.k, self.tokens)
    }
    fn types(&self) -> String {
        let norm = if self.normalize { " renormalized" } else { "" };
        format!("f32{norm}")
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (ne, k, nt) = (self.experts, self.k, self.tokens);
        let mut logits = rng.vec(ne * nt, 4.0);
        if nt > 1 {
            for (i, v) in logits[ne..2 * ne].iter_mut().enumerate() {
                *v = ((i * 7) % 5) as f32;
            }
        }
        let (want_ids, want_w) = route_twin(&logits, ne, k, self.normalize);
        let lb = guarded(ctx, "logits", &logits);
        let ib = upload_u32_at(ctx, "ids", &vec![u32::MAX; k * nt]);
        let wb = poisoned(ctx, "weights", k * nt);
        let (l, i, w) = (
            BufRef::at(&lb, AT),
            BufRef::at(&ib, AT),
            BufRef::at(&wb, AT),
        );
        let r = Router::new(ctx, l, i, w, ne, k, nt, self.normalize).unwrap();
        submit(ctx, |enc| r.encode(enc));
        let (ids, id_guards) = read_u32_guarded(ctx, &ib, k * nt);
        let (wts, guards) = read_guarded(ctx, &wb, k * nt);
        Ok(vec![
            Check::ids("ids", ids, want_ids),
            Check::values("weights", wts, want_w),
            Check::holds(
                "nothing written around ids and weights",
                guards && id_guards,
            ),
        ])
    }
}
