// Groups routed slots by expert for the grouped GEMM (CPU twin: a stable counting sort).
//
// In: ids[s], the expert of slot s (slot t·k + j is token t's j-th choice), or an id ≥ n_mats
// for a slot to skip (a streaming GPU runs a batch's experts in rounds: the slots of the other
// rounds' experts are skipped, and their outputs keep what an earlier round wrote). Out: perm,
// the slot indices ordered by expert and, within an expert, by slot (so the result is
// deterministic), skipped slots last; starts[e] = the index in perm of expert e's first slot
// (starts[n_mats] = the count of slots not skipped); and the GEMM's work list: units[0] = the
// count of work units, units[1 + u] = unit u = (e << 20) | i, token tile i
// (perm[starts[e] + i·TILE ..], at most TILE slots) of expert e < n_mats, ordered by (e, i).
// One GEMM workgroup per unit keeps a popular expert from serialising its tiles.
//
// One workgroup sorts keys (expert << 20 | slot) with a bitonic network in workgroup memory:
// every key is distinct, so the order is total and the network's result unique — unlike
// placement by atomic counters, whose order within an expert depends on timing. KEYS (a power of
// two ≥ n_slots) keys of 4 bytes must fit workgroup memory: 4096 slots take 16 KiB. About
// log2(KEYS)²/2 barriers (78 for 4096): a few microseconds, once per layer. The work list then
// reuses the key array for an exclusive scan of "a tile starts here" flags over the sorted
// positions (2·log2(KEYS) more barriers): a tile's unit index is the number of tiles before it.

struct Params {
    n_slots: u32,
    n_mats: u32,
    ids_off: u32,
    max_units: u32, // units has room for 1 + max_units words
}

override KEYS: u32 = 4096u; // a power of two ≥ n_slots, ≥ 2
override WG: u32 = 256u;
override TILE: u32 = 48u; // slots per GEMM token tile (the GEMM's BN)
const SLOT_BITS: u32 = 20u;
const SLOT_MASK: u32 = 0xfffffu;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> starts: array<u32>;
@group(0) @binding(3) var<storage, read_write> perm: array<u32>;
@group(0) @binding(4) var<storage, read_write> units: array<u32>;

var<workgroup> keys: array<u32, KEYS>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    for (var i = li; i < KEYS; i += WG) {
        var k = 0xffffffffu; // padding sorts last
        if i < p.n_slots {
            // Ids ≥ n_mats all sort into bucket n_mats, which gets no work unit: so no id can
            // send the GEMM outside the weight stack (kernels run without bounds checks in
            // release builds).
            k = (min(ids[p.ids_off + i], p.n_mats) << SLOT_BITS) | i;
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
    // (Skipped slots form bucket n_mats, so starts[n_mats] lands on the first of them.)
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
    // The work list. starts (written above by other invocations) must be visible, and every
    // read of keys above done before keys is overwritten by the flags.
    storageBarrier();
    workgroupBarrier();
    for (var i = li; i < KEYS; i += WG) {
        var f = 0u;
        let e = keys[i] >> SLOT_BITS;
        if i < p.n_slots && e < p.n_mats {
            f = select(0u, 1u, (i - starts[e]) % TILE == 0u);
        }
        keys[i] = f;
    }
    workgroupBarrier();
    // Exclusive scan in place (Blelloch): up-sweep of partial sums, then the down-sweep.
    for (var d = 1u; d < KEYS; d <<= 1u) {
        for (var i = li; i < KEYS / (2u * d); i += WG) {
            let hi = (2u * i + 2u) * d - 1u;
            keys[hi] += keys[hi - d];
        }
        workgroupBarrier();
    }
    if li == 0u {
        units[0] = keys[KEYS - 1u]; // the total: the count of units
        keys[KEYS - 1u] = 0u;
    }
    workgroupBarrier();
    for (var d = KEYS / 2u; d > 0u; d >>= 1u) {
        for (var i = li; i < KEYS / (2u * d); i += WG) {
            let hi = (2u * i + 2u) * d - 1u;
            let lo = hi - d;
            let t = keys[lo];
            keys[lo] = keys[hi];
            keys[hi] += t;
        }
        workgroupBarrier();
    }
    // keys[j] is now the number of tiles opened before position j. The expert of position j is
    // that of its slot (perm[j] was written above, ids clamped as for the keys).
    for (var j = li; j < p.n_slots; j += WG) {
        let e = min(ids[p.ids_off + perm[j]], p.n_mats);
        let r = j - starts[min(e, p.n_mats - 1u)];
        if e < p.n_mats && r % TILE == 0u {
            // The min only guards the buffer (kernels run unchecked): the count never exceeds
            // max_units.
            units[1u + min(keys[j], p.max_units - 1u)] = (e << SLOT_BITS) | (r / TILE);
        }
    }
}
