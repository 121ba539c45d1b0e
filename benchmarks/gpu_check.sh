#!/usr/bin/env bash
# Every GPU check on one CUDA machine, in parts that each fit one 10-minute device call:
#
#   bash benchmarks/gpu_check.sh paths        # the GPU paths through the real `train` command,
#                                             # then step_overhead.py on CUDA (eager, then CUDA
#                                             # graphs with data on the device, profiled)
#   bash benchmarks/gpu_check.sh throughput   # throughput.py: ResNet-18 and LeNet, batch 512, bf16
#   bash benchmarks/gpu_check.sh fsdp         # FSDP2 on gpt: the loop against a hand FSDP2 loop
#                                             # (tokens/s, MFU), fsdp and hsdp runs, a SIGKILLed
#                                             # fsdp worker resuming from its DCP checkpoint
#   bash benchmarks/gpu_check.sh data         # the GPU memory check, evaluate and predict on
#                                             # CUDA, streaming Parquet against data on the GPU
#   bash benchmarks/gpu_check.sh local        # local mode and --smoke on the GPU against Ray,
#                                             # evaluate/predict --local timed, PowerSGD on CUDA
#                                             # with a SIGKILLed worker, LeNet's compiled step
#   bash benchmarks/gpu_check.sh round3       # async checkpoints of gpt 12 x 768 on the GPU, a
#                                             # hung rank on CUDA tensors (2 workers x 0.5 GPU on
#                                             # Ray, Gloo) with its flight-recorder dumps, and a
#                                             # torchrun script on CUDA: torchrun, local mode, Ray
#   bash benchmarks/gpu_check.sh images       # encoded JPEGs: the decode pipeline against torchvision's
#                                             # ImageFolder on 15 processes and against nvjpeg, an
#                                             # ImageNet-shaped ResNet-50 run from JPEGs (decoded by
#                                             # the CPUs, then by nvjpeg) against synthetic tensors
#
# `paths`: NCCL at one worker in bf16 (auto precision), fp16 with GradScaler and clipping,
# compile reduce-overhead (CUDA graphs) with the data on the device, and 2 NCCL workers sharing
# the one GPU (0.5 GPU each). `fsdp` runs its 2-worker runs as 2 workers sharing the one GPU
# (Gloo on CUDA tensors; NCCL refuses two ranks on one GPU) when the machine has one. Run from
# the repository root with raytrain_app importable (see benchmarks/README.md); logs and results
# go to ${OUT:-/tmp/gpu-check}.
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
fsdp)
  echo "== fsdp_throughput.py: the worker loop against a hand FSDP2 loop, gpt 12 x 768, block 1024, batch 16, bf16"
  python3 benchmarks/fsdp_throughput.py --steps 20 --rounds 5 --repeats 3
  cat > "$out/gpt.yaml" <<'YAML'
name: gpt-gpu
seed: 0
model: {name: gpt, args: {n_layer: 4, n_head: 8, n_embd: 256}}
data: {name: text, args: {path: stdlib, pattern: "*.py", max_bytes: 1000000, block: 256}, eval_fraction: 0.1}
task: {name: language_model}
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.01}
schedule: {name: cosine, warmup_epochs: 0.1}
train: {epochs: 2, batch_size: 32, eval_batch_size: 64}
checkpoint: {every_steps: 20}
failure: {max_failures: 1}
YAML
  marker=/tmp/gpu-check-fault; touch "$marker"
  sed "s|model: .*|model: {name: \"tests.helpers:faulty_gpt\", args: {n_layer: 4, n_head: 8, n_embd: 256, marker: $marker, at: 80, rank: 1}}|" \
    "$out/gpt.yaml" > "$out/gpt-faulty.yaml"
  gpus=$(nvidia-smi -L | wc -l); share=$(python3 -c "print(min(1, $gpus / 2))")
  for run in fsdp:gpt fsdp-killed:gpt-faulty hsdp:gpt; do
    name=${run%%:*}; strategy=${name%%-*}
    echo "== $name: 2 workers x $share GPU, strategy $strategy"
    python3 -m raytrain_app.cli train "$out/${run#*:}.yaml" --workers 2 --gpus-per-worker "$share" \
      --set strategy.name="$strategy" --run-dir "/tmp/runs/$name"
    echo "exit $?"
    grep -h "sharded over\|resumed from\|restarting" "/tmp/runs/$name/logs/"*.log "/tmp/runs/$name/restarts.jsonl" \
      2>/dev/null | cut -c1-220 | head -4
    tail -n 1 "/tmp/runs/$name/metrics.jsonl" | cut -c1-400
  done
  [ -e "$marker" ] && echo "the fault never fired"
  echo "== the killed run's final weights against the uninterrupted run's"
  python3 - <<'PY'
