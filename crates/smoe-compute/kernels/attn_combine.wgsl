// Decode attention, pass 2 of 2: merges the n_split partial results of attn_decode for each
// (head, token) (attn_merge.wgsl, prepended). On Vulkan the decode kernel's last split merges
// instead (its MERGE tail) and this pass does not run.

struct Params {
    n_heads: u32,
    head_dim: u32,
    n_split: u32,
    ml_off: u32,
    out_off: u32, // f32 index of token 0's output (token stride n_heads·head_dim)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

fn part_at(i: u32) -> f32 {
    return part[i];
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    merge_splits(wid.x, wid.y, li, 128u);
}
