"""What the gradient collective sends (`ddp.comm_hook`, `strategy.reduce_dtype`): each hook
registered on DDP and seen in the gradients it leaves, against the same collective done by hand
on real Gloo process groups; PowerSGD's state through a SIGKILL and a resume at another world
size; the refusals. Local mode and spawned process groups: no Ray under test."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.config import JobConfig
from raytrain_app.worker.strategy import parallelize
from tests.commands import command
from tests.conftest import REPO
from tests.gloo import spawn
from tests.test_distributed import final_weights
from tests.test_local_mode import same_run, trained
from tests.test_reliability import faulty

CPU = torch.device("cpu")
POWERSGD = {"comm_hook": "powersgd", "powersgd": {"rank": 1, "start_iter": 3}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 10))


def _step(model: nn.Module, rank: int, step: int) -> None:
    """One backward on this rank's own batch (other ranks, other steps: other data)."""
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).pow(2).mean().backward()


def _by_hand(local: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """What torch's fp16/bf16 hook does to each gradient, done here: cast, divide by the world
    size, all-reduce in that dtype, cast back."""
    sent = []
    for p in local.parameters():
        half = p.grad.to(dtype).div_(dist.get_world_size())
        dist.all_reduce(half)
        sent.append(half.to(torch.float32))
    return sent


def _mean(local: nn.Module) -> list[torch.Tensor]:
    """The plain average of every rank's gradient, as DDP computes it without a hook."""
    out = []
    for p in local.parameters():
        g = p.grad / dist.get_world_size()
        dist.all_reduce(g)
        out.append(g)
    return out


def _hooked(rank: int, hook: str, out_dir: str) -> None:
    config = JobConfig.from_dict({"ddp": {**POWERSGD, "comm_hook": hook}, "scaling": {"workers": 2}})
    parallel = parallelize(_model(), config, 2, "one node", CPU, print)
    ddp, local = parallel.train_model, _model()  # the same weights, without DDP: this rank's own gradients
    # What the epoch line's comm share is calibrated on: half the bytes, or P and Q (rank 1) and the biases.
    whole = sum(p.numel() for p in local.parameters())
    assert parallel.sent_per_step() == {"fp16": (whole, torch.float16), "bf16": (whole, torch.bfloat16),
                                        "powersgd": ((32 + 24) + (10 + 32) + 32 + 10, torch.float32)}[hook]
    assert ddp._get_ddp_logging_data().get("comm_hook") == {"fp16": "fp16_compress_hook",
                                                             "bf16": "bf16_compress_hook",
                                                             "powersgd": "CommHook._powersgd_hook"}[hook]
    for step in range(5):
        for model in (ddp, local):
            model.zero_grad()
            _step(model, rank, step)
        got = [p.grad for p in ddp.parameters()]
        if hook != "powersgd":
            assert all(torch.equal(g, h) for g, h in zip(got, _by_hand(local, getattr(torch, {"fp16": "float16",
                                                                                          "bf16": "bfloat16"}[hook]))))
            assert not all(torch.equal(g, m) for g, m in zip(got, _mean(local)))  # really compressed
            continue
        mean = _mean(local)
        matrices = [(g, m) for g, m in zip(got, mean) if g.dim() == 2]
        if step < 3:  # PowerSGD's first start_iter steps are plain all-reduces
            assert all(torch.allclose(g, m, rtol=1e-6, atol=1e-7) for g, m in zip(got, mean))
        else:  # each weight matrix arrives as the rank-1 product of the two factors sent, the rest whole
            assert all(torch.linalg.matrix_rank(g) == 1 < torch.linalg.matrix_rank(m) for g, m in matrices)
            assert all(torch.allclose(g, m, rtol=1e-6, atol=1e-7) for g, m in zip(got, mean) if g.dim() == 1)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_each_hook_is_registered_and_sends_what_it_says(tmp_path, hook):
    spawn(_hooked, hook, str(tmp_path))


def _reduced(rank: int, reduce_dtype: str) -> None:
    config = JobConfig.from_dict({"strategy": {"name": "fsdp", "reduce_dtype": reduce_dtype},
                                  "scaling": {"workers": 2}})
    parallel = parallelize(_model(), config, 2, "one node", CPU, print)
    _step(parallel.train_model, rank, 0)
    grads = [p.grad.to_local() for p in parallel.model.parameters()]
    exact = all(torch.equal(g, g.to(torch.bfloat16).to(torch.float32)) for g in grads)
    assert exact == (reduce_dtype == "bf16"), reduce_dtype  # reduced in bf16: fp32 shards of bf16 values
    assert all(g.dtype == torch.float32 for g in grads)
    assert parallel.sent_per_step()[1] == {"bf16": torch.bfloat16, "auto": torch.float32}[reduce_dtype]


@pytest.mark.parametrize("reduce_dtype", ["bf16", "auto"])
def test_fsdp_reduces_gradients_in_the_reduce_dtype_and_keeps_fp32_shards(reduce_dtype):
    spawn(_reduced, reduce_dtype)


@pytest.mark.slow
def test_a_killed_worker_resumes_bitwise_with_powersgd_and_another_world_size_restarts_its_errors(tmp_path):
    """PowerSGD's factors, step count and random stream (rank 0's) and each rank's error feedback
    are in the checkpoint: a SIGKILL mid-epoch 2 (steps past start_iter) resumes to the same
    weights as a run never killed. Without them the resumed steps would compress otherwise."""
    straight = trained(faulty(tmp_path / "never", 40, "kill", checkpoint={"every_steps": 5},
                              failure={"max_failures": 1}, ddp=POWERSGD), tmp_path / "straight", True)
    marker = tmp_path / "fault"
    marker.touch()
    lines = []
    killed = trained(faulty(marker, 40, "kill", checkpoint={"every_steps": 5}, failure={"max_failures": 1},
                            ddp=POWERSGD), tmp_path / "killed", True, lines=lines)
    assert not marker.exists()  # the fault really happened
    log = (tmp_path / "killed" / "logs" / "rank-1.log").read_text()
    assert re.search(r"resumed from \S+ at step 35: epoch 2 from batch 12", log), log
    assert not [line for line in lines if "powersgd" in line], lines  # nothing restarted
    same_run(straight, killed)
    plain = trained(faulty(tmp_path / "never", 40, "kill"), tmp_path / "plain", True)
    weights, compressed = final_weights(plain), final_weights(straight)
    assert not all(torch.equal(weights[k], compressed[k]) for k in weights)  # PowerSGD really trained it

    # Three workers resume what two trained: other ranks, so their error feedback starts at zero, said once.
    lines = []
    trained(faulty(tmp_path / "never", 40, "kill", ddp=POWERSGD, train={"epochs": 3}, scaling={"workers": 3}),
            tmp_path / "straight", True, resume=True, lines=lines)
    assert [line for line in lines if "powersgd" in line] == [
        "warning: ddp.comm_hook powersgd: the checkpoint is from 2 workers and this run has 3: error feedback and "
        "factors restart at zero"], lines


@pytest.mark.parametrize("sets, message", [
    (["strategy.name=fsdp", "ddp.comm_hook=fp16"], "ddp.comm_hook: applies to strategy ddp, not fsdp, whose "
                                                   "gradients are reduce-scattered: set strategy.reduce_dtype instead"),
    (["strategy.reduce_dtype=bf16"], "strategy.reduce_dtype: applies to strategy fsdp or hsdp: under ddp set "
                                     "ddp.comm_hook instead"),
    (["ddp.comm_hook=powersgd", "ddp.powersgd.start_iter=1"], "ddp.powersgd.start_iter: "),
    (["ddp.comm_hook=int8"], "ddp.comm_hook: "),
])
def test_a_combination_that_makes_no_sense_is_one_line_before_anything_starts(tmp_path, sets, message):
    proc = command(["train", "examples/digits.yaml", "--run-dir", str(tmp_path / "run"),
                    *(a for s in sets for a in ("--set", s))], cwd=REPO)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr and not (tmp_path / "run").exists(), proc.stderr
