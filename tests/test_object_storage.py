"""Run directories on object storage, against a real S3-compatible server (moto) on loopback: a
run, its resume, a damaged checkpoint object, and storage that refuses us (through the real
command). A SIGKILLed worker restarting from the bucket is in test_reliability."""

import json
import os
import re
import time

import boto3
import pytest

from raytrain_app.config import load_config
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from tests.commands import command
from tests.conftest import REPO, short_temp_dir

PREFIX = "runs"
STEPS_PER_EPOCH = 23  # 1438 digits / 2 ranks / 32


def overrides(marker, epochs: int) -> list[str]:
    """The digits example through a dropout MLP that SIGKILLs rank 1 at its 40th training batch
    while `marker` exists, with step checkpoints."""
    return ["data.args={}", "model.name=tests.helpers:faulty_mlp",
            f"model.args={{marker: '{marker}', at: 40, rank: 1, fault: kill}}", "checkpoint.every_epochs=1",
            "checkpoint.keep=3", "checkpoint.every_steps=10", f"train.epochs={epochs}"]


def train(run_dir, marker, epochs, resume=False, echo=lambda line: None):
    """The same job through the library, in local mode (its worker processes take the object
    store's endpoint and credentials from this process's environment: `store_env`)."""
    plan = make_plan(load_config(f"{REPO}/examples/digits.yaml", overrides(marker, epochs)), run_dir=run_dir,
                     resume=resume, local=True)
    return run_training(plan, echo=echo)


def latest_checkpoint(s3, run: str) -> str:
    names = {key.split("/")[2] for key in s3.keys(f"{PREFIX}/{run}/checkpoint_") if key.count("/") == 3}
    return f"s3://{s3.bucket}/{PREFIX}/{run}/{max(names)}"


def metrics(s3, run: str) -> list[dict]:
    body = s3.client().get_object(Bucket=s3.bucket, Key=f"{PREFIX}/{run}/metrics.jsonl")["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines()]


def epoch_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("epoch ")]


@pytest.fixture(scope="module")
def store_env(s3):
    """The object store's endpoint and credentials in this process's environment, as a user
    exports them, for this module's runs (no Ray: local mode)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3.env.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def straight(s3, store_env, tmp_path_factory):
    """An uninterrupted 2-epoch run into the bucket (no marker: the model never faults)."""
    marker = tmp_path_factory.mktemp("s3") / "never"
    return train(f"s3://{s3.bucket}/{PREFIX}/straight", marker, 2)


def test_a_run_lands_in_the_bucket_with_uris_shown(s3, straight):
    keys = s3.keys(f"{PREFIX}/straight/")
    for name in ("config.yaml", "metrics.jsonl", "checkpoint_manager_snapshot.json",
                 "logs/rank-0.log", "logs/rank-1.log", "report.png", "run.json"):
        assert f"{PREFIX}/straight/{name}" in keys, name
    assert any(re.search(r"/checkpoint_[^/]+/state\.pt$", k) for k in keys)
    assert any(re.search(r"/tensorboard/events\.out\.tfevents\.", k) for k in keys)  # uploaded by rank 0
    assert [row["epoch"] for row in metrics(s3, "straight")] == [1, 2]
    for uri in (straight.best_checkpoint, straight.final_checkpoint):
        assert uri.startswith(f"s3://{s3.bucket}/{PREFIX}/straight/checkpoint_")


def test_resume_extends_the_run_and_skips_a_damaged_checkpoint_object(s3, straight, tmp_path):
    """--resume with the latest checkpoint object torn: it is skipped for the one before, and
    the run goes on from there, writing only the epochs after it."""
    run_dir = f"s3://{s3.bucket}/{PREFIX}/straight"
    damaged = latest_checkpoint(s3, "straight")
    assert damaged == straight.final_checkpoint
    key = damaged.split(f"s3://{s3.bucket}/", 1)[1] + "/state.pt"
    whole = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=whole[:100])  # a torn upload

    lines = []
    train(run_dir, tmp_path / "never", 3, resume=True, echo=lines.append)
    assert f"warning: skipping checkpoint {damaged}: state.pt does not match its checksum (partial or corrupted " \
           f"write)" in lines
    restored, step = re.search(r"^resumed from (\S+) at step (\d+)", "\n".join(lines), re.MULTILINE).groups()
    assert restored != damaged and restored.startswith(f"{run_dir}/checkpoint_") and int(step) < 2 * STEPS_PER_EPOCH
    epochs = [line.split("|")[0].strip() for line in epoch_lines("\n".join(lines))]
    assert epochs[-1] == "epoch 3/3" and "epoch 1/3" not in epochs  # only what followed the restored checkpoint
    assert [row["epoch"] for row in metrics(s3, "straight")] == [1, 2, 3]


def read_only_user(s3) -> dict:
    admin = dict(endpoint_url=s3.endpoint, region_name=s3.region, aws_access_key_id=s3.access_key,
                 aws_secret_access_key=s3.secret_key)
    iam = boto3.client("iam", **admin)
    if not any(u["UserName"] == "reader" for u in iam.list_users()["Users"]):
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"],
                                                     "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    return {**s3.env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


@pytest.mark.parametrize("case, message", [
    ("missing bucket", "storage s3://no-such-bucket/runs/x is not writable: Bucket 'no-such-bucket' not found"),
    ("wrong secret", "is not writable: ACCESS_DENIED"),
    ("unknown key", "is not writable: ACCESS_DENIED"),
    ("read-only", "is not writable: ACCESS_DENIED"),
])
def test_storage_that_refuses_us_is_one_line_before_ray_starts(s3, case, message):
    env = {"missing bucket": s3.env, "wrong secret": {**s3.env, "AWS_SECRET_ACCESS_KEY": "wrong"},
           "unknown key": {**s3.env, "AWS_ACCESS_KEY_ID": "AKIANOBODY"}}.get(case) or read_only_user(s3)
    bucket = "no-such-bucket" if case == "missing bucket" else s3.bucket
    ray_tmp = short_temp_dir()
    start = time.monotonic()
    proc = command(["train", "examples/digits.yaml", "--run-dir", f"s3://{bucket}/runs/x"], REPO,
                   {**os.environ, **env, "RAY_TMPDIR": ray_tmp}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert ("(check the credentials: AWS_ACCESS_KEY_ID" in proc.stderr) == (case != "missing bucket")
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == ""
    assert time.monotonic() - start < 15
    assert os.listdir(ray_tmp) == []  # no Ray session was started
    assert s3.keys("runs/x") == []  # nothing written
