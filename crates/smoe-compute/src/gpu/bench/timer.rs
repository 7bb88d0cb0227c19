//! Timing for `gpu::bench`: GPU timestamps around one compute pass when the device has
//! TIMESTAMP_QUERY, else the wall clock around the submission.

use crate::gpu::context::{GpuContext, GpuError};
use std::time::Instant;

pub(super) struct Timer<'a> {
    ctx: &'a GpuContext,
    pub(super) query: Option<(wgpu::QuerySet, wgpu::Buffer)>,
}

impl<'a> Timer<'a> {
    pub(super) fn new(ctx: &'a GpuContext) -> Self {
        let query = ctx
            .info()
            .features
            .contains(wgpu::Features::TIMESTAMP_QUERY)
            .then(|| {
                let qs = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("bench"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                });
                let buf = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("bench timestamps"),
                    size: 16,
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                });
                (qs, buf)
            });
        Timer { ctx, query }
    }

    /// Seconds for the calls `rec` records into one compute pass: the fastest of 3 timed runs,
    /// after warm-up runs for at least 100 ms (an idle GPU runs at low clocks for a while: the
    /// first version of this bench, warmed once, saw its copy bandwidth swing from 1.7 to 4.2 TB/s).
    pub(super) fn time(&self, rec: &dyn Fn(&mut wgpu::ComputePass<'_>)) -> Result<f64, GpuError> {
        let t0 = Instant::now();
        let mut warm = 0;
        while warm < 3 || t0.elapsed().as_secs_f64() < 0.1 {
            let mut enc = self.ctx.encoder();
            crate::gpu::in_pass(&mut enc, "bench warm-up", rec);
            self.ctx.submit_wait(enc);
            warm += 1;
        }
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(self.time_once(rec)?);
        }
        Ok(best)
    }

    fn time_once(&self, rec: &dyn Fn(&mut wgpu::ComputePass<'_>)) -> Result<f64, GpuError> {
        let mut enc = self.ctx.encoder();
        let tw = self
            .query
            .as_ref()
            .map(|(qs, _)| wgpu::ComputePassTimestampWrites {
                query_set: qs,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("bench"),
                timestamp_writes: tw,
            });
            rec(&mut pass);
        }
        if let Some((qs, buf)) = &self.query {
            enc.resolve_query_set(qs, 0..2, buf, 0);
        }
        let t0 = Instant::now();
        self.ctx.submit_wait(enc);
        let wall = t0.elapsed().as_secs_f64();
        match &self.query {
            Some((_, buf)) => {
                let ts = self.ctx.read_bytes(buf, 0, 16)?;
                let t: Vec<u64> = bytemuck::pod_collect_to_vec(&ts);
                let ns =
                    t[1].wrapping_sub(t[0]) as f64 * self.ctx.queue.get_timestamp_period() as f64;
                // A timestamp pair that makes no sense (some drivers) falls back to the wall.
                Ok(if ns > 0.0 && ns < 1e12 {
                    ns * 1e-9
                } else {
                    wall
                })
            }
            None => Ok(wall),
        }
    }
}
