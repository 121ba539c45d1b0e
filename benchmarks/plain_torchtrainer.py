"""The tiny job as a plain Ray Train script: ray.init, TorchTrainer, fit, shutdown."""

import logging

import ray
import ray.train
import torch
from ray.train.torch import TorchConfig, TorchTrainer

from plain_ddp import digits, lenet


def loop() -> None:
    ctx = ray.train.get_context()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(lenet())
    data = digits()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=ctx.get_world_size(), rank=ctx.get_world_rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for x, y in torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ray.train.report({"done": 1})


if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    TorchTrainer(loop, scaling_config=ray.train.ScalingConfig(num_workers=2),
                 torch_config=TorchConfig(backend="gloo")).fit()
    ray.shutdown()
