"""A checkpoint of the digits LeNet opened as docs/reference/run-directory.md tells a user to open one, not through
`raytrain_app.worker.checkpoint`, whose `verify` and loaders are under test: each file against
its `.sha256` by hand, each loaded with `torch.load(..., weights_only=True)`, and the weights
loaded into a LeNet written here, as the classic data-parallel tutorials write it."""

import hashlib
from pathlib import Path

import torch
from torch import nn

from tests import runrecord


class LeNet(nn.Module):
    """LeNet-5 for 1x28x28 images: 2 pixels of padding on the first convolution, so that both
    pools leave 16x5x5; logits out (the loss applies the softmax)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84),
                                        nn.ReLU(), nn.Linear(84, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def check_opens(directory, ranks) -> None:
    """Every file whole by its checksum; state.pt's weights fit a fresh LeNet exactly (every name
    and shape: `load_state_dict` is strict) and classify a batch; its position is the one that
    checkpoint.json gives; each rank's file loads."""
    directory = Path(directory)
    names = ["state.pt", *(f"rank{rank}.pt" for rank in ranks)]
    for name in names:
        digest = (directory / f"{name}.sha256").read_text().split()[0]
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest, directory / name
    state, *_ = (torch.load(directory / name, weights_only=True) for name in names)
    model = LeNet()
    model.load_state_dict(state["model"])
    logits = model(torch.rand(8, 1, 28, 28))
    assert logits.shape == (8, 10) and logits.isfinite().all()
    position = runrecord.positions(directory.parent)[str(directory)]
    assert {key: state[key] for key in ("epoch", "step", "batch")} == position, (position, directory)
