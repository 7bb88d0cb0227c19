// A barrier across the workgroups of one dispatch (`gpu::bench::grid`, a measurement only):
// what a persistent decode kernel — one dispatch per layer or token, its steps separated by
// such barriers instead of by dependent dispatches — would pay per step.
//
// Each round, every workgroup publishes a value (its round and index), counts itself in on
// `sync[0]` and waits until all `groups` have arrived; then it reads its neighbour's value with
// an atomic load (never a stale per-core cache line) and counts a stale one in `sync[2]`. WGSL
// does not promise that a dispatch's workgroups run together: one that waits `spin_limit`
// polls without seeing the others gives up (counted in `sync[1]`) and ends, so a device that
// cannot hold them all at once reports that instead of hanging (`grid_wait`, grid_wait.wgsl,
// prepended). RESET: one invocation zeroes
// the counters (a dispatch of its own, before the measured one).

struct Params {
    rounds: u32,
    groups: u32,
    spin_limit: u32,
    _pad: u32,
}

override RESET: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
// [0] arrivals, [1] workgroups that gave up waiting, [2] stale reads.
@group(0) @binding(1) var<storage, read_write> sync: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> vals: array<atomic<u32>>;

var<workgroup> gave_up: u32;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    if RESET {
        if wg.x == 0u && li < 3u {
            atomicStore(&sync[li], 0u);
        }
        return;
    }
    let g = wg.x;
    for (var r = 0u; r < p.rounds; r++) {
        if li == 0u {
            atomicStore(&vals[g], r * p.groups + g);
        }
        // Release: the value before the arrival (device scope in naga's SPIR-V, as the fused
        // tails rely on).
        storageBarrier();
        if li == 0u {
            atomicAdd(&sync[0], 1u);
        }
        if grid_wait(li, (r + 1u) * p.groups, p.spin_limit) {
            if li == 0u {
                atomicAdd(&sync[1], 1u);
            }
            return;
        }
        storageBarrier();
        if li == 0u {
            // The neighbour has published this round's value, and may already be in the next.
            let o = (g + 1u) % p.groups;
            let v = atomicLoad(&vals[o]);
            if v != r * p.groups + o && v != (r + 1u) * p.groups + o {
                atomicAdd(&sync[2], 1u);
            }
        }
    }
}
