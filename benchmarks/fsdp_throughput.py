"""Tokens/s and MFU of raytrain-app's worker loop on an FSDP2-sharded `gpt`, against a hand-written
FSDP2 loop in the pattern of PyTorch's own FSDP2 example (`fully_shard` on each block, then on
the root; bf16 gathers and compute, fp32 gradient reduction; AdamW; no autocast).

Both run in this one process on the same model, the same token blocks and the same batch,
alternating epoch by epoch so that machine noise hits both alike. raytrain-app's side is the
worker loop's own pieces: `strategy.shard` (what `strategy: fsdp` applies), `Step`, `TrainState`,
`train_epoch` with its DataLoader, metric sums, loss check and LR schedule, and its precision
(`train.precision: bf16` autocast on top of the bf16 mixed-precision policy, as a GPU run
resolves `auto`). The mesh is this process alone (world size 1): one GPU shards over one rank,
which still runs every FSDP2 path (DTensor parameters, the per-block all-gather and
reduce-scatter, the mixed-precision casts), so the ratio is the loop's cost around FSDP2.

MFU counts a training token's FLOPs with PyTorch's FlopCounterMode on a meta copy of the model
(forward and backward, attention included) against the device's dense bf16 peak.

    python benchmarks/fsdp_throughput.py                     # on a GPU: 12 layers x 768, block 1024, batch 16
    python benchmarks/fsdp_throughput.py --device cpu --layers 2 --n-embd 64 --heads 4 --block 64 \\
        --batch 4 --steps 3 --rounds 2 --repeats 1           # a smoke run on CPU (Gloo)
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain_app.config.sections import DataConfig, OptimizerConfig, ScheduleConfig, StrategyConfig, TaskConfig
from raytrain_app.data import build_datasets, train_loader
from raytrain_app.models.gpt import gpt
from raytrain_app.tasks import build_task
from raytrain_app.worker.loop import Precision, Step, seed_everything, train_epoch
from raytrain_app.worker.metrics import peak_flops
from raytrain_app.worker.nonfinite import LossCheck
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import shard
from step_overhead import alternate  # this folder's: run as a script, as step_overhead.py is


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--block", type=int, default=1024, help="tokens per sample")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="independent measurements, for the ratio's median and range")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)

    tokens = args.steps * args.batch * (args.block + 1)
    data = build_datasets(DataConfig(name="text", eval_fraction=0.1, args={
        "path": "stdlib", "pattern": "*.py", "max_bytes": max(2 * tokens, 1_000_000), "block": args.block}))
    n = args.steps * args.batch
    data.train.tokens = data.train.tokens[:n]  # exactly `steps` batches an epoch
    seed_everything(0)
    base = gpt(data.input_shape, 256, args.layers, args.heads, args.n_embd)
    flops = token_flops(base, args.block)

    # raytrain-app: strategy fsdp's sharding, the loop's own epoch function and step.
    ours = shard(copy.deepcopy(base), StrategyConfig(name="fsdp", mixed_precision="bf16"), torch.arange(1), device)
    loader, sampler = train_loader(data, args.batch, 0, 1, 0, 0, device.type == "cuda")
    opt = build_optimizer(ours.parameters(), OptimizerConfig(name="adamw", lr=3e-4, weight_decay=0.1), 1)
    precision = Precision("bf16", device)
    state = TrainState(ours, opt, build_schedule(opt, ScheduleConfig(name="cosine"), len(loader), 10_000),
                       precision.scaler, sharded=True)
    step = Step(ours, precision, build_task(TaskConfig(name="language_model")), device=device,
                loss_check=LossCheck(device))

    def run_ours(epoch: int) -> None:
        sampler.set_epoch(epoch)
        train_epoch(step, loader, state)
        state.finish_epoch()

    # The hand-written loop: PyTorch's FSDP2 example, as a user would write it.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    hand = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in hand.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(hand, mp_policy=policy)
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=3e-4, weight_decay=0.1)
    all_tokens = data.train.tokens

    def run_hand(epoch: int) -> None:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for i in range(0, n, args.batch):
            batch = all_tokens[perm[i:i + args.batch]].long().to(device, non_blocking=True)
            logits = hand(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

    run_ours(0), run_hand(0)  # warm-up: allocator, kernels, caches
    peak = peak_flops(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    params = sum(p.numel() for p in base.parameters())
    print(f"gpt {args.layers} layers x {args.n_embd}, {params / 1e6:.1f}M parameters, block {args.block}, batch "
          f"{args.batch} ({args.batch * args.block} tokens a step), bf16, fsdp over 1 rank on {device}; "
          f"{flops / 1e9:.3f} GFLOP a training token; {args.steps} steps x {args.rounds} rounds x "
          f"{args.repeats} repeats")
    ratios = []
    for repeat in range(args.repeats):
        med = alternate({"raytrain-app": run_ours, "hand-written FSDP2": run_hand}, device, args.steps, args.rounds)
        cells = []
        for name, step_s in med.items():
            tokens_s = args.batch * args.block / step_s
            mfu = f", MFU {100 * tokens_s * flops / peak:.1f}%" if peak else ""
            cells.append(f"{name} {tokens_s:,.0f} tokens/s{mfu}")
        ratios.append(med["hand-written FSDP2"] / med["raytrain-app"])
        print(f"  repeat {repeat + 1}: " + "; ".join(cells) + f"; ratio {ratios[-1]:.3f}")
    print(f"  throughput raytrain-app / hand-written FSDP2: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} repeats")
    dist.destroy_process_group()


def token_flops(model: nn.Module, block: int) -> float:
    """FLOPs of one training token (forward + backward), counted on a meta copy of the model."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = copy.deepcopy(model).to("meta")
    ids = torch.zeros((1, block), dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        meta(ids).float().sum().backward()
    return counter.get_total_flops() / block


if __name__ == "__main__":
    main()
