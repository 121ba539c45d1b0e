"""What a DDP communication hook costs in accuracy: the digits and charlm examples trained with
each `ddp.comm_hook`, the same epochs and seed, in local mode (2 Gloo workers, as the examples
say), against the same run without a hook.

Targets: digits' eval accuracy within 0.5 points of no hook, charlm's eval loss within 2%.

    python benchmarks/hook_accuracy.py
    python benchmarks/hook_accuracy.py --hooks none,powersgd --set ddp.powersgd.rank=2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from raytrain_app.config import load_config
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from throughput import print_table

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = {"digits": ("eval_accuracy", "points"), "charlm": ("eval_loss", "%")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hooks", default="none,fp16,bf16,powersgd", help="comma list; the first is the reference")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override both examples' config, e.g. ddp.powersgd.rank=2; repeatable")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    hooks, tmp, found = args.hooks.split(","), tempfile.mkdtemp(prefix="hook-accuracy-"), []
    for example, (metric, unit) in EXAMPLES.items():
        path = os.path.join(os.path.dirname(HERE), "examples", f"{example}.yaml")
        for hook in hooks:
            config = load_config(path, [*args.overrides, f"ddp.comm_hook={hook}", "tracking.report_png=false",
                                        "tracking.tensorboard=false"])
            result = run_training(make_plan(config, run_dir=os.path.join(tmp, f"{example}-{hook}"), local=True),
                                  echo=lambda *_: None)
            last = result.metrics[-1]
            found.append({"example": example, "hook": hook, "metric": metric, "value": last[metric],
                          "samples_per_s": last["samples_per_s"], "epochs": last["epoch"]})
    rows = []
    for f in found:
        base = next(g["value"] for g in found if g["example"] == f["example"] and g["hook"] == hooks[0])
        unit = EXAMPLES[f["example"]][1]
        change = (f"{(f['value'] - base) * 100:+.2f} points" if unit == "points"
                  else f"{(f['value'] / base - 1) * 100:+.2f}%")
        rows.append([f["example"], f["hook"], str(f["epochs"]), f"{f['metric']} {f['value']:.4f}", change,
                     f"{f['samples_per_s']:,.0f}"])
    print(f"run dirs in {tmp}")
    print_table(["example", "comm_hook", "epochs", "last epoch", f"vs {hooks[0]}", "samples/s"], rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(found, out, indent=1)


if __name__ == "__main__":
    main()
