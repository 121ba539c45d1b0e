"""The DDP loop, 2 Gloo workers on CPU, checked against single-process math: in local mode, and
on the real Ray cluster where its placement is what is checked."""


import signal
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from raytrain_app.cluster.session import wait_for_nodes
from raytrain_app.config import JobConfig
from raytrain_app.data import build_datasets
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.errors import TrainingFailed, UserError
from raytrain_app.models import build_model
from raytrain_app.rundir import checkpoints
from raytrain_app.worker.loop import seed_everything
from tests import losses
from tests.helpers import write_parquet


def job(**sections) -> JobConfig:
    base = {
        "name": "t",
        "seed": 3,
        "model": {"name": "mlp", "args": {"hidden": [16]}},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "schedule": {"name": "cosine", "warmup_epochs": 1},
        "train": {"epochs": 2, "batch_size": 8, "eval_batch_size": 16},
        "checkpoint": {"every_epochs": 1, "keep": 1},
        "scaling": {"workers": 2},
        # On by default; their tests turn them on (test_reliability, test_cli, test_object_storage).
        "tracking": {"tensorboard": False, "report_png": False},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return JobConfig.from_dict(base)


def run(config: JobConfig, run_dir, resume=False, local=True):
    """Train in local mode unless Ray is what is under test: the loop is the same, without the
    cluster's start-up (test_local_mode shows both give bitwise the same run)."""
    return run_training(make_plan(config, run_dir=str(run_dir), resume=resume, local=local), echo=lambda line: None)


def final_weights(result) -> dict:
    return checkpoints.load_state(result.final_checkpoint)["model"]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """96 training rows (divisible by 2 workers and the batches) and 25 eval rows (odd on purpose)."""
    path = tmp_path_factory.mktemp("data") / "table.parquet"
    write_parquet(path, n=96, seed=1)
    eval_path = path.with_name("eval.parquet")
    write_parquet(eval_path, n=25, seed=2)
    return {"name": "parquet", "args": {"path": str(path), "eval_path": str(eval_path)}}


def test_metrics_are_all_reduced_over_every_rank(table, tmp_path):
    # lr ~ 0 keeps the weights at their initial values, so the training loss has a closed form too.
    config = job(data=table, optimizer={"lr": 1e-12}, train={"epochs": 1})
    result = run(config, tmp_path / "run")
    reported = result.metrics[-1]

    data = build_datasets(config.data)
    seed_everything(config.seed)
    model = build_model(config.model, data.input_shape, data.num_classes).eval()
    with torch.no_grad():
        x, y = data.eval.x.float(), data.eval.y
        x = (x - data.eval.mean) / data.eval.std
        logits = model(x)
        xt = (data.train.x.float() - data.train.mean) / data.train.std
        train_loss = F.cross_entropy(model(xt), data.train.y).item()

    assert reported["eval_samples"] == 25  # each eval sample exactly once: no padded duplicates
    assert reported["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert reported["eval_accuracy"] == (logits.argmax(1) == y).sum().item() / len(y)
    assert reported["train_loss"] == pytest.approx(train_loss, rel=1e-5)
    assert reported["world_size"] == 2 and reported["samples_per_s"] > 0
    assert 100 < reported["peak_memory_mib"] < 8192  # a worker process with torch, Ray and this tiny model


def test_a_run_the_cluster_cannot_hold_is_one_line_before_any_worker_starts(ray_cluster, table, tmp_path):
    """On Ray: what is checked is the cluster's room. The session's cluster has 4 CPUs and Ray's
    default share of this machine's memory."""
    ray_data = {**table, "engine": "ray_data"}
    for sections, message in (
            ({"scaling": {"workers": 5}}, "the cluster holds 4 workers of 1 CPU each, not 5: it has 1 nodes: "),
            ({"scaling": {"memory_per_worker_gb": 10000}}, "the cluster holds 0 workers of 1 CPU and 10000 GiB of "
                                                          "memory each, not 2"),
            ({"data": ray_data, "scaling": {"workers": 4}}, "data.engine: ray_data reads with Ray Data tasks, which "
                                                           "need 1 CPU besides the workers' 4")):
        with pytest.raises(UserError) as refused:
            run(job(**{"data": table, **sections}), tmp_path / "run", local=False)
        assert str(refused.value).startswith(message), str(refused.value)
        assert not (tmp_path / "run").exists()


def test_a_cluster_short_of_nodes_is_waited_for_then_named(ray_cluster):
    """What a SLURM job's entrypoint does while the allocation's nodes start Ray (`--min-nodes`)."""
    said = []
    wait_for_nodes(1, 0, said.append)  # the session's one node is there
    start = time.monotonic()
    with pytest.raises(UserError, match=r"^only 1 of 2 nodes joined the Ray cluster within 1.5s$"):
        wait_for_nodes(2, 1.5, said.append)
    assert 1.5 <= time.monotonic() - start < 5 and said == ["waiting for nodes: 1 of 2 joined"]


def test_a_cluster_too_small_for_the_run_is_said_once_and_a_range_below_min_gives_up(ray_cluster):
    """RoomWatch against the session's cluster (4 CPUs, one node): a fixed run of 6 workers is
    told once, and waits on (its start tries end it); a range whose min is 5 gives up after
    failure.placement_timeout_s, interrupting the main thread as Ray Train's own Ctrl-C handling
    expects, and says what is missing."""
    from raytrain_app.driver.placement import RoomWatch

    # Python's own SIGINT handler, as in a command: in a run, Ray Train's takes its place.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for workers, timeout in ((6, 2.5), ("5:8", 1.5)):
        config = job(scaling={"workers": workers, "on_resize": "scale_lr"}, failure={"placement_timeout_s": timeout})
        said, said_at = [], []

        def say(line: str) -> None:
            said.append(line)
            said_at.append(time.monotonic())

        watch = RoomWatch(config, "/runs/r", say)
        start = time.monotonic()
        watch.start()
        try:
            while time.monotonic() - start < timeout + 3:
                time.sleep(0.1)
            gave_up_at = None
        except KeyboardInterrupt:
            gave_up_at = time.monotonic()
        watch.stop()
        low = 5 if config.scaling.elastic else 6
        needs = "the range needs at least" if config.scaling.elastic else "the run needs"
        assert said == [f"waiting for room: the cluster holds 4 of the {low} workers {needs} (1 nodes: 0 GPUs/4 CPUs); "
                        f"giving up in {timeout:g}s (failure.placement_timeout_s)"], said
        assert (gave_up_at is not None) == config.scaling.elastic == (watch.gave_up is not None), gave_up_at
    assert 1.5 <= gave_up_at - said_at[0] < 1.5 + 3  # it gives up its timeout after saying it waits, not before
    assert watch.gave_up == ("the cluster could not place the 5 workers its range needs within 1.5s "
                             "(failure.placement_timeout_s): it holds 4 now (1 nodes: 0 GPUs/4 CPUs); `--resume "
                             "--run-dir /runs/r` continues from its latest checkpoint (with --workers 4 it fits now)")


def recorded_run(tmp_path, name: str):
    out = tmp_path / name
    out.mkdir()
    config = job(data={"name": "tests.helpers:index_data", "args": {"train_size": 20, "eval_size": 5}},
                 model={"name": "tests.helpers:recorder", "args": {"out_dir": str(out)}},
                 train={"epochs": 2, "batch_size": 5})
    run(config, tmp_path / f"{name}-run")
    return out


def test_train_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(tmp_path):
    out = recorded_run(tmp_path, "seen")

    # 20 samples / 2 ranks / batch 5 = 2 batches per rank per epoch.
    seen = {r: [list(map(int, line.split())) for line in (out / f"rank-{r}.txt").read_text().splitlines()]
            for r in (0, 1)}
    epochs = [{r: sum(seen[r][2 * e: 2 * e + 2], []) for r in (0, 1)} for e in (0, 1)]
    for shards in epochs:
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(20))
    assert epochs[0][0] != epochs[1][0]  # set_epoch gave a new order

    # Per-rank seeding: each rank draws its own dropout masks (that they are the same in every run,
    # test_reliability's bitwise restarts of a dropout model show).
    assert (out / "dropout-0.txt").read_text() != (out / "dropout-1.txt").read_text()


def test_two_workers_match_one_worker_at_the_same_global_batch(table, tmp_path):
    one = run(job(data=table, train={"batch_size": 16}, scaling={"workers": 1}), tmp_path / "one")
    # DDP with a static graph and gradients as bucket views must not change the numbers, nor must
    # batches cut from device-resident data (the CPU here) instead of a DataLoader.
    two = run(job(data={**table, "on_device": "on"}, train={"batch_size": 8, "ddp_static_graph": True},
                  scaling={"workers": 2}), tmp_path / "two")
    for name, w in final_weights(one).items():
        torch.testing.assert_close(final_weights(two)[name], w, rtol=1e-4, atol=1e-5)
    assert two.metrics[-1]["train_loss"] == pytest.approx(one.metrics[-1]["train_loss"], rel=1e-4)
    assert two.metrics[-1]["step"] == one.metrics[-1]["step"] == 2 * 6  # 96 rows / 16 per step, 2 epochs
    # Where the time went: measured data wait, estimated all-reduce (none at one worker), the rest compute.
    for result, workers in ((one, 1), (two, 2)):
        row = result.metrics[-1]
        assert row["data_wait_frac"] + row["comm_frac"] + row["compute_frac"] == pytest.approx(1.0)
        assert (row["comm_frac"] > 0) == (workers == 2)
        assert "tflops_per_worker" not in row and "mfu" not in row  # FLOPs are counted for GPUs' MFU only


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_resumed_inside_an_epoch_at_another_world_size_trains_each_sample_of_it_once(tmp_path, before, after):
    """A crash at step 5 of epoch 1 (48 samples, batch 4; step checkpoints every 2), then
    `--resume` at another world size: what the checkpoint at step 4 had not trained of the
    epoch's permutation is dealt to the new world's ranks (a shrink, and a grow), so the epoch
    trains every sample once (no padding: the 16 or 32 left divide by either size), the next
    epoch too, and the epoch's loss is over all 48."""
    out, marker = tmp_path / "seen", tmp_path / "fault"
    out.mkdir()
    marker.touch()
    model = {"name": "tests.losses:faulty_output_recorder", "args": {"out_dir": str(out), "marker": str(marker),
                                                                    "at": 5, "rank": before - 1}}
    config = job(data={"name": "tests.helpers:index_data", "args": {"train_size": 48, "eval_size": 5}}, model=model,
                 train={"epochs": 2, "batch_size": 4}, checkpoint={"every_steps": 2}, scaling={"workers": before})
    with pytest.raises(TrainingFailed, match="injected crash"):
        run(config, tmp_path / "run")
    marker.unlink()
    done = 4 * 4 * before  # steps 1-4 of every rank: the checkpoint's position, 16 or 32 samples
    first = recorded_batches(out, before)
    resumed = run(config.model_copy(update={"scaling": config.scaling.model_copy(update={"workers": after})}),
                  tmp_path / "run", resume=True)
    batches = recorded_batches(out, after)
    left = (48 - done) // 4 // after  # each new rank's batches in the rest of epoch 1
    epoch1 = [batch for r in range(before) for batch in first[r][:4]]
    epoch1 += [batch for r in range(after) for batch in batches[r][:left]]
    epoch2 = [batch for r in range(after) for batch in batches[r][left:]]
    assert sorted(i for samples, _ in epoch1 for i in samples) == list(range(48))
    assert sorted(i for samples, _ in epoch2 for i in samples) == list(range(48))
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert "at step 4: epoch 1 from batch 4" in log.rsplit("rank 0/", 1)[-1], log
    assert [r["world_size"] for r in resumed.metrics] == [after, after]
    # The epoch's loss is over every sample it trained, before the resize and after: the mean of
    # the 48 losses computed here from the outputs each sample got.
    assert [r["train_samples"] for r in resumed.metrics] == [48, 48]
    assert [r["train_loss"] for r in resumed.metrics] == pytest.approx(
        [statistics.fmean(loss for _, scored in epoch for loss in scored) for epoch in (epoch1, epoch2)], rel=1e-5)


def recorded_batches(out, ranks: int) -> list[list[tuple[list[int], list[float]]]]:
    """Each rank's training batches in `out` (tests.losses.OutputRecorder's files), as (samples,
    each sample's loss); the files are removed, for the next run's."""
    found = []
    for r in range(ranks):
        samples, outputs = ((out / f"{name}-{r}.txt").read_text().splitlines() for name in ("rank", "outputs"))
        found.append([(indices, losses.cross_entropy(logits, [i % 2 for i in indices]))  # IndexDataset: label i % 2
                      for indices, logits in zip((list(map(int, line.split())) for line in samples), outputs)])
        for name in ("rank", "outputs"):
            (out / f"{name}-{r}.txt").unlink()
    return found
