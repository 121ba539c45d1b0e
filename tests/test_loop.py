"""The loop's pieces in one process: precision, clipping, schedule, models, checkpoint safety."""

import math

import pytest
import torch

from raytrain_app import checkpoint
from raytrain_app.checkpoint import TrainState
from raytrain_app.config import DataConfig, JobConfig, ModelConfig, OptimizerConfig, ScheduleConfig
from raytrain_app.data import build_datasets, train_loader
from raytrain_app.errors import UserError
from raytrain_app.loop import Precision, evaluate, seed_everything, train_epoch
from raytrain_app.models import build_model
from raytrain_app.optim import build_optimizer, build_schedule
from raytrain_app.plan import make_plan

CPU = torch.device("cpu")


def setup(precision="fp32", lr=0.05):
    seed_everything(0)
    data = build_datasets(DataConfig(name="digits"))
    model = build_model(ModelConfig(name="mlp"), data.input_shape, data.num_classes)
    opt = build_optimizer(model.parameters(), OptimizerConfig(lr=lr), world_size=1)
    loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    prec = Precision(precision, CPU)
    state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), len(loader), 1), prec.scaler)
    return data, loader, state, prec


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_learns(precision):
    data, loader, state, prec = setup(precision)
    eval_loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    before = evaluate(state.model, eval_loader, prec, CPU).loss
    for _ in range(3):
        totals = train_epoch(state.model, loader, state, prec, 1, None, CPU)
    assert totals.count == len(data.train)
    assert evaluate(state.model, eval_loader, prec, CPU).loss < before * 0.5
    assert (state.scaler is not None) == (precision == "fp16")


def test_gradient_clipping_bounds_the_update():
    _, loader, state, prec = setup(lr=1.0)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in state.model.parameters()]
    x, y = next(iter(loader))
    train_epoch(state.model, [(x, y)], state, prec, 1, 1e-3, CPU)
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
    assert build_optimizer(params, OptimizerConfig(lr=0.1, scale_lr="linear"), 4).param_groups[0]["lr"] == pytest.approx(0.4)
    assert build_optimizer(params, OptimizerConfig(name="adamw", lr=0.1), 4).param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name, shape", [("lenet", (1, 28, 28)), ("lenet", (3, 32, 32)), ("mlp", (64,)),
                                         ("resnet18", (3, 32, 32))])
def test_builtin_models(name, shape):
    model = build_model(ModelConfig(name=name), shape, 10)
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_checkpoint_round_trip_with_safe_loading(tmp_path):
    _, loader, state, prec = setup()
    train_epoch(state.model, loader, state, prec, 1, None, CPU)
    state.epoch = 1
    checkpoint.save(str(tmp_path), state, rank=0, config=JobConfig().to_dict())
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
        train_epoch(model, batches, state, prec, 1, None, CPU, memory_format=memory_format)
        results.append([p.detach().clone() for p in model.parameters()])
    assert results[1][0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(*results):
        torch.testing.assert_close(a.contiguous(), b.contiguous(), rtol=1e-4, atol=1e-5)
