//! Wrapper of `kernels/router.wgsl`: softmax + top-k (+ norm_topk_prob) on the GPU.

use super::buffers::BufRef;
use super::context::{GpuContext, GpuError};
use super::ops::{recordable, Dispatch};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_exp: u32,
    k: u32,
    normalize: u32,
    x_off: u32,
    ids_off: u32,
    w_off: u32,
    _pad: [u32; 2],
}

/// Routes `n_tokens` tokens: from `logits` (`[n_tokens][n_experts]` f32) writes `ids`
/// (`[n_tokens][k]` u32, most probable first) and `weights` (`[n_tokens][k]` f32, the softmax
/// probabilities, renormalised over the k when `normalize`).
pub struct Router {
    d: Dispatch,
}

/// Limits of the kernel's workgroup arrays.
pub const MAX_EXPERTS: usize = 1024;
pub const MAX_TOP_K: usize = 64;

impl Router {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &GpuContext,
        logits: BufRef,
        ids: BufRef,
        weights: BufRef,
        n_experts: usize,
        k: usize,
        n_tokens: usize,
        normalize: bool,
    ) -> Result<Self, GpuError> {
        if n_experts > MAX_EXPERTS || k > MAX_TOP_K || k == 0 || k > n_experts {
            return Err(GpuError::Shape(format!(
                "router: {k} of {n_experts} experts (at most {MAX_TOP_K} of {MAX_EXPERTS})"
            )));
        }
        let (lb, x_off) = logits.bind(ctx, "router logits", n_experts * n_tokens, 4)?;
        let (ib, ids_off) = ids.bind(ctx, "router ids", k * n_tokens, 4)?;
        let (wb, w_off) = weights.bind(ctx, "router weights", k * n_tokens, 4)?;
        let p = Params {
            n_exp: n_experts as u32,
            k: k as u32,
            normalize: normalize as u32,
            x_off,
            ids_off,
            w_off,
            _pad: [0; 2],
        };
        let bufs = [lb, ib, wb];
        let d = Dispatch::new(ctx, "router", &[("WG", 256.0)], &p, &bufs, [n_tokens, 1, 1])?;
        Ok(Router { d })
    }
}
recordable!(Router, "router", d);
