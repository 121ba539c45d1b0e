"""FSDP2 and HSDP on real two-rank Gloo groups, without Ray: the same training as DDP, sharded
checkpoints that restore exactly and reshard, a model placed over its worker's devices, and the
checks that refuse what cannot work."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raytrain_app.config import JobConfig
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.config.sections import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    StrategyConfig,
    TaskConfig,
)
from raytrain_app.data import build_datasets, train_loader
from raytrain_app.driver.plan import make_plan
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.models import build_model, places_itself
from raytrain_app.rundir import checkpoints
from raytrain_app.tasks import build_task
from raytrain_app.tasks.supervised import Classification
from raytrain_app.worker import checkpoint
from raytrain_app.worker.loop import Precision, Step, eval_epoch, seed_everything, train_epoch
from raytrain_app.worker.memory import GiB, check_state_fits, shard_group, state_bytes
from raytrain_app.worker.metrics import EpochMetrics
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import is_sharded, mesh_ranks, parallelize, shard_units
from tests.gloo import spawn

CPU = torch.device("cpu")
GPT = {"name": "gpt", "args": {"n_layer": 2, "n_head": 2, "n_embd": 16}}
VOCAB, LENGTH = 32, 17
VARIANTS = {"ddp": {"name": "ddp"}, "fsdp": {"name": "fsdp"},
            "hsdp 1x2": {"name": "hsdp", "replicate_degree": 1}, "hsdp 2x1": {"name": "hsdp", "replicate_degree": 2}}
# Beyond the strategies' own: bf16 parameters (compared loosely), and torch.compile of the sharded model.
TRAIN = {"fsdp bf16": {"precision": "bf16"}, "fsdp compiled": {"compile": "default"}}


def job(strategy: dict, **train) -> JobConfig:
    return JobConfig.from_dict({"model": GPT, "task": {"name": "language_model"}, "strategy": strategy,
                                "train": {"grad_accum_steps": 2, "grad_clip": 0.5, **train},
                                "scaling": {"workers": 2}})


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


def trained(rank: int, world_size: int, strategy: dict, **train):
    """The GPT after 6 micro-batches (3 accumulated, clipped steps) of this rank's half of a
    global batch of 8, and its parallel form and training state."""
    config = resolve_auto(job(strategy, **train))
    seed_everything(0)
    model = build_model(config.model, (LENGTH,), VOCAB)
    model.computed_in = set()  # the dtypes a layer's weight has while it computes
    model.blocks[0].mlp[0].register_forward_hook(lambda m, i, o: model.computed_in.add(str(m.weight.dtype)))
    parallel = parallelize(model, config, world_size, "one node", CPU, print)
    opt = build_optimizer(parallel.model.parameters(), OptimizerConfig(name="adamw", lr=3e-3), world_size)
    state = TrainState(parallel.model, opt, build_schedule(opt, ScheduleConfig(), 3, 1), None,
                       sharded=parallel.mesh is not None)
    step = Step(parallel.train_model, Precision(config.train.precision, CPU), build_task(config.task), 2, 0.5)
    batches = [tokens(8, seed)[rank::world_size] for seed in range(6)]
    totals = train_epoch(step, batches, state)
    return parallel, state, step, float(totals.sums[0]) / totals.samples


def held(model, state) -> dict:
    """Bytes this rank holds of the parameters and (with `state`) of the optimizer's per-parameter state."""
    nbytes = lambda t: (t.to_local() if hasattr(t, "to_local") else t).nbytes  # noqa: E731
    moments = [v for m in state.optimizer.state.values() for v in m.values()] if state else []
    return {"params": sum(nbytes(p) for p in model.parameters()),
            "optimizer": sum(nbytes(v) for v in moments if torch.is_tensor(v) and v.dim())}  # not AdamW's 0-d steps


