enable f16;
// Prepended to matvec.wgsl where the device has SHADER_F16 (kernel `matvec_f16`): the two f16
// halves of w, each 1024 + c for an integer code c (q4: c in 0..16), less off (q4: 1032) in one
// packed f16 subtraction (exact: integers below 2048), widened to f32. (q8's bytes decoded the
// same way, c + 128 less 1152, measured no faster than its int → float conversions on an H200:
// 30B shapes within 0.3 %, so q8 keeps them.)
fn code_pair(w: u32, off: f32) -> vec2<f32> {
    // (naga 30 mistypes a bitcast from u32 to vec2<f16>: the pair goes through f32, exactly.)
    return vec2<f32>(vec2<f16>(unpack2x16float(w)) - vec2<f16>(f16(off)));
}
