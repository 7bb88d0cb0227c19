// RMSNorm of each row (CPU twin: cpu::ops::rms_norm): y = x · 1/sqrt(mean(x²) + eps) · w.
// One workgroup per row.

struct Params {
    n: u32,
    eps: f32,
    x_off: u32,
    y_off: u32,
    w_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> wt: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let xb = p.x_off + wid.x * p.n;
    let yb = p.y_off + wid.x * p.n;
    var ss = 0.0;
    for (var i = li; i < p.n; i += WG) {
        let v = x[xb + i];
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, sg, nsg, lane) / f32(p.n) + p.eps);
    for (var i = li; i < p.n; i += WG) {
        y[yb + i] = x[xb + i] * r * wt[p.w_off + i];
    }
}
