#!/usr/bin/env bash
# One prepared GPU session (device tool, H200): the measured profile behind the
# simulator's H200 llama-8b comparison, where a decode step's time goes, the engine's
# speculative/autoregressive equivalence on CUDA (float32 and bfloat16), and a
# Qwen2.5-32B-shaped target on one GPU. Uses the machine's own python3 (torch with CUDA)
# with this checkout on PYTHONPATH; writes into $OUT (default ./gpu-out).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 ADASERVE_CACHE=/tmp/adaserve-cache
nvidia-smi -L
python3 -c "import torch, numba, numpy; print('torch', torch.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
step() { local t=$1; shift; echo "== $*"; local s=$SECONDS; timeout "$t" "$@"; echo "== rc=$? in $((SECONDS - s)) s"; }
step 150 python3 -m adaserve profile --shapes Llama-3.1-8B:Llama-3.2-1B --device cuda \
    --dtype bfloat16 --reps 7 --out "$OUT/H200-llama-8b.json"
step 100 python3 benchmarks/gpu_step_profile.py --shapes Llama-3.1-8B --dtype bfloat16 \
    --steps 8 --top 20 > "$OUT/step_profile_llama8b.txt" 2>&1
head -1 "$OUT/step_profile_llama8b.txt"
step 90 python3 benchmarks/gpu_check.py --device cuda --dtype bfloat16 --out "$OUT/gpu_check_bf16.json"
step 90 python3 benchmarks/gpu_check.py --device cuda --dtype float32 --out "$OUT/gpu_check_fp32.json"
step 120 python3 -m adaserve profile --shapes Qwen2.5-32B --device cuda --dtype bfloat16 \
    --reps 5 --out "$OUT/H200-qwen-32b-tp1.json"
# defaults on CUDA: dtype auto and the KV pool gpu_memory_utilization leaves
step 90 python3 -c "
from adaserve import LLM, SamplingParams
e = LLM(device='cuda').engine
slots = e.allocator.num_blocks * e.cfg.block_size
print('dtype', e.dtype, 'kv slots', slots, 'kv GiB', round(slots * e.kv_bytes_per_slot / 2**30, 1))
"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
