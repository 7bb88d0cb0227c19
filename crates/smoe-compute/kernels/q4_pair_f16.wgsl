enable f16;
// Prepended to matvec.wgsl where the device has SHADER_F16 (kernel `matvec_f16`): the two f16
// halves of w, each 1024 + c for a 4-bit code c, less 1032 in one packed f16 subtraction (exact:
// small integers), widened to f32: (c0 − 8, c1 − 8).
fn q4_pair(w: u32) -> vec2<f32> {
    // (naga 30 mistypes a bitcast from u32 to vec2<f16>: the pair goes through f32, exactly.)
    return vec2<f32>(vec2<f16>(unpack2x16float(w)) - vec2<f16>(1032.0h));
}
