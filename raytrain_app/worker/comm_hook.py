"""What DDP's gradient all-reduce sends (`ddp.comm_hook`), and PowerSGD's state across a restart.

DDP all-reduces gradients in buckets during backward; a communication hook replaces that
all-reduce. fp16 and bf16 cast each bucket, divided by the world size, to half precision for the
collective (half the bytes) and back. PowerSGD (Vogels et al., 2019) sends, for each gradient
matrix, two thin factors of a rank-r approximation; what the approximation misses stays on each
rank (error feedback) and is added to the next step's gradient, so no part of a gradient is lost
for good. Its first `start_iter` steps are plain all-reduces, while DDP settles its buckets.

PowerSGD's state carries over from step to step. The factors, the step count and the random
stream that draws fresh factors come out of all-reduces or shared seeds and are the same on every
rank, so rank 0 saves them with the rest of the shared state; the error feedback is each rank's
own and each rank saves it. A resume at the same world size continues exactly. At another world
size the ranks are not the same ones: error feedback and factors restart at zero, said once.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from raytrain_app.config.sections import DDPConfig


class CommHook:
    """The hook a DDP model sends its gradients through; a stateful piece of the TrainState.

    torch's PowerSGD keeps its memories by bucket, as flat tensors in the bucket's order of
    parameters. DDP lays its buckets out again after the first step of every process, by the
    order gradients arrived, so the same bucket holds the same parameters in another order
    before and after. The memories are therefore saved by parameter name, and put back together
    in whatever order a bucket has when the hook sees it, and again whenever that order changes.
    """

    def __init__(self, config: DDPConfig, seed: int, world_size: int, device: torch.device,
                 warn: Callable[[str], None]):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.name, self.world_size, self.device, self.warn = config.comm_hook, world_size, device, warn
        p = config.powersgd
        self.powersgd = PowerSGDState(None, matrix_approximation_rank=p.rank, start_powerSGD_iter=p.start_iter,
                                      warm_start=p.warm_start, use_error_feedback=True,
                                      random_seed=seed) if self.name == "powersgd" else None
        self._names: dict[int, str] = {}  # parameter id -> name
        self._shapes: dict[str, torch.Size] = {}
        self._orders: dict[int, list[str]] = {}  # bucket index -> its parameters' names, as last seen
        self._restored: dict[str, dict[str, torch.Tensor]] = {}  # memory -> name -> piece, until placed

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if self.powersgd is None:
            ddp.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                          "bf16": default_hooks.bf16_compress_hook}[self.name])
            return
        for name, param in ddp.module.named_parameters():
            self._names[id(param)], self._shapes[name] = name, param.shape
        ddp.register_comm_hook(self.powersgd, self._powersgd_hook)

    def _compressed(self, shape: torch.Size) -> Optional[tuple[int, int]]:
        """The sizes of P and Q for a gradient of this shape, or None where torch's hook sends it
        whole (vectors, and matrices too small to gain)."""
        if len(shape) <= 1:
            return None
        n, m = shape[0], shape.numel() // shape[0]
        r = min(n, m, self.powersgd.matrix_approximation_rank)
        return (n * r, m * r) if (n + m) * r * self.powersgd.min_compression_rate < n * m else None

    def sent(self, params: list[torch.Tensor]) -> tuple[int, torch.dtype]:
        """How many values of which dtype one step all-reduces (for the epoch line's comm share):
        P and Q for each matrix worth compressing, the rest whole."""
        if self.powersgd is None:
            return sum(p.numel() for p in params), torch.float16 if self.name == "fp16" else torch.bfloat16
        sizes = [self._compressed(p.shape) for p in params]
        return sum(sum(s) if s else p.numel() for p, s in zip(params, sizes)), torch.float32

    def _layout(self, names: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
        """Where each parameter's piece lies in a bucket's three flat memories: (offset, length).
        The error follows the bucket's order; P and Q hold the compressed matrices grouped by
        shape, in order of first appearance, as torch's hook lays them out."""
        layout, offset = {"error": {}, "p": {}, "q": {}}, 0
        by_shape: dict[tuple, list[str]] = {}
        for name in names:
            numel = self._shapes[name].numel()
            layout["error"][name], offset = (offset, numel), offset + numel
            if self._compressed(self._shapes[name]):
                by_shape.setdefault((self._shapes[name][0], numel // self._shapes[name][0]), []).append(name)
        ends = {"p": 0, "q": 0}
        for name in (n for group in by_shape.values() for n in group):
            for memory, size in zip(("p", "q"), self._compressed(self._shapes[name])):
                layout[memory][name], ends[memory] = (ends[memory], size), ends[memory] + size
        return layout

    def _memories(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.powersgd
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def _pieces(self, memory: str) -> dict[str, torch.Tensor]:
        """One memory of every bucket, by parameter name."""
        pieces = {}
        for index, flat in self._memories()[memory].items():
            for name, (offset, length) in self._layout(self._orders[index])[memory].items():
                pieces[name] = flat[offset:offset + length].clone()  # a view would save the whole bucket
        return pieces

    def _place(self, index: int, names: list[str], pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        """Bucket `index`'s memories assembled in the order `names`; a memory with a piece
        missing is left out, and torch's hook starts it afresh."""
        for memory, where in self._layout(names).items():
            held = self._memories()[memory]
            found = [pieces.get(memory, {}).get(name) for name in where]
            if where and all(piece is not None for piece in found):
                held[index] = torch.cat(found).to(self.device)
            else:
                held.pop(index, None)

    def _powersgd_hook(self, state, bucket):
        """torch's PowerSGD hook, once the bucket's memories are in the bucket's present order."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        index, names = bucket.index(), [self._names[id(p)] for p in bucket.parameters()]
        before = self._orders.get(index)
        if before != names:
            if before is None:  # first seen: what a checkpoint gave, if anything
                pieces = {memory: {n: self._restored.get(memory, {}).pop(n) for n in names
                                   if n in self._restored.get(memory, {})} for memory in ("error", "p", "q")}
            else:  # laid out again: the same pieces, in the new order
                layout, memories = self._layout(before), self._memories()
                pieces = {memory: {n: memories[memory][index][o:o + k] for n, (o, k) in layout[memory].items()}
                          for memory in layout if index in memories[memory]}
            self._place(index, names, pieces)
            self._orders[index] = names
        return powerSGD_hook(state, bucket)

    def state_dict(self) -> Optional[dict]:
        """What every rank holds alike, saved by rank 0; None for fp16 and bf16, which hold nothing."""
        s = self.powersgd
        if s is None:
            return None
        kind, keys, pos, has_gauss, gauss = s.rng.get_state()
        return {"world_size": self.world_size, "iter": s.iter,
                "rng": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
                "p": self._pieces("p"), "q": self._pieces("q")}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        s = self.powersgd
        if s is None:
            return
        if saved is None:
            self.warn("ddp.comm_hook powersgd: the checkpoint holds no PowerSGD state: PowerSGD starts afresh, "
                      f"with plain all-reduces for its first {s.start_powerSGD_iter} steps")
            return
        kind, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        s.iter = saved["iter"]
        if saved["world_size"] != self.world_size:
            self.warn(f"ddp.comm_hook powersgd: the checkpoint is from {saved['world_size']} workers and this run "
                      f"has {self.world_size}: error feedback and factors restart at zero")
            return
        self._restored = {"p": dict(saved["p"]), "q": dict(saved["q"])}

    def rank_state_dict(self) -> Optional[dict]:
        """This rank's error feedback, by parameter name, saved by every rank."""
        return None if self.powersgd is None else self._pieces("error")

    def load_rank_state_dict(self, saved: Optional[dict]) -> None:
        if self._restored and saved is not None:  # the same world size: this rank's own errors go on
            self._restored["error"] = dict(saved)
