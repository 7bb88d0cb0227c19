// Weighted accumulate of expert outputs (CPU twin: cpu::ops::axpy per slot):
// acc[t, i] += Σ_s wts[t·k + s] · y[(t·k + s)·n + i].

struct Params {
    n: u32,
    k: u32,
    acc_off: u32,
    y_off: u32,
    w_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> yv: array<f32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read_write> acc: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if i >= p.n {
        return;
    }
    var a = acc[p.acc_off + t * p.n + i];
    for (var s = 0u; s < p.k; s++) {
        let slot = t * p.k + s;
        a += wts[p.w_off + slot] * yv[p.y_off + slot * p.n + i];
    }
    acc[p.acc_off + t * p.n + i] = a;
}
