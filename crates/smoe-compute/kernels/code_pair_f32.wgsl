// Prepended to matvec.wgsl (kernel `matvec`, for devices without SHADER_F16): code_pair_f16.wgsl's
// values with the subtraction in f32 (exact as well).
fn code_pair(w: u32, off: f32) -> vec2<f32> {
    return unpack2x16float(w) - vec2<f32>(off);
}
