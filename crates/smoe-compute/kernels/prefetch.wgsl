// L2 prefetch (CPU twin: none — it computes nothing): touch one u32 in every 32-byte sector of a
// byte range so that a later dispatch finds the range in the GPU's L2 cache. Decode is a chain
// of dependent, latency-bound kernels that each leave most of the GPU's memory system idle; a
// prefetch recorded right after kernel K (and binding nothing K writes, so no barrier separates
// them) runs beside K and warms the weights of the kernel after it.
//
// The loaded words only feed an xor that is written to `sink` when it equals `magic`, so the
// compiler cannot drop the loads and nothing reads the result: a prefetch never changes what
// any other kernel computes.
//
// GROUPED: dispatch y is a slot; its range starts ids[ids_off + y] · mat_stride words further
// on (the experts a router chose, as the grouped matvec reads them).

struct Params {
    words: u32,      // u32 words in one range
    base: u32,       // u32 index of the (first) range in the binding
    mat_stride: u32, // GROUPED: u32 words between stacked matrices
    ids_off: u32,
    n_mats: u32,     // GROUPED: ids at or above this are skipped
    magic: u32,
    _pad0: u32,
    _pad1: u32,
}

override GROUPED: bool = false;
const WG: u32 = 256u;
// Sectors per invocation, loaded before any is used.
const PER: u32 = 8u;
// u32 words per 32-byte sector.
const SECTOR: u32 = 8u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> sink: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var base = p.base;
    if GROUPED {
        let id = ids[p.ids_off + g.y];
        if id >= p.n_mats {
            return;
        }
        base += id * p.mat_stride;
    }
    let first = g.x * WG * PER + li;
    var v: array<u32, PER>;
    for (var j = 0u; j < PER; j++) {
        let word = (first + j * WG) * SECTOR;
        if word < p.words {
            v[j] = w[base + word];
        }
    }
    var acc = 0u;
    for (var j = 0u; j < PER; j++) {
        acc ^= v[j];
    }
    if acc == p.magic {
        sink[li] = acc;
    }
}
