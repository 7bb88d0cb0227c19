// A chain of bf16 matrix-vector products, y[s + 1] = W[s] · y[s], for `gpu::bench::persistent`:
// the same step run as one dispatch per step (what a decode layer does today) or as one
// persistent dispatch whose steps are separated by a barrier across its workgroups
// (grid_sync.wgsl's), with each step's weights loaded before (EARLY) or after the wait for the
// step before. A measurement of what a persistent decode kernel would gain, not an engine kernel.
//
// OVERLAP: one dispatch per step again, but from pipelines whose layout declares every binding
// read-only (`GpuContext::pipeline_unfenced`), so that wgpu puts no barrier between the steps and
// a step's workgroups may start while the step before runs: each waits on the arrival counter
// for every workgroup of the steps before (sync[0] counts them all, never reset between steps),
// and reads y through atomic loads (`ya`, the same buffer), which no SM's cache can answer from
// an older copy. With EARLY its weights are loaded before that wait, overlapping the step before.
//
// Shapes are fixed: COLS = 2048 inputs, 16 rows per workgroup (rows = 16 · workgroups); lane li
// of a workgroup multiplies 16-byte chunk li (8 inputs) of each of its 16 rows, the partial sums
// are added per subgroup and then per row in workgroup memory. Every step's y is written with
// plain stores and read, after the barrier, with plain loads: a region of y is read only after
// the step that writes it, so no SM holds an older copy of it.

struct Params {
    rows: u32,
    steps: u32,   // steps run by this dispatch
    step0: u32,   // the first of them
    groups: u32,  // PERSIST: workgroups that take part in each barrier
    spin_limit: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override PERSIST: bool = false;
override EARLY: bool = false;
override RESET: bool = false;
override OVERLAP: bool = false;
const COLS: u32 = 2048u;
const R: u32 = 16u;
const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
// Step s's matrix: rows · 256 vec4s (8 bf16 each) from s · rows · 256.
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
// y[s] at s · COLS floats; y[0] is the input.
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
// [0] arrivals, [1] workgroups that gave up waiting.
@group(0) @binding(3) var<storage, read_write> sync: array<atomic<u32>>;
// y again, for OVERLAP's atomic loads.
@group(0) @binding(4) var<storage, read_write> ya: array<atomic<u32>>;

var<workgroup> xs: array<f32, COLS>;
var<workgroup> red: array<f32, 512>; // R rows × up to 32 subgroups
var<workgroup> gave_up: u32;

fn bf16x8(q: vec4<u32>) -> array<vec4<f32>, 2> {
    let a = bitcast<vec4<f32>>(vec4<u32>(q.x << 16u, q.x & 0xffff0000u, q.y << 16u, q.y & 0xffff0000u));
    let b = bitcast<vec4<f32>>(vec4<u32>(q.z << 16u, q.z & 0xffff0000u, q.w << 16u, q.w & 0xffff0000u));
    return array<vec4<f32>, 2>(a, b);
}

fn load_rows(s: u32, row0: u32, li: u32) -> array<vec4<u32>, R> {
    var q: array<vec4<u32>, R>;
    let base = s * p.rows * 256u;
    for (var j = 0u; j < R; j++) {
        q[j] = w[base + (row0 + j) * 256u + li];
    }
    return q;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) ss: u32,
) {
    if RESET {
        if wg.x == 0u && li < 2u {
            atomicStore(&sync[li], 0u);
        }
        return;
    }
    let row0 = wg.x * R;
    let sg = li / ss;
    let nsg = WG / ss;
    for (var i = 0u; i < p.steps; i++) {
        let s = p.step0 + i;
        var q: array<vec4<u32>, R>;
        if EARLY {
            q = load_rows(s, row0, li);
        }
        if PERSIST && i > 0u {
            // Wait for every workgroup's step s − 1 (grid_wait.wgsl, prepended).
            if grid_wait(li, i * p.groups, p.spin_limit) {
                if li == 0u {
                    atomicAdd(&sync[1], 1u);
                }
                return;
            }
            storageBarrier();
        }
        if OVERLAP && s > 0u {
            // Every workgroup of steps 0..s (this dispatch is step s alone).
            if grid_wait(li, s * p.groups, p.spin_limit) {
                if li == 0u {
                    atomicAdd(&sync[1], 1u);
                }
                return;
            }
            storageBarrier();
        }
        for (var c = li; c < COLS; c += WG) {
            if OVERLAP {
                xs[c] = bitcast<f32>(atomicLoad(&ya[s * COLS + c]));
            } else {
                xs[c] = y[s * COLS + c];
            }
        }
        workgroupBarrier();
        if !EARLY {
            q = load_rows(s, row0, li);
        }
        for (var j = 0u; j < R; j++) {
            let v = bf16x8(q[j]);
            let x0 = vec4<f32>(xs[8u * li], xs[8u * li + 1u], xs[8u * li + 2u], xs[8u * li + 3u]);
            let x1 = vec4<f32>(xs[8u * li + 4u], xs[8u * li + 5u], xs[8u * li + 6u], xs[8u * li + 7u]);
            let t = subgroupAdd(dot(v[0], x0) + dot(v[1], x1));
            if lane == 0u {
                red[j * nsg + sg] = t;
            }
        }
        workgroupBarrier();
        if li < R {
            var acc = 0.0;
            for (var k = 0u; k < nsg; k++) {
                acc += red[li * nsg + k];
            }
            y[(s + 1u) * COLS + row0 + li] = acc;
        }
        if PERSIST || OVERLAP {
            // Publish this step's rows, then count the workgroup in.
            storageBarrier();
            if li == 0u {
                atomicAdd(&sync[0], 1u);
            }
        }
    }
}