import torch
from raytrain_app import load_model
a = load_model("/tmp/runs/fsdp").state_dict()
b = {k.replace(".inner.", "."): v for k, v in load_model("/tmp/runs/fsdp-killed").state_dict().items()}
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"{len(a)} tensors, bitwise equal: {all(torch.equal(a[k], b[k]) for k in a)}, largest difference {diff:.3g}")
PY
  echo "== fsdp at 1 worker, local mode (nothing to shard over: unsharded, the console says so)"
  python3 -m raytrain_app.cli train "$out/gpt.yaml" --workers 1 --gpus-per-worker 1 --set strategy.name=fsdp \
    --run-dir /tmp/runs/fsdp-one --set train.epochs=1
  echo "exit $?"
  ;;
data)
  total=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  echo "== the GPU memory check: another process holds all but 8 of the GPU's $total GiB, then a 1.2B gpt"
  python3 -c "import torch, time; x = torch.empty(($total - 8) << 30, dtype=torch.uint8, device='cuda'); \
print('held', flush=True); time.sleep(90)" > /tmp/hold.log & holder=$!
  until grep -q held /tmp/hold.log; do sleep 0.5; done
  python3 -m raytrain_app.cli train examples/charlm.yaml --workers 1 --gpus-per-worker 1 --run-dir /tmp/runs/too-big \
    --set model.args.n_layer=24 --set model.args.n_embd=2048 --set model.args.n_head=16
  echo "exit $?"
  kill $holder; wait $holder 2>/dev/null
  train evaluated --set train.epochs=6
  for where in cuda cpu; do
    echo "== evaluate and predict --local on $where"
    [ $where = cpu ] && export CUDA_VISIBLE_DEVICES=
    python3 -m raytrain_app.cli evaluate /tmp/runs/evaluated --local
    echo "exit $?"
    python3 -m raytrain_app.cli predict /tmp/runs/evaluated --input raytrain_app/data/digits.parquet \
      --output "/tmp/preds-$where.parquet" --local
    echo "exit $?"
  done
  unset CUDA_VISIBLE_DEVICES
  python3 - <<'PY'
