"""A trained model as users get it back: the built model behind the preprocessing its training
data had, so that it takes inputs as they are stored (a CSV's numbers, uint8 pixels)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from raytrain_app.config.sections import ModelConfig
from raytrain_app.data.preprocess import preprocess_for
from raytrain_app.models import build_model


class TrainedModel(nn.Module):
    """`forward(x)`: `model(preprocess(x))`. `.model` is the model as its builder made it (its
    inputs normalised), `.preprocess` what comes before it (nothing for token ids or a builder's
    own dataset), `.source` the checkpoint or export it was loaded from, `.class_names` the name
    of each output class where the training labels were names (else None)."""

    def __init__(self, model: nn.Module, preprocess: Optional[nn.Module] = None, source: str = "",
                 class_names: Optional[list[str]] = None):
        super().__init__()
        self.preprocess = preprocess if preprocess is not None else nn.Identity()
        self.model = model
        self.source = source
        self.class_names = class_names

    def forward(self, x) -> torch.Tensor:
        """`x`: inputs as stored; a model trained on encoded images also takes a list of image
        files, encoded bytes or pixel tensors of any size (`data.images.ImagePreprocess`)."""
        return self.model(self.preprocess(x))


def rebuild(config: ModelConfig, builder: Union[str, Callable, None], input_shape: Sequence[int],
            num_classes: Optional[int], recipe: Optional[dict], source: str,
            devices: Optional[Sequence[torch.device]] = None) -> TrainedModel:
    """A TrainedModel built as training built it (or with `builder` instead of the saved name,
    as a notebook's function must be given), weights not yet loaded."""
    if builder is not None:
        config = config.model_copy(update={"name": builder})
    model = build_model(config, tuple(input_shape), num_classes, devices)
    return TrainedModel(model, preprocess_for(recipe) if recipe else None, source, (recipe or {}).get("classes"))
