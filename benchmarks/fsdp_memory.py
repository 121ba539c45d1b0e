"""Memory per worker under ddp and fsdp, for a gpt that does not fit one worker's memory cap under ddp.

In one run, through the library API on an embedded local Ray cluster (as `raytrain-app train`),
2 CPU workers, the built-in `gpt` on two small text files, AdamW, a few steps:

1. the plan's own check: ddp with `scaling.memory_per_worker_gb` set below its training state
   (`--floor-gb`) is refused before Ray starts, and the message is printed;
2. ddp and fsdp, each with `scaling.memory_per_worker_gb: CAP` (`--cap-gb`), trained.

For each strategy the table gives the per-worker state the plan estimates
(`raytrain_app.worker.memory.state_bytes`: parameters, gradients, AdamW's two moments) and the peak
resident memory of the largest worker process (the run's `peak_memory_mib` metric, from
`ru_maxrss`, all-reduced with MAX). Ray's `memory` resource places workers but does not enforce
a limit, so the measured peak is what says whether a hard cap of that size would have held. The
peak is more than the state: the worker process itself (Python, torch, Ray: about 0.9 GiB), the
model built whole before it is sharded, activations, and the optimizer's and FSDP's buffers.

    python benchmarks/fsdp_memory.py                   # n_embd 1280, 12 layers (~236M parameters), cap 4.25 GiB
    python benchmarks/fsdp_memory.py --n-embd 768 --layers 12 --cap-gb 2 --floor-gb 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from raytrain_app import fit  # noqa: E402
from raytrain_app.config import with_overrides  # noqa: E402
from raytrain_app.data import build_datasets  # noqa: E402
from raytrain_app.driver.plan import make_plan  # noqa: E402
from raytrain_app.errors import UserError  # noqa: E402
from raytrain_app.models import build_model  # noqa: E402
from raytrain_app.worker.memory import GiB, shard_group, state_bytes  # noqa: E402

BLOCK, BATCH = 64, 2


def write_text(folder: str, steps: int) -> None:
    """Two files of Python source: one is the eval split, the other `steps` batches a worker of training."""
    size = (BLOCK + 1) * BATCH * 2 * steps + 1
    source = open(os.__file__, "rb").read()
    for name, part in (("a.txt", source[:size]), ("b.txt", source[size:2 * size])):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(part)


def job(args, folder: str, strategy: str, cap) -> dict:
    size = os.path.getsize(os.path.join(folder, "a.txt"))
    return {
        "name": f"memory-{strategy}",
        "model": {"name": "gpt", "args": {"n_layer": args.layers, "n_head": 16, "n_embd": args.n_embd}},
        "data": {"name": "text", "args": {"path": folder, "pattern": "*.txt", "max_bytes": 2 * size, "block": BLOCK},
                 "eval_fraction": 0.5},
        "task": {"name": "language_model"},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "train": {"epochs": 1, "batch_size": BATCH, "eval_batch_size": 8},
        "strategy": {"name": strategy},
        "scaling": {"workers": 2, **({"memory_per_worker_gb": cap} if cap else {})},
        "tracking": {"tensorboard": False, "report_png": False},
    }


def built(config):
    data = build_datasets(config.data)
    return build_model(config.model, data.input_shape, data.num_classes)


def estimate(config) -> str:
    return state_bytes(built(config), config.optimizer, shard_group(config)).describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, default=1280)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cap-gb", type=float, default=4.25, help="the workers' memory resource in the runs")
    parser.add_argument("--floor-gb", type=float, default=3.25, help="a cap below ddp's state, which the plan refuses")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        write_text(scratch, args.steps)
        refused = with_overrides(job(args, scratch, "ddp", args.floor_gb))
        try:
            make_plan(refused, run_dir=os.path.join(scratch, "refused"))
            message = "not refused"
        except UserError as e:
            message = f"refused: {e}"
        print(f"ddp under a {args.floor_gb:g} GiB cap: {message}", flush=True)
        for strategy in ("ddp", "fsdp"):
            config = with_overrides(job(args, scratch, strategy, args.cap_gb))
            result = fit(config, run_dir=os.path.join(scratch, strategy), echo=lambda line: None)
            peak = result.metrics[-1]["peak_memory_mib"] / 1024
            rows.append((strategy, estimate(config), peak, result.metrics[-1]["train_loss"]))
            print(f"{strategy}: state {rows[-1][1]}, peak {peak:.2f} GiB", flush=True)
        params = sum(p.numel() for p in built(refused).parameters())

    print(f"\ngpt n_embd {args.n_embd}, {args.layers} layers: {params / 1e6:.0f}M parameters; 2 workers; "
          f"cap {args.cap_gb:g} GiB ({args.cap_gb * GiB / 2**20:.0f} MiB)\n")
    print("| strategy | state per worker (estimate) | peak RSS per worker (measured) | under the cap | train loss |")
    print("| --- | --- | --- | --- | --- |")
    for strategy, state, peak, loss in rows:
        print(f"| {strategy} | {state} | {peak:.2f} GiB | {'yes' if peak <= args.cap_gb else 'no'} | {loss:.3f} |")


if __name__ == "__main__":
    main()
