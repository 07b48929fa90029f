"""The chart's object store: every durable byte lives in it, so no pod keeps anything another
pod needs. The chart refuses the shapes that would keep bytes on one pod's disk, points every
gateway, worker and the doctor at the store (credentials by reference only), and gives a dev
cluster a MinIO of its own."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import (
    DAYTONA,
    DEV,
    KEDA,
    MINIMAL,
    NO_BLOB_STORE,
    PRIVILEGED,
    Manifest,
    containers,
    egress_ports,
    env_of,
    find,
    notes,
    pod_spec,
    render,
    render_error,
)

pytestmark = pytest.mark.deploy

LOCAL_PROFILE = (
    '[config]\ndefault_profile = "p"\n[profiles.p.llm.root]\nmodel = "scripted/x"\n'
    '[profiles.p.storage.blobs]\nbackend = "local"\n'
)
# Each way of naming the fix, all in the one line the refusal prints.
FIXES = (
    "set blobStore.url=s3://<bucket>",
    "dev.minio.enabled=true for a dev cluster",
    "dataVolume.existingClaim to a ReadWriteMany PVC",
)


def refusal_line(error: str) -> str:
    """The one line of helm's error that holds the chart's message."""
    (line,) = [line for line in error.splitlines() if "execution error" in line]
    return line


def fleet_env(manifests: list[Manifest]) -> dict[str, dict[str, dict[str, Any]]]:
    """The env of the gateway, the worker, the doctor and the migration, by component."""
    return {
        "gateway": env_of(next(containers(find(manifests, "Deployment", "gateway")))),
        "worker": env_of(next(containers(find(manifests, "Deployment", "worker")))),
        "doctor": env_of(next(containers(find(manifests, "Pod", "doctor")))),
        "migrate": env_of(pod_spec(next(m for m in manifests if m["kind"] == "Job"))["containers"][0]),
    }


def values_of(env: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: entry.get("value", entry.get("valueFrom")) for name, entry in env.items()}


def store_env(env: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The variables that choose the object store and reach it."""
    return {
        name: value
        for name, value in values_of(env).items()
        if name == "FLEET_BLOB_URL" or name.startswith("AWS_")
    }


@pytest.mark.parametrize(
    ("values", "settings", "where"),
    [
        (MINIMAL, NO_BLOB_STORE, 'profile "offline", storage.blobs.backend = "local"'),
        (
            MINIMAL,
            {**NO_BLOB_STORE, "gateway.replicas": 1, "worker.replicas": 1},
            'profile "offline"',
        ),
        (
            MINIMAL,
            {**NO_BLOB_STORE, "config.fleetToml": LOCAL_PROFILE, "config.profile": "p"},
            'profile "p", storage.blobs.backend = "local"',
        ),
        (MINIMAL, {**NO_BLOB_STORE, "blobStore.url": "file:///app/.fleet/blobs"}, "blobStore.url=file:///"),
        (DAYTONA, {"blobStore.url": "", "blobStore.region": ""}, 'profile "daytona-recursive"'),
        (KEDA, {"dataVolume.existingClaim": ""}, 'profile "local"'),
        (DEV, {"dev.minio.enabled": False}, 'profile "offline"'),
    ],
    ids=["minimal", "one-gateway-one-worker", "explicit-local", "file-url", "daytona", "keda", "dev"],
)
def test_the_local_backend_without_a_shared_claim_is_refused(
    values: Path, settings: dict[str, object], where: str
) -> None:
    """One gateway and one worker are already two pods, each with its own emptyDir: an
    attachment one stores and a workspace the other writes would be invisible to the other."""
    line = refusal_line(render_error(values, settings=settings))
    assert "the local blob backend" in line and where in line, line
    for fix in FIXES:
        assert fix in line, line


def test_the_local_backend_on_a_shared_claim_renders() -> None:
    """A ReadWriteMany claim that every pod mounts is the one shape where local bytes survive."""
    manifests = render(KEDA)
    for component in ("gateway", "worker"):
        volumes = pod_spec(find(manifests, "Deployment", component))["volumes"]
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "fleet-data"}} in volumes
        assert "FLEET_BLOB_URL" not in env_of(next(containers(find(manifests, "Deployment", component))))
    shared = {
        **NO_BLOB_STORE,
        "blobStore.url": "file:///app/.fleet/blobs",
        "dataVolume.existingClaim": "fleet-data",
    }
    env = fleet_env(render(MINIMAL, settings=shared))
    for component in ("gateway", "worker", "doctor"):
        assert store_env(env[component]) == {"FLEET_BLOB_URL": "file:///app/.fleet/blobs"}, component
    assert not store_env(env["migrate"])


def test_a_folder_outside_the_shared_volume_is_refused() -> None:
    settings = {**NO_BLOB_STORE, "dataVolume.existingClaim": "fleet-data"}
    for url in ("file:///var/blobs", "file:///app/.fleet/../blobs", "file:///app/.fleetx"):
        error = render_error(MINIMAL, settings={**settings, "blobStore.url": url})
        assert f"blobStore.url {url} is outside dataVolume.mountPath (/app/.fleet)" in error


