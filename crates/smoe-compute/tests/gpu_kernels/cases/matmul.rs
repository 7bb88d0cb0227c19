//! The prefill GEMM (`gpu::MatMul`: dense, gated, output rows split into regions, grouped by
//! expert after a sort) against `cpu::matmul` on the same stored bytes, and the expert sort
//! (`gpu::ExpertSort`, with its work list of token tiles) against a stable counting sort.

use super::{guarded, poisoned, read_guarded, submit, upload_at, AT};
use crate::conformance::{Case, Check, Op, Rng, Tol, Unsupported};
use smoe_compute::cpu::ops::silu_mul;
use smoe_compute::cpu::{matmul, QMatRef};
use smoe_compute::gpu::{
    BufRef, ExpertSort, GpuContext, MatMulDesc, MatMulGrouped, MatMulTuning, WeightRef,
};
use smoe_vault::quant::{quantize_matrix, DType};

/// The GEMM's workgroup tile.
#[derive(Clone, Copy, Debug)]
pub enum Tile {
    /// What `MatMul::new` picks (on the matrix units where the adapter has them).
    Default,
    /// f32 ALUs: rows, tokens and columns per step.
    Alus(u32, u32, u32),
    /// Matrix units (tokens, columns per step): not supported where the adapter has none.
    Units(u32, u32),
}

impl Tile {
    fn tuning(self, ctx: &GpuContext) -> Result<Option<MatMulTuning>, Unsupported> {
        match self {
            Tile::Default => Ok(None),
            Tile::Alus(bm, bn, bk) => Ok(Some(MatMulTuning {
                coop: false,
                bm,
                bn,
                bk,
            })),
            Tile::Units(_, _) if !ctx.has_matrix_units() => {
                Err(Unsupported("no matrix units".into()))
            }
            Tile::Units(bn, bk) => Ok(Some(MatMulTuning {
                bk,
                ..MatMulTuning::coop(bn)
            })),
        }
    }

    fn describe(self) -> String {
        match self {
            Tile::Default => String::new(),
            Tile::Alus(bm, bn, bk) => format!(" alus {bm}x{bn}x{bk}"),
            Tile::Units(bn, bk) => format!(" units 128x{bn}x{bk}"),
        }
    }
}

/// The GEMM: `MatMul::new`, or `with_tuning` at the tile.
fn build(ctx: &GpuContext, d: &MatMulDesc, t: Option<MatMulTuning>) -> smoe_compute::gpu::MatMul {
    match t {
        Some(t) => smoe_compute::gpu::MatMul::with_tuning(ctx, d, t),
        None => smoe_compute::gpu::MatMul::new(ctx, d),
    }
    .unwrap()
}

/// On the matrix units the weights are rounded to f16 first (bf16 exact, quantized d·c within
/// 2⁻¹²; x keeps ~22 bits as two f16 halves): NMSE ~1e-8 instead of the ALUs' ~1e-14.
fn tolerance_of(mm: &smoe_compute::gpu::MatMul) -> Option<Tol> {
    mm.tuning().coop.then_some(Tol::Nmse(1e-6))
}

/// `(gate, up)` of `n` matrices (up empty unless gated).
fn matrices(
    rng: &mut Rng,
    dtype: DType,
    n: usize,
    rows: usize,
    cols: usize,
    gated: bool,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut q = || quantize_matrix(dtype, &rng.vec(rows * cols, 1.0), rows, cols);
    (0..n)
        .map(|_| {
            let g = q();
            (g, if gated { q() } else { vec![] })
        })
        .collect()
}

/// `silu(G·x)·(U·x)` or `G·x` of `nt` tokens into `out`.
fn twin(
    dtype: DType,
    rows: usize,
    cols: usize,
    (g, u): &(Vec<u8>, Vec<u8>),
    x: &[f32],
    nt: usize,
    out: &mut [f32],
) {
    matmul(QMatRef::new(dtype, rows, cols, g), x, nt, out);
    if !u.is_empty() {
        let mut up = vec![0f32; nt * rows];
        matmul(QMatRef::new(dtype, rows, cols, u), x, nt, &mut up);
        silu_mul(out, &up);
    }
}

/// A dense (optionally gated) product of `tokens` tokens; with `split`, output rows `..a`,
/// `a..b`, `b..` go to three regions of y one after the other (q, k, v from one GEMM).
#[derive(Clone, Debug)]
pub struct DenseMatMul {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    pub gated: bool,
    pub split: Option<[usize; 2]>,
    pub tile: Tile,
}

