"""A plain multi-layer perceptron over flattened inputs."""

import math

from torch import nn


def mlp(input_shape: tuple = (784,), num_classes: int = 10, hidden: list = (256, 128),
        dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