def test_minimal_points_every_pod_at_the_bucket_with_keys_by_reference() -> None:
    env = fleet_env(render(MINIMAL))
    for component in ("gateway", "worker", "doctor"):
        assert store_env(env[component]) == {
            "FLEET_BLOB_URL": "s3://fleet-blobs",
            "AWS_ACCESS_KEY_ID": {"secretKeyRef": {"name": "fleet-credentials", "key": "blob-access-key"}},
            "AWS_SECRET_ACCESS_KEY": {
                "secretKeyRef": {"name": "fleet-credentials", "key": "blob-secret-key"}
            },
        }, component
    assert not store_env(env["migrate"])


def test_endpoint_region_and_plain_http_reach_the_pods_and_the_network_policy() -> None:
    """A MinIO of the cluster's own on http://minio.storage.svc:9000: its port is let out
    without networkPolicy.egress.s3 having to repeat it."""
    manifests = render(PRIVILEGED)
    worker = values_of(fleet_env(manifests)["worker"])
    assert worker["FLEET_BLOB_URL"] == "s3://fleet/prod"
    assert worker["AWS_ENDPOINT_URL"] == "http://minio.storage.svc:9000"
    assert worker["AWS_ALLOW_HTTP"] == "true"
    assert worker["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "fleet-minio", "key": "secret-key"}}
    assert "AWS_REGION" not in worker
    assert gateway_store_ports(manifests) == {443, 9000}
    for component in ("worker", "doctor"):
        assert 9000 in egress_ports(find(manifests, "NetworkPolicy", component)), component
    assert 9000 not in egress_ports(find(manifests, "NetworkPolicy", "migrate"))
    for endpoint, ports in (("https://storage.googleapis.com", {443}), ("http://rgw.ceph", {443, 80})):
        assert gateway_store_ports(render(PRIVILEGED, settings={"blobStore.endpoint": endpoint})) == ports


def gateway_store_ports(manifests: list[Manifest]) -> set[int]:
    """The ports of the gateway's egress rule to the store: its one rule with port 443, since
    gateways call no LM."""
    rules = find(manifests, "NetworkPolicy", "gateway")["spec"]["egress"]
    (ports,) = [
        {p["port"] for p in rule["ports"]}
        for rule in rules
        if {"port": 443, "protocol": "TCP"} in rule["ports"]
    ]
    return ports


def test_the_pod_identity_needs_no_keys() -> None:
    """AWS S3 with IRSA: no AWS_ACCESS_KEY_ID, so the client takes the pod's web identity."""
    env = values_of(fleet_env(render(DAYTONA))["worker"])
    assert env["FLEET_BLOB_URL"] == "s3://fleet-prod/daytona"
    assert env["AWS_REGION"] == "eu-west-1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} & set(env)


@pytest.mark.parametrize(
    ("values", "settings", "message"),
    [
        (
            MINIMAL,
            {"blobStore.url": ""},
            "secrets.blobAccessKey.key, secrets.blobSecretKey.key configure an s3 store: "
            "set blobStore.url=s3://<bucket>[/<prefix>]",
        ),
        (
            MINIMAL,
            {"blobStore.url": "file:///app/.fleet/b", "blobStore.endpoint": "http://m:9000"},
            "blobStore.endpoint, secrets.blobAccessKey.key",
        ),
        (
            MINIMAL,
            {"secrets.blobSecretKey.key": ""},
            "set both secrets.blobAccessKey.key and secrets.blobSecretKey.key",
        ),
        (
            DAYTONA,
            {"secrets.blobAccessKey.key": "a", "secrets.blobSecretKey.key": "b"},
            "secrets.blobAccessKey.key: set secrets.existingSecret or secrets.blobAccessKey.name",
        ),
        (
            DEV,
            {"blobStore.url": "s3://elsewhere", "blobStore.region": "eu-west-1"},
            "dev.minio.enabled points every pod at the release's own MinIO: "
            "unset blobStore.url, blobStore.region",
        ),
        (MINIMAL, {"blobStore.url": "https://bucket.s3.amazonaws.com"}, "/blobStore/url"),
        (MINIMAL, {"blobStore.url": "s3://"}, "/blobStore/url"),
        (MINIMAL, {"blobStore.endpoint": "https://key:secret@minio:9000"}, "/blobStore/endpoint"),
        (MINIMAL, {"blobStore.prefix": "x"}, "additional properties 'prefix' not allowed"),
        (DEV, {"dev.minio.bucket": "Fleet_Bucket"}, "/dev/minio/bucket"),
    ],
    ids=["keys-without-url", "keys-with-file-url", "one-key", "key-without-secret", "dev-and-url",
         "http-url", "no-bucket", "endpoint-credentials", "unknown-key", "bad-bucket"],
)  # fmt: skip
def test_store_values_that_cannot_work_are_refused(
    values: Path, settings: dict[str, object], message: str
) -> None:
    assert message in render_error(values, settings=settings)


def minio(manifests: list[Manifest]) -> dict[str, Any]:
    (container,) = pod_spec(find(manifests, "Deployment", "minio"))["containers"]
    return container


def test_dev_minio_is_the_store_every_pod_points_at() -> None:
    manifests = render(DEV)
    server = minio(manifests)
    assert server["image"] == "quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z"
    assert server["command"][:3] == ["minio", "server", "/data"]
    service = find(manifests, "Service", "minio")
    assert service["spec"]["ports"] == [{"name": "s3", "port": 9000, "targetPort": "s3", "protocol": "TCP"}]
    env = fleet_env(manifests)
    for component in ("gateway", "worker", "doctor"):
        assert store_env(env[component]) == {
            "FLEET_BLOB_URL": "s3://fleet",
            "AWS_ENDPOINT_URL": "http://t-fleet-minio:9000",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
            # The bucket is open to the release's pods, as the dev PostgreSQL trusts them.
            "AWS_SKIP_SIGNATURE": "true",
        }, component
    assert not store_env(env["migrate"])
    other = render(DEV, settings={"dev.minio.bucket": "other"})
    assert values_of(fleet_env(other)["worker"])["FLEET_BLOB_URL"] == "s3://other"
    assert values_of(env_of(minio(other)))["BUCKET"] == "other"


def test_dev_minio_is_reachable_from_the_release_pods_only() -> None:
    manifests = render(DEV)
    peer = {
        "app.kubernetes.io/name": "fleet",
        "app.kubernetes.io/instance": "t",
        "app.kubernetes.io/component": "minio",
    }
    for component in ("gateway", "worker", "doctor"):
        rules = find(manifests, "NetworkPolicy", component)["spec"]["egress"]
        assert {
            "to": [{"podSelector": {"matchLabels": peer}}],
            "ports": [{"port": 9000, "protocol": "TCP"}],
        } in rules
    assert 9000 not in egress_ports(find(manifests, "NetworkPolicy", "migrate"))
    own = find(manifests, "NetworkPolicy", "minio")["spec"]
    assert own["podSelector"]["matchLabels"] == peer
    (ingress,) = own["ingress"]
    assert ingress["from"] == [
        {
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "fleet", "app.kubernetes.io/instance": "t"}
            }
        }
    ]
    assert ingress["ports"] == [{"port": 9000, "protocol": "TCP"}]
    assert own["egress"] == []


