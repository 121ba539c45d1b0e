"""A data builder that holds a run in its start-up, named by import path ("tests.held:digits") as
users name theirs: a test does something while the run is starting, and knows that it is."""

import os
import time
from pathlib import Path

from raytrain_app.data.parquet import digits as builtin_digits


def digits(eval_fraction: float, split_seed: int, hold: str, resize: int = 28):
    """The built-in digits, once the file `hold` is gone. A run's checks build its data before
    anything of the run starts, its run directory's lease held: while `hold` exists the run
    waits there, and says so with the file `hold`.waiting."""
    if os.path.exists(hold):
        Path(f"{hold}.waiting").touch()
    while os.path.exists(hold):
        time.sleep(0.05)
    return builtin_digits(eval_fraction, split_seed, resize=resize)
