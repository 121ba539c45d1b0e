"""Encoded images (`data: images`): real PNG and JPEG files written by the tests, as an ImageFolder
tree (local and on a real S3-compatible server), as Parquet in the Hugging Face layout and as a
plain binary column; trained in local mode, then scored with `evaluate --data`, `predict` and
`load_model` on the raw files; bad images stopping the run with their name, or skipped and
counted; and each sample's random crop fixed by (seed, epoch, sample).
"""

import io
import json
import os
import resource

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raytrain_app import fit, load_model
from raytrain_app.config.sections import DataConfig
from raytrain_app.data import DrawnShard, build_datasets, loader_workers, train_loader
from raytrain_app.data.image_sources import find
from raytrain_app.data.images import EncodedImages, Transforms
from raytrain_app.inference import scoring
from raytrain_app.inference.export import export
from tests.commands import command
from tests.conftest import REPO

CLASSES = ["bottom", "centre", "top"]  # where a bright bar sits: a cue that flips and crops keep


def picture(label: int, rng: np.random.Generator) -> np.ndarray:
    """An image of varying size whose class is where its bright bar sits."""
    h, w = int(rng.integers(36, 60)), int(rng.integers(36, 60))
    pixels = (rng.random((h, w, 3)) * 60).astype(np.uint8)
    top = {0: h * 2 // 3, 1: h // 3, 2: 0}[label]
    pixels[top:top + h // 3, w // 4:3 * w // 4] = 230
    return pixels


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def samples(n: int, seed: int = 0):
    """(class, name, bytes): n per class, PNG and JPEG in turn."""
    rng = np.random.default_rng(seed)
    for label in range(len(CLASSES)):
        for i in range(n):
            fmt = "PNG" if i % 2 else "JPEG"
            yield label, f"{i:03d}.{fmt.lower()}", encoded(picture(label, rng), fmt)


def image_folder(root, n: int = 16, seed: int = 0):
    for label, name, data in samples(n, seed):
        (root / CLASSES[label]).mkdir(parents=True, exist_ok=True)
        (root / CLASSES[label] / name).write_bytes(data)
    return root


def hugging_face_parquet(path, n: int = 16, seed: int = 0):
    """The layout `datasets` writes for an Image and a ClassLabel feature: a struct of bytes and
    path, integer labels, the names in the schema's `huggingface` metadata."""
    rows = list(samples(n, seed))
    image = pa.StructArray.from_arrays([pa.array([data for _, _, data in rows], pa.binary()),
                                        pa.array([name for _, name, _ in rows])], names=["bytes", "path"])
    features = {"image": {"_type": "Image"}, "label": {"names": CLASSES, "_type": "ClassLabel"}}
    table = pa.table({"image": image, "label": pa.array([label for label, _, _ in rows], pa.int64())})
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
                   path, row_group_size=16)
    return path


def job(path, **args):
    return {"name": "images", "seed": 0, "model": {"name": "lenet"},
            "data": {"name": "images", "args": {"path": str(path), "size": 24, "scale": [0.5, 1.0], **args},
                     "eval_fraction": 0.25},
            "optimizer": {"name": "adam", "lr": 0.003}, "train": {"epochs": 3, "batch_size": 16},
            "scaling": {"workers": 1, "local": True}}


def metric_rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "epoch" in row]


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A run trained on an ImageFolder tree, and a held-out tree of other images."""
    root = tmp_path_factory.mktemp("images")
    held_out = image_folder(root / "held-out", n=8, seed=1)
    return fit(job(image_folder(root / "train")), run_dir=str(root / "run"), echo=lambda line: None), held_out


@pytest.mark.slow
def test_an_image_folder_trains_and_predict_on_its_files_agrees_with_evaluate_and_load_model(folder_run, tmp_path):
    result, held_out = folder_run
    assert [row["epoch"] for row in metric_rows(result.run_dir)] == [1, 2, 3]
    assert metric_rows(result.run_dir)[-1]["eval_accuracy"] > 0.9  # the bar's place is learnt

    scored = scoring.evaluate(result.run_dir, data=str(held_out), echo=lambda line: None)
    out = tmp_path / "predictions.csv"
    assert scoring.predict(result.run_dir, str(held_out), str(out), echo=lambda line: None) == 24
    predicted = pcsv.read_csv(out).to_pydict()
    truth = [os.path.basename(os.path.dirname(path)) for path in predicted["image"]]
    assert predicted["label"] == [CLASSES[i] for i in predicted["prediction"]]
    assert np.mean(np.array(predicted["label"]) == truth) == pytest.approx(scored["eval_accuracy"])

    model = load_model(result.run_dir)  # on the raw files, and on their bytes: the same classes
    files = predicted["image"]
    with torch.no_grad():
        by_path = torch.softmax(model(files), 1).max(1)
        by_bytes = model([open(path, "rb").read() for path in files]).argmax(1)
    assert by_path.indices.tolist() == by_bytes.tolist() == predicted["prediction"]
    assert by_path.values.tolist() == pytest.approx(predicted["probability"], abs=1e-5)  # the same eval transform
    assert model.class_names == CLASSES


@pytest.mark.slow
def test_an_image_model_exports_as_torchscript_and_onnx_taking_pixels_cropped_as_its_json_says(folder_run, tmp_path):
    """Cropped here by torchvision's own transforms, from what the JSON says, the held-out images
    give the traced file, onnxruntime and load_model of the export what load_model of the run gives
    on the files."""
    import onnxruntime
    import torchvision.transforms.v2 as T
    from torchvision.io import ImageReadMode, decode_image

    result, held_out = folder_run
    files = sorted(str(path) for path in held_out.rglob("*.*"))
    with torch.no_grad():
        expected = load_model(result.run_dir)(files)
    traced = export(result.run_dir, "torchscript", output=str(tmp_path / "model.torchscript.pt"))
    onnx = export(result.run_dir, "onnx", output=str(tmp_path / "model.onnx"))
    manifest = json.loads(open(traced.manifest).read())
    recipe, spec = manifest["preprocessing"], manifest["example_input"]
    crop = T.Compose([T.Resize(recipe["resize"], antialias=True), T.CenterCrop(recipe["size"])])
    pixels = torch.stack([crop(decode_image(path, mode=ImageReadMode.RGB)) for path in files])
    assert (spec["dtype"], spec["shape"][1:]) == ("uint8", list(pixels.shape[1:]))
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(traced.weights)(pixels), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(traced.weights)(files), expected, rtol=0, atol=0)
    session = onnxruntime.InferenceSession(onnx.weights, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": pixels.numpy()})[0], expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_parquet_in_the_hugging_face_layout_and_a_binary_column_of_names_train(tmp_path):
    hf = hugging_face_parquet(tmp_path / "hf.parquet")
    result = fit(job(hf), run_dir=str(tmp_path / "hf-run"), echo=lambda line: None)
    assert metric_rows(result.run_dir)[-1]["eval_accuracy"] > 0.9
    assert load_model(result.run_dir).class_names == CLASSES  # the ClassLabel's names

    rows = list(samples(16))
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"jpeg": pa.array([data for _, _, data in rows], pa.binary()),
                             "kind": [CLASSES[label] for label, _, _ in reversed(rows)][::-1]}), plain)
    # This one's JPEGs are decoded by the training process (`decode: device`; here on the CPU).
    result = fit(job(plain, column="jpeg", label="kind", decode="device"), run_dir=str(tmp_path / "plain-run"),
                 echo=lambda line: None)
    assert metric_rows(result.run_dir)[-1]["eval_accuracy"] > 0.9
    assert load_model(result.run_dir).class_names == CLASSES  # the sorted names


def test_the_converter_keeps_image_bytes_as_they_are_in_the_hugging_face_layout(tmp_path):
    folder = image_folder(tmp_path / "photos", n=5)
    out = tmp_path / "converted"
    proc = command(["convert", "images", str(folder), str(out), "--encoded", "--row-group-rows", "4"], REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote 15 encoded images of 3 classes in 1 files to {out}\n"
    table = pq.read_table(out / "part-00000.parquet")
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["label"] == {"names": CLASSES, "_type": "ClassLabel"}
    for image, label in zip(table.column("image").to_pylist(), table.column("label").to_pylist()):
        assert image["bytes"] == (folder / image["path"]).read_bytes()  # no re-encoding
        assert image["path"].split("/")[0] == CLASSES[label]
    found = find(str(out))
    assert found.classes == tuple(CLASSES) and len(found) == 15


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["loader", "device"])
def test_a_bad_image_is_one_line_naming_it_or_skipped_and_counted(tmp_path, decode):
    """Decoded by the loader processes, or by the training process (`decode: device`): the bad
    JPEG's header reads, so there only the training process finds it bad."""
    folder = image_folder(tmp_path / "photos", n=8)
    bad = folder / "top" / "000.jpeg"
    bad.write_bytes(bad.read_bytes()[:-200])  # truncated, as an interrupted copy leaves it
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({**job(folder, decode=decode), "train": {"epochs": 2, "batch_size": 8}}))
    proc = command(["train", str(config), "--run-dir", str(tmp_path / "stopped")], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"error: {bad}: not a readable image (Image is incomplete or truncated); set "
                           "data.args.on_bad: skip to train without such images\n")

    proc = command(["train", str(config), "--run-dir", str(tmp_path / "skipped"), "--set", "data.args.on_bad=skip"],
                   tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = metric_rows(tmp_path / "skipped")
    assert [row["skipped_images"] for row in rows] == [1, 1]  # in training or in evaluation, every epoch
    assert rows[-1]["train_samples"] + rows[-1]["eval_samples"] == 3 * 8 - 1


def test_a_samples_crop_depends_on_the_seed_epoch_and_sample_not_on_who_reads_it(tmp_path):
    folder = image_folder(tmp_path / "photos", n=6)
    data = build_datasets(DataConfig(name="images", args={"path": str(folder), "size": 16}, eval_fraction=0.2))
    assert isinstance(data.train, EncodedImages)
    assert loader_workers(None, data, 2) == 2  # decoding takes a process per CPU

    def first_epochs(world: int, workers: int) -> dict:
        """Every sample's tensor in epochs 0 and 1, read by `world` ranks with `workers` loader processes each."""
        seen = {}
        for rank in range(world):
            loader, sampler = train_loader(data, 4, rank, world, seed=7, workers=workers, pin=False)
            assert isinstance(sampler, DrawnShard)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                keys = [k for k in sampler]
                batches = [x for x, _ in loader]
                for (i, _, _), x in zip(keys, torch.cat(batches)):
                    seen[(epoch, i)] = x
        return seen

    one, two = first_epochs(1, 0), first_epochs(2, 2)
    assert set(one) >= set(two) and len(set(i for _, i in one)) == len(data.train)
    for key, x in two.items():
        assert torch.equal(x, one[key])  # bitwise, whichever rank and process decoded it
    i = next(i for e, i in one if e == 0)
    assert not torch.equal(one[(0, i)], one[(1, i)])  # a new crop every epoch
    # Evaluation is the same centre crop every time.
    assert torch.equal(data.eval[0][0], data.eval[0][0])
    assert data.eval[0][0].shape == (3, 16, 16)
    # Decoded by the training process (on its device: here the CPU), the crops are the same.
    data = build_datasets(DataConfig(name="images", args={"path": str(folder), "size": 16, "decode": "device"},
                                     eval_fraction=0.2))
    on_device = first_epochs(2, 2)
    assert set(on_device) == set(two)
    for key, x in on_device.items():
        assert torch.equal(x, one[key])
    assert data.input_shape == (3, 16, 16)


@pytest.mark.timeout(90)
def test_a_large_batch_decoded_on_the_device_takes_no_open_file_per_image(tmp_path):
    """Loader processes hand a batch to the training process through shared memory, a file per
    tensor: a tensor per image would exhaust a usual limit of open files at ImageNet's batch sizes.
    (Then a loader process cannot send its batch, and the loader waits: so the time limit.)"""
    data = build_datasets(DataConfig(name="images", eval_fraction=0.01,
                                     args={"path": str(image_folder(tmp_path / "photos", n=100)), "size": 16,
                                           "decode": "device"}))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 160), hard))
    try:
        loader, _ = train_loader(data, 256, 0, 1, seed=0, workers=2, pin=False)
        sizes = [len(x) for x, _ in loader]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sizes == [256, len(data.train) - 256]


