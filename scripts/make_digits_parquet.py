"""Convert scikit-learn's bundled handwritten digits into the Parquet file shipped with the package.

Run once (needs scikit-learn, which is not a runtime dependency):

    pip install -e '.[scripts]' && python scripts/make_digits_parquet.py

The 1,797 images are 8x8 grey levels in 0..16 (UCI "optdigits"). They are stored unchanged as
uint8 in a fixed-size list column, with their shape in the schema metadata, so the generic
`parquet` reader can load them like any user file.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parents[1] / "raytrain_app" / "data" / "digits.parquet"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.uint8).reshape(len(digits.images), 64)
    table = pa.table(
        {
            "image": pa.FixedSizeListArray.from_arrays(pa.array(images.ravel(), pa.uint8()), 64),
            "label": pa.array(digits.target.astype(np.int64)),
        }
    )
    meta = {b"raytrain.shape": json.dumps([1, 8, 8]).encode(), b"raytrain.source": b"sklearn.datasets.load_digits"}
    pq.write_table(table.replace_schema_metadata(meta), OUT, compression="zstd")
    print(f"wrote {OUT} ({len(images)} rows)")


if __name__ == "__main__":
    main()
