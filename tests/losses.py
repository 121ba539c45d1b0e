"""A model whose training batches say what they were scored on: each batch's samples and the
outputs it gave them, so that a test computes an epoch's loss itself, from the samples the
ranks really trained, and checks the run's reported loss against it. Named by import path
("tests.losses:faulty_output_recorder"), as tests.helpers' builders are."""

import math
import os

import ray.train

from tests.helpers import Fault, Recorder


class OutputRecorder(Recorder):
    """A Recorder (each training batch's sample indices in out_dir/rank-R.txt) that also writes the
    outputs it gave that batch to out_dir/outputs-R.txt: one line per batch, one "a,b" pair of
    logits per sample, in the same order."""

    def forward(self, x):
        out = super().forward(x)
        if self.training and x.shape[0] > 1:  # as the Recorder writes its line
            rank = ray.train.get_context().get_world_rank()
            with open(os.path.join(self.out_dir, f"outputs-{rank}.txt"), "a") as f:
                f.write(" ".join(",".join(repr(float(v)) for v in sample) for sample in out.detach()) + "\n")
        return out


def faulty_output_recorder(input_shape: tuple, num_classes: int, out_dir: str, marker: str, at: int, rank: int = 1):
    """An OutputRecorder whose rank `rank` crashes on its training call `at` (see tests.helpers.Fault)."""
    return Fault(OutputRecorder(out_dir), marker, at, rank, "crash")


def cross_entropy(outputs: str, labels: list[int]) -> list[float]:
    """Each sample's cross-entropy, from one line of outputs-R.txt and the samples' labels."""
    losses = []
    for pair, label in zip(outputs.split(), labels, strict=True):
        logits = [float(v) for v in pair.split(",")]
        top = max(logits)
        losses.append(top + math.log(sum(math.exp(v - top) for v in logits)) - logits[label])
    return losses
