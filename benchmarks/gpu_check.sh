#!/usr/bin/env bash
# Every GPU check in one run on one CUDA machine: NCCL, bf16 and fp16 (+GradScaler, clipping)
# through the real `train` command, CUDA graphs at one worker, device-resident data, MFU in the
# metrics, then the throughput benchmark (ResNet-18 and LeNet, batch 512, bf16) and the
# step-overhead benchmark on CUDA. Run from the repository root with raytrain_app importable
# (see benchmarks/README.md); results go to ${OUT:-/tmp/gpu-check}.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
train() { python3 -m raytrain_app.cli train examples/digits.yaml --workers 1 --gpus-per-worker 1 "$@"; echo "exit $?"; }
echo "== bf16 autocast (auto precision), NCCL";    train --run-dir /tmp/gpu-bf16
echo "== fp16 + GradScaler + clipping";           train --run-dir /tmp/gpu-fp16 --set train.precision=fp16 --set train.grad_clip=1.0
echo "== CUDA graphs (reduce-overhead), data on device"; train --run-dir /tmp/gpu-graphs --set train.compile=reduce-overhead --set data.on_device=on
grep -h "backend\|precision\|on_device" /tmp/gpu-bf16/config.yaml
grep -h "data \|rank 0" /tmp/gpu-graphs/logs/rank-0.log | head -2
tail -1 /tmp/gpu-graphs/metrics.jsonl
for model in resnet18 lenet; do
  python3 benchmarks/throughput.py --model "$model" --json "$out/throughput-$model.json"
done
python3 benchmarks/step_overhead.py --device cuda --model resnet18 --precision bf16 --batch 512 --steps 40 --rounds 5
