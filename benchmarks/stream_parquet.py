"""Streaming Parquet against reading it whole: per-worker throughput and memory, 2 ranks.

Writes a synthetic CIFAR-sized Parquet dataset (random uint8 images 3x32x32, labels 0..9, in
files of row groups of `--group-rows` rows, with the schema metadata that lets the reader find
its columns), and a second one `--scale` times larger of the same files. Then, in one run and
alternating, it reads them through raytrain-app's library API (`build_datasets`, `train_loader`)
in separate processes, rank 0 and rank 1 of world size 2 side by side (no process group: reading
needs none), each taking one full epoch of training batches and doing a trivial amount of work
per batch (`x.float().mean()`), so the reading is what is timed:

    streaming     data.args.streaming: true, buffer_rows rows a window
    whole         the files read whole into memory (the default)

at the base size, and both again at the scaled size; with `--layout both`, each dataset is
written twice, its images as fixed-size binary (as `raytrain-app convert images` writes them)
and as fixed_size_list<uint8> (as it wrote them before), and every variant runs on each. Each
worker reports the rows it took, its time to build the datasets and to run the epoch, rows/s,
its resident memory right after the imports (the baseline, from psutil) and its peak
(`ru_maxrss`); the data's share is peak minus baseline. The table gives medians over `--repeats`
runs of both ranks, the streaming/whole ratios, and checks that a streaming worker's memory
above the baseline stays under a bound that
follows from stream.py's design and does not depend on the dataset's size (exit 1 if not):

    bound = 6 x window_bytes + 22 x READ_ROWS x pixel_bytes + 4 x NORM_ROWS x pixel_bytes + 96 MiB

- window_bytes = window_rows x decoded row bytes (uint8 pixels + int64 label). Six windows:
  stream.py holds up to three decoded windows (the one the loop still references, the one read
  ahead, and the one being decoded), plus the Arrow record batches of two (a window's batches
  live until the reader moves on to the next) and the concatenated column made while decoding.
- 22 x READ_ROWS x pixel_bytes: pyarrow decoding READ_ROWS rows of the `fixed_size_list<uint8>`
  image column, measured here (pyarrow 25): INT32 values (Parquet has no 8-bit type) plus 16-bit
  definition and repetition levels, in buffers grown by doubling. stream.py decodes a row group
  READ_ROWS at a time (`ParquetFile.iter_batches`); a dataset fragment's scanner decoded the
  whole group at once, 66 MiB for a 1,024-row group, and this benchmark is what found that.
- 4 x NORM_ROWS x pixel_bytes: the float32 copy the normalisation statistics make at start.
- 96 MiB: torch's per-batch float copies, pyarrow's scanner reading a little ahead, and what the
  allocators (mimalloc for Arrow, glibc for torch, a heap per thread) keep after freeing: 60 to
  90 MiB measured, the most with the smallest windows.

    python benchmarks/stream_parquet.py                         # 40,000 rows (117 MiB decoded), buffer 4,096 rows
    python benchmarks/stream_parquet.py --rows 100000 --buffer-rows 8192 --repeats 3
    python benchmarks/stream_parquet.py --dir /data/bench        # keep the files (reused when they match)
    python benchmarks/stream_parquet.py --scale 1 --world 1 --layout both   # the two image layouts, one rank
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = (3, 32, 32)
PIXELS = SHAPE[0] * SHAPE[1] * SHAPE[2]
ROW_BYTES = PIXELS + 8  # decoded: uint8 pixels + an int64 label
MiB = 2**20
VARIANTS = ("streaming", "whole")
DECODE_FACTOR = 22  # pyarrow's peak allocation decoding fixed_size_list<uint8>, per pixel byte


# ---- the dataset --------------------------------------------------------------------------------


def write_dataset(out: str, rows: int, files: int, group_rows: int, seed: int, layout: str) -> None:
    """`rows` random images in `files` files of row groups of `group_rows` rows, with the metadata
    the reader takes its columns and shape from. Skipped when `out` holds this dataset already."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stamp = os.path.join(out, "_dataset.json")  # "_" files are not read as data
    spec = {"rows": rows, "files": files, "group_rows": group_rows, "seed": seed, "shape": list(SHAPE),
            "layout": layout}
    if os.path.exists(stamp):
        with open(stamp) as fh:
            if json.load(fh) == spec:
                return
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    image_type = pa.binary(PIXELS) if layout == "binary" else pa.list_(pa.uint8(), PIXELS)
    schema = pa.schema([("image", image_type), ("label", pa.int64())]).with_metadata({
        b"raytrain.shape": json.dumps(list(SHAPE)).encode(), b"raytrain.features": b'"image"',
        b"raytrain.label": b"label",  # plain text, as `raytrain-app convert` writes it and the reader reads it
        b"raytrain.num_classes": b"10"})
    rng = np.random.default_rng(seed)
    for f in range(files):
        n = rows // files + (f < rows % files)
        pixels = rng.integers(0, 256, n * PIXELS, dtype=np.uint8)
        images = (pa.Array.from_buffers(image_type, n, [None, pa.py_buffer(pixels.tobytes())]) if layout == "binary"
                  else pa.FixedSizeListArray.from_arrays(pa.array(pixels), PIXELS))
        table = pa.Table.from_arrays([images, pa.array(rng.integers(0, 10, n))], schema=schema)
        with pq.ParquetWriter(os.path.join(out, f"part-{f:05d}.parquet"), schema, compression="zstd") as w:
            w.write_table(table, row_group_size=group_rows)
    with open(stamp, "w") as fh:
        json.dump(spec, fh)


