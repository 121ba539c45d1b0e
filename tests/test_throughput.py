"""The throughput machinery without Ray: device-resident batches, loader sizing, FLOPs, MFU, the
epoch time split, and torch.compile alone and under DDP over two Gloo ranks."""

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_app.config.sections import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TaskConfig
from raytrain_app.data import (
    Datasets,
    build_datasets,
    eval_loader,
    keep_on_device,
    loader_workers,
    to_device,
    train_loader,
)
from raytrain_app.data.arrays import flip_and_crop
from raytrain_app.errors import UserError
from raytrain_app.models import build_model
from raytrain_app.tasks.supervised import Classification
from raytrain_app.worker.loop import Precision, Step, eval_epoch, seed_everything, train_epoch
from raytrain_app.worker.metrics import peak_flops, time_split, train_flops_per_sample
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import compiled
from tests.gloo import spawn

CPU = torch.device("cpu")


def augmented_digits():
    """Real digits as 3x16x16 images with the CIFAR flip-and-crop: augmentation draws random numbers per batch."""
    return build_datasets(DataConfig(name="tests.helpers:augmented_digits"))


@pytest.mark.parametrize("rank", [0, 1])
def test_device_batches_are_the_dataloaders_batches(rank):
    data = augmented_digits()
    resident = to_device(data, CPU)
    for epoch, skip in ((0, 0), (3, 40)):  # a later epoch, resumed 40 samples in
        batches = {}
        for kind, ds, on_device in (("loader", data, False), ("device", resident, True)):
            loader, sampler = train_loader(ds, 32, rank, 2, 7, 0, False, resident=on_device)
            sampler.set_epoch(epoch)
            sampler.start = 2 * skip  # over both ranks
            seed_everything(epoch)  # the same augmentation draws for both
            batches[kind] = list(loader)
            assert len(loader) == len(batches[kind])
        assert len(batches["device"]) == len(batches["loader"]) > 1
        for (xd, yd), (xl, yl) in zip(batches["device"], batches["loader"]):
            assert torch.equal(yd, yl)
            assert torch.equal(xd, xl)
        # ... and those batches are augmented: the same samples without augmentation differ.
        plain = copy.copy(data.train)
        plain.augment = False
        loader, sampler = train_loader(Datasets(plain, data.eval, data.input_shape, data.num_classes), 32, rank, 2, 7,
                                       0, False)
        sampler.set_epoch(epoch)
        sampler.start = 2 * skip
        for (xa, ya), (xp, yp) in zip(batches["loader"], loader):
            assert torch.equal(ya, yp)
            assert (xa != xp).flatten(1).any(1).float().mean() > 0.5
    ev_device = list(eval_loader(resident, 100, rank, 2, 0, False, resident=True))
    ev_loader = list(eval_loader(data, 100, rank, 2, 0, False))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ev_device, ev_loader))


def test_flip_and_crop_flips_half_the_images_and_crops_uniformly():
    """Each output is one of 2 x 9 x 9 candidates (flipped or not, crop offset 0..8 in each axis
    of the 4-pixel padded image): find which, and check the draws' statistics."""
    n, h, pad = 1800, 6, 4
    torch.manual_seed(0)
    x = torch.rand(n, 1, h, h) + 1.0  # no zeros: padding shows in a crop
    out = flip_and_crop(x, pad)
    found = torch.full((n, 3), -1)
    for flip in (0, 1):
        padded = F.pad(x.flip(3) if flip else x, (pad,) * 4)
        for dy in range(2 * pad + 1):
            for dx in range(2 * pad + 1):
                match = (padded[:, :, dy:dy + h, dx:dx + h] == out).flatten(1).all(1)
                assert not (match & (found[:, 0] >= 0)).any()  # one explanation per output
                found[match] = torch.tensor([flip, dy, dx])
    assert (found[:, 0] >= 0).all()  # every output is a flip-and-crop of its input
    assert 0.45 < found[:, 0].float().mean() < 0.55  # half flipped
    for axis in (1, 2):  # each of the 9 offsets about n/9 = 200 times
        counts = torch.bincount(found[:, axis], minlength=2 * pad + 1)
        assert counts.min() > 140 and counts.max() < 260, counts


def test_on_device_choice():
    data = augmented_digits()
    assert keep_on_device(data, "on", CPU) is True
    assert keep_on_device(data, "off", CPU) is False
    assert keep_on_device(data, "auto", CPU) is False  # auto moves data only onto GPUs
    per_sample = build_datasets(DataConfig(name="tests.helpers:index_data"))
    with pytest.raises(UserError, match="on_device: on needs an in-memory dataset"):
        keep_on_device(per_sample, "on", CPU)
    assert keep_on_device(per_sample, "auto", CPU) is False


def test_loader_workers_are_sized_to_the_machine():
    arrays, per_sample = augmented_digits(), build_datasets(DataConfig(name="tests.helpers:index_data"))
    assert loader_workers(None, arrays, 8) == 0  # a batch of an in-memory dataset is one indexing op
    assert [loader_workers(None, per_sample, c) for c in (1, 3, 16)] == [0, 2, 4]
    assert loader_workers(3, arrays, 1) == 3  # an explicit setting wins


