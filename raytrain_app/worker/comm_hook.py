"""What DDP's gradient all-reduce sends (`ddp.comm_hook`), and PowerSGD's state across a restart.

DDP all-reduces gradients in buckets during backward; a communication hook replaces that
all-reduce. fp16 and bf16 (torch's own hooks) cast each bucket, divided by the world size, to half
precision for the collective (half the bytes) and back. PowerSGD (Vogels et al., 2019) sends, for
each gradient matrix, two thin factors of a rank-r approximation; what the approximation misses
stays on each rank (error feedback) and is added to the next step's gradient, so no part of a
gradient is lost for good. Its first `start_iter` steps are plain all-reduces, while DDP settles
its buckets.

PowerSGD is done here, not by torch's `powerSGD_hook`, for an exact resume. torch's multiplies
the gradients where they lie in DDP's bucket, and keeps its memories flat by bucket. DDP lays its
buckets out by the order gradients arrive, but only after the first step of each process: a
resumed process's first step has another layout than the same step of the run it continues, so
each matrix starts at another offset in memory. MKL's matrix products on some CPUs (its SSE4.2
code, which `MKL_ENABLE_INSTRUCTIONS=SSE4_2` or `AVX` selects on any x86) round differently at
another alignment, and the resumed run drifted from the one never stopped in the last bits. Here
every product is taken on tensors of its own (fresh allocations, aligned alike in every process)
and the memories are kept by parameter name, so a step gives the same bits whatever the layout.

PowerSGD's state carries over from step to step. The step count and each matrix's Q factor come
out of all-reduces and are the same on every rank, so rank 0 saves them with the rest of the
shared state; the error feedback is each rank's own and each rank saves it. A fresh Q is drawn
from the seed, the step and the parameter: every rank draws the same, and so does a restart. A
resume at the same world size continues exactly (at 2 workers bitwise; at 3 or more a restarted
process's first step is not, hook or none: Gloo sums 3 ranks' values in an order set by where each
lies in its bucket). At another world size the ranks are not the same ones: error feedback and
factors restart at zero, said once.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.config.sections import DDPConfig

# A matrix is compressed only if its factors are less than half its size (torch's hook's default).
MIN_COMPRESSION_RATE = 2


class CommHook:
    """The hook a DDP model sends its gradients through; a stateful piece of the TrainState."""

    def __init__(self, config: DDPConfig, seed: int, world_size: int, device: torch.device,
                 warn: Callable[[str], None]):
        self.name, self.seed, self.world_size, self.device, self.warn = (config.comm_hook, seed, world_size, device,
                                                                          warn)
        self.powersgd = config.powersgd if self.name == "powersgd" else None
        self.iter = 0  # steps all-reduced, plain ones included
        self.q: dict[str, torch.Tensor] = {}  # parameter name -> its last Q, the same on every rank
        self.error: dict[str, torch.Tensor] = {}  # parameter name -> what this rank's last step missed
        self._names: dict[int, str] = {}  # parameter id -> name
        self._index: dict[str, int] = {}  # name -> position in the model, for the seed of its Q
        self._shapes: dict[str, torch.Size] = {}
        self._same_ranks = False  # resumed from a checkpoint of this world size: its errors are this rank's

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if self.powersgd is None:
            ddp.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                          "bf16": default_hooks.bf16_compress_hook}[self.name])
            return
        for index, (name, param) in enumerate(ddp.module.named_parameters()):
            self._names[id(param)], self._index[name], self._shapes[name] = name, index, param.shape
        ddp.register_comm_hook(None, self._powersgd_hook)

    def _compressed(self, shape: torch.Size) -> Optional[tuple[int, int, int]]:
        """(n, m, r) for a gradient of this shape, seen as an n x m matrix and sent as P (n x r) and
        Q (m x r); None where it goes whole (vectors, and matrices too small to gain)."""
        if len(shape) <= 1:
            return None
        n, m = shape[0], shape.numel() // shape[0]
        r = min(n, m, self.powersgd.rank)
        return (n, m, r) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None

    def sent(self, params: list[torch.Tensor]) -> tuple[int, torch.dtype]:
        """How many values of which dtype one step all-reduces (for the epoch line's comm share):
        P and Q for each matrix worth compressing, the rest whole."""
        if self.powersgd is None:
            return sum(p.numel() for p in params), torch.float16 if self.name == "fp16" else torch.bfloat16
        factors = [self._compressed(p.shape) for p in params]
        return sum((f[0] + f[1]) * f[2] if f else p.numel() for p, f in zip(params, factors)), torch.float32

    def _powersgd_hook(self, group, bucket):  # (DDP refuses annotations other than its own objects: none here)
        """One bucket through PowerSGD. Each compressed matrix M (this rank's gradient plus its
        error) sends P = MQ, summed over ranks and orthonormalized, then Q = M^T P, averaged; the
        gradient becomes P Q^T and the error M - P Q^T. The rest is averaged whole, in the same
        all-reduce as the Ps."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if self.iter < self.powersgd.start_iter:
            self.iter += bucket.is_last()
            return default_hooks.allreduce_hook(group, bucket)
        world = dist.get_world_size(group)
        grads = dict(zip((self._names[id(p)] for p in bucket.parameters()), bucket.gradients()))
        matrices = {name: self._plus_error(name, g) for name, g in grads.items() if self._compressed(g.shape)}
        kept = [g for name, g in grads.items() if name not in matrices]
        whole = [g / world for g in kept]
        ps = [m @ self._start(name) for name, m in matrices.items()]

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            reduced = _pieces(fut.value()[0], [*whole, *ps])
            for g, mean in zip(kept, reduced):
                g.copy_(mean)
            ps_summed = [torch.linalg.qr(p).Q for p in reduced[len(whole):]]  # orthonormal: the sum's scale is moot
            qs = [m.T @ p for m, p in zip(matrices.values(), ps_summed)]
            if qs:
                qs = [q.div_(world) for q in _pieces(_all_reduced(qs, group), qs)]
            for (name, m), p, q in zip(matrices.items(), ps_summed, qs):
                approximation = p @ q.T
                grads[name].copy_(approximation.view_as(grads[name]))
                self.error[name] = m - approximation
                if self.powersgd.warm_start:
                    self.q[name] = q
            if self.device.type == "cuda":  # as torch's hook: without, it failed on GPUs (pytorch/pytorch#54838)
                torch.cuda.synchronize(self.device)
            self.iter += bucket.is_last()
            return bucket.buffer()

        return dist.all_reduce(torch.cat([t.reshape(-1) for t in (*whole, *ps)]), group=group,
                               async_op=True).get_future().then(decompress)

    def _plus_error(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """This rank's gradient as a matrix of its own, in fp32, with the error its last step left."""
        matrix = grad.reshape(grad.shape[0], -1).float()
        return matrix + self.error[name] if name in self.error else matrix.clone()

    def _start(self, name: str) -> torch.Tensor:
        """This step's orthonormal Q for one matrix: its last one (warm start), or a random one from
        a stream seeded by the seed, the step and the parameter."""
        q = self.q.get(name) if self.powersgd.warm_start else None
        if q is None:
            _, m, r = self._compressed(self._shapes[name])
            entropy = np.random.SeedSequence([self.seed % 2**64, self.iter, self._index[name]]).generate_state(1)
            q = torch.randn(m, r, generator=torch.Generator().manual_seed(int(entropy[0]))).to(self.device)
        return torch.linalg.qr(q).Q

    def state_dict(self) -> Optional[dict]:
        """What every rank holds alike, saved by rank 0; None for fp16 and bf16, which hold nothing."""
        if self.powersgd is None:
            return None
        return {"world_size": self.world_size, "iter": self.iter, "q": dict(self.q)}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        if self.powersgd is None:
            return
        if saved is None:
            self.warn("ddp.comm_hook powersgd: the checkpoint holds no PowerSGD state: PowerSGD starts afresh, "
                      f"with plain all-reduces for its first {self.powersgd.start_iter} steps")
            return
        self.iter = saved["iter"]
        if saved["world_size"] != self.world_size:
            self.warn(f"ddp.comm_hook powersgd: the checkpoint is from {saved['world_size']} workers and this run "
                      f"has {self.world_size}: error feedback and factors restart at zero")
            return
        # Reshaped: checkpoints of the version that ran torch's hook hold flat pieces.
        self.q = {name: q.reshape(self._compressed(self._shapes[name])[1], -1).to(self.device)
                  for name, q in saved["q"].items()}
        self._same_ranks = True

    def rank_state_dict(self) -> Optional[dict]:
        """This rank's error feedback, by parameter name, saved by every rank."""
        return None if self.powersgd is None else dict(self.error)

    def load_rank_state_dict(self, saved: Optional[dict]) -> None:
        if self._same_ranks and saved is not None:  # this rank's own errors go on (vectors had some, once)
            self.error = {name: error.reshape(self._shapes[name][0], -1).to(self.device)
                          for name, error in saved.items() if self._compressed(self._shapes[name])}


def _all_reduced(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The tensors' sum over ranks, in one all-reduce of them laid end to end."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return flat


def _pieces(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut back into tensors shaped as `like`, each a copy of its own: a view at the
    piece's offset would put its products at the mercy of that offset's alignment."""
    return [piece.view_as(t).clone() for piece, t in zip(flat.split([t.numel() for t in like]), like)]
