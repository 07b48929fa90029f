"""A private S3-compatible server for tests that run fleet as pods: moto's server as a process of
its own on a free loopback port (no S3 store is reachable here), with one bucket.

fleet reaches it the way a deployment reaches its store: `FLEET_BLOB_URL=s3://<bucket>/<prefix>`
and the standard AWS_* variables (`env()`).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3

from tests.support.servers import _port_open, _tail, free_port

START_SECONDS = 30.0


class S3Server:
    def __init__(self, bucket: str = "fleet") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fleet-s3-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        log = self.dir / "moto.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=open(log, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_SECONDS
        while not _port_open(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's S3 server did not start:\n{_tail(log)}")
            time.sleep(0.05)
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self) -> Any:
        """boto3, to look at the bucket from outside (moto accepts any credentials)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    def env(self, prefix: str = "fleet") -> dict[str, str]:
        """What a fleet process needs to use the bucket as its store."""
        return {
            "FLEET_BLOB_URL": f"s3://{self.bucket}/{prefix}",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
