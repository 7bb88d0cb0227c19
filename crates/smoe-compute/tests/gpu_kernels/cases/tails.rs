//! Fused tails (`Fuse::route`, `Fuse::sum_into`, `Fuse::next_route`): the work a matvec's last
//! workgroup does after every workgroup has written its rows — the router's top-k, the experts'
//! weighted sum, the next block's whole router — against the CPU doing the same steps on the
//! GPU's own products (so that a near-tie of two logits cannot flip a choice between the two
//! sides). Each runs twice in a row, so that a counter left unreset would show. Vulkan only: not
//! supported where the adapter does not fuse tails.

use super::ops::route_twin;
use super::{guarded, poisoned, read_guarded, read_u32_guarded, submit, upload_u32_at, AT};
use crate::conformance::{Case, Check, Op, Rng, Tol, Unsupported};
use smoe_compute::cpu::ops::rms_norm;
use smoe_compute::cpu::{matmul, QMatRef};
use smoe_compute::gpu::{
    wgpu, BufRef, Fuse, GpuContext, Grouped, MatVec, MatVecDesc, NextRoute, RouteTail, SumTail,
    WeightRef,
};
use smoe_vault::quant::{quantize_matrix, DType};

const EPS: f32 = 1e-6;

fn fused_tails(ctx: &GpuContext) -> Result<(), Unsupported> {
    match ctx.fused_tails() {
        true => Ok(()),
        false => Err(Unsupported("fused tails are off on this adapter".into())),
    }
}

/// Runs `mv` twice, `reset` writing its inputs before each.
fn run_twice(ctx: &GpuContext, mv: &MatVec, reset: impl Fn()) {
    for _ in 0..2 {
        reset();
        submit(ctx, |enc| mv.encode(enc));
    }
}

/// Writes `v` at `AT` of a guarded buffer.
fn rewrite(ctx: &GpuContext, buf: &wgpu::Buffer, v: &[f32]) {
    ctx.queue.write_buffer(buf, AT, bytemuck::cast_slice(v));
}

/// The router as the engine runs it in decode: RMSNorm fused in, the normed input written out,
/// the top-k in the last workgroup. With several tokens, rows 0..4 of the router repeat rows
/// 4..8: logits tie in pairs, the lower index first.
#[derive(Clone, Debug)]
pub struct RouteTailCase {
    pub dtype: DType,
    pub experts: usize,
    pub cols: usize,
    pub k: usize,
    pub tokens: usize,
    pub normalize: bool,
}

