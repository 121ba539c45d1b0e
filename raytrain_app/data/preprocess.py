"""What stands between a sample as stored and the model's input, kept with the trained model.

Training reads values as they are stored (a CSV's numbers, uint8 pixels), reshapes them, may
resize images, and normalises them with the training split's statistics. A model used later, on
new rows and without the training data, needs exactly those steps again, so the training loop
records them in every checkpoint (`recipe`), `export` copies them into its JSON, and
`Preprocess` applies them as a module in front of the model (`models.TrainedModel`), where
TorchScript and ONNX exports include them.

The recipe also keeps the label's class names, where the labels were names: new data must map
names to ids as training did (not as its own names would sort), and predictions are shown by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Stored:
    """How a dataset's samples are stored, before training reads them."""

    shape: tuple[int, ...]  # one sample's values as stored, before any resize
    resize: int = 0  # images are resized to resize x resize (bilinear) before normalisation
    features: Union[str, tuple[str, ...], None] = None  # the table column(s) they come from, in order
    label: Optional[str] = None  # the table's label column
    classes: Optional[tuple[str, ...]] = None  # the names of class ids 0, 1, ..., where the labels were names


def recipe(train) -> Optional[dict]:
    """The training split's preprocessing as plain data (for checkpoints and JSON), or None where
    the data is not normalised (token ids, a builder's own dataset yielding model inputs)."""
    if isinstance(getattr(train, "recipe", None), dict):  # encoded images say their own (data.images)
        return train.recipe
    stored: Optional[Stored] = getattr(train, "stored", None)
    if stored is None or getattr(train, "mean", None) is None:
        return None
    mean, std = train.mean.float().cpu(), train.std.float().cpu()
    features = list(stored.features) if isinstance(stored.features, tuple) else stored.features
    return {"features": features, "label": stored.label, "shape": list(stored.shape), "resize": stored.resize,
            "mean": mean.flatten().tolist(), "std": std.flatten().tolist(), "stats_shape": list(mean.shape),
            "classes": list(stored.classes) if stored.classes else None}


def feature_columns(recipe: Optional[dict], default: Union[str, list, None] = None) -> Union[str, list[str]]:
    """The column(s) a table must hold for the model: the recipe's, else `default`, else `image`."""
    features = (recipe or {}).get("features") or default or "image"
    return features if isinstance(features, str) else list(features)


def preprocess_for(recipe: dict) -> nn.Module:
    """The module that applies a recipe: `Preprocess`, or for encoded images `ImagePreprocess`."""
    if recipe.get("kind") == "images":
        from raytrain_app.data.images import ImagePreprocess

        return ImagePreprocess(recipe)
    return Preprocess(recipe)


class Preprocess(nn.Module):
    """A recipe as a module: raw rows (flat, or shaped as stored; any numeric dtype) in, the
    model's input out, computed as the data module computes it (bitwise on the CPU)."""

    def __init__(self, recipe: dict):
        super().__init__()
        self.shape = tuple(recipe["shape"])
        self.resize = int(recipe["resize"])
        self.register_buffer("mean", torch.tensor(recipe["mean"], dtype=torch.float32).reshape(recipe["stats_shape"]))
        self.register_buffer("std", torch.tensor(recipe["std"], dtype=torch.float32).reshape(recipe["stats_shape"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.shape).float()
        if self.resize:
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear", align_corners=False)
        return (x - self.mean) / self.std
