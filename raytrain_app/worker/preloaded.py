"""Imported last by the local-mode fork server (`driver/local.PRELOAD`), once torch and the worker's
modules are loaded: it moves all they made out of the garbage collector's sight (`gc.freeze`).

Why: a worker forked from the server then never writes to those objects' pages when it collects,
so they stay shared (Python's own advice for a server that forks), and the server's exit skips a
final collection of torch's objects that took a second, during which it held the command's output
open (a `| tee` or a captured run waited for it after the driver had ended).
"""

import gc

gc.freeze()
