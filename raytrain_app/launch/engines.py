"""The backend of a profile's kind: the one place that maps kinds to engines."""

from __future__ import annotations

from raytrain_app.cluster.profiles import ClusterProfile
from raytrain_app.launch.backend import Backend
from raytrain_app.launch.kuberay import KubeRay
from raytrain_app.launch.rayjobs import RayJobs
from raytrain_app.launch.slurm import Slurm

ENGINES = {"ray": RayJobs, "kuberay": KubeRay, "slurm": Slurm}


def for_profile(profile: ClusterProfile) -> Backend:
    return ENGINES[profile.kind](profile)
