"""A torchrun-style DDP script that also runs, unchanged, under raytrain-app:

    torchrun --nproc_per_node 2 examples/torchrun_script/train.py --epochs 4
    raytrain-app train examples/torchrun_script/train.py --workers 2 -- --epochs 4
    raytrain-app submit examples/torchrun_script/train.py --cluster cluster/local.yaml -- --epochs 4

It trains an MLP on the handwritten digits shipped with raytrain-app, the tutorials' way:
env:// rendezvous, DistributedSampler with set_epoch, all-reduced accuracy, rank-0 printing.
Accuracy passes 0.8 on the held-out digits in 4 epochs (tests/test_scripts.py checks it, through
a restart), in about 30 seconds here.
Under raytrain-app it also reports each epoch (metrics.jsonl) with a rank-0 checkpoint, and
resumes from the latest one after a restart (--max-failures) or --resume; under torchrun those
two calls do nothing. --crash-at-epoch N kills rank 1 once at epoch N, to watch a restart;
--hang-at-epoch N stops rank 1 (for an hour) once at epoch N, to watch the hang watch find it.
"""

import argparse
import os
import signal
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import raytrain_app
from raytrain_app.data.parquet import DIGITS_FILE


def load(path):
    table = pq.read_table(path)
    x = torch.tensor(np.stack(table["image"].to_numpy(zero_copy_only=False)), dtype=torch.float32) / 16
    y = torch.tensor(table["label"].to_numpy())
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=str(DIGITS_FILE))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--crash-at-epoch", type=int, default=-1)
    parser.add_argument("--hang-at-epoch", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)

    train_set, test_set = load(args.data)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)

    start = 0
    checkpoint = raytrain_app.latest_checkpoint()  # None under torchrun, and in a fresh run
    if checkpoint:
        state = torch.load(os.path.join(checkpoint, "state.pt"), map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if rank == 0:
            print(f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}: resumed from {checkpoint} at epoch {start}")

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for batch, (x, y) in enumerate(loader):
            if (epoch, batch, rank) == (args.crash_at_epoch, len(loader) // 2, 1) and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, as a lost node would
            if (epoch, batch, rank) == (args.hang_at_epoch, len(loader) // 2, 1) and first_attempt:
                time.sleep(3600)  # mid-epoch, as a rank stuck on a dead filesystem would
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                correct += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
        dist.all_reduce(total)
        dist.all_reduce(correct)
        metrics = {"epoch": epoch, "train_loss": (total[0] / total[1]).item(),
                   "accuracy": (correct[0] / correct[1]).item()}
        if rank == 0:
            print(f"epoch {epoch}: train_loss {metrics['train_loss']:.4f} accuracy {metrics['accuracy']:.4f}")

        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           os.path.join(folder, "state.pt"))
            raytrain_app.report(metrics, checkpoint_dir=folder if rank == 0 else None)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