impl DenseMatMul {
    pub fn new(dtype: DType, rows: usize, cols: usize, tokens: usize) -> Self {
        DenseMatMul {
            dtype,
            rows,
            cols,
            tokens,
            gated: false,
            split: None,
            tile: Tile::Default,
        }
    }
    pub fn gated(self) -> Self {
        DenseMatMul {
            gated: true,
            ..self
        }
    }
    pub fn split(self, a: usize, b: usize) -> Self {
        DenseMatMul {
            split: Some([a, b]),
            ..self
        }
    }
    pub fn tile(self, tile: Tile) -> Self {
        DenseMatMul { tile, ..self }
    }
}

impl Case for DenseMatMul {
    fn op(&self) -> Op {
        Op::MatMul
    }

    fn shape(&self) -> String {
        let s = format!("{}x{} t{}", self.rows, self.cols, self.tokens);
        match self.split {
            Some([a, b]) => format!("{s} regions ..{a}, ..{b}, .."),
            None => s,
        }
    }

    fn types(&self) -> String {
        let gated = if self.gated { " gated" } else { "" };
        format!("{}{gated}{}", self.dtype, self.tile.describe())
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let tuning = self.tile.tuning(ctx)?;
        let (rows, cols, nt, dtype) = (self.rows, self.cols, self.tokens, self.dtype);
        let m = matrices(rng, dtype, 1, rows, cols, self.gated).remove(0);
        let x = rng.vec(nt * cols, 1.0);
        let mut want = vec![0f32; nt * rows];
        twin(dtype, rows, cols, &m, &x, nt, &mut want);
        if let Some([a, b]) = self.split {
            // Regions [nt][a], [nt][b - a], [nt][rows - b].
            want = [0..a, a..b, b..rows]
                .iter()
                .flat_map(|r| want.chunks(rows).flat_map(|row| row[r.clone()].to_vec()))
                .collect();
        }

        let pad = 16 * rng.below(5);
        let wbuf = upload_at(ctx, "weights", &[&m.0[..], &m.1].concat(), pad);
        let xbuf = guarded(ctx, "x", &x);
        let ybuf = poisoned(ctx, "y", nt * rows);
        let desc = MatMulDesc {
            w: WeightRef {
                buffer: &wbuf,
                offset: pad as u64,
                dtype,
                rows,
                cols,
            },
            up_offset: self.gated.then_some(m.0.len() as u64),
            x: BufRef::at(&xbuf, AT),
            y: BufRef::at(&ybuf, AT),
            n_tokens: nt,
            grouped: None,
            y_split: self.split,
        };
        let mm = build(ctx, &desc, tuning);
        submit(ctx, |enc| mm.encode(enc));
        let (got, guards) = read_guarded(ctx, &ybuf, nt * rows);
        Ok(vec![
            Check::Values {
                what: "y".into(),
                got,
                want,
                tol: tolerance_of(&mm),
            },
            Check::holds("nothing written around y", guards),
        ])
    }
}