@pytest.mark.slow
def test_an_image_folder_on_object_storage_trains(tmp_path, s3, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    client = s3.client()
    for split, seed in (("train", 0), ("eval", 1)):
        for label, name, data in samples(8, seed):
            client.put_object(Bucket=s3.bucket, Key=f"photos/{split}/{CLASSES[label]}/{name}", Body=data)
    root = f"s3://{s3.bucket}/photos"
    config = job(f"{root}/train", eval_path=f"{root}/eval")
    result = fit(config, run_dir=str(tmp_path / "run"), echo=lambda line: None)
    rows = metric_rows(result.run_dir)
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    assert rows[-1]["train_samples"] == 24 and rows[-1]["eval_samples"] == 24
    scored = scoring.evaluate(result.run_dir, data=f"{root}/eval", echo=lambda line: None)
    assert scored["eval_samples"] == 24 and scored["eval_accuracy"] == pytest.approx(rows[-1]["eval_accuracy"])


def test_transforms_are_recorded_with_the_model(tmp_path):
    folder = image_folder(tmp_path / "photos", n=4)
    data = build_datasets(DataConfig(name="images", args={"path": str(folder), "size": 20, "resize": 28,
                                                          "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}))
    recipe = data.train.recipe
    assert recipe == {"kind": "images", "features": "image", "label": "label", "shape": [3, 20, 20], "size": 20,
                      "resize": 28, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "classes": CLASSES}
    assert Transforms(size=224).eval_resize == 256  # the usual 0.875 centre crop


def webdataset_shards(folder, n: int = 16, per_shard: int = 20, named: bool = False):
    """Uncompressed tar shards as WebDataset writes them: KEY.jpg or KEY.png beside KEY.cls."""
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    rows = list(samples(n))
    for start in range(0, len(rows), per_shard):
        with tarfile.open(folder / f"shard-{start // per_shard:05d}.tar", "w") as tar:
            for i, (label, name, data) in enumerate(rows[start:start + per_shard], start=start):
                for member, body in ((f"{i:06d}.{name.split('.')[1]}", data),
                                     (f"{i:06d}.cls", (CLASSES[label] if named else str(label)).encode())):
                    info = tarfile.TarInfo(member)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    return folder


@pytest.mark.slow
def test_webdataset_shards_train_and_predict_names_each_member(tmp_path):
    shards = webdataset_shards(tmp_path / "ids")
    result = fit(job(shards), run_dir=str(tmp_path / "run"), echo=lambda line: None)
    rows = metric_rows(result.run_dir)
    assert rows[-1]["train_samples"] + rows[-1]["eval_samples"] == 48 and rows[-1]["eval_accuracy"] > 0.9
    out = tmp_path / "predictions.parquet"
    assert scoring.predict(result.run_dir, str(shards / "shard-00001.tar"), str(out), echo=lambda line: None) == 20
    predicted = pq.read_table(out).to_pydict()
    assert predicted["image"][0] == f"{shards / 'shard-00001.tar'}:000020.jpeg"
    truth = [label for label, _, _ in samples(16)][20:40]
    assert np.mean(np.array(predicted["prediction"]) == truth) > 0.9

    named = find(str(webdataset_shards(tmp_path / "names", n=4, named=True)))
    assert named.classes == tuple(CLASSES) and named.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert named.read(5) == list(samples(4))[5][2]  # the member's bytes, read at its offset
