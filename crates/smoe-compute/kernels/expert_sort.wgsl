// Groups routed slots by expert for the grouped GEMM (CPU twin: a stable counting sort).
//
// In: ids[s], the expert of slot s (slot t·k + j is token t's j-th choice). Out: perm, the slot
// indices ordered by expert and, within an expert, by slot (so the result is deterministic), and
// starts[e] = the index in perm of expert e's first slot (starts[n_mats] = n_slots).
//
// One workgroup sorts keys (expert << 20 | slot) with a bitonic network in workgroup memory:
// every key is distinct, so the order is total and the network's result unique — unlike
// placement by atomic counters, whose order within an expert depends on timing. KEYS (a power of
// two ≥ n_slots) keys of 4 bytes must fit workgroup memory: 4096 slots take 16 KiB. About
// log2(KEYS)²/2 barriers (78 for 4096): a few microseconds, once per layer.

struct Params {
    n_slots: u32,
    n_mats: u32,
    ids_off: u32,
    _pad: u32,
}

override KEYS: u32 = 4096u; // a power of two ≥ n_slots, ≥ 2
override WG: u32 = 256u;
const SLOT_BITS: u32 = 20u;
const SLOT_MASK: u32 = 0xfffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> starts: array<u32>;
@group(0) @binding(3) var<storage, read_write> perm: array<u32>;

var<workgroup> keys: array<u32, KEYS>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    for (var i = li; i < KEYS; i += WG) {
        var k = 0xffffffffu; // padding sorts last
        if i < p.n_slots {
            // Clamped so that a bad id can never send the GEMM outside the weight stack (kernels
            // run without bounds checks in release builds); ids < n_mats are the contract.
            k = (min(ids[p.ids_off + i], p.n_mats - 1u) << SLOT_BITS) | i;
        }
        keys[i] = k;
    }
    workgroupBarrier();
    for (var size = 2u; size <= KEYS; size <<= 1u) {
        for (var stride = size >> 1u; stride > 0u; stride >>= 1u) {
            for (var i = li; i < KEYS / 2u; i += WG) {
                // The i-th compare pair: lo has bit `stride` clear, hi = lo + stride.
                let lo = ((i & ~(stride - 1u)) << 1u) | (i & (stride - 1u));
                let hi = lo | stride;
                let a = keys[lo];
                let b = keys[hi];
                let ascending = (lo & size) == 0u;
                if (a > b) == ascending {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
            workgroupBarrier();
        }
    }
    // perm, and starts from the boundaries: index j opens experts prev + 1 ..= e (prev being the
    // expert at j - 1, or -1); j = n_slots closes the rest. Each starts[e] is written once.
    for (var j = li; j <= p.n_slots; j += WG) {
        var e = p.n_mats;
        if j < p.n_slots {
            let k = keys[j];
            perm[j] = k & SLOT_MASK;
            e = k >> SLOT_BITS;
        }
        var first = 0u;
        if j > 0u {
            first = (keys[j - 1u] >> SLOT_BITS) + 1u;
        }
        for (var m = first; m <= e; m++) {
            starts[m] = j;
        }
    }
}