impl Case for RouteTailCase {
    fn op(&self) -> Op {
        Op::RouteTail
    }
    fn shape(&self) -> String {
        let (ne, c, k, nt) = (self.experts, self.cols, self.k, self.tokens);
        format!("{ne} experts x{c} k{k} t{nt}")
    }
    fn types(&self) -> String {
        let norm = if self.normalize { " renormalized" } else { "" };
        format!("{}{norm}", self.dtype)
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        fused_tails(ctx)?;
        let (dtype, ne, cols, k, nt) = (self.dtype, self.experts, self.cols, self.k, self.tokens);
        let mut q = quantize_matrix(dtype, &rng.vec(ne * cols, 1.0), ne, cols);
        if nt > 1 {
            let stride = dtype.row_stride(cols);
            let (a, b) = q.split_at_mut(4 * stride);
            a.copy_from_slice(&b[..4 * stride]);
        }
        let (x, nw) = (rng.vec(nt * cols, 20.0), rng.vec(cols, 1.5));
        let mut h = vec![0f32; nt * cols];
        rms_norm(&x, &nw, EPS, &mut h);
        let mut want = vec![0f32; nt * ne];
        matmul(QMatRef::new(dtype, ne, cols, &q), &h, nt, &mut want);

        let wbuf = ctx.upload("router", &q);
        let xbuf = guarded(ctx, "x", &x);
        let nbuf = ctx.upload_f32("norm", &nw);
        let ybuf = poisoned(ctx, "logits", nt * ne);
        let hbuf = poisoned(ctx, "normed x", nt * cols);
        let ibuf = upload_u32_at(ctx, "ids", &vec![u32::MAX; k * nt]);
        let rbuf = poisoned(ctx, "weights", k * nt);
        let desc = MatVecDesc::plain(
            WeightRef::whole(&wbuf, dtype, ne, cols),
            BufRef::at(&xbuf, AT),
            BufRef::at(&ybuf, AT),
            nt,
        );
        let fuse = Fuse {
            norm: Some((BufRef::new(&nbuf), EPS)),
            norm_out: Some(BufRef::at(&hbuf, AT)),
            route: Some(RouteTail {
                ids: BufRef::at(&ibuf, AT),
                weights: BufRef::at(&rbuf, AT),
                k,
                normalize: self.normalize,
            }),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        run_twice(ctx, &mv, || {
            ctx.queue
                .write_buffer(&ibuf, AT, bytemuck::cast_slice(&vec![u32::MAX; k * nt]));
            rewrite(ctx, &rbuf, &vec![f32::NAN; k * nt]);
        });
        let (logits, lguards) = read_guarded(ctx, &ybuf, nt * ne);
        let (normed, hguards) = read_guarded(ctx, &hbuf, nt * cols);
        let (ids, iguards) = read_u32_guarded(ctx, &ibuf, k * nt);
        let (wts, wguards) = read_guarded(ctx, &rbuf, k * nt);
        // The choice, against the CPU's top-k of the GPU's logits.
        let (want_ids, want_w) = route_twin(&logits, ne, k, self.normalize);
        Ok(vec![
            Check::values("logits", logits, want),
            Check::values_within("normed x", normed, h, Tol::Nmse(1e-10)),
            Check::ids("ids", ids, want_ids),
            Check::values_within("weights", wts, want_w, Tol::Nmse(1e-10)),
            Check::holds(
                "nothing written around the outputs",
                lguards && hguards && iguards && wguards,
            ),
        ])
    }
}

/// The experts' down projection per slot, then each token's `k` slots summed with the
/// router's weights into the residual by each row block's last workgroup: the per-slot
/// products against `cpu::matmul`, the sum against the weighted sum (in `WeightedSum`'s order)
/// of the GPU's own products.
#[derive(Clone, Debug)]
pub struct SumTailCase {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub n_mats: usize,
    pub k: usize,
    pub ids: Vec<u32>,
}

impl Case for SumTailCase {
    fn op(&self) -> Op {
        Op::SumTail
    }
    fn shape(&self) -> String {
        let (r, c, n, k) = (self.rows, self.cols, self.n_mats, self.k);
        format!("{r}x{c} x{n} experts k{k} ids {:?}", self.ids)
    }
    fn types(&self) -> String {
        self.dtype.to_string()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        fused_tails(ctx)?;
        let (dtype, rows, cols, k, ids) = (self.dtype, self.rows, self.cols, self.k, &self.ids);
        let size = dtype.row_stride(cols) * rows;
        let stride = (size + 100).next_multiple_of(16);
        let mut blob = vec![0u8; stride * self.n_mats];
        let mats: Vec<Vec<u8>> = (0..self.n_mats)
            .map(|m| {
                let q = quantize_matrix(dtype, &rng.vec(rows * cols, 1.0), rows, cols);
                blob[m * stride..][..size].copy_from_slice(&q);
                q
            })
            .collect();
        let n_tok = ids.len() / k;
        let (x, wts, acc0) = (
            rng.vec(ids.len() * cols, 1.0),
            rng.vec(ids.len(), 1.0),
            rng.vec(n_tok * rows, 1.0),
        );
        let mut want_y = vec![0f32; ids.len() * rows];
        for (s, out) in want_y.chunks_exact_mut(rows).enumerate() {
            let q = QMatRef::new(dtype, rows, cols, &mats[ids[s] as usize]);
            matmul(q, &x[s * cols..][..cols], 1, out);
        }

        let wbuf = ctx.upload("experts", &blob);
        let idbuf = upload_u32_at(ctx, "ids", ids);
        let wtbuf = guarded(ctx, "weights", &wts);
        let xbuf = guarded(ctx, "x", &x);
        let ybuf = poisoned(ctx, "y", ids.len() * rows);
        let abuf = guarded(ctx, "acc", &acc0);
        let desc = MatVecDesc {
            grouped: Some(Grouped {
                ids: &idbuf,
                ids_offset: AT,
                n_slots: ids.len(),
                n_mats: self.n_mats,
                mat_stride: stride as u64,
                x_per_slot: true,
                slots_per_x: 1,
            }),
            ..MatVecDesc::plain(
                WeightRef::whole(&wbuf, dtype, rows, cols),
                BufRef::at(&xbuf, AT),
                BufRef::at(&ybuf, AT),
                1,
            )
        };
        let fuse = Fuse {
            sum_into: Some(SumTail {
                acc: BufRef::at(&abuf, AT),
                weights: BufRef::at(&wtbuf, AT),
                k,
            }),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        run_twice(ctx, &mv, || rewrite(ctx, &abuf, &acc0));
        let (y, yguards) = read_guarded(ctx, &ybuf, ids.len() * rows);
        let (got, aguards) = read_guarded(ctx, &abuf, n_tok * rows);
        let mut want = acc0.clone();
        for t in 0..n_tok {
            for r in 0..rows {
                for s in t * k..(t + 1) * k {
                    want[t * rows + r] += wts[s] * y[s * rows + r];
                }
            }
        }
        Ok(vec![
            Check::values("per-slot products", y, want_y),
            Check::values_within("sum into the residual", got, want, Tol::Nmse(1e-12)),
            Check::holds(
                "nothing written around y and the residual",
                yguards && aguards,
            ),
        ])
    }
}

/// The attention's output projection added to the residual, with the next MoE block's router
/// (bf16, after 64 bytes of other data) in its last workgroups: the new residual, the normed row
/// the experts read, and the top-k, against the CPU's RMSNorm, router product and top-k of the
/// GPU's residual.
#[derive(Clone, Debug)]
pub struct NextRouteCase {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    pub k: usize,
    pub normalize: bool,
}

impl Case for NextRouteCase {
    fn op(&self) -> Op {
        Op::NextRoute
    }
    fn shape(&self) -> String {
        let (r, c, ne, k) = (self.rows, self.cols, self.experts, self.k);
        format!("{r}x{c}, {ne} experts k{k}")
    }
    fn types(&self) -> String {
        let norm = if self.normalize { " renormalized" } else { "" };
        format!("{} router bf16{norm}", self.dtype)
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        fused_tails(ctx)?;
        let (dtype, rows, cols, ne, k) = (self.dtype, self.rows, self.cols, self.experts, self.k);
        let q = quantize_matrix(dtype, &rng.vec(rows * cols, 1.0), rows, cols);
        let rq = quantize_matrix(DType::Bf16, &rng.vec(ne * rows, 1.0), ne, rows);
        let (x, resid, g) = (rng.vec(cols, 1.0), rng.vec(rows, 4.0), rng.vec(rows, 1.5));
        let mut want_y = vec![0f32; rows];
        matmul(QMatRef::new(dtype, rows, cols, &q), &x, 1, &mut want_y);
        want_y.iter_mut().zip(&resid).for_each(|(w, r)| *w += r);

        let wbuf = ctx.upload("o proj", &q);
        let rbuf = ctx.upload("router", &[&[0u8; 64][..], &rq].concat());
        let xbuf = guarded(ctx, "x", &x);
        let gbuf = ctx.upload_f32("norm", &g);
        let ybuf = guarded(ctx, "residual", &resid);
        let hbuf = poisoned(ctx, "normed", rows);
        let ibuf = upload_u32_at(ctx, "ids", &vec![u32::MAX; k]);
        let wtbuf = poisoned(ctx, "weights", k);
        let desc = MatVecDesc::plain(
            WeightRef::whole(&wbuf, dtype, rows, cols),
            BufRef::at(&xbuf, AT),
            BufRef::at(&ybuf, AT),
            1,
        );
        let fuse = Fuse {
            accumulate: true,
            next_route: Some(NextRoute {
                router: WeightRef {
                    buffer: &rbuf,
                    offset: 64,
                    dtype: DType::Bf16,
                    rows: ne,
                    cols: rows,
                },
                norm: (BufRef::new(&gbuf), EPS),
                normed: BufRef::at(&hbuf, AT),
                route: RouteTail {
                    ids: BufRef::at(&ibuf, AT),
                    weights: BufRef::at(&wtbuf, AT),
                    k,
                    normalize: self.normalize,
                },
            }),
            ..Default::default()
        };
        let mv = MatVec::fused(ctx, &desc, &fuse).unwrap();
        run_twice(ctx, &mv, || {
            rewrite(ctx, &ybuf, &resid);
            ctx.queue
                .write_buffer(&ibuf, AT, bytemuck::cast_slice(&vec![u32::MAX; k]));
            rewrite(ctx, &wtbuf, &vec![f32::NAN; k]);
        });
        let (y, yguards) = read_guarded(ctx, &ybuf, rows);
        let (hn, hguards) = read_guarded(ctx, &hbuf, rows);
        let (ids, iguards) = read_u32_guarded(ctx, &ibuf, k);
        let (wts, wguards) = read_guarded(ctx, &wtbuf, k);
        // The router's steps on the GPU's own residual.
        let mut h = vec![0f32; rows];
        rms_norm(&y, &g, EPS, &mut h);
        let mut logits = vec![0f32; ne];
        matmul(QMatRef::new(DType::Bf16, ne, rows, &rq), &h, 1, &mut logits);
        let (want_ids, want_w) = route_twin(&logits, ne, k, self.normalize);
        Ok(vec![
            Check::values("residual", y, want_y),
            Check::values_within("normed row", hn, h, Tol::Nmse(1e-10)),
            Check::ids("ids", ids, want_ids),
            Check::values_within("weights", wts, want_w, Tol::Nmse(1e-9)),
            Check::holds(
                "nothing written around the outputs",
                yguards && hguards && iguards && wguards,
            ),
        ])
    }
}
