// The wait of a barrier across the workgroups of one dispatch (grid_sync.wgsl,
// persist_matvec.wgsl; bench kernels only): invocation 0 polls the arrival counter `sync[0]`
// until it reaches `want` or `spin_limit` polls pass, and every invocation learns whether it
// gave up. The kernel declares `sync` (array<atomic<u32>>) and `var<workgroup> gave_up: u32`.
// Call from uniform control flow.
fn grid_wait(li: u32, want: u32, spin_limit: u32) -> bool {
    if li == 0u {
        var polls = 0u;
        loop {
            if atomicLoad(&sync[0]) >= want || polls >= spin_limit {
                break;
            }
            polls++;
        }
        gave_up = select(0u, 1u, polls >= spin_limit);
    }
    return workgroupUniformLoad(&gave_up) != 0u;
}
