//! matvec (`gpu::MatVec`) against `cpu::matmul` on the same stored bytes: plain, gated
//! (silu(G·x)·(U·x), `cpu::ops::silu_mul`), grouped (a stack of experts picked by ids), with
//! the fused RMSNorm of the input (`cpu::ops::rms_norm`), the residual add and the weighted
//! reduce over each token's experts.

use super::{guarded, poisoned, read_guarded, submit, upload_at, upload_u32_at, AT};
use crate::conformance::{Case, Check, Op, Rng, Tol, Unsupported};
use smoe_compute::cpu::ops::{rms_norm, silu_mul};
use smoe_compute::cpu::{matmul, QMatRef};
use smoe_compute::gpu::{
    BufRef, Fuse, GpuContext, Grouped, MatVecDesc, MatVecTuning, Q4Decode, WeightRef,
};
use smoe_vault::quant::{dequantize_row, quantize_matrix, DType};

const EPS: f32 = 1e-6;

/// What each slot of a grouped product reads.
#[derive(Clone, Copy, Debug)]
pub enum SlotInput {
    /// Every slot the same x (one token's gate_up).
    Shared,
    /// Each slot its own x (the down projection after a grouped gate_up).
    Own,
    /// This many consecutive slots share one x (several tokens' gate_up: a token's k experts).
    PerToken(usize),
}

/// A stack of `n_mats` experts at a padded blob stride; slot `s` multiplies expert `ids[s]`.
#[derive(Clone, Debug)]
pub struct Experts {
    pub n_mats: usize,
    pub ids: Vec<u32>,
    pub input: SlotInput,
}

/// One matvec row; `MatVec::new(..)` then the variant's builders.
#[derive(Clone, Debug)]
pub struct MatVec {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    pub gated: bool,
    pub experts: Option<Experts>,
    /// RMSNorm of the input fused in; `Some(true)`: the normed input written out too.
    pub norm: Option<bool>,
    /// `y += W·x` (a residual add).
    pub accumulate: bool,
    /// Grouped: each token's `k` slots summed with router weights into one output row.
    pub reduce: Option<usize>,
    /// The launch shape (None: what the engine's `MatVec::fused` picks).
    pub tuning: Option<MatVecTuning>,
}

impl MatVec {
    pub fn new(dtype: DType, rows: usize, cols: usize, tokens: usize) -> Self {
        MatVec {
            dtype,
            rows,
            cols,
            tokens,
            gated: false,
            experts: None,
            norm: None,
            accumulate: false,
            reduce: None,
            tuning: None,
        }
    }
    pub fn gated(self) -> Self {
        MatVec {
            gated: true,
            ..self
        }
    }
    pub fn tuned(self, tuning: MatVecTuning) -> Self {
        MatVec {
            tuning: Some(tuning),
            ..self
        }
    }
    pub fn experts(self, n_mats: usize, ids: &[u32], input: SlotInput) -> Self {
        let ids = ids.to_vec();
        MatVec {
            experts: Some(Experts { n_mats, ids, input }),
            ..self
        }
    }
    /// `written`: the normed input is written out as well.
    pub fn normed(self, written: bool) -> Self {
        MatVec {
            norm: Some(written),
            ..self
        }
    }
    pub fn accumulate(self) -> Self {
        MatVec {
            accumulate: true,
            ..self
        }
    }
    pub fn reduce(self, k: usize) -> Self {
        MatVec {
            reduce: Some(k),
            ..self
        }
    }

    fn slots(&self) -> usize {
        self.experts.as_ref().map_or(1, |e| e.ids.len())
    }
    fn matrices(&self) -> usize {
        self.experts.as_ref().map_or(1, |e| e.n_mats)
    }
    /// Rows of x (each `tokens × cols`), and which one slot `s` reads.
    fn x_rows(&self) -> usize {
        (0..self.slots()).map(|s| self.x_of(s) + 1).max().unwrap()
    }
    fn x_of(&self, s: usize) -> usize {
        match self.experts.as_ref().map(|e| e.input) {
            None | Some(SlotInput::Shared) => 0,
            Some(SlotInput::Own) => s,
            Some(SlotInput::PerToken(k)) => s / k,
        }
    }
    fn matrix_of(&self, s: usize) -> usize {
        self.experts.as_ref().map_or(0, |e| e.ids[s] as usize)
    }
    /// Output rows of `rows` values (per token): a slot each, or a token each under a reduce.
    fn outputs(&self) -> usize {
        self.slots() / self.reduce.unwrap_or(1)
    }
    fn int8(&self) -> bool {
        self.tuning.is_some_and(|t| t.q4 == Q4Decode::Int8Dot) && self.dtype == DType::Q4
    }
}

