"""Convert scikit-learn's bundled datasets into the Parquet files this repository ships.

Run once (needs scikit-learn, which is not a runtime dependency):

    pip install -e '.[scripts]' && python scripts/sklearn_to_parquet.py

- digits: 1,797 handwritten digits, 8x8 grey levels in 0..16 (UCI "optdigits"), stored
  unchanged as uint8 in a fixed-size list column with their shape in the schema metadata, so
  the generic `parquet` reader loads them like any user file (raytrain_app/data/digits.parquet).
- diabetes: 442 patients, 10 standardised baseline measurements and a real-valued measure of
  disease progression one year later (examples/diabetes.parquet, for examples/regression.yaml).
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_diabetes, load_digits

ROOT = Path(__file__).resolve().parents[1]


def rows(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """One fixed-size list per row: the layout the `parquet` reader takes for a feature column."""
    return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel(), type_), values.shape[1])


def write(path: Path, columns: dict, meta: dict) -> None:
    table = pa.table(columns).replace_schema_metadata(meta)
    pq.write_table(table, path, compression="zstd")
    print(f"wrote {path} ({table.num_rows} rows)")


def main() -> None:
    digits = load_digits()
    write(ROOT / "raytrain_app" / "data" / "digits.parquet",
          {"image": rows(digits.images.astype(np.uint8).reshape(len(digits.images), 64), pa.uint8()),
           "label": pa.array(digits.target.astype(np.int64))},
          {b"raytrain.shape": json.dumps([1, 8, 8]).encode(), b"raytrain.source": b"sklearn.datasets.load_digits"})
    x, y = load_diabetes(return_X_y=True)
    write(ROOT / "examples" / "diabetes.parquet",
          {"features": rows(x.astype(np.float32), pa.float32()), "target": pa.array(y.astype(np.float32))},
          {b"raytrain.source": b"sklearn.datasets.load_diabetes"})


if __name__ == "__main__":
    main()
