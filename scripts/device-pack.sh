#!/usr/bin/env bash
# Packs what a session runs on the lent GPU machine (no Rust toolchain there): the release `smoe`,
# the GPU test binaries and the `pipeline_stats` example (the driver's register counts), stripped, in one xz archive (they share most of their bytes, so a
# 192 MiB dictionary keeps all of them under the 64 MiB carry), plus the Vulkan/GL loader debs.
#
#   scripts/device-pack.sh [EXTRA_DIR...]   # EXTRA_DIRs (e.g. kernel variants for
#                                           # SMOE_KERNEL_DIR) go into the archive too
#
# Then, with the device tool: carry [".gl", ".dev/pack.tar.xz", ".dev/device.sh"] and run
#   bash .dev/device.sh 'smoe info; SMOE_REQUIRE_GPU=1 .dev/bin/gpu_kernels matmul'
# where .dev/device.sh unpacks into .dev/bin, prepares the loader, links /work/main to the tree
# (the test fixtures' paths are compiled in) and runs its argument with bash.
# See docs/testing.md ("Trying a kernel variant") and docs/performance.md for what was measured.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device-debs.sh

cargo build --release -p smoe-cli
rm -rf .dev/bin && mkdir -p .dev/bin
cp target/release/smoe .dev/bin/
for t in smoe-compute:gpu_kernels smoe-engine:gpu_parity smoe-engine:gpu_streaming smoe-engine:gpu_unfused; do
    crate=${t%%:*} test=${t#*:}
    path=$(cargo test --release -p "$crate" --test "$test" --no-run 2>&1 |
        grep -o "(target/release/deps/$test-[^)]*)" | tr -d '()' | tail -1)
    cp "$path" ".dev/bin/$test"
done
cargo build --release -p smoe-compute --example pipeline_stats
cp target/release/examples/pipeline_stats .dev/bin/
strip .dev/bin/*
tar cf - .dev/bin "$@" | xz -T2 --lzma2=preset=6,dict=192MiB > .dev/pack.tar.xz

cat > .dev/device.sh <<'EOF'
#!/usr/bin/env bash
# On the device machine, from the tree's root: unpack, prepare Vulkan, run "$1".
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig >/dev/null 2>&1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
xz -dc .dev/pack.tar.xz | tar xf -
chmod +x .dev/bin/*
export PATH="$PWD/.dev/bin:$PATH"
[ -e /work/main ] || { mkdir -p /work; ln -s "$PWD" /work/main; }
bash -c "$1"
EOF
ls -la .dev/pack.tar.xz