def _compare(rank: int, out_dir: str) -> None:
    """Every variant from the same seed on the same data; the eval set is uneven over the ranks
    (3 batches on rank 0, 2 on rank 1), which a sharded forward must survive."""
    results = {}
    runs = [(name, strategy, {}) for name, strategy in VARIANTS.items()]
    for name, train in TRAIN.items():
        runs.append((name, VARIANTS["fsdp"], train))
    for name, strategy, train in runs:
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        parallel, state, step, train_loss = trained(rank, 2, strategy, **train)
        compiled = {"wrapper": type(parallel.train_model).__name__,  # what the steps ran through
                    "frames": torch._dynamo.utils.counters["frames"]["ok"] - frames}  # what dynamo compiled
        evaluated = eval_epoch(parallel.model, [tokens(4, 100 + i) for i in range(rank, 5, 2)], step)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist()
                for k, v in parallel.model.state_dict().items()}
        results[name] = {"train_loss": train_loss, "eval_loss": evaluated["loss"], "samples": evaluated["samples"],
                         "sharded": is_sharded(parallel.model), "mesh": parallel.mesh, "weights": full,
                         "computed_in": sorted(parallel.model.computed_in), "held": held(parallel.model, state),
                         "compiled": compiled}
    hsdp = StrategyConfig(name="hsdp")  # one replica per node: what each rank builds, seeing both ranks' nodes
    results["layouts"] = [mesh_ranks(hsdp, 2, node).tolist() for node in (f"node{rank}", "one node")]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
@pytest.mark.timeout(180)  # a rank short of eval batches would otherwise wait in an all-gather forever
def test_fsdp_and_hsdp_train_and_evaluate_as_ddp_does(tmp_path):
    spawn(_compare, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    ddp = ranks[0]["ddp"]
    assert not ddp["sharded"] and ddp["samples"] == 20
    for name, mesh in (("fsdp", [2]), ("hsdp 1x2", [1, 2]), ("hsdp 2x1", [2, 1])):
        for rank in ranks:
            got = rank[name]
            assert got["sharded"] and got["mesh"] == mesh, name
            assert got["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-5), name
            assert got["samples"] == 20, name  # every eval sample once, none of the repeated batch
            for key, value in ddp["weights"].items():
                assert torch.allclose(torch.tensor(got["weights"][key]), torch.tensor(value), atol=1e-5), (name, key)
    # Each rank's own training loss is the same under every strategy: the same samples, the same weights.
    for rank in ranks:
        assert rank["fsdp"]["train_loss"] == pytest.approx(rank["ddp"]["train_loss"], rel=1e-5)
        # Compiled under FSDP: the training steps ran through torch.compile's module and dynamo
        # compiled frames, and trained as the eager sharded model did.
        compiled = rank["fsdp compiled"]
        assert compiled["compiled"]["wrapper"] == "OptimizedModule" and compiled["compiled"]["frames"] > 0
        assert rank["fsdp"]["compiled"]["frames"] == 0 and rank["fsdp"]["compiled"]["wrapper"] != "OptimizedModule"
        assert compiled["train_loss"] == pytest.approx(rank["fsdp"]["train_loss"], rel=1e-5)
        assert compiled["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-5)
        bf16 = rank["fsdp bf16"]
        assert bf16["mesh"] == [2] and bf16["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=2e-2)
        assert bf16["computed_in"] == ["torch.bfloat16"] and rank["fsdp"]["computed_in"] == ["torch.float32"]
    assert ranks[0]["ddp"]["weights"] == ranks[1]["ddp"]["weights"]
    for rank in ranks:
        assert rank["layouts"] == [[[0], [1]], [[0, 1]]]  # two nodes: 2 replicas x 1; one node: 1 x 2
    # What the plan estimates a worker holds is what the ranks held: all of it under ddp and hsdp
    # 2x1, half under fsdp and hsdp 1x2 (a parameter's rows split unevenly, so on average).
    model = build_model(ModelConfig.model_validate(GPT), (LENGTH,), VOCAB)
    for name, strategy in VARIANTS.items():
        estimate = state_bytes(model, OptimizerConfig(name="adamw"), shard_group(job(strategy)))
        for part in ("params", "optimizer"):
            mean = sum(rank[name]["held"][part] for rank in ranks) / 2
            assert abs(mean - getattr(estimate, part)) <= 1, (name, part, mean, estimate)


def _odd_rows(rank: int, out_dir: str) -> None:
    """A GPT whose position table has 17 rows: fsdp gives rank 0 nine and rank 1 eight."""
    parallel, _, _, _ = trained(rank, 2, VARIANTS["fsdp"])
    metrics = EpochMetrics(parallel.model, (LENGTH,), "fp32", CPU, 2, parallel.sent_per_step())  # its shard: timed
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"sync_s": metrics.sync_s,
                                                                 "held": held(parallel.model, None)["params"]}))


def test_shards_of_different_sizes_time_their_gradient_sync_alike(tmp_path):
    spawn(_odd_rows, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["held"] != ranks[1]["held"]  # the case: unequal shards
    assert ranks[0]["sync_s"] == ranks[1]["sync_s"] > 0  # one calibration, agreed by every rank


def _save_and_restore(rank: int, out_dir: str) -> None:
    """A sharded checkpoint saved after training, restored into a fresh sharded state."""
    parallel, state, _, _ = trained(rank, 2, VARIANTS["fsdp"])
    state.batch = 0
    state.finish_epoch()
    directory = Path(out_dir) / f"rank{rank}"  # as under Ray: each rank its own directory, merged after
    directory.mkdir()
    checkpoint.save(str(directory), rank, state, about={"config": job(VARIANTS["fsdp"]).to_dict(),
                                                        "input_shape": [LENGTH], "num_classes": VOCAB})
    dist.barrier()
    merged = Path(out_dir) / "merged"
    if rank == 0:
        for part in sorted(Path(out_dir).glob("rank*")):
            for f in part.rglob("*"):
                if f.is_file():
                    (merged / f.relative_to(part)).parent.mkdir(parents=True, exist_ok=True)
                    f.rename(merged / f.relative_to(part))
    dist.barrier()
    expected = torch.rand(3)  # drawn after the save: the restore must replay this rank's stream
    fresh_parallel, fresh, _, _ = trained(rank, 2, VARIANTS["fsdp"])  # other weights: trained on
    for p in fresh.model.parameters():
        p.data.add_(1.0)
    for moments in fresh.optimizer.state.values():
        moments["exp_avg"].zero_()
        moments["exp_avg_sq"].zero_()
    fresh.step = 0
    checkpoint.load_into(str(merged), fresh, rank, CPU)
    same = torch.equal(torch.rand(3), expected) and fresh.epoch == 1 and fresh.step == state.step
    for (name, a), b in zip(parallel.model.state_dict().items(), fresh_parallel.model.state_dict().values()):
        same = same and torch.equal(a.to_local(), b.to_local())
    optimizer = state.sharded_state_dict()["optimizer"]["state"]
    restored = fresh.sharded_state_dict()["optimizer"]["state"]
    same = same and all(torch.equal(optimizer[k][m].to_local(), restored[k][m].to_local())
                        for k in optimizer for m in ("exp_avg", "exp_avg_sq"))
    full = {k: v.full_tensor().tolist() for k, v in parallel.model.state_dict().items()}
    moments = {k: v["exp_avg_sq"].full_tensor().tolist() for k, v in optimizer.items()}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"same": same, "weights": full,
                                                                 "exp_avg_sq": moments}))


