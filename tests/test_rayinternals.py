"""The private Ray APIs raytrain-app wraps (raytrain_app/rayinternals.py) still exist in the installed
Ray: when an upgrade removes one, this names it, instead of a failure deep inside a run."""

import importlib

import pytest

# (module, attribute path, what raytrain-app uses it for)
PRIVATE = [
    ("ray._private.worker", "global_worker", "the session's log directory, copied into the run directory"),
    ("ray._private.worker", "print_to_stdstream", "routing raylets' error paragraphs away from the console"),
    ("ray._raylet", "Config.initialize",
     "re-reading the auth mode when Ray was loaded before a joined cluster's token was set"),
    ("ray.util.queue", "_QueueActor.put_nowait", "queueing console events without waiting for the actor"),
    ("ray.train.v2._internal.exceptions", "WorkerGroupStartupTimeoutError",
     "telling a worker group the cluster could not place (failure.placement_timeout_s) from other failures"),
    ("ray._private.state", "state.get_draining_nodes", "leaving nodes being drained out of what a cluster can hold"),
]


@pytest.mark.parametrize("module, path, use", PRIVATE, ids=[f"{m}.{p}" for m, p, _ in PRIVATE])
def test_the_private_ray_apis_still_exist(module, path, use):
    try:
        found = importlib.import_module(module)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        pytest.fail(f"the installed Ray no longer has {module}.{path}, which raytrain_app/rayinternals.py uses for "
                    f"{use}: adapt rayinternals.py to this Ray")


def test_raylet_errors_reach_the_sink_and_the_rest_is_printed_as_before(capsys):
    import ray._private.worker as worker

    from raytrain_app.rayinternals import route_raylet_errors

    original = worker.print_to_stdstream
    caught = []
    try:
        route_raylet_errors(caught.append)
        worker.print_to_stdstream({"lines": ["A worker died or was killed"], "pid": "raylet", "is_err": False}, False)
        worker.print_to_stdstream({"lines": ["hello from a worker"], "pid": 42, "ip": "1.2.3.4", "is_err": False,
                                   "task_name": "t", "actor_name": "", "job": "01"}, False)
        route_raylet_errors(caught.append)  # twice: wraps the original once, not itself
    finally:
        worker.print_to_stdstream = original
    assert caught == ["A worker died or was killed"]
    out = capsys.readouterr().out
    assert "hello from a worker" in out and "A worker died" not in out