def test_dev_minio_root_credentials_are_drawn_per_start_and_never_rendered(tmp_path: Path) -> None:
    """MinIO needs root credentials to create its bucket; they are drawn at each pod start into a
    file MinIO reads (MINIO_CONFIG_ENV_FILE), so no manifest holds one. The init container's
    script, run here with sh and coreutils, writes a file MinIO's parser accepts."""
    manifests = render(DEV)
    deployment = find(manifests, "Deployment", "minio")
    (init,) = pod_spec(deployment)["initContainers"]
    text = "\n".join(str(entry) for container in containers(deployment) for entry in container.get("env", []))
    assert "MINIO_ROOT_PASSWORD" not in text and "MINIO_ROOT_USER" not in text
    drawn = []
    for attempt in range(2):
        config = tmp_path / f"config-{attempt}.env"
        environment = {"PATH": os.environ["PATH"], "MINIO_CONFIG_ENV_FILE": str(config)}
        subprocess.run(init["command"], env=environment, check=True, timeout=30)
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        lines = config.read_text().splitlines()
        assert lines[0] == "MINIO_ROOT_USER=fleet-dev"
        assert re.fullmatch(r"MINIO_ROOT_PASSWORD=[0-9a-f]{64}", lines[1]), lines
        drawn.append(lines[1])
    assert drawn[0] != drawn[1]
    bucket_script = minio(manifests)["lifecycle"]["postStart"]["exec"]["command"]
    assert bucket_script[:2] == ["sh", "-ec"]
    subprocess.run(["sh", "-n", "-c", bucket_script[2]], check=True, timeout=30)  # it parses
    assert 'mc mb --ignore-existing "local/$BUCKET"' in bucket_script[2]
    assert 'mc anonymous set public "local/$BUCKET"' in bucket_script[2]


def test_notes_say_where_the_bytes_live() -> None:
    assert "Object store: s3://fleet-blobs; each pod's /app/.fleet is scratch." in notes(MINIMAL)
    dev = notes(DEV)
    assert "Object store: the dev MinIO, s3://fleet (http://t-fleet-minio:9000)" in dev
    assert "dev Redis/PostgreSQL/MinIO keep nothing across restarts" in dev
    assert "the local backend on the claim fleet-data" in notes(KEDA)
