//! `smoe info`: what this machine offers smoe: CPU threads, and the GPU adapter that
//! `--backend gpu|auto` would use, with its features, limits and free memory (or why there is
//! none).

use anyhow::Result;
use smoe_compute::gpu::kernel_names;
use smoe_engine::gpu;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> Result<()> {
    println!("smoe {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu: {} threads, kernels {}",
        rayon::current_num_threads(),
        smoe_compute::cpu::simd_path()
    );
    // The engine's device: a discrete / high-performance adapter first.
    match gpu::context() {
        Ok(ctx) => {
            println!("{}", ctx.info());
            // What `--vram-cache auto` and a resident load stay within.
            match ctx.memory_room() {
                Ok(room) => println!("memory: {room}"),
                Err(why) => println!("memory: free amount unknown ({why})"),
            }
            println!("kernels: {}", kernel_names().join(" "));
        }
        // Not an error: the CPU backend still works, and `auto` will use it.
        Err(e) => println!("no GPU adapter ({e})"),
    }
    match gpu::auto_adapter() {
        Ok(()) => println!("--backend auto: gpu"),
        Err(e) => println!("--backend auto: cpu ({e})"),
    }
    Ok(())
}
