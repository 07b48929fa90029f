"""An S3-compatible store on loopback for the lanes: moto's server in a process of its own (as a
real store is: its work never shares this process's GIL), a bucket in it, and fleet's
`BlobStore` over it, made the way a worker makes it (`FLEET_BLOB_URL` and the AWS_* variables
the S3 client reads)."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from bench.harness import REPO
from bench.stack import free_port, stop_group
from fleet_shared.blobs import BlobStore, open_blob_store
from fleet_shared.config import load_settings

BUCKET = "fleet-bench"
PREFIX = "fleet"


def moto_available() -> bool:
    """moto (the dev dependency group) is what serves the S3 API here."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def s3_on_loopback(log: Path) -> Iterator[str]:
    """moto's S3 server on a free loopback port, its bucket made; its endpoint URL. The server's
    process group is ended when the block ends."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=log.parent,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto's server exited with {proc.returncode}: {log.read_text()[-800:]}")
            if bucket_made(port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("moto's server never answered")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)


def bucket_made(port: int) -> bool:
    """PUT the bucket (moto takes any credentials); whether the server answered it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("PUT", f"/{BUCKET}", headers={"Host": f"127.0.0.1:{port}"})
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def aws_environment(endpoint: str) -> Iterator[dict[str, str]]:
    """The AWS_* variables a worker given `FLEET_BLOB_URL=s3://…` reads, set in this process (and
    restored after): the S3 client reads them when it is made."""
    values = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def blob_store(data_dir: Path) -> BlobStore:
    """fleet's store for `s3://BUCKET/PREFIX`, as `open_blob_store` makes it for a worker (call it
    inside `aws_environment`)."""
    env = {
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",  # read, never connected to
        "FLEET_BLOB_URL": f"s3://{BUCKET}/{PREFIX}",
    }
    settings = load_settings(env, lm_credentials=False)
    return open_blob_store(msgspec.structs.replace(settings, data_dir=data_dir))
