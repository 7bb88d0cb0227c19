// Groups routed slots by expert for the grouped GEMM (CPU twin: a counting sort).
//
// In: ids[s], the expert of slot s (slot t·k + j is token t's j-th choice), or an id ≥ n_mats
// for a slot to skip (a streaming GPU runs a batch's experts in rounds: the slots of the other
// rounds' experts are skipped, and their outputs keep what an earlier round wrote). Out: perm,
// the slot indices grouped by expert, skipped slots last; starts[e] = the index in perm of
// expert e's first slot (starts[n_mats] = the count of slots not skipped); and the GEMM's work
// list: units[0] = the count of work units, units[1 + u] = unit u = (e << 20) | i, token tile i
// (perm[starts[e] + i·TILE ..], at most TILE slots) of expert e < n_mats, ordered by (e, i).
// One GEMM workgroup per unit keeps a popular expert from serialising its tiles.
//
// A counting sort in one workgroup: the slots of each expert (bucket) are counted with
// workgroup atomics, the counts and each expert's tiles scanned into starts and unit indices,
// then every slot takes the next place in its bucket with an atomic increment. Within an expert
// the slots' order therefore depends on timing; nothing computed from them does: the grouped
// GEMMs compute every slot's row alone, with the same operations wherever it sits in a tile,
// and starts and units depend only on the counts. (A bitonic sort of (expert, slot) keys, which
// also fixed that order, took 37.5 µs per 4,096 slots on an H200: ~100 barriers.)

struct Params {
    n_slots: u32,
    n_mats: u32,
    ids_off: u32,
    max_units: u32, // units has room for 1 + max_units words
}

override NB: u32 = 129u; // buckets: n_mats experts and the skipped slots
override WG: u32 = 256u;
override TILE: u32 = 48u; // slots per GEMM token tile (the GEMM's BN)
const SLOT_BITS: u32 = 20u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> starts: array<u32>;
@group(0) @binding(3) var<storage, read_write> perm: array<u32>;
@group(0) @binding(4) var<storage, read_write> units: array<u32>;

// Per bucket: its count, then the next place in perm to fill.
var<workgroup> count: array<atomic<u32>, NB>;
// Per invocation: the slots and tiles of its buckets, scanned.
var<workgroup> part_c: array<u32, WG>;
var<workgroup> part_t: array<u32, WG>;

// Ids ≥ n_mats all go to bucket n_mats, which gets no work unit: so no id can send the GEMM
// outside the weight stack (kernels run without bounds checks in release builds).
fn bucket(s: u32) -> u32 {
    return min(ids[p.ids_off + s], p.n_mats);
}

fn tiles(b: u32, c: u32) -> u32 {
    return select(0u, (c + TILE - 1u) / TILE, b < p.n_mats);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    let nb = p.n_mats + 1u;
    for (var b = li; b < nb; b += WG) {
        atomicStore(&count[b], 0u);
    }
    workgroupBarrier();
    for (var s = li; s < p.n_slots; s += WG) {
        atomicAdd(&count[bucket(s)], 1u);
    }
    workgroupBarrier();
    // Invocation li owns buckets b0 .. b0 + per: their sums, scanned over the invocations.
    let per = (nb + WG - 1u) / WG;
    let b0 = li * per;
    let b1 = min(b0 + per, nb);
    var c_sum = 0u;
    var t_sum = 0u;
    for (var b = b0; b < b1; b++) {
        let c = atomicLoad(&count[b]);
        c_sum += c;
        t_sum += tiles(b, c);
    }
    part_c[li] = c_sum;
    part_t[li] = t_sum;
    workgroupBarrier();
    for (var d = 1u; d < WG; d <<= 1u) {
        var c_add = 0u;
        var t_add = 0u;
        if li >= d {
            c_add = part_c[li - d];
            t_add = part_t[li - d];
        }
        workgroupBarrier();
        part_c[li] += c_add;
        part_t[li] += t_add;
        workgroupBarrier();
    }
    // Exclusive prefixes of this invocation's first bucket, then its buckets in order.
    var at = part_c[li] - c_sum;
    var unit = part_t[li] - t_sum;
    for (var b = b0; b < b1; b++) {
        let c = atomicLoad(&count[b]);
        starts[b] = at;
        atomicStore(&count[b], at);
        let t = tiles(b, c);
        for (var i = 0u; i < t; i++) {
            // The min only guards the buffer: the count never exceeds max_units.
            units[1u + min(unit + i, p.max_units - 1u)] = (b << SLOT_BITS) | i;
        }
        at += c;
        unit += t;
    }
    if li == WG - 1u {
        units[0] = part_t[li]; // the count of units (skipped slots make none)
    }
    workgroupBarrier();
    for (var s = li; s < p.n_slots; s += WG) {
        perm[atomicAdd(&count[bucket(s)], 1u)] = s;
    }
}
