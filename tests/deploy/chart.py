"""The Helm chart, driven like an operator drives it: `helm lint` and `helm template` with the CI
values files (charts/fleet/ci/*-values.yaml), the rendered manifests parsed into dicts, and small
lookups over them. helm itself comes from .ci/tools.sh (a static binary in .tools/bin/).

Without helm the chart tests skip, unless FLEET_REQUIRE_DEPLOY_TOOLS=1 (CI), where a missing
tool is a failure: a skipped check must never look like a passing one.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fleet"
VALUES_DIR = CHART / "ci"
CHECKOV_CONFIG = VALUES_DIR / "checkov.yaml"
CHECKOV_SPEC = "checkov==3.2.533"  # keep equal to CHECKOV_SPEC in .ci/tools.sh
RELEASE = "t"
NAMESPACE = "fleet"
HELM_TIMEOUT_SECONDS = 60

Manifest = dict[str, Any]

# Settings that take minimal-values' S3 bucket away, leaving the profile's storage.blobs to
# choose the store.
NO_BLOB_STORE = {"blobStore.url": "", "secrets.blobAccessKey.key": "", "secrets.blobSecretKey.key": ""}


def values_files() -> list[Path]:
    """Every CI values file: each is linted, rendered, validated and scanned."""
    return sorted(VALUES_DIR.glob("*-values.yaml"))


def values_file(name: str) -> Path:
    return VALUES_DIR / f"{name}-values.yaml"


MINIMAL = values_file("minimal")
DEV = values_file("dev")
KEDA = values_file("keda")
DAYTONA = values_file("daytona")
PRIVILEGED = values_file("privileged")


def require_tool(name: str, path: str | None) -> str:
    """The tool's path; a missing tool skips the test, or fails it when CI requires the tools."""
    if path:
        return path
    message = f"{name} is not installed: run `bash .ci/tools.sh`"
    if os.environ.get("FLEET_REQUIRE_DEPLOY_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def helm() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    return require_tool("helm", str(local) if local.is_file() else shutil.which("helm"))


def uvx() -> str:
    return require_tool("uvx", shutil.which("uvx"))


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_SECONDS, check=False
    )


def template_args(
    values: tuple[Path, ...], settings: tuple[str, ...], release: str, chart: Path = CHART
) -> list[str]:
    args = ["template", release, str(chart), "--namespace", NAMESPACE]
    for path in values:
        args += ["--values", str(path)]
    for setting in settings:
        args += ["--set", setting]
    return args


@functools.cache
def rendered_text(values: tuple[Path, ...], settings: tuple[str, ...] = (), release: str = RELEASE) -> str:
    """`helm template` output; the chart suite renders the same inputs often, so it is cached."""
    result = run_helm(*template_args(values, settings, release))
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return result.stdout


def render(
    *values: Path, settings: Mapping[str, object] | None = None, release: str = RELEASE
) -> list[Manifest]:
    """The manifests `helm template` renders (hooks and test pods included)."""
    flat = tuple(f"{key}={value}" for key, value in (settings or {}).items())
    text = rendered_text(tuple(values), flat, release)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_error(*values: Path, settings: Mapping[str, object] | None = None) -> str:
    """helm's error when rendering must fail; asserts that it does."""
    flat = tuple(f"{key}={value}" for key, value in (settings or {}).items())
    result = run_helm(*template_args(tuple(values), flat, RELEASE))
    assert result.returncode != 0, "helm template succeeded, expected it to refuse these values"
    return result.stderr


# A ConfigMap that renders the chart's NOTES.txt (copied beside Chart.yaml) with `tpl`, so that
# `helm template` shows the notes, for any --kube-version (`helm install` has no such flag).
NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes
data:
  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}
"""


@functools.cache
def notes_text(values: tuple[Path, ...], settings: tuple[str, ...], kube_version: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        chart = Path(folder) / "fleet"
        shutil.copytree(CHART, chart)
        shutil.copy(CHART / "templates" / "NOTES.txt", chart / "notes.txt")
        (chart / "templates" / "notes-probe.yaml").write_text(NOTES_PROBE)
        args = template_args(values, settings, RELEASE, chart)
        result = run_helm(*args, "--kube-version", kube_version, "--show-only", "templates/notes-probe.yaml")
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    text: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return text


def notes(*values: Path, settings: Mapping[str, object] | None = None, kube_version: str = "1.35.0") -> str:
    """The install notes (NOTES.txt) for these values on a cluster of that Kubernetes version."""
    flat = tuple(f"{key}={value}" for key, value in (settings or {}).items())
    return notes_text(tuple(values), flat, kube_version)


def find(manifests: list[Manifest], kind: str, suffix: str) -> Manifest:
    """The one manifest of that kind named `<release>-fleet-<suffix>` (`<release>-fleet` for "")."""
    name = f"{RELEASE}-fleet-{suffix}" if suffix else f"{RELEASE}-fleet"
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def kinds(manifests: list[Manifest]) -> set[str]:
    return {manifest["kind"] for manifest in manifests}


def pod_spec(manifest: Manifest) -> dict[str, Any]:
    """The pod spec of a Deployment, a Job or a Pod."""
    if manifest["kind"] == "Pod":
        spec: dict[str, Any] = manifest["spec"]
        return spec
    template: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return template


def containers(manifest: Manifest) -> Iterator[dict[str, Any]]:
    spec = pod_spec(manifest)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def workloads(manifests: list[Manifest]) -> Iterator[Manifest]:
    for manifest in manifests:
        if manifest["kind"] in ("Deployment", "Job", "Pod"):
            yield manifest


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env by variable name."""
    return {entry["name"]: entry for entry in container.get("env", [])}


def egress_ports(policy: Manifest) -> set[int]:
    """Every port a NetworkPolicy lets out to."""
    return {port["port"] for rule in policy["spec"]["egress"] for port in rule["ports"]}


def hook_of(manifest: Manifest) -> str | None:
    annotations: dict[str, str] = manifest["metadata"].get("annotations") or {}
    return annotations.get("helm.sh/hook")
