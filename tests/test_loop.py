"""The loop's pieces in one process: precision, clipping, schedule, models, checkpoint safety."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_app.config import JobConfig
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.config.sections import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
)
from raytrain_app.data import build_datasets, train_loader
from raytrain_app.driver.plan import make_plan
from raytrain_app.errors import UserError
from raytrain_app.models import build_model
from raytrain_app.rundir import SNAPSHOT as CHECKPOINT_SNAPSHOT
from raytrain_app.tasks.supervised import Classification
from raytrain_app.worker import checkpoint
from raytrain_app.worker.loop import Precision, Step, eval_epoch, seed_everything, train_epoch
from raytrain_app.worker.nonfinite import LAG, LossCheck, NonFiniteLoss
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import place
from tests.gloo import spawn
from tests.helpers import save_checkpoint

CPU = torch.device("cpu")

CLASSIFY = Classification(TaskConfig())  # the task the steps here run


def setup(precision="fp32", lr=0.05):
    seed_everything(0)
    data = build_datasets(DataConfig(name="digits"))
    model = build_model(ModelConfig(name="mlp"), data.input_shape, data.num_classes)
    opt = build_optimizer(model.parameters(), OptimizerConfig(lr=lr), world_size=1)
    loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    prec = Precision(precision, CPU)
    state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), len(loader), 1), prec.scaler)
    return data, loader, state, prec


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                              ("fp16", torch.float16)])
def test_every_precision_learns(precision, dtype, monkeypatch):
    data, loader, state, prec = setup(precision)
    computed = []  # the dtype the first Linear layer really computes in, inside autocast
    state.model[1].register_forward_hook(lambda module, inputs, out: computed.append(out.dtype))
    scaled, stepped = [], []
    if prec.scaler:  # count what GradScaler really does, passing every call through
        scale, scaler_step = prec.scaler.scale, prec.scaler.step
        monkeypatch.setattr(prec.scaler, "scale", lambda loss: scaled.append(float(scale(loss) / loss)) or scale(loss))
        monkeypatch.setattr(prec.scaler, "step", lambda opt: stepped.append(1) or scaler_step(opt))
    eval_loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    step = Step(state.model, prec, CLASSIFY)
    before = eval_epoch(state.model, eval_loader, step)["loss"]
    for _ in range(3):
        totals = train_epoch(step, loader, state)
        state.finish_epoch()
    assert totals.samples == len(data.train) and state.epoch == 3
    assert eval_epoch(state.model, eval_loader, step)["loss"] < before * 0.5
    assert set(computed) == {dtype}
    assert (state.scaler is not None) == (precision == "fp16")
    if precision == "fp16":  # every loss scaled up before backward, every step through the scaler
        assert len(scaled) == len(stepped) == state.step == 3 * len(loader)
        assert set(scaled) == {65536.0}


def test_gradient_clipping_bounds_the_update():
    _, loader, state, prec = setup(lr=1.0)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in state.model.parameters()]
    x, y = next(iter(loader))
    train_epoch(Step(state.model, prec, CLASSIFY, grad_clip=1e-3), [(x, y)], state)
    step = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(state.model.parameters(), before)))
    assert step.item() == pytest.approx(1e-3, rel=1e-3)  # plain SGD moves by lr * clipped norm


def test_warmup_then_cosine():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_schedule(opt, ScheduleConfig(name="cosine", warmup_epochs=1, min_lr_ratio=0.1), 10, 3)
    lrs = []
    for _ in range(30):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] > lrs[20] > lrs[29] >= 0.1
    assert lrs[20] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 20)))


def test_linear_lr_scaling():
    params = [torch.zeros(1, requires_grad=True)]
    assert (build_optimizer(params, OptimizerConfig(lr=0.1, scale_lr="linear"), 4).param_groups[0]["lr"]
            == pytest.approx(0.4))
    assert build_optimizer(params, OptimizerConfig(name="adamw", lr=0.1), 4).param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name, shape", [("lenet", (1, 28, 28)), ("lenet", (3, 32, 32)), ("mlp", (64,)),
                                         ("resnet18", (3, 32, 32))])
def test_builtin_models(name, shape):
    model = build_model(ModelConfig(name=name), shape, 10)
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_checkpoint_round_trip_with_safe_loading(tmp_path):
    _, loader, state, prec = setup()
    train_epoch(Step(state.model, prec, CLASSIFY), loader, state)
    state.finish_epoch()
    checkpoint.save(str(tmp_path), 0, state, about={"config": JobConfig().to_dict()})
    expected = torch.rand(3)  # drawn after the save: restoring must replay it

    _, _, fresh, _ = setup()
    checkpoint.load_into(str(tmp_path), fresh, rank=0, device=CPU)
    assert torch.equal(torch.rand(3), expected)
    assert fresh.step == state.step and fresh.epoch == 1
    for a, b in zip(fresh.model.parameters(), state.model.parameters()):
        assert torch.equal(a, b)


def test_sync_batchnorm_on_cpu_is_refused_before_start(tmp_path):
    config = JobConfig.from_dict({"train": {"sync_batchnorm": True}, "scaling": {"workers": 2}})
    with pytest.raises(UserError, match="sync_batchnorm needs GPU workers"):
        make_plan(config, run_dir=str(tmp_path / "run"))


def test_channels_last_trains_to_the_same_weights():
    data = build_datasets(DataConfig(name="digits", args={"resize": 28}))
    loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    batches = [b for b, _ in zip(loader, range(4))]
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        seed_everything(0)
        model = build_model(ModelConfig(name="lenet"), data.input_shape, 10).to(memory_format=memory_format)
        opt = build_optimizer(model.parameters(), OptimizerConfig(lr=0.05), world_size=1)
        prec = Precision("fp32", CPU)
        state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), 4, 1), None)
        train_epoch(Step(model, prec, CLASSIFY, memory_format=memory_format), batches, state)
        results.append([p.detach().clone() for p in model.parameters()])
    assert results[1][0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(*results):
        torch.testing.assert_close(a.contiguous(), b.contiguous(), rtol=1e-4, atol=1e-5)


class NanAt(torch.nn.Module):
    """Wraps a model; its training forward number `at` returns NaN outputs."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x) * (float("nan") if self.calls == self.at else 1.0)


