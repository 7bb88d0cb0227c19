// Element-wise ops in place on f32 values, for the model features that have no fused kernel
// (CPU twins: the engine decoder's bias add, clip_qkv clamp and shared-expert gate):
//   OP 0: y[i] += b[i % nb]          a bias added to every row of nb values
//   OP 1: y[i] = clamp(y[i], -c, c)
//   OP 2: y[i] = 1 / (1 + exp(-y[i])) the sigmoid
// `b` is bound (and read) only by OP 0.

struct Params {
    n: u32,
    nb: u32,
    y_off: u32,
    b_off: u32,
    c: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override OP: u32 = 0u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= p.n {
        return;
    }
    let v = y[p.y_off + i];
    var r = v;
    switch OP {
        case 0u: { r = v + b[p.b_off + i % p.nb]; }
        case 1u: { r = clamp(v, -p.c, p.c); }
        default: { r = 1.0 / (1.0 + exp(-v)); }
    }
    y[p.y_off + i] = r;
}