/// Drawn inputs: each matrix's gate (or only) and up weights, x, the norm weight, y before the
/// product, the router weights.
struct Inputs {
    mats: Vec<(Vec<u8>, Vec<u8>)>,
    x: Vec<f32>,
    norm: Vec<f32>,
    y0: Vec<f32>,
    weights: Vec<f32>,
}

impl MatVec {
    fn draw(&self, rng: &mut Rng) -> Inputs {
        let (rows, cols) = (self.rows, self.cols);
        let mut quantized = || quantize_matrix(self.dtype, &rng.vec(rows * cols, 1.0), rows, cols);
        let mats = (0..self.matrices())
            .map(|_| {
                let g = quantized();
                (g, if self.gated { quantized() } else { vec![] })
            })
            .collect();
        // Large inputs where a norm is fused, so that it matters.
        let scale = if self.norm.is_some() { 30.0 } else { 1.0 };
        Inputs {
            mats,
            x: rng.vec(self.x_rows() * self.tokens * cols, scale),
            norm: rng.vec(cols, 2.0),
            y0: rng.vec(self.outputs() * self.tokens * rows, 1.0),
            weights: rng.vec(self.slots(), 1.0),
        }
    }

    /// The CPU twin: (y, the normed x).
    fn cpu(&self, inp: &Inputs) -> (Vec<f32>, Vec<f32>) {
        let (rows, cols, nt, dtype) = (self.rows, self.cols, self.tokens, self.dtype);
        let mut h = inp.x.clone();
        if self.norm.is_some() {
            rms_norm(&inp.x, &inp.norm, EPS, &mut h);
        }
        let mut out = vec![0f32; self.slots() * nt * rows];
        for (s, o) in out.chunks_exact_mut(nt * rows).enumerate() {
            let (g, u) = &inp.mats[self.matrix_of(s)];
            let xs = &h[self.x_of(s) * nt * cols..][..nt * cols];
            matmul(QMatRef::new(dtype, rows, cols, g), xs, nt, o);
            if self.gated {
                let mut up = vec![0f32; nt * rows];
                matmul(QMatRef::new(dtype, rows, cols, u), xs, nt, &mut up);
                silu_mul(o, &up);
            }
        }
        let y = match self.reduce {
            Some(k) => {
                let mut y = inp.y0.clone();
                for (s, o) in out.chunks_exact(nt * rows).enumerate() {
                    let acc = &mut y[s / k * nt * rows..][..nt * rows];
                    acc.iter_mut()
                        .zip(o)
                        .for_each(|(a, v)| *a += inp.weights[s] * v);
                }
                y
            }
            None if self.accumulate => out.iter().zip(&inp.y0).map(|(o, y)| o + y).collect(),
            None => out,
        };
        (y, h)
    }

    /// q4 with int8 activations: the product of x as the kernel sees it, int8 codes times a
    /// scale per 64 inputs (plain products only).
    fn int8_twin(&self, inp: &Inputs) -> Vec<f32> {
        let plain = self.experts.is_none() && !self.gated && self.norm.is_none();
        assert!(plain, "the int8 twin is of plain products");
        let (rows, cols, nt) = (self.rows, self.cols, self.tokens);
        let xq: Vec<f32> = (inp.x.chunks(64))
            .flat_map(|g| {
                let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                g.iter()
                    .map(move |v| (v * inv).round_ties_even() * (amax / 127.0))
                    .collect::<Vec<_>>()
            })
            .collect();
        let stride = DType::Q4.row_stride(cols);
        let (mut w, mut twin) = (vec![0f32; cols], vec![0f32; nt * rows]);
        for r in 0..rows {
            dequantize_row(DType::Q4, &inp.mats[0].0[r * stride..][..stride], &mut w);
            for t in 0..nt {
                let xt = &xq[t * cols..(t + 1) * cols];
                let dot: f64 = w.iter().zip(xt).map(|(a, b)| (a * b) as f64).sum();
                twin[t * rows + r] = dot as f32;
            }
        }
        twin
    }
}

/// What the kernel wrote: y, the normed x (if written out), whether the guards of each held.
struct Written {
    y: Vec<f32>,
    y_guards: bool,
    normed: Option<(Vec<f32>, bool)>,
}

