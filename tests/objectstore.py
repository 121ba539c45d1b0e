"""A real S3-compatible server on loopback: moto's standalone server, with IAM checks on.

moto's server is what s3fs and others test against. Started with INITIAL_NO_AUTH_ACTION_COUNT,
it lets the first few requests through unsigned (enough to create a user, its access key and a
policy) and from then on checks every request's signature against that user's keys, so wrong
credentials are refused as a real store refuses them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import boto3

from raytrain_app.cluster.session import free_port

SETUP_ACTIONS = 3  # create_user, create_access_key, put_user_policy


@dataclass
class ObjectStore:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    @property
    def env(self) -> dict:
        """What a user exports to point raytrain-app (pyarrow) at an S3-compatible endpoint."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region}

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def keys(self, prefix: str) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for o in listed.get("Contents", [])]


def start_moto(log_path: str) -> tuple[subprocess.Popen, ObjectStore]:
    port = free_port()
    server = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_ACTIONS)})
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start (log: {log_path})") from None
            time.sleep(0.2)
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                       aws_secret_access_key="setup")
    iam.create_user(UserName="raytrain")
    key = iam.create_access_key(UserName="raytrain")["AccessKey"]
    iam.put_user_policy(UserName="raytrain", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    store = ObjectStore(endpoint, "rta-bucket", key["AccessKeyId"], key["SecretAccessKey"])
    store.client().create_bucket(Bucket=store.bucket)
    return proc, store
