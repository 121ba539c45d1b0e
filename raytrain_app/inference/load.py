"""`load_model`: a trained model for use in Python, from a run directory, a checkpoint or an
export, taking raw rows as the training data stored them."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from raytrain_app.config import JobConfig


def load_model(path: str, model: Optional[Callable] = None, devices: Optional[Sequence] = None,
               checkpoint: Optional[str] = None):
    """The trained model, weights loaded and in eval mode, taking inputs as the training data
    stored them (raw CSV values, uint8 pixels): it resizes and normalises them itself, as training
    did. `.model` inside it is the model as built; `.source` says which checkpoint it is;
    `.class_names` names its outputs where the training labels were names (a CSV's `species`
    column, say): output i is class `class_names[i]`, as training numbered the sorted names, so
    `model.class_names[model(rows).argmax(1)[0]]` is the first row's class; None for class ids,
    regression and language models.

    `path` is a run directory, a checkpoint directory, or an export (`raytrain-app export`: its
    JSON, its weights file, or their directory); local paths or URIs. In a run directory,
    `checkpoint` picks "best", "latest" or a checkpoint_* name; by default the best where the run
    scored its checkpoints, else the latest (`rundir.choose`). `model` is the builder to use
    instead of the saved name (needed when training was given a notebook's function); `devices`
    go to a builder that places its own layers (default: the CPU).
    """
    from raytrain_app import rundir
    from raytrain_app.inference import export
    from raytrain_app.models.trained import rebuild
    from raytrain_app.rundir import checkpoints

    if export.is_export(str(path)):
        return export.load_exported(str(path), model)
    chosen = rundir.choose(str(path), checkpoint)
    saved = checkpoints.for_inference(chosen.path)
    config = JobConfig.from_dict(saved["config"], source=chosen.path).model
    built = rebuild(config, model, saved["input_shape"], saved["num_classes"], saved["preprocess"], chosen.path,
                    devices)
    built.model.load_state_dict(saved["model"])
    return built.eval()
