#!/usr/bin/env bash
# Every GPU check on one CUDA machine, in two parts that each fit one 10-minute device call:
#
#   bash benchmarks/gpu_check.sh paths        # the GPU paths through the real `train` command,
#                                             # then step_overhead.py on CUDA (eager, then CUDA
#                                             # graphs with data on the device, profiled)
#   bash benchmarks/gpu_check.sh throughput   # throughput.py: ResNet-18 and LeNet, batch 512, bf16
#
# `paths`: NCCL at one worker in bf16 (auto precision), fp16 with GradScaler and clipping,
# compile reduce-overhead (CUDA graphs) with the data on the device, and 2 NCCL workers sharing
# the one GPU (0.5 GPU each). Run from the repository root with raytrain_app importable (see
# benchmarks/README.md); logs and results go to ${OUT:-/tmp/gpu-check}.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"

train() {  # NAME ARGS...: the digits job on one GPU; its run directory lands in $out/NAME
  local name=$1; shift
  echo "== $name: train examples/digits.yaml --workers 1 --gpus-per-worker 1 $*"
  python3 -m raytrain_app.cli train examples/digits.yaml --workers 1 --gpus-per-worker 1 \
    --run-dir "/tmp/runs/$name" --set train.epochs=4 "$@"
  echo "exit $?"
  grep -h "rank 0/\|data \|compile" "/tmp/runs/$name/logs/rank-0.log" | head -3
  python3 - "/tmp/runs/$name" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
keys = ("epoch", "train_loss", "eval_accuracy", "samples_per_s", "mfu")
for row in rows:
    print("   ", {k: row[k] for k in keys if k in row})
PY
}

case "${1:-paths}" in
paths)
  train bf16-nccl
  grep -h "backend\|precision" /tmp/runs/bf16-nccl/config.yaml
  train fp16-scaler-clip --set train.precision=fp16 --set train.grad_clip=1.0
  train cudagraphs-on-device --set train.compile=reduce-overhead --set data.on_device=on
  echo "== 2 workers sharing one GPU (0.5 each): NCCL refused before start, auto picks Gloo"
  python3 -m raytrain_app.cli train examples/digits.yaml --workers 2 --gpus-per-worker 0.5 --set scaling.backend=nccl
  echo "exit $?"
  python3 -m raytrain_app.cli train examples/digits.yaml --workers 2 --gpus-per-worker 0.5 \
    --run-dir /tmp/runs/two-on-one --set train.epochs=2
  echo "exit $?"
  grep -h "backend" /tmp/runs/two-on-one/config.yaml
  for mode in off reduce-overhead; do
    echo "== step_overhead.py, ResNet-18 bf16 batch 512, compile $mode"
    python3 benchmarks/step_overhead.py --device cuda --model resnet18 --precision bf16 --batch 512 \
      --steps 40 --rounds 5 --repeats 3 --compile "$mode" --on-device on $([ "$mode" = off ] || echo --profile)
  done
  echo "== step_overhead.py, LeNet bf16 batch 512, compile reduce-overhead"
  python3 benchmarks/step_overhead.py --device cuda --model lenet --precision bf16 --batch 512 \
    --steps 100 --rounds 5 --repeats 3 --compile reduce-overhead --on-device on --profile
  ;;
throughput)
  for model in resnet18 lenet; do
    python3 benchmarks/throughput.py --model "$model" --steps 100 --epochs 5 --json "$out/throughput-$model.json"
  done
  ;;
*) echo "usage: gpu_check.sh [paths|throughput]" >&2; exit 2 ;;
esac