def test_the_first_non_finite_loss_stops_training_within_two_checks():
    _, loader, state, prec = setup()
    model = NanAt(state.model, at=4)
    with pytest.raises(NonFiniteLoss) as stop:
        train_epoch(Step(model, prec, CLASSIFY, loss_check=LossCheck(CPU)), loader, state)
    assert stop.value.step == 4 and stop.value.lr == pytest.approx(0.05)
    assert state.step == 2 * LAG  # steps 1 to LAG checked together, read LAG steps later: no step waits

    _, loader, state, prec = setup()
    step = Step(NanAt(state.model, at=4), prec, CLASSIFY, loss_check=LossCheck(CPU, enabled=False))
    totals = train_epoch(step, loader, state)
    assert state.step == len(loader) and math.isnan(totals.loss)


def test_fp16_steps_skipped_by_the_grad_scaler_do_not_stop_training():
    _, loader, state, prec = setup("fp16")
    # A scale so large that the fp16 backward overflows: GradScaler skips those steps and lowers it.
    prec.scaler = state.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    before = [p.detach().clone() for p in state.model.parameters()]
    train_epoch(Step(state.model, prec, CLASSIFY, loss_check=LossCheck(CPU)), [b for b, _ in zip(loader, range(3))],
                state)
    assert prec.scaler.get_scale() == 2.0**97  # three overflows, three skipped steps, no stop
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))


def _accumulate(rank: int, out_dir: str) -> None:
    """One of two Gloo ranks: 12 micro-batches of 4 with grad_accum_steps 4, counting DDP's
    all-reduces with a communication hook; then the same samples as 3 batches of 16."""
    data = build_datasets(DataConfig(name="digits"))
    weights = {}
    for batch, accum in ((4, 4), (16, 1)):
        seed_everything(0)
        model = build_model(ModelConfig(name="mlp", args={"hidden": [16]}), data.input_shape, 10)
        ddp = DDP(model)
        syncs = []

        def counting_allreduce(process_group, bucket):
            syncs.append(bucket.index())
            return allreduce_hook(process_group, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
        loader, _ = train_loader(data, batch, rank, 2, 0, 0, False)
        batches = [b for b, _ in zip(loader, range(48 // batch))]
        opt = build_optimizer(model.parameters(), OptimizerConfig(lr=0.05), world_size=2)
        state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), 3, 1), None)
        train_epoch(Step(ddp, Precision("fp32", CPU), CLASSIFY, accum), batches, state)
        weights[accum] = [p.detach() for p in model.parameters()]
        if accum == 4:
            (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"syncs": syncs, "steps": state.step}))
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(weights[4], weights[1]))
    (Path(out_dir) / f"rank{rank}-same").write_text(str(same))


def test_gradient_accumulation_all_reduces_once_per_step_and_matches_a_larger_batch(tmp_path):
    """DDP all-reduces on every backward unless told not to: counted by a DDP communication hook
    over a real two-rank Gloo group, non-final micro-batches must run under no_sync(), and 4
    accumulated micro-batches of 4 must step as one batch of 16."""
    spawn(_accumulate, str(tmp_path))
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counted["steps"] == 3 and counted["syncs"] == [0, 0, 0]  # one bucket, once per step
        assert (tmp_path / f"rank{rank}-same").read_text() == "True"


def test_sync_batchnorm_replaces_every_batch_norm():
    """The conversion only: DDP refuses SyncBatchNorm on CPU modules, so the rest needs a GPU."""
    net = lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())  # noqa: E731
    model, _ = place(net(), TrainConfig(sync_batchnorm=True), 2, CPU)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "SyncBatchNorm" in kinds and "BatchNorm2d" not in kinds
    alone, _ = place(net(), TrainConfig(sync_batchnorm=True), 1, CPU)
    assert isinstance(alone[1], torch.nn.BatchNorm2d)  # one worker: nothing to synchronise
    last, memory_format = place(net(), TrainConfig(channels_last="on"), 1, CPU)
    assert memory_format is torch.channels_last and last[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_resume_defaults_to_the_latest_run_of_the_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = JobConfig.from_dict({"name": "job", "model": {"name": "mlp"}})
    for stamp in ("20260101-000000", "20260301-000000", "20260201-000000"):
        save_checkpoint(tmp_path / "runs" / f"job-{stamp}" / "checkpoint_2026-01-01_00-00-00.000000",
                        resolve_auto(config))
        (tmp_path / "runs" / f"job-{stamp}" / CHECKPOINT_SNAPSHOT).write_text("{}")
    (tmp_path / "runs" / "other-20270101-000000").mkdir()  # another job's run is not a candidate
    plan = make_plan(config, resume=True)
    plan.lease.release()
    assert plan.run_dir == str(tmp_path / "runs" / "job-20260301-000000")
    fresh = make_plan(config)
    fresh.lease.release()
    assert re.fullmatch(str(tmp_path / "runs" / r"job-\d{8}-\d{6}"), fresh.run_dir)
