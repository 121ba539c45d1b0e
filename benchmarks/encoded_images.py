"""Encoded images to training tensors: raytrain-app's `images` data against torchvision's plain
`ImageFolder` + `DataLoader`, at the same number of loader processes, in one run.

Writes `--images` synthetic JPEGs of ImageNet's typical size (500x375, quality 90, textured so
that they compress as photos do, about 80 KiB) into an ImageFolder tree of 10 classes, then times
one epoch of each pipeline in turn, `--repeats` times, each producing 224x224 float tensors with
the standard training augmentation (random-resized crop, horizontal flip, normalisation):

    raytrain-app   build_datasets(data: images) and train_loader: torchvision.io's decoder on
                   bytes, transforms.v2 on uint8 tensors, each sample's draws from its key
    torchvision    datasets.ImageFolder (Pillow's decoder) with the same transforms.v2 crop and
                   flip on PIL images, then ToImage, ToDtype and Normalize
    on DEVICE      with --decode-device: raytrain-app's `decode: device`, the loader processes
                   reading bytes and drawing crops, the batch decoded (nvjpeg on cuda) and cut there

Both read the same files through a DataLoader with `--workers` processes, batch 64. The table
gives images/s per pipeline (median), images/s per loader process, and the ratio.

    python benchmarks/encoded_images.py                      # 600 images, 2 loader processes
    python benchmarks/encoded_images.py --images 3000 --workers 16
    python benchmarks/encoded_images.py --images 3000 --workers 15 --decode-device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

from raytrain_app.config.sections import DataConfig
from raytrain_app.data import build_datasets, train_loader


def write_images(root: Path, count: int) -> float:
    """`count` JPEGs in 10 class folders; returns their mean size in KiB."""
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(count):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 255, (47, 63, 3), dtype=np.uint8)  # smooth structure, as photos have
        image = Image.fromarray(base).resize((500, 375), Image.BICUBIC)
        noise = rng.normal(0, 12, (375, 500, 3))
        pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        sizes.append(path.stat().st_size)
    return statistics.mean(sizes) / 1024


def ours(root: Path, workers: int, device: Optional[str] = None):
    args = {"path": str(root), "size": 224, "decode": "device" if device else "loader"}
    data = build_datasets(DataConfig(name="images", args=args, eval_fraction=0.01))
    return train_loader(data, 64, 0, 1, seed=0, workers=workers, pin=False,
                        device=torch.device(device) if device else None)


def plain(root: Path, workers: int):
    import torchvision.transforms.v2 as T
    from torchvision.datasets import ImageFolder

    transform = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(), T.ToImage(),
                           T.ToDtype(torch.float32, scale=True),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    dataset = ImageFolder(str(root), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=workers,
                                         persistent_workers=workers > 0)
    return loader, None


def epoch_rate(loader, sampler, epoch: int) -> float:
    if sampler is not None:
        sampler.set_epoch(epoch)
    start, images = time.perf_counter(), 0
    for x, _ in loader:
        assert x.shape[1:] == (3, 224, 224) and x.dtype == torch.float32
        images += len(x)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return images / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-device", help="also time `decode: device` on this device (cuda, or cpu)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # each loader process is one core's worth, as in training
    with tempfile.TemporaryDirectory(prefix="encoded-images-") as scratch:
        root = Path(scratch) / "train"
        kib = write_images(root, args.images)
        print(f"{args.images} JPEGs of 500x375, {kib:.0f} KiB on average; {args.workers} loader processes, batch 64")
        pipelines = {"raytrain-app": ours(root, args.workers), "torchvision": plain(root, args.workers)}
        if args.decode_device:
            pipelines[f"on {args.decode_device}"] = ours(root, args.workers, args.decode_device)
        for loader, sampler in pipelines.values():  # start the loader processes, warm the page cache
            epoch_rate(loader, sampler, 0)
        rates = {name: [] for name in pipelines}
        for repeat in range(args.repeats):
            for name, (loader, sampler) in pipelines.items():
                rates[name].append(epoch_rate(loader, sampler, repeat + 1))
    print(f"{'pipeline':<14} {'images/s':>9} {'per process':>12}   runs")
    for name, runs in rates.items():
        median = statistics.median(runs)
        print(f"{name:<14} {median:>9.0f} {median / max(args.workers, 1):>12.0f}   "
              + " ".join(f"{r:.0f}" for r in runs))
    ratio = statistics.median(rates["raytrain-app"]) / statistics.median(rates["torchvision"])
    print(f"raytrain-app / torchvision: {ratio:.2f}x")
    if args.decode_device:
        on_device = statistics.median(rates[f"on {args.decode_device}"])
        print(f"decoded on {args.decode_device} / in the loader processes: "
              f"{on_device / statistics.median(rates['raytrain-app']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
