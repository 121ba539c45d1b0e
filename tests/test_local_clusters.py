"""Local clusters belong to their user: two users (real UIDs, made here) bring up one profile
at once without touching each other's state, and ports a profile fixes are refused in one line
when another's cluster holds them.

Needs root (useradd, setpriv): elsewhere it skips, saying so; in CI (`CI=true`) that fails.
The users get CAP_DAC_READ_SEARCH, so that they can read the project's Python where it lives
(under /root, 0700, on the test machine); what they write stays their own.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys

import pytest
import requests

USERS = ("rtuser1", "rtuser2")
PROFILE = """\
name: shared
address: local
nodes: 1
cpus_per_node: 1
storage: ~/runs
auth:
  token_file: ~/.raytrain/shared.token
"""


def uid_of(user: str) -> int:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", user], check=True)
        return pwd.getpwnam(user).pw_uid


@pytest.fixture(scope="module")
def users(tmp_path_factory):
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("useradd"):
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the two-user test: needs root, setpriv and useradd")
        pytest.skip("two users need root, setpriv and useradd")
    root = tmp_path_factory.mktemp("users")
    root.chmod(0o755)
    homes = {}
    for user in USERS:
        home = root / f"home-{user}"
        home.mkdir()
        shutil.chown(home, user=uid_of(user), group=uid_of(user))
        homes[user] = home
    (root / "shared.yaml").write_text(PROFILE)
    (root / "shared.yaml").chmod(0o644)
    yield root, homes
    for user in USERS:  # whatever a failed test left up
        as_user(user, homes[user], root, "cluster", "down", "shared.yaml")


def as_user(user: str, home, cwd, *args) -> subprocess.CompletedProcess:
    uid = pwd.getpwnam(user).pw_uid
    env = {"HOME": str(home), "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                           sys.executable, "-m", "raytrain_app.cli", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_two_users_bring_up_one_profile_without_colliding(users):
    root, homes = users
    up = {user: as_user(user, homes[user], root, "cluster", "up", "shared.yaml") for user in USERS}
    for user, proc in up.items():
        assert proc.returncode == 0 and "cluster 'shared' is up: 1 node, Jobs API at" in proc.stdout, proc.stderr
    ports, tokens = {}, {}
    for user in USERS:
        uid = pwd.getpwnam(user).pw_uid
        own = f"/tmp/raytrain-{uid}"
        assert os.stat(own).st_uid == uid and os.stat(own).st_mode & 0o777 == 0o700  # nobody else's to enter
        ports[user] = json.loads(open(f"{own}/shared/raytrain-ports.json").read())
        tokens[user] = (homes[user] / ".raytrain" / "shared.token").read_text().strip()
        assert (homes[user] / ".raytrain" / "shared.token").stat().st_mode & 0o777 == 0o600
    first, second = (set(ports[u].values()) for u in USERS)
    assert not first & second and tokens[USERS[0]] != tokens[USERS[1]]
    for user in USERS:  # each cluster answers its own user's token, and refuses the other's
        address = f"http://127.0.0.1:{ports[user]['dashboard_port']}/api/version"
        assert requests.get(address, headers={"Authorization": f"Bearer {tokens[user]}"}, timeout=10).ok
        other = tokens[USERS[1] if user == USERS[0] else USERS[0]]
        assert requests.get(address, headers={"Authorization": f"Bearer {other}"}, timeout=10).status_code in (401, 403)

    # A profile that fixes its ports where another's cluster runs: one line, before any node starts.
    fixed = root / "fixed.yaml"
    fixed.write_text(PROFILE.replace("name: shared", "name: fixed") + f"local:\n  port: {ports[USERS[0]]['port']}\n")
    fixed.chmod(0o644)
    refused = as_user(USERS[1], homes[USERS[1]], root, "cluster", "up", "fixed.yaml")
    assert refused.returncode == 2 and refused.stderr == (
        f"error: fixed.yaml: local.port {ports[USERS[0]]['port']}: port {ports[USERS[0]]['port']} is in use "
        "(another user's cluster, or another program): leave local's ports out to have free ones chosen\n")

    for user in USERS:
        down = as_user(user, homes[user], root, "cluster", "down", "shared.yaml")
        assert down.returncode == 0 and down.stdout.strip() == "cluster 'shared' is down (1 node stopped)", down.stderr