/// A map of ids and its name for the line.
pub type NamedMap = (&'static str, fn(u32) -> u32);

/// Expert ids of a batch's slots, drawn per row.
#[derive(Clone, Debug)]
pub enum Ids {
    /// Exactly these.
    List(Vec<u32>),
    /// `n` uniform in `0..of`, then mapped (named for the line).
    Uniform {
        n: usize,
        of: u32,
        map: Option<NamedMap>,
    },
    /// Expert 1 takes about 3/4 of the slots, experts 4.. share the rest unevenly, the others
    /// (0, 2, 3 and the last) none.
    Skewed { n: usize, of: u32 },
    /// Uniform in `0..of`, about a third replaced by ids ≥ `of`: slots of another round's
    /// experts, which the sort puts last and the GEMM skips.
    OtherRounds { n: usize, of: u32 },
}

impl Ids {
    pub fn uniform(n: usize, of: u32) -> Self {
        Ids::Uniform { n, of, map: None }
    }
    pub fn mapped(n: usize, of: u32, name: &'static str, f: fn(u32) -> u32) -> Self {
        Ids::Uniform {
            n,
            of,
            map: Some((name, f)),
        }
    }

    pub fn draw(&self, rng: &mut Rng) -> Vec<u32> {
        match self {
            Ids::List(v) => v.clone(),
            Ids::Uniform { n, of, map } => {
                let ids = rng.ids(*n, *of as usize);
                match map {
                    Some((_, f)) => ids.into_iter().map(f).collect(),
                    None => ids,
                }
            }
            Ids::Skewed { n, of } => (rng.vec(*n, 1.0).iter())
                .map(|v| {
                    let u = (v + 1.0) / 2.0;
                    match u < 0.75 {
                        true => 1,
                        false => (4.0 + ((u - 0.75) * 4.0).powi(2) * (of - 5) as f32) as u32,
                    }
                })
                .map(|e| e.min(of - 2))
                .collect(),
            Ids::OtherRounds { n, of } => {
                let ids = rng.ids(*n, *of as usize);
                let marks = rng.ids(*n, 3);
                (ids.iter().zip(marks))
                    .map(|(&e, m)| if m == 0 { of + e % 2 * 1000 } else { e })
                    .collect()
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Ids::List(v) if v.len() <= 8 => format!("{v:?}"),
            Ids::List(v) if v.iter().all(|&e| e == v[0]) => format!("{} x [{}]", v.len(), v[0]),
            Ids::List(v) => format!("{} listed ids", v.len()),
            Ids::Uniform { n, of, map: None } => format!("{n} ids in 0..{of}"),
            Ids::Uniform {
                n,
                of,
                map: Some((name, _)),
            } => format!("{n} ids in 0..{of} {name}"),
            Ids::Skewed { n, of } => format!("{n} skewed ids in 0..{of}"),
            Ids::OtherRounds { n, of } => format!("{n} ids in 0..{of}, 1/3 other rounds'"),
        }
    }
}

/// The expert sort over `ids` (uploaded after `pad` words of garbage), cut into `tile`s.
fn sort_on_gpu(
    ctx: &GpuContext,
    ids: &[u32],
    n_mats: usize,
    tile: usize,
    pad: usize,
) -> ExpertSort {
    let mut words = vec![0xdead_beefu32; pad];
    words.extend_from_slice(ids);
    let buf = ctx.upload("ids", bytemuck::cast_slice(&words));
    let at = BufRef::at(&buf, 4 * pad as u64);
    let sort = ExpertSort::new(ctx, at, ids.len(), n_mats, tile).unwrap();
    submit(ctx, |enc| sort.encode(enc));
    sort
}

/// A grouped product after a sort: experts in one buffer at a padded blob stride holding gate
/// then up; slot `s` multiplies expert `ids[s]` by x row `s / x_div`; slots of ids ≥ `n_mats`
/// are skipped and keep their poison.
#[derive(Clone, Debug)]
pub struct GroupedMatMul {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub n_mats: usize,
    pub ids: Ids,
    pub x_div: usize,
    pub gated: bool,
    pub tile: Tile,
}

impl Case for GroupedMatMul {
    fn op(&self) -> Op {
        Op::MatMul
    }

    fn shape(&self) -> String {
        let (r, c, n) = (self.rows, self.cols, self.n_mats);
        format!(
            "{r}x{c} x{n} experts, {}, x/{}",
            self.ids.describe(),
            self.x_div
        )
    }

    fn types(&self) -> String {
        let gated = if self.gated { " gated" } else { "" };
        format!("{}{gated}{}", self.dtype, self.tile.describe())
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let tuning = self.tile.tuning(ctx)?;
        let (rows, cols, dtype, n_mats) = (self.rows, self.cols, self.dtype, self.n_mats);
        let ids = self.ids.draw(rng);
        let mats = matrices(rng, dtype, n_mats, rows, cols, self.gated);
        let x = rng.vec(ids.len().div_ceil(self.x_div) * cols, 1.0);
        let skipped = |s: usize| ids[s] as usize >= n_mats;
        let mut want = vec![0f32; ids.len() * rows];
        for (s, out) in want.chunks_exact_mut(rows).enumerate() {
            if !skipped(s) {
                let xs = &x[s / self.x_div * cols..][..cols];
                twin(dtype, rows, cols, &mats[ids[s] as usize], xs, 1, out);
            }
        }

        let size = dtype.row_stride(cols) * rows;
        let stride = ((1 + self.gated as usize) * size + 300).next_multiple_of(16);
        let mut blob = vec![0x77u8; stride * n_mats];
        for (m, (g, u)) in mats.iter().enumerate() {
            blob[m * stride..][..size].copy_from_slice(g);
            blob[m * stride + size..][..u.len()].copy_from_slice(u);
        }
        // The sort cuts its work list into the GEMM's token tiles.
        let tile = match tuning {
            Some(t) => t.bn as usize,
            None => MatMulTuning::grouped_bn(ids.len(), n_mats),
        };
        let sort = sort_on_gpu(ctx, &ids, n_mats, tile, 1);
        let wbuf = ctx.upload("experts", &blob);
        let xbuf = guarded(ctx, "x", &x);
        let ybuf = poisoned(ctx, "y", ids.len() * rows);
        let desc = MatMulDesc {
            w: WeightRef::whole(&wbuf, dtype, rows, cols),
            up_offset: self.gated.then_some(size as u64),
            x: BufRef::at(&xbuf, AT),
            y: BufRef::at(&ybuf, AT),
            n_tokens: 0,
            grouped: Some(MatMulGrouped {
                sort: &sort,
                mat_stride: stride as u64,
                x_div: self.x_div,
            }),
            y_split: None,
        };
        let mm = build(ctx, &desc, tuning);
        submit(ctx, |enc| mm.encode(enc));
        let (all, guards) = read_guarded(ctx, &ybuf, ids.len() * rows);
        let (mut got, mut kept, mut untouched) = (vec![], vec![], true);
        for (s, (g, w)) in all.chunks(rows).zip(want.chunks(rows)).enumerate() {
            match skipped(s) {
                true => untouched &= g.iter().all(|v| v.is_nan()),
                false => {
                    got.extend_from_slice(g);
                    kept.extend_from_slice(w);
                }
            }
        }
        Ok(vec![
            Check::Values {
                what: "y of the experts' slots".into(),
                got,
                want: kept,
                tol: tolerance_of(&mm),
            },
            Check::holds("skipped slots untouched", untouched),
            Check::holds("nothing written around y", guards),
        ])
    }
}

/// The expert sort: (starts, perm) against a stable counting sort (within an expert the GPU's
/// order is free: compared as sets), ids ≥ `n_mats` last and uncounted; the work list (each
/// expert's token tiles `(e << 20) | i`) exactly.
#[derive(Clone, Debug)]
pub struct Sort {
    pub ids: Ids,
    pub n_mats: usize,
    pub tile: usize,
    /// Words of garbage before the ids (offsets that are not a multiple of 16 bytes too).
    pub pad: usize,
}

impl Sort {
    fn twin(ids: &[u32], n_mats: usize, tile: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let mut starts = vec![0u32; n_mats + 1];
        for &e in ids.iter().filter(|&&e| (e as usize) < n_mats) {
            starts[e as usize + 1] += 1;
        }
        for e in 0..n_mats {
            starts[e + 1] += starts[e];
        }
        let mut perm: Vec<u32> = (0..ids.len() as u32).collect();
        perm.sort_by_key(|&s| (ids[s as usize] as usize).min(n_mats));
        let mut units = vec![];
        for (e, w) in starts.windows(2).enumerate() {
            let tiles = ((w[1] - w[0]) as usize).div_ceil(tile);
            units.extend((0..tiles as u32).map(|i| (e as u32) << 20 | i));
        }
        (starts, perm, units)
    }
}

impl Case for Sort {
    fn op(&self) -> Op {
        Op::ExpertSort
    }

    fn shape(&self) -> String {
        let (ids, n, tile, pad) = (self.ids.describe(), self.n_mats, self.tile, self.pad);
        format!("{ids} over {n}, tile {tile}, ids@{pad}")
    }

    fn types(&self) -> String {
        "u32".into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let ids = self.ids.draw(rng);
        let (starts, want_perm, want_units) = Self::twin(&ids, self.n_mats, self.tile);
        let sort = sort_on_gpu(ctx, &ids, self.n_mats, self.tile, self.pad);
        let got_starts = ctx.read_u32(sort.starts(), 0, self.n_mats + 1).unwrap();
        let mut perm = ctx.read_u32(sort.perm(), 0, ids.len()).unwrap();
        // Within an expert (and among the skipped slots) the order is free.
        let ends = [starts[self.n_mats], ids.len() as u32];
        for w in starts.windows(2).chain([&ends[..]]) {
            perm[w[0] as usize..w[1] as usize].sort_unstable();
        }
        let units = ctx.read_u32(sort.units(), 0, 1 + want_units.len()).unwrap();
        Ok(vec![
            Check::ids("starts", got_starts, starts),
            Check::ids("perm (as sets per expert)", perm, want_perm),
            Check::ids("unit count", vec![units[0]], vec![want_units.len() as u32]),
            Check::ids("units", units[1..].to_vec(), want_units.clone()),
            Check::holds(
                "units within max_units",
                want_units.len() <= sort.max_units(),
            ),
        ])
    }
}
