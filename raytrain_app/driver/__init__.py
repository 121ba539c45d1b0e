"""What runs in the `train` process: the plan, Ray Train's trainer around the worker loop, sweeps, the result."""
