//! Where can an O_DIRECT read land on this GPU? For a mapped `MAP_WRITE | COPY_SRC` staging
//! buffer and (with `MAPPABLE_PRIMARY_BUFFERS`) a mapped `MAP_WRITE | STORAGE` buffer: the
//! mapping's alignment, whether O_DIRECT reads into it work and how fast, how fast the host
//! reads the bytes back (checksum) and writes them (memcpy), and the copy into a VRAM buffer.
//! Against an aligned host buffer. Usage: `staging_probe FILE [MiB]` (FILE ≥ MiB, on the disk
//! under test). A measurement tool for docs/performance.md, not part of the engine.

use smoe_compute::gpu::wgpu;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: staging_probe FILE [MiB]");
    let mib: usize = args.next().map_or(64, |s| s.parse().expect("MiB"));
    let len = mib << 20;
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("open O_DIRECT");
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .expect("adapter");
    let info = adapter.get_info();
    println!(
        "adapter: {} ({:?}, {:?})",
        info.name, info.device_type, info.backend
    );
    let mappable = adapter
        .features()
        .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_features: if mappable {
            wgpu::Features::MAPPABLE_PRIMARY_BUFFERS
        } else {
            wgpu::Features::empty()
        },
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("device");
    let vram = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("vram"),
        size: len as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });

    // The host baseline: an aligned heap buffer.
    let layout = std::alloc::Layout::from_size_align(len, 16 << 10).unwrap();
    let host = unsafe { std::alloc::alloc_zeroed(layout) };
    let host = unsafe { std::slice::from_raw_parts_mut(host, len) };
    probe("host heap", &direct, host);

    let mut kinds = vec![(
        "staging MAP_WRITE|COPY_SRC",
        wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
    )];
    if mappable {
        kinds.push((
            "mappable MAP_WRITE|STORAGE|COPY_SRC",
            wgpu::BufferUsages::MAP_WRITE
                | wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC,
        ));
    } else {
        println!("MAPPABLE_PRIMARY_BUFFERS: not offered");
    }
    for (name, usage) in kinds {
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(name),
            size: len as u64,
            usage,
            mapped_at_creation: true,
        });
        {
            let mut view = buf.slice(..).get_mapped_range_mut().expect("mapped");
            probe(name, &direct, raw(&mut view));
        }
        buf.unmap();
        for _ in 0..3 {
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&buf, 0, &vram, 0, len as u64);
            let t = Instant::now();
            queue.submit([enc.finish()]);
            device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            let s = t.elapsed().as_secs_f64();
            println!("  {name}: copy to VRAM {:.1} GB/s", len as f64 / s / 1e9);
        }
        // Map again (what a staging ring does after each use).
        let t = Instant::now();
        buf.slice(..)
            .map_async(wgpu::MapMode::Write, |r| r.expect("map"));
        device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        println!(
            "  {name}: map again {:.1} µs",
            t.elapsed().as_secs_f64() * 1e6
        );
        let mut view = buf.slice(..).get_mapped_range_mut().expect("mapped");
        probe(&format!("{name}, mapped again"), &direct, raw(&mut view));
    }
    // write_buffer: what the engine does today (memcpy into wgpu's staging, then a copy).
    for _ in 0..3 {
        let t = Instant::now();
        queue.write_buffer(&vram, 0, host);
        let w = t.elapsed().as_secs_f64();
        queue.submit([]);
        device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "write_buffer: host copy {:.1} GB/s, with the GPU copy {:.1} GB/s",
            len as f64 / w / 1e9,
            len as f64 / s / 1e9
        );
    }
}

fn probe(name: &str, direct: &std::fs::File, dst: &mut [u8]) {
    let len = dst.len();
    println!(
        "{name}: mapped at {:#x} (mod 4 KiB: {}, mod 16 KiB: {})",
        dst.as_ptr() as usize,
        dst.as_ptr() as usize % 4096,
        dst.as_ptr() as usize % 16384
    );
    for rep in 0..2 {
        // Fresh file offsets each time (the disk's own cache).
        let offset = ((rep + 1) * len) as u64;
        let t = Instant::now();
        let r = direct.read_exact_at(dst, offset);
        let s = t.elapsed().as_secs_f64();
        match r {
            Ok(()) => println!("  O_DIRECT read: {:.2} GB/s", len as f64 / s / 1e9),
            Err(e) => println!("  O_DIRECT read failed: {e}"),
        }
    }
    // 4 MiB at most: a PCIe BAR mapping reads back at a few MB/s.
    let back = &dst[..len.min(4 << 20)];
    let t = Instant::now();
    let sum = back.iter().fold(0u64, |a, &b| a.wrapping_add(b as u64));
    let s = t.elapsed().as_secs_f64();
    println!(
        "  host reads it back (as a checksum would): {:.1} MB/s (sum {sum})",
        back.len() as f64 / s / 1e6
    );
    let src = vec![7u8; len];
    let t = Instant::now();
    dst.copy_from_slice(&src);
    let s = t.elapsed().as_secs_f64();
    println!("  host memcpy into it: {:.2} GB/s", len as f64 / s / 1e9);
}

/// The mapped bytes as a plain slice: reading it back is what this probe measures (wgpu only
/// hands out write-only views because the memory may be write-combined).
fn raw(view: &mut wgpu::BufferViewMut) -> &mut [u8] {
    let len = view.len();
    let ptr = view.slice(..).as_raw_element_ptr().as_ptr();
    // SAFETY: the view covers len mapped bytes and outlives the slice.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}
