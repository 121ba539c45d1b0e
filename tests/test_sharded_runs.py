"""FSDP2 on the real Ray cluster: a worker SIGKILLed mid-epoch resumes bitwise from its sharded
checkpoint, the run then resumes on one worker (resharded), and its checkpoints export."""

import re

import pytest
import torch

from raytrain_app import load_model
from raytrain_app.config import updated
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.inference import export
from raytrain_app.rundir import checkpoints
from tests.test_distributed import final_weights
from tests.test_reliability import faulty, straight_and_killed

# Each Linear its own shard unit, then the root: the MLP's layers are not repeated blocks.
FSDP = {"name": "fsdp", "shard_modules": ["Linear"]}


def sharded_job(marker):
    """As test_reliability's step-checkpointed run: step checkpoints every 5 steps, rank 1
    SIGKILLed at its 40th forward (epoch 2, batch 17), one restart allowed."""
    return faulty(marker, at=40, fault="kill", checkpoint={"every_steps": 5}, failure={"max_failures": 1},
                  strategy=FSDP)


@pytest.mark.slow
def test_a_killed_fsdp_worker_resumes_bitwise_and_the_run_reshards_to_one_worker(tmp_path):
    straight, killed, (step, epoch, batch) = straight_and_killed(sharded_job, tmp_path)
    assert epoch == 2 and step in (25, 30, 35) and batch == step - 23
    assert "sharded over mesh (2,)" in (tmp_path / "killed" / "logs" / "rank-0.log").read_text()

    # Each rank wrote its own shard, and no full copy of the weights exists anywhere.
    final = tmp_path / "killed" / killed.final_checkpoint.rsplit("/", 1)[1]
    assert sorted(p.name for p in (final / "shards").iterdir() if not p.name.endswith(".sha256")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "model" not in torch.load(final / "state.pt", weights_only=True)
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(killed)[name], w), name
    assert killed.metrics[-1]["train_loss"] == pytest.approx(straight.metrics[-1]["train_loss"], rel=1e-12)

    # Exported from the killed run's final checkpoint: the uninterrupted run's weights, bit for bit,
    # consolidated from the shards; and a plain model loads them into the same outputs.
    exported = export.export(str(tmp_path / "killed"), "pt", checkpoint=final.name)
    weights = torch.load(exported.weights, weights_only=True)
    assert weights.keys() == final_weights(straight).keys()
    assert all(torch.equal(weights[name], w) for name, w in final_weights(straight).items())
    model = load_model(str(tmp_path / "killed"), checkpoint="latest")
    plain = load_model(exported.manifest)
    x = torch.randn(5, *checkpoints.loop_state(str(final))["input_shape"])
    assert torch.equal(plain(x), model(x))

    # One more epoch on one worker: DCP reads the two shards into a single unsharded model. With a
    # learning rate whose steps round to nothing, what it ends with is what it started from: the
    # checkpoint's shards merged, bit for bit.
    lines = []
    one = updated(sharded_job(tmp_path / "fault"), {"train": {"epochs": 3}, "scaling": {"workers": 1},
                                                    "optimizer": {"lr": 1e-46}})
    plan = make_plan(one, run_dir=str(tmp_path / "killed"), resume=True, local=True)
    assert plan.warnings == ("strategy fsdp on one worker has nothing to shard over: training it unsharded",)
    resumed = run_training(plan, echo=lines.append)
    console = "\n".join(lines)
    assert re.search(r"warning: resharded through torch.distributed.checkpoint from 2 workers under fsdp \(2,\) to "
                     r"1 worker: the run goes on from the saved state, but is not bitwise", console)
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3] and resumed.metrics[-1]["world_size"] == 1
    started = final_weights(straight)
    assert all(torch.equal(final_weights(resumed)[name], w) for name, w in started.items())
    assert resumed.metrics[-1]["eval_accuracy"] == killed.metrics[-1]["eval_accuracy"]