impl MatVec {
    fn gpu(&self, ctx: &GpuContext, inp: &Inputs, rng: &mut Rng) -> Written {
        let (rows, cols, nt, dtype) = (self.rows, self.cols, self.tokens, self.dtype);
        // The weights at a blob stride padded past the matrices (a multiple of 16), the stack
        // at an offset inside its buffer.
        let size = dtype.row_stride(cols) * rows;
        let blob = if self.gated { 2 * size } else { size };
        let stride = match self.experts {
            Some(_) => (blob + 16 * rng.below(20)).next_multiple_of(16),
            None => blob,
        };
        let mut stack = vec![0x77u8; stride * self.matrices()];
        for (m, (g, u)) in inp.mats.iter().enumerate() {
            stack[m * stride..][..size].copy_from_slice(g);
            stack[m * stride + size..][..u.len()].copy_from_slice(u);
        }
        let pad = 16 * rng.below(7);
        let wbuf = upload_at(ctx, "weights", &stack, pad);
        let xbuf = guarded(ctx, "x", &inp.x);
        let n_y = self.outputs() * nt * rows;
        let ybuf = match self.accumulate || self.reduce.is_some() {
            true => guarded(ctx, "y", &inp.y0),
            false => poisoned(ctx, "y", n_y),
        };
        let nbuf = ctx.upload_f32("norm", &inp.norm);
        let hbuf = poisoned(ctx, "normed x", nt * cols);
        let wtbuf = ctx.upload_f32("router weights", &inp.weights);
        let ids = self.experts.as_ref().map_or(vec![], |e| e.ids.clone());
        let idbuf = upload_u32_at(ctx, "ids", &ids);
        let desc = MatVecDesc {
            w: WeightRef {
                buffer: &wbuf,
                offset: pad as u64,
                dtype,
                rows,
                cols,
            },
            up_offset: self.gated.then_some(size as u64),
            x: BufRef::at(&xbuf, AT),
            y: BufRef::at(&ybuf, AT),
            n_tokens: nt,
            grouped: self.experts.as_ref().map(|e| Grouped {
                ids: &idbuf,
                ids_offset: AT,
                n_slots: e.ids.len(),
                n_mats: e.n_mats,
                mat_stride: stride as u64,
                x_per_slot: !matches!(e.input, SlotInput::Shared),
                slots_per_x: match e.input {
                    SlotInput::PerToken(k) => k,
                    _ => 1,
                },
            }),
        };
        let fuse = Fuse {
            norm: self.norm.map(|_| (BufRef::new(&nbuf), EPS)),
            norm_out: (self.norm == Some(true)).then(|| BufRef::at(&hbuf, AT)),
            accumulate: self.accumulate,
            reduce: self.reduce.map(|k| (BufRef::new(&wtbuf), k)),
            ..Default::default()
        };
        let mv = match self.tuning {
            Some(t) => smoe_compute::gpu::MatVec::fused_tuned(ctx, &desc, &fuse, t),
            None => smoe_compute::gpu::MatVec::fused(ctx, &desc, &fuse),
        }
        .unwrap();
        submit(ctx, |enc| mv.encode(enc));
        let (y, y_guards) = read_guarded(ctx, &ybuf, n_y);
        let normed = (self.norm == Some(true)).then(|| read_guarded(ctx, &hbuf, nt * cols));
        Written {
            y,
            y_guards,
            normed,
        }
    }
}

impl Case for MatVec {
    fn op(&self) -> Op {
        Op::MatVec
    }

    fn shape(&self) -> String {
        let mut s = format!("{}x{} t{}", self.rows, self.cols, self.tokens);
        if let Some(e) = &self.experts {
            s += &format!(" ids {:?} of {} x:{:?}", e.ids, e.n_mats, e.input);
        }
        if let Some(k) = self.reduce {
            s += &format!(" sum of {k}");
        }
        s
    }

    fn types(&self) -> String {
        let mut s = self.dtype.to_string();
        for (on, tag) in [
            (self.gated, " gated"),
            (self.norm == Some(false), " +norm"),
            (self.norm == Some(true), " +norm(out)"),
            (self.accumulate, " +acc"),
        ] {
            if on {
                s += tag;
            }
        }
        if let Some(t) = self.tuning {
            s += &format!(" wg{}/r{}/{:?}/u{}", t.wg, t.rows, t.q4, t.items);
        }
        s
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let inp = self.draw(rng);
        let (want, h) = self.cpu(&inp);
        let got = self.gpu(ctx, &inp, rng);
        let mut checks = vec![
            Check::values("y", got.y.clone(), want),
            Check::holds("nothing written around y", got.y_guards),
        ];
        if let Some((normed, guards)) = got.normed {
            checks.push(Check::values_within(
                "normed x",
                normed,
                h,
                Tol::Nmse(1e-10),
            ));
            checks.push(Check::holds("nothing written around the normed x", guards));
        }
        if self.int8() {
            // Exact but for rare rounding flips (the GPU's 127/amax may differ by an ulp).
            let twin = self.int8_twin(&inp);
            checks.push(Check::values_within(
                "y vs the int8 twin",
                got.y,
                twin,
                Tol::Nmse(1e-6),
            ));
        }
        Ok(checks)
    }
}
