"""Built-in models and the `model:` config entry.

Builders receive `input_shape` and `num_classes` from the dataset when their signature asks for
them, so `model: {name: lenet}` fits MNIST, CIFAR-10 and the digits alike. A builder that asks
for `devices` gets the worker's devices (several with `scaling.gpus_per_worker: 2` and more) and
places its layers on them itself: model parallelism inside one data-parallel worker.
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
from torch import nn

from raytrain_app.config import registry
from raytrain_app.config.sections import ModelConfig
from raytrain_app.errors import ConfigError
from raytrain_app.models.gpt import gpt
from raytrain_app.models.lenet import lenet
from raytrain_app.models.mlp import mlp
from raytrain_app.models.resnet import resnet18, resnet50

BUILTINS = {"lenet": lenet, "mlp": mlp, "resnet18": resnet18, "resnet50": resnet50, "gpt": gpt}


def build_model(config: ModelConfig, input_shape: tuple[int, ...], num_classes: Optional[int],
                devices: Optional[Sequence[torch.device]] = None) -> nn.Module:
    """`num_classes` None (a dataset that does not say, for a task that does not need it): the
    builder's own default stands, or it is a missing argument."""
    context = {"input_shape": tuple(input_shape), **({"num_classes": num_classes} if num_classes is not None else {})}
    if num_classes is None and "num_classes" not in config.args:
        wanted = inspect.signature(registry.resolve(config.name, BUILTINS, "model.name")).parameters.get("num_classes")
        if wanted is not None and wanted.default is wanted.empty:
            raise ConfigError(f"model.args.num_classes: the dataset does not declare num_classes and model "
                              f"'{registry.label(config.name)}' needs it: give the training dataset a `num_classes` "
                              "attribute, or set model.args.num_classes")
    if places_itself(config):  # only to a builder that names it: one taking **kwargs may pass them on
        context["devices"] = list(devices or [torch.device("cpu")])
    model = registry.build(config.name, config.args, BUILTINS, "model", context)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: '{registry.label(config.name)}' returned {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model


def places_itself(config: ModelConfig) -> bool:
    """The builder takes `devices`: it puts its layers on them, so nothing moves the model as a
    whole, and its forward returns on devices[0], where the batches (and labels) are."""
    return "devices" in inspect.signature(registry.resolve(config.name, BUILTINS, "model.name")).parameters
