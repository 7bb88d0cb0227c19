// Greedy sampling on the GPU (CPU twin: the engine's sampler::argmax): the index of the largest
// logit of each row; ties go to the lowest index, NaN counts as -inf, so an all -inf/NaN row
// gives 0. One workgroup per row.

struct Params {
    n: u32,
    x_off: u32,
    out_off: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let base = p.x_off + wid.x * p.n;
    // Each invocation scans its elements in increasing order, keeping the first maximum.
    var bv = NEG_BIG;
    var bi = 0xffffffffu;
    for (var i = li; i < p.n; i += WG) {
        var v = x[base + i];
        // NaN (and -inf) become the sentinel, tested on the bits so no fast-math folds it away.
        let b = bitcast<u32>(v);
        if (b & 0x7fffffffu) > 0x7f800000u || b == 0xff800000u {
            v = NEG_BIG;
        }
        if v > bv || bi == 0xffffffffu {
            bv = v;
            bi = i;
        }
    }
    let best = wg_argmax(bv, bi, sg, nsg, lane);
    if li == 0u {
        out[p.out_off + wid.x] = select(best, 0u, best == 0xffffffffu);
    }
}
