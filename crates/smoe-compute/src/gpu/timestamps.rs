//! GPU timestamps between the dispatches of a compute pass, for a per-step time breakdown
//! (`smoe bench decode --breakdown`). Needs `TIMESTAMP_QUERY_INSIDE_PASSES`; where the adapter
//! lacks it `Timestamps::new` returns `None` and callers simply do not profile.
//!
//! Mark i records when the GPU finished everything before it; the time between marks i−1 and i
//! is charged to mark i's label. Timestamps between dependent dispatches serialize nothing that
//! was not already serialized (each of our dispatches waits for the previous one's writes).

use super::context::GpuContext;

/// Queries per pass; marks beyond it are dropped (and counted).
pub const MAX_MARKS: u32 = 4096;

pub struct Timestamps {
    set: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    staging: wgpu::Buffer,
    labels: Vec<&'static str>,
    dropped: u64,
    period_ns: f64,
}

impl Timestamps {
    pub fn new(ctx: &GpuContext) -> Option<Self> {
        let need = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if !ctx.info().features.contains(need) {
            return None;
        }
        let bytes = 8 * MAX_MARKS as u64;
        let buf = |label, usage| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        use wgpu::BufferUsages as U;
        Some(Timestamps {
            set: ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: MAX_MARKS,
            }),
            resolved: buf("timestamps resolved", U::QUERY_RESOLVE | U::COPY_SRC),
            staging: buf("timestamps read", U::MAP_READ | U::COPY_DST),
            labels: vec![],
            dropped: 0,
            period_ns: ctx.queue.get_timestamp_period() as f64,
        })
    }

    /// Records a timestamp after what the pass holds so far, charged to `label`.
    pub fn mark(&mut self, pass: &mut wgpu::ComputePass<'_>, label: &'static str) {
        let i = self.labels.len() as u32;
        if i >= MAX_MARKS {
            self.dropped += 1;
            return;
        }
        pass.write_timestamp(&self.set, i);
        self.labels.push(label);
    }

    /// Marks that did not fit since the last `collect`.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Records the resolution of the marks (after the pass has ended).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        let n = self.labels.len() as u32;
        if n == 0 {
            return;
        }
        enc.resolve_query_set(&self.set, 0..n, &self.resolved, 0);
        enc.copy_buffer_to_buffer(&self.resolved, 0, &self.staging, 0, 8 * n as u64);
    }

    /// After the submission that resolved them completed: (label, ns since the previous mark)
    /// for every mark but the first, and a fresh start.
    pub fn collect(&mut self, ctx: &GpuContext) -> Vec<(&'static str, f64)> {
        let n = self.labels.len();
        if n == 0 {
            return vec![];
        }
        let slice = self.staging.slice(..8 * n as u64);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
        let mut out = vec![];
        if let Ok(Ok(())) = rx.recv() {
            if let Ok(view) = slice.get_mapped_range() {
                let ts: Vec<u64> = bytemuck::pod_collect_to_vec(&view[..]);
                for i in 1..n {
                    let dt = ts[i].saturating_sub(ts[i - 1]) as f64 * self.period_ns;
                    out.push((self.labels[i], dt));
                }
            }
            self.staging.unmap();
        }
        self.labels.clear();
        self.dropped = 0;
        out
    }
}