# ---- one worker ---------------------------------------------------------------------------------


def worker(spec: dict) -> dict:
    """One rank's epoch; runs in a fresh process (`--worker`), so its memory is its own."""
    import psutil
    import torch

    from raytrain_app.config.sections import DataConfig
    from raytrain_app.data import build_datasets, train_loader

    torch.set_num_threads(spec["threads"])
    proc = psutil.Process()
    baseline = proc.memory_info().rss
    t0 = time.perf_counter()
    args = {"path": spec["dir"], "streaming": spec["streaming"]}
    if spec["streaming"]:
        args["buffer_rows"] = spec["buffer_rows"]
    ds = build_datasets(DataConfig(name="parquet", args=args))
    loader, sampler = train_loader(ds, spec["batch"], spec["rank"], spec["world"], 0, 0, False)
    sampler.set_epoch(0)
    t1 = time.perf_counter()
    peak_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows, total = 0, 0.0
    for x, y in loader:
        total += float(x.float().mean())  # a trivial amount of work per batch
        rows += len(y)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rank": spec["rank"], "rows": rows, "train_rows": len(ds.train), "build_s": t1 - t0, "epoch_s": t2 - t1,
            "baseline": baseline, "peak_built": peak_built, "peak": peak, "end": proc.memory_info().rss}


