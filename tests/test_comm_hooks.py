"""What the gradient collective sends (`ddp.comm_hook`, `strategy.reduce_dtype`): each hook
registered on DDP and seen in the gradients it leaves, against the same collective done by hand
on real Gloo process groups; PowerSGD going on in a restarted process, whose DDP buckets are laid
out otherwise, and its state through a SIGKILL and a resume at another world size; the refusals.
Local mode and spawned process groups: no Ray under test."""

import json
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.config import JobConfig
from raytrain_app.worker.strategy import parallelize
from tests import runrecord
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


def _summed(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over the ranks, all-reduced here."""
    t = t.clone()
    dist.all_reduce(t)
    return t


def _projected(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`m` projected onto the direction of the column `p`: P P^T m with P = p / |p|, which is P Q^T
    for Q = m^T P. PowerSGD of rank 1 leaves each gradient so, `m` being the ranks' mean matrix."""
    p = p / p.norm()
    return p @ (p.T @ m)


def _off(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


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
    hand = {}  # weight matrix -> (this rank's error feedback, the Q its next step starts from), by hand
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
            continue
        # Each weight matrix arrives as the rank-1 product of the two factors sent, the rest whole; and
        # the same on every rank: a hook that left P or Q unreduced would leave each rank its own.
        assert all(torch.linalg.matrix_rank(g) == 1 < torch.linalg.matrix_rank(m) for g, m in matrices)
        assert all(torch.allclose(g, m, rtol=1e-6, atol=1e-7) for g, m in zip(got, mean) if g.dim() == 1)
        for g in got:
            ranks = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, g)
            assert all(torch.equal(g, other) for other in ranks)
        # PowerSGD done here: M is this rank's gradient plus its error feedback; P = the sum of M Q over
        # the ranks, orthonormalized (rank 1: a unit vector); Q = M^T P averaged; the gradient P Q^T.
        # The first compressed step starts from a random Q of the hook's own: there P is the direction
        # of the gradient's one column space, and the check is that the gradient is the ranks' mean
        # matrix projected onto it (no error feedback yet). The next one starts from that step's Q.
        for index, (g, own) in enumerate(zip(got, (p.grad for p in local.parameters()))):
            if g.dim() == 2:
                error, q = hand.get(index, (torch.zeros_like(own), None))
                m = own + error
                p = torch.linalg.svd(g).U[:, :1] if q is None else _summed(m @ q)
                m_mean = _summed(m) / dist.get_world_size()
                expected = _projected(m_mean, p)
                assert _off(g, expected) < 1e-5, (step, index, _off(g, expected))  # rounding: 4e-7 seen
                hand[index] = (m - expected, m_mean.T @ (p / p.norm()))


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


def _resumed(rank: int, tolerance: float) -> None:
    """Eight SGD steps through PowerSGD; then steps 5 to 7 again on a fresh DDP object, as a
    restarted process has, from the state saved before step 5: each gives the same gradients, up to
    `tolerance` of their norm. Then step 5 from that state said to be from one worker more: the
    ranks are other ones, so it starts with no error feedback and a fresh Q, as from a state that
    holds neither (the step count alone)."""
    world = dist.get_world_size()
    config = JobConfig.from_dict({"ddp": POWERSGD, "scaling": {"workers": world}})

    def sgd(model: nn.Module, step: int) -> list[torch.Tensor]:
        model.zero_grad()
        _step(model, rank, step)
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return grads

    first, grads = parallelize(_model(), config, world, "one node", CPU, print), []
    for step in range(8):
        if step == 5:
            saved = ({k: v.clone() for k, v in first.model.state_dict().items()}, first.comm_hook.state_dict(),
                     first.comm_hook.rank_state_dict())
        grads.append(sgd(first.train_model, step))
    again = parallelize(_model(), config, world, "one node", CPU, print)
    again.model.load_state_dict(saved[0])
    again.comm_hook.load_state_dict(saved[1])
    again.comm_hook.load_rank_state_dict(saved[2])
    for step in range(5, 8):
        got = sgd(again.train_model, step)
        off = [((g - h).norm() / h.norm()).item() for g, h in zip(got, grads[step])]
        assert max(off) <= tolerance, (step, off)  # 0: bitwise

    elsewhere, bare = (parallelize(_model(), config, world, "one node", CPU, print) for _ in range(2))
    for parallel in (elsewhere, bare):
        parallel.model.load_state_dict(saved[0])
    elsewhere.comm_hook.load_state_dict({**saved[1], "world_size": world + 1})
    elsewhere.comm_hook.load_rank_state_dict(saved[2])
    bare.comm_hook.load_state_dict({**saved[1], "q": {}})
    got = sgd(elsewhere.train_model, 5)
    assert all(torch.equal(g, h) for g, h in zip(got, sgd(bare.train_model, 5)))
    assert not all(torch.equal(g, h) for g, h in zip(got, grads[5]))  # what was saved would have changed it
    # By hand: with no error feedback each weight's gradient is the ranks' mean gradient projected
    # onto P, the direction of its one column space (see _hooked).
    local = _model()
    local.load_state_dict(saved[0])
    _step(local, rank, 5)
    for g, mean in zip(got, _mean(local)):
        if g.dim() == 2:
            assert _off(g, _projected(mean, torch.linalg.svd(g).U[:, :1])) < 1e-5


@pytest.mark.parametrize("world_size, tolerance", [(2, 0), (3, 1e-5)])
def test_a_restarted_process_goes_on_with_powersgd_bitwise_at_2_workers_within_rounding_at_3(monkeypatch, world_size,
                                                                                             tolerance):
    """DDP lays its buckets out by the order gradients arrive only after a process's first step,
    so a restarted process's first step has each gradient at another offset than the same step of
    the run it continues. MKL's SSE4.2 code (what it runs on a CPU without AVX2; forced here on
    any x86) rounds a product otherwise at another alignment: PowerSGD multiplies copies of its
    own (torch's `powerSGD_hook` differed from step 5, in the last bits). At 3 workers
    that first step is not bitwise, with or without a hook: Gloo sums 3 ranks' values in an
    order set by each value's offset in its bucket (2 ranks': a + b either way)."""
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    spawn(_resumed, tolerance, world_size=world_size)


@pytest.mark.slow
def test_a_killed_worker_resumes_bitwise_with_powersgd_and_another_world_size_restarts_its_errors(tmp_path,
                                                                                                   monkeypatch):
    """PowerSGD's factors and step count (rank 0's) and each rank's error feedback are in the
    checkpoint: a SIGKILL mid-epoch 2 (steps past start_iter) resumes to the same weights as a run
    never killed. Without them the resumed steps would compress otherwise. Under MKL's SSE4.2 code,
    where torch's own hook resumed otherwise, as it did on one machine (see the test above)."""
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
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

    # Three workers resume what two trained: other ranks, so their error feedback starts at zero, said once
    # (what that step then computes is checked in the test above). The run finishes at 3 workers, PowerSGD's
    # step count going on from the two's, and each of the three ranks saves error feedback for each matrix.
    lines = []
    grown = trained(faulty(tmp_path / "never", 40, "kill", ddp=POWERSGD, train={"epochs": 3}, scaling={"workers": 3}),
                    tmp_path / "straight", True, resume=True, lines=lines)
    assert [line for line in lines if "powersgd" in line] == [
        "warning: ddp.comm_hook powersgd: the checkpoint is from 2 workers and this run has 3: error feedback and "
        "factors restart at zero"], lines
    assert json.loads((tmp_path / "straight" / "run.json").read_text())["status"] == "finished"
    rows = runrecord.metrics(tmp_path / "straight")
    assert [(row["epoch"], row["world_size"]) for row in rows] == [(1, 2), (2, 2), (3, 3)], rows
    state = torch.load(f"{grown.final_checkpoint}/state.pt", weights_only=True)
    assert state["comm_hook"]["world_size"] == 3 and state["comm_hook"]["iter"] == rows[-1]["step"]
    matrices = {name: weight.shape for name, weight in state["model"].items() if weight.dim() == 2}
    for rank in range(3):
        errors = torch.load(f"{grown.final_checkpoint}/rank{rank}.pt", weights_only=True)["comm_hook"]
        assert {name: error.shape for name, error in errors.items()} == matrices, (rank, errors.keys())


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