import pyarrow.parquet as pq
cuda, cpu = (pq.read_table(f"/tmp/preds-{w}.parquet").to_pydict() for w in ("cuda", "cpu"))
col = [k for k in cuda if k.startswith("pred")][0]
same = sum(a == b for a, b in zip(cuda[col], cpu[col]))
print(f"predictions on CUDA and on CPU agree on {same} of {len(cuda[col])} rows ({col})")
PY
  echo "== streaming Parquet into a GPU run against the same data read whole onto the GPU (ResNet-18, bf16)"
  for layout in binary list; do  # images as `convert images` writes them now, and as it wrote them before
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import stream_parquet as s; \
s.write_dataset('/tmp/cifar-like-$layout', 100_000, 16, 1024, 0, '$layout')"
  done
  for variant in "streaming:binary --set data.args.streaming=true --set data.args.buffer_rows=16384" \
                 "streaming:list --set data.args.streaming=true --set data.args.buffer_rows=16384" \
                 "on-device:binary --set data.on_device=on"; do
    run=${variant%% *}; name=${run/:/-}; layout=${run#*:}
    echo "== $name"
    python3 -m raytrain_app.cli train examples/digits.yaml --workers 1 --gpus-per-worker 1 --run-dir "/tmp/runs/$name" \
      --set model.name=resnet18 --set data.name=parquet --set data.args="{path: /tmp/cifar-like-$layout}" \
      --set data.eval_fraction=0.05 --set train.epochs=3 --set train.batch_size=512 ${variant#* }
    echo "exit $?"
    python3 - "/tmp/runs/$name" <<'PY'
import json, sys
for row in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")):
    print("   ", {k: round(row[k], 3) for k in ("epoch", "samples_per_s", "data_wait_frac", "mfu") if k in row})
PY
  done
  ;;
local)
  since() { python3 -c "import time; print(f'{time.time() - $1:.1f}')"; }
  t=$(date +%s.%N); train local-mode --local
  echo "   command to exit $(since "$t") s"; cat /tmp/runs/local-mode/startup.json
  t=$(date +%s.%N); train ray-mode --ray
  echo "   command to exit $(since "$t") s"; cat /tmp/runs/ray-mode/startup.json
  echo "== train --smoke on the GPU"
  python3 -m raytrain_app.cli train examples/digits.yaml --smoke --workers 1 --gpus-per-worker 1
  echo "exit $?"; python3 -m raytrain_app.cli runs | tail -n 3
  t=$(date +%s.%N); python3 -m raytrain_app.cli evaluate /tmp/runs/local-mode --local
  echo "== evaluate --local: exit $? in $(since "$t") s (target 6)"
  t=$(date +%s.%N)
  python3 -m raytrain_app.cli predict /tmp/runs/local-mode --input raytrain_app/data/digits.parquet --output /tmp/p.csv --local
  echo "== predict --local to CSV: exit $? in $(since "$t") s, $(wc -l < /tmp/p.csv) lines"
  marker=/tmp/gpu-check-hook; touch "$marker"
  for run in powersgd:mlp powersgd-killed:tests.helpers:faulty_mlp; do
    name=${run%%:*}; model=${run#*:}
    echo "== $name: 2 workers x 0.5 GPU on Ray (Gloo on CUDA tensors), ddp.comm_hook=powersgd, model $model"
    args="{hidden: [64], dropout: 0.2}"; [ "$name" = powersgd ] || args="{hidden: [64], marker: $marker, at: 40, rank: 1, fault: kill}"
    python3 -m raytrain_app.cli train examples/digits.yaml --ray --workers 2 --gpus-per-worker 0.5 \
      --run-dir "/tmp/runs/$name" --set train.epochs=4 --set ddp.comm_hook=powersgd --set checkpoint.every_steps=10 \
      --set failure.max_failures=1 --set model.name="$model" --set model.args="$args"
    echo "exit $?"
    grep -h "resumed from\|restarting\|comm_hook\|powersgd" "/tmp/runs/$name/logs/"*.log 2>/dev/null | cut -c1-200 | head -4
    tail -n 1 "/tmp/runs/$name/metrics.jsonl" | cut -c1-300
  done
  [ -e "$marker" ] && echo "the fault never fired"
  python3 - <<'PY'
import torch
from raytrain_app import load_model
a = load_model("/tmp/runs/powersgd").state_dict()
b = {k.replace(".inner.", "."): v for k, v in load_model("/tmp/runs/powersgd-killed").state_dict().items()}
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"killed vs uninterrupted: {len(a)} tensors, bitwise equal: {all(torch.equal(a[k], b[k]) for k in a)}, "
      f"largest difference {diff:.3g}")
PY
  echo "== step_overhead.py, LeNet bf16 batch 512, compile reduce-overhead (1.100x at the last check)"
  python3 benchmarks/step_overhead.py --device cuda --model lenet --precision bf16 --batch 512 \
    --steps 100 --rounds 5 --repeats 5 --compile reduce-overhead --on-device on
  ;;
round3)
  echo "== checkpoint_stall.py on the GPU: gpt 12 x 768, bf16 autocast, AdamW; sync against async, local disk"
  python3 benchmarks/checkpoint_stall.py --device cuda --local-only --checkpoints 3 --steps 3
  echo "== hang_detection.py: rank 1 stalls in its forward; 2 workers x 0.5 GPU on Ray (Gloo on CUDA tensors)"
  python3 benchmarks/hang_detection.py --ray --set scaling.gpus_per_worker=0.5
  echo "== a torchrun script on CUDA (NCCL, 1 rank): torchrun, then train in local mode, then on Ray"
  since() { python3 -c "import time; print(f'{time.time() - $1:.1f}')"; }
  t=$(date +%s.%N); torchrun --standalone --nproc_per_node 1 examples/torchrun_script/train.py --epochs 2 | tail -n 2
  echo "   torchrun: exit ${PIPESTATUS[0]} in $(since "$t") s"
  for mode in --local --ray; do
    t=$(date +%s.%N)
    python3 -m raytrain_app.cli train examples/torchrun_script/train.py --workers 1 --gpus-per-worker 1 $mode \
      --run-dir "/tmp/runs/script$mode" -- --epochs 2 | grep "^epoch"
    echo "   train $mode: exit ${PIPESTATUS[0]} in $(since "$t") s"
  done
  if python3 -c "import transformers" 2>/dev/null; then
    echo "== the HF Trainer pattern on CUDA: torchrun against train --local, the same losses"
    torchrun --standalone --nproc_per_node 1 tests/scripts/hf_trainer.py /tmp/hf-torchrun | grep "^step" > /tmp/hf-a
    python3 -m raytrain_app.cli train tests/scripts/hf_trainer.py --workers 1 --gpus-per-worker 1 --local \
      --run-dir /tmp/runs/hf -- /tmp/hf-ours | grep "^step" > /tmp/hf-b
    cmp /tmp/hf-a /tmp/hf-b && echo "   the same $(wc -l < /tmp/hf-a) losses"
  else
    echo "== (transformers is not installed here: the HF Trainer pattern is not run)"
  fi
  ;;
