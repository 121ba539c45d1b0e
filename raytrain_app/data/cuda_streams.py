"""Batches made on a CUDA stream of their reader's own (a Parquet window copied to the GPU,
`stream.StreamBatches`; a batch of JPEGs decoded there, `images.CheckedBatches`), so that the
making overlaps the step, then handed to the stream the training loop runs on."""

from __future__ import annotations

from typing import Optional

import torch


def handed_over(made: Optional["torch.cuda.Event"], device: torch.device, tensors) -> None:
    """The loop's current stream waits for `made` (the event its maker recorded), and the caching
    allocator keeps `tensors`' memory until that stream is done with them, not only their maker's.
    Nothing to do for tensors made on the host (`made` None)."""
    if made is None:
        return
    current = torch.cuda.current_stream(device)
    current.wait_event(made)
    for tensor in tensors:
        tensor.record_stream(current)
