"""LeNet split over one worker's devices, the tutorials' model parallelism inside a DDP worker:
the convolutions on the first device, the classifier on the last.

A builder that takes `devices` gets the worker's devices (two GPUs with `scaling.gpus_per_worker:
2`; the CPU alone on a CPU worker) and places its layers itself. Its forward takes the batch on
devices[0] and returns there too, where the labels are; activations cross devices once each way.
DDP then replicates the split model across workers (it is wrapped with `device_ids=None`).
"""

import torch
from torch import nn

from raytrain_app.models.lenet import lenet


class SplitLeNet(nn.Module):
    def __init__(self, input_shape: tuple, num_classes: int, devices: list[torch.device]):
        super().__init__()
        whole = lenet(input_shape, num_classes)
        self.first, self.last = devices[0], devices[-1]
        self.features = whole.features.to(self.first)
        self.classifier = whole.classifier.to(self.last)

    def forward(self, x):
        return self.classifier(self.features(x).to(self.last)).to(self.first)


def build(input_shape: tuple, num_classes: int, devices: list) -> nn.Module:
    return SplitLeNet(input_shape, num_classes, devices)
