#!/usr/bin/env bash
# Here, before a device call: keeps .dev/ and .gl/ out of git, and downloads into .gl/ the Vulkan
# loader and the GL vendor libraries NVIDIA's Vulkan driver on the device needs (without the
# latter wgpu finds no adapter). Sourced by device-pack.sh and ab-bench.sh.
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo '/.gl/' >> .git/info/exclude
if ! ls .gl/libegl1_*.deb >/dev/null 2>&1; then
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $o update >/dev/null
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null)
fi
