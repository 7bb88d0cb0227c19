//! Per-sequence key/value cache, preallocated for the context length at creation.

use crate::error::EngineError;

pub struct KvCache {
    /// `[layer][position * kv_width + i]`
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    kv_width: usize,
    capacity: usize,
    /// Positions filled so far.
    pub len: usize,
    /// The cache of a GPU model lives in GPU memory (`k` and `v` stay empty), created at the
    /// first forward pass together with the kernels bound to it.
    pub(crate) gpu: Option<Box<crate::gpu::GpuKv>>,
}

impl KvCache {
    pub fn new(layers: usize, kv_width: usize, capacity: usize) -> Self {
        KvCache {
            k: (0..layers)
                .map(|_| vec![0.0; capacity * kv_width])
                .collect(),
            v: (0..layers)
                .map(|_| vec![0.0; capacity * kv_width])
                .collect(),
            kv_width,
            capacity,
            len: 0,
            gpu: None,
        }
    }

    /// A cache for a GPU model: no host copy of keys and values.
    pub(crate) fn on_gpu(kv_width: usize, capacity: usize) -> Self {
        KvCache {
            k: vec![],
            v: vec![],
            kv_width,
            capacity,
            len: 0,
            gpu: None,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Fails, rather than overwriting, when `n` more positions do not fit.
    pub fn check_room(&self, n: usize) -> Result<(), EngineError> {
        if self.len + n > self.capacity {
            return Err(EngineError::ContextFull {
                needed: self.len + n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Stores keys and values of the tokens at positions `pos0..`.
    pub fn write(&mut self, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let w = self.kv_width;
        self.k[layer][pos0 * w..pos0 * w + k.len()].copy_from_slice(k);
        self.v[layer][pos0 * w..pos0 * w + v.len()].copy_from_slice(v);
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }
}