def run_variant(spec: dict, world: int) -> list[dict]:
    """`world` worker processes side by side, one per rank; their reports."""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps({**spec, "rank": r})],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker failed (exit {p.returncode}): {spec}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# ---- main ---------------------------------------------------------------------------------------


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, columns aligned, ready to paste into benchmarks/README.md."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=40_000, help="rows of the base dataset")
    p.add_argument("--scale", type=int, default=2, help="the second dataset is this many times larger (1: none)")
    p.add_argument("--files", type=int, default=8, help="files of the base dataset (the scaled one has scale x files)")
    p.add_argument("--group-rows", type=int, default=1024, help="rows per row group")
    p.add_argument("--buffer-rows", type=int, default=4096, help="data.args.buffer_rows of the streaming variant")
    p.add_argument("--batch", type=int, default=256, help="per-worker batch")
    p.add_argument("--world", type=int, default=2, help="worker processes per variant, run side by side")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs every variant once, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (Ray gives a 1-CPU worker 1)")
    p.add_argument("--layout", choices=["binary", "list", "both"], default="binary",
                   help="the image column: fixed-size binary (as convert writes it), fixed_size_list<uint8>, or both")
    p.add_argument("--dir", help="write the datasets here and keep them (default: a temporary directory, removed)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    import pyarrow as pa
    import torch

    from raytrain_app.data.stream import NORM_ROWS, READ_ROWS

    window_rows = max(args.batch, args.buffer_rows // args.batch * args.batch)  # as StreamBatches cuts them
    window_bytes = window_rows * ROW_BYTES
    terms = {"6 windows": 6 * window_bytes, "decoding READ_ROWS rows": DECODE_FACTOR * READ_ROWS * PIXELS,
             "normalisation statistics": 4 * NORM_ROWS * PIXELS, "allocators and batches": 96 * MiB}
    bound = sum(terms.values())
    if args.rows * ROW_BYTES < 4 * window_bytes:
        p.error(f"--rows {args.rows:,} is less than 4 streaming windows ({window_rows:,} rows each): "
                "streaming would hold about as much as the whole dataset")
    root = args.dir or tempfile.mkdtemp(prefix="stream-parquet-")
    counts = {1: args.rows} | ({args.scale: args.rows * args.scale} if args.scale > 1 else {})
    layouts = ["binary", "list"] if args.layout == "both" else [args.layout]
    sizes = {f"x{k}" + (f" {layout}" if len(layouts) > 1 else ""): (k, n, layout)
             for layout in layouts for k, n in counts.items()}
    started = time.perf_counter()
    try:
        dirs = {}
        for key, (k, n, layout) in sizes.items():
            dirs[key] = os.path.join(root, f"rows-{n}-{layout}")
            write_dataset(dirs[key], n, args.files * k, args.group_rows, seed=k, layout=layout)
        print(f"data written in {time.perf_counter() - started:.0f}s under {root}")
        runs = {(v, k): [] for k in sizes for v in VARIANTS}
        for r in range(args.repeats):
            # A, B, A, B within each dataset; the variant that goes first alternates between rounds.
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for k in sizes:
                for v in order:
                    spec = {"dir": dirs[k], "streaming": v == "streaming", "buffer_rows": args.buffer_rows,
                            "batch": args.batch, "world": args.world, "threads": args.threads}
                    runs[v, k] += run_variant(spec, args.world)
                    last = runs[v, k][-args.world:]
                    print(f"  round {r + 1}, {v:<9} {k}: " + ", ".join(
                        f"rank {w['rank']} {w['rows'] / w['epoch_s']:,.0f} rows/s, "
                        f"+{(w['peak'] - w['baseline']) / MiB:.0f} MiB" for w in last), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    def med(ws, f):
        return statistics.median(f(w) for w in ws)

    def above(w):
        return w["peak"] - w["baseline"]

    def epoch_rate(w):
        return w["rows"] / w["epoch_s"]

    def total_rate(w):
        return w["rows"] / (w["build_s"] + w["epoch_s"])

    print(f"\n{os.cpu_count()} CPUs, torch {torch.__version__}, pyarrow {pa.__version__}; {args.world} worker "
          f"processes side by side per variant, batch {args.batch}, {args.threads} torch thread(s) each; "
          f"{args.repeats} rounds, medians over rounds and ranks")
    for key, (k, n, _) in sizes.items():
        print(f"dataset {key}: {n:,} rows in {args.files * k} files, row groups of {args.group_rows} rows, "
              f"{n * ROW_BYTES / MiB:,.0f} MiB decoded ({ROW_BYTES:,} B a row) = "
              f"{n * ROW_BYTES / window_bytes:.1f}x a streaming window")
    print(f"streaming window: {window_rows:,} rows = {window_bytes / MiB:.1f} MiB decoded (buffer_rows "
          f"{args.buffer_rows:,})")
    rows = []
    for k in sizes:
        for v in VARIANTS:
            ws = runs[v, k]
            rows.append([f"{v} {k}", f"{med(ws, lambda w: w['rows']):,.0f}", f"{med(ws, lambda w: w['build_s']):.2f}",
                         f"{med(ws, epoch_rate):,.0f}", f"{med(ws, total_rate):,.0f}",
                         f"{med(ws, lambda w: w['peak']) / MiB:,.0f}", f"{med(ws, above) / MiB:,.0f}",
                         f"{max(above(w) for w in ws) / MiB:,.0f}"])
    print_table(["variant", "rows/worker", "build s", "rows/s, epoch", "rows/s, build + epoch", "peak RSS MiB",
                 "above baseline MiB", "max above baseline MiB"], rows)
    for k in sizes:
        s, w = runs["streaming", k], runs["whole", k]
        print(f"{k} streaming/whole: rows/s {med(s, total_rate) / med(w, total_rate):.2f}x (build + epoch), "
              f"{med(s, epoch_rate) / med(w, epoch_rate):.2f}x (epoch alone); memory above baseline "
              f"{med(s, above) / med(w, above):.2f}x")
    for layout in layouts if args.scale > 1 else []:
        small, big = (next(key for key, (k, _, lay) in sizes.items() if k == want and lay == layout)
                      for want in (1, args.scale))
        for v in VARIANTS:
            print(f"{v} ({layout}): memory above baseline at {big} / {small} = "
                  f"{med(runs[v, big], above) / med(runs[v, small], above):.2f}x")
    if len(layouts) > 1:
        for key, (k, _, layout) in sizes.items():
            if layout == "binary":
                other = next(o for o, (ko, _, lo) in sizes.items() if ko == k and lo == "list")
                for v in VARIANTS:
                    ratio = med(runs[v, key], epoch_rate) / med(runs[v, other], epoch_rate)
                    print(f"{v} x{k}: binary/list rows/s {ratio:.2f}x (epoch alone)")
    worst = max(above(w) for k in sizes for w in runs["streaming", k])
    held = worst <= bound
    print("bound: " + " + ".join(f"{name} {b / MiB:.0f}" for name, b in terms.items()) + f" = {bound / MiB:.0f} MiB; "
          f"streaming's largest memory above baseline {worst / MiB:.0f} MiB: {'held' if held else 'EXCEEDED'}")
    print(f"wall {time.perf_counter() - started:.0f}s")
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