def test_flops_of_an_mlp_match_the_formula():
    model = build_model(ModelConfig(name="mlp", args={"hidden": [32, 16]}), (1, 8, 8), 10)
    model[1].weight.requires_grad_(False)  # a frozen layer still costs its forward and input gradient
    weights = [(64, 32), (32, 16), (16, 10)]
    forward = sum(2 * i * o for i, o in weights)
    # Backward: each layer's weight gradient, and the gradient of its input except for the first layer's.
    backward = sum(2 * i * o for i, o in weights[1:]) + sum(2 * i * o for i, o in weights[1:])
    assert train_flops_per_sample(model, (1, 8, 8)) == forward + backward
    before = [p.clone() for p in model.parameters()]
    assert all(p.grad is None for p in model.parameters())  # counted on a meta copy: nothing touched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_peak_flops_and_time_split():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "fp16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362e12
    # Whole names only, and no fp32 figure: cuDNN runs fp32 convolutions as TF32 anyway.
    for name, precision in (("NVIDIA L40", "bf16"), ("NVIDIA RTX A1000", "bf16"), ("NVIDIA H100 80GB HBM3", "fp32"),
                            ("Some Future GPU", "bf16")):
        assert peak_flops(name, precision) is None
    split = time_split(epoch_s=10.0, data_wait_s=1.0, syncs=100, sync_s=0.02)
    assert split == pytest.approx({"data_wait_frac": 0.1, "comm_frac": 0.2, "compute_frac": 0.7})
    # The estimate is an upper bound on exposed communication: never more than what is left.
    assert time_split(10.0, 4.0, 1000, 0.02)["comm_frac"] == pytest.approx(0.6)


def test_cuda_graph_modes_fall_back_under_ddp_and_accumulation():
    notices = []
    model = nn.Linear(4, 2)
    cuda = torch.device("cuda")
    _, graphs = compiled(model, "reduce-overhead", 1, 1, cuda, notices.append)
    assert graphs and not notices  # world size 1: the whole step can be one CUDA graph
    _, graphs = compiled(model, "reduce-overhead", 2, 1, cuda, notices.append)
    assert not graphs and "cannot capture the gradient collectives" in notices[-1]
    _, graphs = compiled(model, "max-autotune", 1, 4, cuda, notices.append)
    assert not graphs and "cannot capture gradient accumulation" in notices[-1]
    assert compiled(model, "off", 4, 1, CPU, notices.append) == (model, False)


def _mlp(data) -> nn.Module:
    seed_everything(0)
    return build_model(ModelConfig(name="mlp", args={"hidden": [32]}), data.input_shape, 10)


def _trained(model: nn.Module, batches: list, mode: str, world_size: int = 1, static_graph: bool = False) -> nn.Module:
    """`model` after one pass over `batches` with `train.compile: mode`, under DDP beyond one worker."""
    wrapped = DDP(model, gradient_as_bucket_view=True, static_graph=static_graph) if world_size > 1 else model
    train_model, _ = compiled(wrapped, mode, world_size, 1, CPU, print)
    opt = build_optimizer(model.parameters(), OptimizerConfig(lr=0.05), world_size=world_size)
    state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), len(batches), 1), None)
    train_epoch(Step(train_model, Precision("fp32", CPU), Classification(TaskConfig())), batches, state)
    return model


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


def test_compiled_model_trains_like_the_eager_one():
    data = build_datasets(DataConfig(name="digits"))
    loader, _ = train_loader(data, 64, 0, 1, 0, 0, False)
    batches = [b for b, _ in zip(loader, range(5))]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # which reset() keeps: an earlier test's compiles in this process
    eager = _trained(_mlp(data), batches, "off")
    assert torch._dynamo.utils.counters["frames"]["ok"] == 0
    compiled = _trained(_mlp(data), batches, "default")
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0  # dynamo really compiled frames of the step
    precision, task = Precision("fp32", CPU), Classification(TaskConfig())
    assert eval_epoch(compiled, batches, Step(compiled, precision, task))["loss"] == pytest.approx(
        eval_epoch(eager, batches, Step(eager, precision, task))["loss"], rel=1e-4)
    np.testing.assert_allclose(_flat(compiled), _flat(eager), rtol=1e-4, atol=1e-5)


def _train_compiled_ddp(rank: int, out_dir: str) -> None:
    """One of two Gloo ranks: the same steps eagerly, compiled, and compiled with a static graph."""
    data = build_datasets(DataConfig(name="digits"))
    loader, _ = train_loader(data, 32, rank, 2, 0, 0, False)
    batches = [b for b, _ in zip(loader, range(4))]
    weights = {"init": _flat(_mlp(data))}
    for mode, static in (("off", False), ("default", False), ("default", True)):
        torch._dynamo.reset()
        weights[f"{mode}-static{static}"] = _flat(_trained(_mlp(data), batches, mode, 2, static))
        weights[f"{mode}-static{static}-graphs"] = np.array(torch._dynamo.utils.counters["frames"]["ok"])
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **weights)


@pytest.mark.slow
def test_compiled_ddp_trains_like_eager_ddp(tmp_path):
    """torch.compile under DDP (graph split at the buckets) over a real two-rank Gloo group: each
    rank trains on its own shard, so equal replicas also show the compiled step all-reduced."""
    spawn(_train_compiled_ddp, str(tmp_path))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    eager = ranks[0]["off-staticFalse"]
    assert not np.allclose(eager, ranks[0]["init"], atol=1e-3)  # the steps moved the weights
    np.testing.assert_allclose(ranks[1]["off-staticFalse"], eager, rtol=1e-4, atol=1e-5)  # eager replicas agree
    for weights in ranks:
        for variant in ("default-staticFalse", "default-staticTrue"):
            assert weights[f"{variant}-graphs"] > 0  # dynamo really compiled frames of the step
            np.testing.assert_allclose(weights[variant], eager, rtol=1e-4, atol=1e-5)
        assert weights["off-staticFalse-graphs"] == 0  # and "off" really is eager