@pytest.mark.slow
def test_a_sharded_checkpoint_restores_exactly_reshards_and_consolidates(tmp_path):
    spawn(_save_and_restore, str(tmp_path))
    merged = tmp_path / "merged"
    files = sorted(str(f.relative_to(merged)) for f in merged.rglob("*") if f.is_file())
    assert files == ["checkpoint.json", "rank0.pt", "rank0.pt.sha256", "rank1.pt", "rank1.pt.sha256",
                     "shards/.metadata", "shards/.metadata.sha256", "shards/__0_0.distcp", "shards/__0_0.distcp.sha256",
                     "shards/__1_0.distcp", "shards/__1_0.distcp.sha256", "state.pt", "state.pt.sha256"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["same"] and ranks[1]["same"]
    full = {k: torch.tensor(v) for k, v in ranks[0]["weights"].items()}

    # Consolidated on this one process, no process group: the plain model's weights, all of them.
    saved = checkpoints.load_state(str(merged))
    assert "optimizer" not in saved  # the weights only
    plain = build_model(job(VARIANTS["ddp"]).model, (LENGTH,), VOCAB)
    plain.load_state_dict(saved["model"])
    for key, value in plain.state_dict().items():
        assert torch.equal(value, full[key]), key

    # Resharded into one unsharded process: weights and optimizer state through DCP.
    seed_everything(1)
    alone = build_model(job(VARIANTS["ddp"]).model, (LENGTH,), VOCAB)
    opt = build_optimizer(alone.parameters(), OptimizerConfig(name="adamw", lr=3e-3), 1)
    state = TrainState(alone, opt, build_schedule(opt, ScheduleConfig(), 3, 1), None)
    checkpoint.load_into(str(merged), state, 0, CPU)
    for key, value in alone.state_dict().items():
        assert torch.equal(value, full[key]), key
    restored = state.sharded_state_dict()["optimizer"]["state"]
    for key, value in ranks[0]["exp_avg_sq"].items():
        assert torch.equal(restored[key]["exp_avg_sq"], torch.tensor(value)), key
    assert state.step == 3

    # And back: the one process trains on unsharded, and its checkpoint grows into two FSDP ranks,
    # each holding its shards of exactly those weights and moments.
    step = Step(alone, Precision("fp32", CPU), build_task(job(VARIANTS["ddp"]).task))
    train_epoch(step, [tokens(4, 200 + i) for i in range(2)], state)
    unsharded = tmp_path / "unsharded"
    unsharded.mkdir()
    checkpoint.save(str(unsharded), 0, state, about={})
    spawn(_grow_into_shards, str(tmp_path))
    grown = [json.loads((tmp_path / f"grown{r}.json").read_text()) for r in (0, 1)]
    for key, value in alone.state_dict().items():
        assert torch.equal(torch.tensor(grown[0]["weights"][key]), value), key
    moments = state.sharded_state_dict()["optimizer"]["state"]
    for key, value in moments.items():
        assert torch.equal(torch.tensor(grown[0]["exp_avg_sq"][key]), value["exp_avg_sq"]), key
    assert grown[0] == grown[1] and grown[0]["step"] == state.step == 5

    # A damaged shard is caught by its checksum, on every rank.
    with open(merged / "shards" / "__1_0.distcp", "r+b") as f:
        f.write(b"\0" * 8)
    assert "shards/__1_0.distcp does not match its checksum" in checkpoint.verify(str(merged), 0)


def _grow_into_shards(rank: int, out_dir: str) -> None:
    """Rank `rank` of two FSDP ranks restoring the unsharded checkpoint in OUT_DIR/unsharded."""
    parallel, fresh, _, _ = trained(rank, 2, VARIANTS["fsdp"])  # other weights and moments than the checkpoint's
    checkpoint.load_into(str(Path(out_dir) / "unsharded"), fresh, rank, CPU)
    optimizer = fresh.sharded_state_dict()["optimizer"]["state"]
    (Path(out_dir) / f"grown{rank}.json").write_text(json.dumps({
        "weights": {k: v.full_tensor().tolist() for k, v in parallel.model.state_dict().items()},
        "exp_avg_sq": {k: v["exp_avg_sq"].full_tensor().tolist() for k, v in optimizer.items()},
        "step": fresh.step}))


def test_shard_units_are_the_repeated_blocks_or_the_named_classes():
    model = build_model(job(VARIANTS["ddp"]).model, (LENGTH,), VOCAB)
    assert [type(m).__name__ for m in shard_units(model, "auto")] == ["Block", "Block"]
    assert [type(m).__name__ for m in shard_units(model, ["CausalSelfAttention"])] == ["CausalSelfAttention"] * 2
    resnet = build_model(JobConfig.from_dict({"model": {"name": "resnet18"}}).model, (3, 32, 32), 10)
    assert {type(m).__name__ for m in shard_units(resnet, "auto")} == {"BasicBlock"}
    with pytest.raises(ConfigError, match="strategy.shard_modules: Blok names no module of the model"):
        shard_units(model, ["Blok"])


def _split(rank: int, out_dir: str) -> None:
    """The model-parallel example's LeNet, given the CPU twice as its devices, against the plain
    LeNet it splits: both under DDP (device_ids=None for the placed one), the same steps."""
    config = JobConfig.from_dict({"model": {"name": "examples.model_parallel.model:build"}, "scaling": {"workers": 2}})
    data = build_datasets(DataConfig(name="digits", args={"resize": 28}))
    batches = [batch for batch, _ in zip(train_loader(data, 16, rank, 2, 0, 0, False)[0], range(4))]
    weights = []
    for model_config, devices in ((config.model, [CPU, CPU]), (ModelConfig(name="lenet"), None)):
        seed_everything(0)
        model = build_model(model_config, data.input_shape, 10, devices)
        parallel = parallelize(model, config, 2, "one node", CPU, print, placed=places_itself(model_config))
        assert parallel.train_model.device_ids is None
        opt = build_optimizer(parallel.model.parameters(), OptimizerConfig(lr=0.05), 2)
        state = TrainState(parallel.model, opt, build_schedule(opt, ScheduleConfig(name="constant"), 4, 1), None)
        train_epoch(Step(parallel.train_model, Precision("fp32", CPU), Classification(TaskConfig())), batches, state)
        weights.append([p.detach() for p in parallel.model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*weights))
    (Path(out_dir) / f"rank{rank}").write_text(str(same and places_itself(config.model)))


def test_a_model_that_places_itself_on_its_devices_trains_under_ddp_as_the_whole_model(tmp_path):
    spawn(_split, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True", "True"]


@pytest.mark.parametrize("overrides, message", [
    ({"strategy": {"name": "hsdp", "replicate_degree": 3}, "scaling": {"workers": 4}},
     "strategy.replicate_degree: 3 does not divide the 4 workers"),
    ({"strategy": {"name": "fsdp", "cpu_offload": True}, "train": {"compile": "default"},
      "scaling": {"gpus_per_worker": 1}},
     "strategy.cpu_offload: cannot be combined with train.compile"),
    ({"strategy": {"name": "fsdp", "cpu_offload": True}}, "strategy.cpu_offload: needs GPU workers"),
    ({"strategy": {"name": "fsdp"}, "train": {"precision": "fp16"}},
     "train.precision: fp16 is not supported under strategy fsdp"),
])
def test_strategies_that_cannot_work_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict(overrides)


def test_plan_checks_shard_modules_and_warns_for_one_worker(tmp_path):
    config = {"model": {"name": "gpt", "args": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
              "data": {"name": "text", "args": {"block": 16, "max_bytes": 40000}}, "task": {"name": "language_model"},
              "train": {"batch_size": 8}}
    with pytest.raises(UserError, match="strategy.shard_modules: Layer names no module of the model"):
        make_plan(JobConfig.from_dict({**config, "strategy": {"name": "fsdp", "shard_modules": ["Layer"]}}),
                  str(tmp_path / "a"))
    with pytest.raises(UserError, match="strategy fsdp: the model places its own layers"):
        make_plan(JobConfig.from_dict({"model": {"name": "examples.model_parallel.model:build"},
                                       "strategy": {"name": "fsdp"}}), str(tmp_path / "c"))
    plan = make_plan(JobConfig.from_dict({**config, "strategy": {"name": "fsdp"}, "scaling": {"workers": 1}}),
                     str(tmp_path / "b"))
    assert plan.warnings == ("strategy fsdp on one worker has nothing to shard over: training it unsharded",)
    assert plan.config.strategy.mixed_precision == "off"


def test_a_model_whose_state_exceeds_the_workers_memory_is_refused_under_ddp_and_fits_under_fsdp():
    """AdamW: 4 bytes a parameter, its gradient and two moments; ddp holds them whole, fsdp a half."""
    model = build_model(ModelConfig.model_validate(GPT), (LENGTH,), VOCAB)
    total = 16 * sum(p.numel() for p in model.parameters())
    cap = 0.75 * total / GiB

    def config(strategy, optimizer="adamw"):
        return JobConfig.from_dict({"model": GPT, "optimizer": {"name": optimizer}, "strategy": {"name": strategy},
                                    "scaling": {"workers": 2, "memory_per_worker_gb": cap}})

    with pytest.raises(UserError) as refused:
        check_state_fits(model, config("ddp"))
    assert str(refused.value).startswith(f"scaling.memory_per_worker_gb: the model's training state takes "
                                         f"{total / GiB:.2f} GiB (parameters {total / 4 / GiB:.2f}")
    assert f"more than the {cap:g} GiB given; strategy fsdp splits it over the 2 workers: {total / 2 / GiB:.2f}" \
           in str(refused.value)
    check_state_fits(model, config("fsdp"))  # half of it fits
    check_state_fits(model, config("ddp", optimizer="sgd"))  # one momentum buffer: 12 bytes a parameter fit
    assert config("ddp").scaling.resources["memory"] == cap * GiB  # Ray places workers by it
