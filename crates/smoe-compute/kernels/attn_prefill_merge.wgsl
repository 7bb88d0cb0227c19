// Prefill attention, pass 2 where attn_prefill split long tiles' keys into units (SPLITS > 1)
// and does not merge them itself (no MERGE tail: not Vulkan, or fused tails off):
// attn_prefill_common.wgsl, prepended, says how and has the merge. Workgroup (x, y) = (KV head,
// row tile); a tile of one unit was written by attn_prefill itself and is left alone.

@group(0) @binding(2) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

fn part_vec(i: u32) -> vec4<f32> {
    return part[i];
}

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let tk = tile_keys(wid.y);
    if tk.n_units > 1u {
        merge_tile(wid.x, wid.y, tk, li, 128u);
    }
}
