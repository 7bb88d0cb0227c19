// Sets the overlapped decode's arrival counter (gpu/chain.rs): sync[0] = p.value. Recorded
// before a pass's first chained dispatch and wherever an ordinary dispatch follows chained ones;
// it binds the counter writable, so wgpu fences it from the chained dispatches on both sides.

struct Params {
    value: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> sync: array<atomic<u32>>;

@compute @workgroup_size(1)
fn main() {
    atomicStore(&sync[0], p.value);
}
