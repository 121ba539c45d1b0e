#!/usr/bin/env bash
# GPU checks on one CUDA machine: NCCL process group, bf16 and fp16 (+GradScaler, clipping)
# through the real `train` command, torch.compile, and the step-overhead benchmark on GPU.
# Run from the repository root with raytrain_app importable (see benchmarks/README.md).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
train() { python3 -m raytrain_app.cli train examples/digits.yaml --workers 1 --gpus-per-worker 1 "$@"; echo "exit $?"; }
echo "== bf16 autocast (auto precision), NCCL"; train --run-dir /tmp/gpu-bf16
echo "== fp16 + GradScaler + clipping";        train --run-dir /tmp/gpu-fp16 --set train.precision=fp16 --set train.grad_clip=1.0
echo "== torch.compile";                       train --run-dir /tmp/gpu-compile --set train.compile=default
grep -h "backend\|precision" /tmp/gpu-bf16/config.yaml
grep -h "rank 0" /tmp/gpu-bf16/logs/rank-0.log | head -1
for model in resnet18 lenet; do
  python3 benchmarks/step_overhead.py --device cuda --model "$model" --precision bf16 --batch 512 --steps 40 --rounds 5
done
