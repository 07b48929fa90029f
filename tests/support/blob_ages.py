"""Blob stores for gc tests on both backends, with a way to make an object old.

gc removes only objects older than its grace period; a test cannot wait an hour, so it moves an
object's last-modified time back: a file's mtime (the `local` backend), or the key's time in
moto's own in-process backend (the `s3` backend, served by moto's ThreadedMotoServer on
loopback; S3 itself never lets a client set it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import ThreadedMotoServer
from obstore.store import LocalStore, S3Store

from fleet_shared.blobs import BlobStore
from tests.support.servers import free_port

AGE = timedelta(hours=2)
S3_PREFIX = "fleet"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}


def moto_server() -> Iterator[str]:
    """moto's S3 API on a loopback port, for a fixture to yield: its endpoint."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@dataclass
class Store:
    """One backend's store, seen as fleet sees it (`blobs`) and from outside (keys, ages)."""

    blobs: BlobStore
    folder: Path | None = None  # local
    client: Any = None  # s3: boto3
    bucket: str = ""

    def keys(self) -> set[str]:
        if self.folder is not None:
            return {str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file()}
        found: set[str] = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            found.update(item["Key"][len(S3_PREFIX) + 1 :] for item in page.get("Contents", []))
        return found

    def age(self, *keys: str) -> None:
        """Make these objects look last put well over an hour ago."""
        then = datetime.now(UTC) - AGE
        for key in keys:
            if self.folder is not None:
                os.utime(self.folder / key, (then.timestamp(), then.timestamp()))
            else:
                bucket = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets[self.bucket]
                bucket.keys[f"{S3_PREFIX}/{key}"].last_modified = then.replace(tzinfo=None)


def local_store(folder: Path) -> Store:
    folder.mkdir(parents=True, exist_ok=True)
    return Store(BlobStore(LocalStore(prefix=folder, mkdir=True), "local", folder), folder=folder)


def s3_client(endpoint: str) -> Any:
    """boto3, to look at a bucket from outside (moto accepts any credentials)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )


def s3_store(endpoint: str, bucket: str) -> Store:
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    config = {
        "endpoint": endpoint,
        "region": "us-east-1",
        "access_key_id": "test",
        "secret_access_key": "test",
    }
    store = S3Store(bucket, prefix=S3_PREFIX, config=config, client_options={"allow_http": True})  # type: ignore[arg-type]
    return Store(BlobStore(store, f"s3 bucket {bucket}"), client=client, bucket=bucket)
