#!/usr/bin/env bash
# On the lent GPU machine: Vulkan's memory budget against the CUDA driver, free and with all but 9 GiB
# held by a torch process (does NVIDIA's budget count another process's memory?). Pack with
# scripts/device-pack.sh, then: bash .dev/device.sh "bash scripts/memory-budget-check.sh"
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SMOE_REQUIRE_GPU=1
smoe info > $OUT/info_free.txt 2>&1
gpu_streaming --test-threads 1 the_free_gpu_memory --nocapture > $OUT/t_mem_free.txt 2>&1
python3 -c "
import torch, time
free, total = torch.cuda.mem_get_info()
x = torch.empty(free - (9 << 30), dtype=torch.uint8, device='cuda')
print('held', x.numel() >> 30, 'GiB of', total >> 30, flush=True)
time.sleep(40)
" > $OUT/hog.txt 2>&1 &
for i in $(seq 30); do grep -q held $OUT/hog.txt 2>/dev/null && break; sleep 1; done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/hog.txt
smoe info > $OUT/info_hog.txt 2>&1
gpu_streaming --test-threads 1 the_free_gpu_memory --nocapture > $OUT/t_mem_hog.txt 2>&1
kill %1
grep -h 'memory\|adapter' $OUT/info_*.txt; cat $OUT/hog.txt; grep -h 'GiB\|test result\|panicked' $OUT/t_mem_*.txt
