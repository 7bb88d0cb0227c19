// Shared by several kernels (prepended to their source): workgroup-wide reductions built on
// subgroup operations, so they work for any subgroup size. Call them in workgroup-uniform
// control flow; every invocation gets the same result (all sum the partials in the same order).

override WG: u32 = 256u;
// Sentinel for "minus infinity": finite, so exp(m - m) and max() stay well defined even where a
// driver treats infinities loosely.
const NEG_BIG: f32 = -3.0e38;

var<workgroup> red_f: array<f32, WG>;
var<workgroup> red_u: array<u32, WG>;

fn wg_sum(v: f32, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = subgroupAdd(v);
    workgroupBarrier();
    if lane == 0u {
        red_f[sg] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    for (var i = 0u; i < nsg; i++) {
        t += red_f[i];
    }
    return t;
}

fn wg_max(v: f32, sg: u32, nsg: u32, lane: u32) -> f32 {
    let s = subgroupMax(v);
    workgroupBarrier();
    if lane == 0u {
        red_f[sg] = s;
    }
    workgroupBarrier();
    var t = red_f[0];
    for (var i = 1u; i < nsg; i++) {
        t = max(t, red_f[i]);
    }
    return t;
}

// The largest v over the workgroup and its index; ties go to the lowest index.
fn wg_argmax(v: f32, idx: u32, sg: u32, nsg: u32, lane: u32) -> u32 {
    let m = subgroupMax(v);
    let i = subgroupMin(select(0xffffffffu, idx, v == m));
    workgroupBarrier();
    if lane == 0u {
        red_f[sg] = m;
        red_u[sg] = i;
    }
    workgroupBarrier();
    var bm = red_f[0];
    var bi = red_u[0];
    for (var s = 1u; s < nsg; s++) {
        let sm = red_f[s];
        if sm > bm || (sm == bm && red_u[s] < bi) {
            bm = sm;
            bi = red_u[s];
        }
    }
    return bi;
}
