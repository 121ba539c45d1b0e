"""The names of a run directory's files, for the one module that reads them (`rundir`) and the
worker that writes checkpoints; light enough for commands that never load torch."""

METRICS = "metrics.jsonl"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's index of the checkpoints it completed and kept
CONFIG = "config.yaml"
RESTARTS = "restarts.jsonl"  # one line per restart or resume, for report.png
POSITION = "checkpoint.json"  # in each checkpoint: its epoch, step and batch (written with the checkpoint)
STATE_FILE = "state.pt"  # in each checkpoint: rank 0's state, which every checkpoint of the built-in loop holds
SHARDS = "shards"  # in a sharded run's checkpoint: the DCP directory of its weights and optimizer state
COMPILE_CACHE = "compile_cache.bin"  # torch.compile's portable cache, rank 0's (worker/compile_cache.py)
STACK_REQUEST = "logs/stack-request"  # `raytrain-app stack` asks the live run's driver for every rank's stack
STACKS = "logs/stacks.txt"  # the driver's answer, naming the request it answers on its first line
