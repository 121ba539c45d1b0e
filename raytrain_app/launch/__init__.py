"""Sending a job to a cluster: the plan every engine shares, and one backend per engine (Ray Jobs, SLURM, KubeRay)."""