images)
  echo "== encoded_images.py: 3,000 JPEGs of 500x375 to 224x224 tensors, ours against ImageFolder + DataLoader"
  python3 benchmarks/encoded_images.py --images 3000 --workers 15 --repeats 2 --decode-device cuda
  echo "== an ImageNet-shaped run: those JPEGs (data: images), ResNet-50, bf16, batch 256, 15 loader processes"
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import encoded_images as e; from pathlib import Path; \
print(f'{e.write_images(Path(\"/tmp/jpegs/train\"), 3000):.0f} KiB per image')"
  resnet50() {  # NAME --set ...: 3 epochs of ResNet-50 at 224x224, bf16, batch 256, on the one GPU
    local name=$1; shift
    python3 -m raytrain_app.cli train examples/digits.yaml --workers 1 --gpus-per-worker 1 --cpus-per-worker 16 \
      --run-dir "/tmp/runs/$name" --set model.name=resnet50 --set data.eval_fraction=0.05 --set train.epochs=3 \
      --set train.batch_size=256 --set train.precision=bf16 --set checkpoint.every_epochs=3 "$@"
    echo "exit $?"
    python3 - "/tmp/runs/$name" <<'PY'
import json, sys
for row in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")):
    print("   ", {k: round(row[k], 3) for k in ("epoch", "samples_per_s", "data_wait_frac", "mfu") if k in row})
PY
  }
  resnet50 jpegs --set data.name=images --set "data.args={path: /tmp/jpegs/train, size: 224}" \
    --set data.loader_workers=15
  resnet50 jpegs-nvjpeg --set data.name=images --set "data.args={path: /tmp/jpegs/train, size: 224, decode: device}" \
    --set data.loader_workers=15
  resnet50 tensors-on-gpu --set data.name=synthetic --set data.on_device=on \
    --set "data.args={shape: [3, 224, 224], train_size: 2850, eval_size: 150}"
  ;;
*) echo "usage: gpu_check.sh [paths|throughput|fsdp|data|local|round3|images]" >&2; exit 2 ;;
esac
