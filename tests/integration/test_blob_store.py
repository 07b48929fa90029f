"""The blob store on both backends. `local` is a real folder; `s3` is tested at its boundary only,
because no S3 store is reachable here: moto's S3 server on loopback stands in for the HTTP API,
and obstore (the client we ship) signs and sends real requests to it."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from moto.server import ThreadedMotoServer

from fleet_shared.blobs import BlobMissing, BlobStore, open_blob_store
from fleet_shared.config import ConfigError, Settings, load_settings
from tests.support.blob_ages import s3_client
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[2]
BUCKET = "fleet-blobs"
S3_ENV = {
    "FLEET_S3_ENDPOINT": "",
    "FLEET_S3_KEY": "test-access-key",
    "FLEET_S3_SECRET": "test-secret-key-never-logged",
}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3_client(endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def s3_settings(tmp_path: Path, endpoint: str, **blobs: object) -> Settings:
    config = tmp_path / "fleet.toml"
    table = {
        "backend": "s3",
        "s3_bucket": BUCKET,
        "s3_endpoint_env": "FLEET_S3_ENDPOINT",
        "s3_access_key_env": "FLEET_S3_KEY",
        "s3_secret_key_env": "FLEET_S3_SECRET",
        "s3_allow_http": True,
        **blobs,
    }
    lines = "\n".join(f"{k} = {msgspec.json.encode(v).decode()}" for k, v in table.items())
    base = (
        (REPO / "config" / "fleet.toml")
        .read_text()
        .replace('script = "scripts/', f'script = "{REPO}/config/scripts/')
    )
    config.write_text(base + f"\n[profiles.offline.storage.blobs]\n{lines}\n")
    env = {
        **S3_ENV,
        "FLEET_S3_ENDPOINT": endpoint,
        "FLEET_CONFIG": str(config),
        "FLEET_REDIS_URL": "redis://x",
    }
    return load_settings(env)


async def exercise(store: BlobStore, tmp_path: Path) -> None:
    data = os.urandom(700_000)  # several read chunks
    source = tmp_path / "payload.bin"
    source.write_bytes(data)
    await store.put_file_async("artifacts/a", source)
    store.put_file("attachments/b", source)
    sink = io.BytesIO()
    assert store.download("attachments/b", sink) == len(data) and sink.getvalue() == data
    whole = b"".join([chunk async for chunk in store.read_range("artifacts/a", 0, len(data))])
    assert hashlib.sha256(whole).digest() == hashlib.sha256(data).digest()
    middle = b"".join([chunk async for chunk in store.read_range("artifacts/a", 1000, 1010)])
    assert middle == data[1000:1010]
    with pytest.raises(BlobMissing):
        store.download("attachments/missing", io.BytesIO())
    with pytest.raises(BlobMissing):
        await anext(store.read_range("artifacts/missing", 0, 10))
    await store.delete("artifacts/a")
    await store.delete("artifacts/a")  # twice is fine
    with pytest.raises(BlobMissing):
        await anext(store.read_range("artifacts/a", 0, 10))


def test_local_backend_round_trip(tmp_path: Path) -> None:
    settings = load_settings(
        {"FLEET_CONFIG": str(REPO / "config" / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    )
    settings = msgspec.structs.replace(settings, data_dir=tmp_path / "data")
    store = open_blob_store(settings)
    asyncio.run(exercise(store, tmp_path))
    assert (tmp_path / "data" / "blobs" / "attachments" / "b").is_file()


def test_s3_backend_round_trip_at_the_http_boundary(tmp_path: Path, s3_endpoint: str) -> None:
    settings = s3_settings(tmp_path, s3_endpoint)
    assert "test-secret-key-never-logged" not in repr(settings) + repr(settings.blobs)
    store = open_blob_store(settings)
    assert store.description == f"s3 bucket {BUCKET}"
    asyncio.run(exercise(store, tmp_path))
    listed = s3_client(s3_endpoint).list_objects_v2(Bucket=BUCKET)
    assert [o["Key"] for o in listed["Contents"]] == ["fleet/attachments/b"]  # the prefix is kept


def test_s3_backend_config_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="s3_bucket is required"):
        s3_settings(tmp_path, "http://127.0.0.1:1", s3_bucket="")
    s3_settings(tmp_path, "http://127.0.0.1:1")  # writes a valid config file
    env = {"FLEET_CONFIG": str(tmp_path / "fleet.toml"), "FLEET_REDIS_URL": "redis://x"}
    env |= {"FLEET_S3_ENDPOINT": "http://127.0.0.1:1", "FLEET_S3_SECRET": "s"}
    with pytest.raises(ConfigError, match="FLEET_S3_KEY is not set"):
        load_settings(env)
