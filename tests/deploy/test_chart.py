"""The chart as CI checks it: helm lint --strict, helm template, kubernetes-validate --strict on
every rendered manifest, checkov with each skip justified, the schema and the rules rendering
enforces (secret references, the API token, the sandbox mode), and the shipped fleet.toml."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    CHECKOV_CONFIG,
    CHECKOV_SPEC,
    MINIMAL,
    REPO,
    Manifest,
    containers,
    env_of,
    find,
    hook_of,
    kinds,
    notes,
    render,
    render_error,
    run_helm,
    uvx,
    values_file,
    values_files,
    workloads,
)

pytestmark = pytest.mark.deploy

# Custom resources: kubernetes-validate has no schema for them; test_custom_resources_shape
# checks the fields KEDA and the Prometheus Operator read instead.
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: appArmorProfile, the preStop
# sleep action) and kubernetes-validate's newest.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")


def test_ci_values_files_cover_the_required_scenarios() -> None:
    names = {path.name.removesuffix("-values.yaml") for path in values_files()}
    assert {"minimal", "keda", "dev"} <= names


@pytest.mark.parametrize("values", values_files(), ids=lambda path: path.stem)
def test_helm_lint_strict(values: Path) -> None:
    result = run_helm("lint", "--strict", str(CHART), "--values", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_shipped_config_is_the_repository_config() -> None:
    shipped = (CHART / "files" / "fleet.toml").read_bytes()
    assert shipped == (REPO / "config" / "fleet.toml").read_bytes(), (
        "charts/fleet/files/fleet.toml differs from config/fleet.toml: copy it again"
    )


def test_config_map_holds_the_file_and_values_may_replace_it() -> None:
    config = find(render(MINIMAL), "ConfigMap", "config")
    assert config["data"]["fleet.toml"] == (REPO / "config" / "fleet.toml").read_text().rstrip("\n")
    custom = '[config]\ndefault_profile = "p"\n[profiles.p.llm.root]\nmodel = "scripted/x"\n'
    replaced = render(MINIMAL, settings={"config.fleetToml": custom, "config.profile": "p"})
    assert find(replaced, "ConfigMap", "config")["data"]["fleet.toml"] == custom.rstrip("\n")


def write_manifests(manifests: list[Manifest], folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(manifests, sort_keys=False))
    return path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_pass_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    files = []
    for values in values_files():
        manifests = [m for m in render(values) if m["kind"] not in CUSTOM_KINDS]
        files.append(str(write_manifests(manifests, tmp_path, values.stem)))
    validator = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run(
        [str(validator), "--strict", "--quiet", "-k", version, *files],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_strict_catches_an_unknown_field(tmp_path: Path) -> None:
    """The check above can fail: strict mode refuses a field the API does not have."""
    deployment = find(render(MINIMAL), "Deployment", "gateway")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["bogus"] = 1
    path = write_manifests([deployment], tmp_path, "bad")
    validator = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run(
        [str(validator), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0


def test_custom_resources_shape() -> None:
    manifests = render(values_file("keda"))
    scaled = find(manifests, "ScaledObject", "worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "t-fleet-worker",
    }
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == (
        'max(fleet_queue_depth{queue="fleet:queue",namespace="fleet"})'
        ' + max(fleet_queue_in_progress{queue="fleet:queue",namespace="fleet"})'
    )
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert all(isinstance(value, str) for value in trigger["metadata"].values()), "KEDA metadata is strings"
    monitor = find(manifests, "ServiceMonitor", "")  # named after the release alone
    ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
    assert ports == {"http", "metrics"}
    service_ports = {port["name"] for m in manifests if m["kind"] == "Service" for port in m["spec"]["ports"]}
    assert ports <= service_ports


def checkov_summary(folder: Path) -> list[dict[str, object]]:
    """checkov on `folder`, offline: uv runs it from the cache .ci/tools.sh warmed (`--offline`
    asks no index), and `--skip-download` keeps checkov from fetching its guidelines from Prisma
    Cloud (without it, every run asks api0.prismacloud.io)."""
    result = subprocess.run(
        [uvx(), "--offline", "--quiet", "--from", CHECKOV_SPEC, "checkov", "--skip-download",
         "--config-file", str(CHECKOV_CONFIG), "--directory", str(folder), "--output", "json"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if not result.stdout.strip():
        pytest.fail(
            f"checkov did not run (`bash .ci/tools.sh` warms it in uv's cache):\n{result.stderr[-2000:]}"
        )
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def test_checkov_passes_on_every_rendered_manifest(tmp_path: Path) -> None:
    for values in values_files():
        write_manifests(render(values), tmp_path, values.stem)
    reports = checkov_summary(tmp_path)
    failed = [
        f"{check['check_id']} {check['resource']} ({check['file_path']})"
        for report in reports
        for check in report["results"]["failed_checks"]  # type: ignore[index]
    ]
    assert not failed, "checkov failures:\n" + "\n".join(failed)
    assert all(report["summary"]["parsing_errors"] == 0 for report in reports)  # type: ignore[index]
    assert sum(report["summary"]["passed"] for report in reports) > 1000  # type: ignore[index]


def test_every_checkov_skip_is_justified() -> None:
    lines = CHECKOV_CONFIG.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"\s*- CKV", line):
            assert lines[number - 1].lstrip().startswith("#"), f"skip without a reason: {line.strip()}"
    inline = re.findall(r"checkov\.io/skip\d+: \"(CKV\w+)=([^\"]*)\"", all_template_text())
    assert inline, "the mode-specific skips are annotations in the templates"
    assert all(len(reason) > 20 for _check, reason in inline)


def all_template_text() -> str:
    return "\n".join(path.read_text() for path in sorted((CHART / "templates").rglob("*")) if path.is_file())


def test_no_secret_is_created_and_secret_env_is_by_reference() -> None:
    for values in values_files():
        manifests = render(values)
        assert "Secret" not in kinds(manifests), values.name
        dev = "dev" in values.name
        for workload in workloads(manifests):
            for container in containers(workload):
                for entry in container.get("env", []):
                    secret_like = re.search(r"KEY|TOKEN|PASSWORD|SECRET", entry["name"])
                    url = entry["name"] in ("FLEET_DATABASE_URL", "FLEET_REDIS_URL") and not dev
                    if secret_like or url:
                        assert set(entry) == {"name", "valueFrom"}, entry
                        assert set(entry["valueFrom"]) == {"secretKeyRef"}, entry
                    # No URL in plain sight carries a password (user:password@host).
                    assert not re.search(r"://[^/@\s]*:[^/@\s]*@", entry.get("value", "")), entry


def test_dev_urls_carry_no_password() -> None:
    """The dev services take no credential: PostgreSQL trusts the release's pods, Redis has no
    password, and the dev MinIO's bucket takes unsigned requests; their NetworkPolicies let only
    the release's pods in."""
    manifests = render(values_file("dev"))
    env = env_of(next(containers(find(manifests, "Deployment", "worker"))))
    assert env["FLEET_DATABASE_URL"]["value"] == "postgresql+asyncpg://fleet@t-fleet-postgresql:5432/fleet"
    assert env["FLEET_REDIS_URL"]["value"] == "redis://t-fleet-redis:6379/0"
    assert env["FLEET_BLOB_URL"]["value"] == "s3://fleet"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://t-fleet-minio:9000"
    assert env["AWS_SKIP_SIGNATURE"]["value"] == "true"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"worker.sandbox.mode": "chroot"}, "/worker/sandbox/mode"),
        ({"gateway.replicas": -1}, "/gateway/replicas"),
        ({"gateway.unknownKey": 1}, "additional properties 'unknownKey' not allowed"),
        ({"gateway.readinessPath": "/metrics"}, "/gateway/readinessPath"),
        ({"lm.baseUrl": "ftp://x"}, "/lm/baseUrl"),
        ({"lm.baseUrl": "https://user:secret@lm.internal/v1"}, "/lm/baseUrl"),
        ({"secrets.apiToken.key": "has space"}, "/secrets/apiToken/key"),
        ({"dataVolume.emptyDirSizeLimit": "2GB"}, "/dataVolume/emptyDirSizeLimit"),
        ({"gateway.pdb.maxUnavailable": 0}, "/gateway/pdb/maxUnavailable"),
        ({"worker.pdb.maxUnavailable": "0%"}, "/worker/pdb/maxUnavailable"),
        ({"worker.sandbox.seccompProfile.type": "Localhost"}, "localhostProfile"),
        ({"worker.sandbox.appArmorProfile.type": "Localhost"}, "localhostProfile"),
        ({"dev.postgresql.image.tag": ""}, "/dev/postgresql/image/tag"),
    ],
)
def test_schema_rejects_bad_values(settings: dict[str, object], message: str) -> None:
    assert message in render_error(MINIMAL, settings=settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"dataVolume.emptyDirSizeLimit": "2G"},
        {"dataVolume.emptyDirSizeLimit": "500M"},
        {"dataVolume.emptyDirSizeLimit": "2Gi"},
        {"gateway.pdb.maxUnavailable": "25%", "worker.pdb.maxUnavailable": 2},
        {
            "worker.sandbox.seccompProfile.type": "Localhost",
            "worker.sandbox.seccompProfile.localhostProfile": "p.json",
        },
        {"lm.baseUrl": "https://lm.internal:8443/v1?tenant=a@b"},
    ],
    ids=["2G", "500M", "2Gi", "pdb", "localhost-seccomp", "url-with-at-in-query"],
)
def test_schema_accepts_kubernetes_forms(settings: dict[str, object]) -> None:
    assert render(MINIMAL, settings=settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"secrets.existingSecret": ""}, "FLEET_DATABASE_URL: set secrets.existingSecret"),
        ({"secrets.redisUrl.key": ""}, "FLEET_REDIS_URL: set secrets.existingSecret"),
        (
            {"config.profile": "local"},
            'profile "local" reads FLEET_LM_MODEL (llm.root.model_env): set lm.model',
        ),
        (
            {"config.profile": "local", "lm.model": "m", "lm.baseUrl": "http://lm"},
            "reads FLEET_LM_API_KEY (llm.root.api_key_env): set secrets.lmApiKey.key",
        ),
        ({"config.profile": "nope"}, 'config.profile "nope" is not a profile of fleet.toml'),
        ({"config.fleetToml": "x = ["}, "config.fleetToml is not valid TOML"),
        ({"worker.sandbox.mode": "daytona"}, 'worker.sandbox.mode=daytona but profile "offline"'),
        ({"keda.enabled": True}, "keda.enabled=true needs keda.serverAddress"),
        ({"worker.replicas": 0}, "worker.replicas=0 with gateway.readinessPath=/ready"),
        (
            {
                "gateway.autoscaling.enabled": True,
                "gateway.autoscaling.minReplicas": 5,
                "gateway.autoscaling.maxReplicas": 3,
            },
            "gateway.autoscaling.minReplicas (5) is above gateway.autoscaling.maxReplicas (3)",
        ),
        (
            {
                "worker.autoscaling.enabled": True,
                "worker.autoscaling.minReplicas": 4,
                "worker.autoscaling.maxReplicas": 2,
            },
            "worker.autoscaling.minReplicas (4) is above worker.autoscaling.maxReplicas (2)",
        ),
        (
            {
                "keda.enabled": True,
                "keda.serverAddress": "http://p:9090",
                "keda.minReplicas": 9,
                "keda.maxReplicas": 3,
            },
            "keda.minReplicas (9) is above keda.maxReplicas (3)",
        ),
    ],
)
def test_rendering_refuses_incomplete_values(settings: dict[str, object], message: str) -> None:
    assert message in render_error(MINIMAL, settings=settings)


def test_the_api_token_rule() -> None:
    """Off loopback the gateway refuses to start without a token, so the chart refuses too,
    unless gateway.allowUnauthenticated, which passes --allow-unauthenticated."""
    error = render_error(MINIMAL, settings={"secrets.apiToken.key": ""})
    assert "gateway refuses to serve off loopback without FLEET_API_TOKEN" in error
    open_gateway = render(
        MINIMAL, settings={"secrets.apiToken.key": "", "gateway.allowUnauthenticated": True}
    )
    container = find(open_gateway, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "--allow-unauthenticated" in container["args"]
    assert "FLEET_API_TOKEN" not in {entry["name"] for entry in container["env"]}
    guarded = find(render(MINIMAL), "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "--allow-unauthenticated" not in guarded["args"]
    token = next(entry for entry in guarded["env"] if entry["name"] == "FLEET_API_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "fleet-credentials", "key": "api-token"}


def test_the_auth_modes_take_their_credentials_from_values_and_secrets() -> None:
    """tokens: the file comes from a Secret, mounted read-only and named by
    FLEET_AUTH_TOKENS_FILE; jwt: the provider from values, and the gateway may reach it."""
    no_token = {"secrets.apiToken.key": ""}
    error = render_error(MINIMAL, settings={**no_token, "gateway.auth.mode": "tokens"})
    assert "gateway.auth.mode=tokens reads a tokens file: set secrets.tokensFile.key" in error
    tokens = render(
        MINIMAL, settings={**no_token, "gateway.auth.mode": "tokens", "secrets.tokensFile.key": "tok"}
    )
    pod = find(tokens, "Deployment", "gateway")["spec"]["template"]["spec"]
    env = {entry["name"]: entry.get("value") for entry in pod["containers"][0]["env"]}
    assert (
        env["FLEET_AUTH_MODE"] == "tokens" and env["FLEET_AUTH_TOKENS_FILE"] == "/etc/fleet/auth/tokens.toml"
    )
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "auth-tokens")
    assert mount == {"name": "auth-tokens", "mountPath": "/etc/fleet/auth", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "auth-tokens")
    assert volume["secret"] == {
        "secretName": "fleet-credentials",
        "items": [{"key": "tok", "path": "tokens.toml"}],
    }
    worker = find(tokens, "Deployment", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert not {"FLEET_AUTH_MODE", "FLEET_AUTH_TOKENS_FILE"} & {entry["name"] for entry in worker["env"]}

    jwt = {**no_token, "gateway.auth.mode": "jwt", "networkPolicy.enabled": True}
    assert "gateway.auth.mode=jwt needs the provider" in render_error(MINIMAL, settings=jwt)
    provider = {
        "gateway.auth.jwt.jwksUrl": "https://login.example/keys",
        "gateway.auth.jwt.issuer": "https://login.example/",
        "gateway.auth.jwt.audience": "api://fleet",
    }
    rendered = render(MINIMAL, settings={**jwt, **provider})
    gateway = find(rendered, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {entry["name"]: entry.get("value") for entry in gateway["env"]}
    assert (
        env["FLEET_AUTH_JWKS_URL"] == "https://login.example/keys"
        and env["FLEET_AUTH_JWT_AUDIENCE"] == "api://fleet"
    )

    def https_rules(values: dict[str, object]) -> int:
        egress = find(render(MINIMAL, settings=values), "NetworkPolicy", "gateway")["spec"]["egress"]
        return sum({"port": 443, "protocol": "TCP"} in rule.get("ports", []) for rule in egress)

    assert https_rules({**jwt, **provider}) == https_rules({"networkPolicy.enabled": True}) + 1  # the JWKS


def test_the_webhook_secret_goes_to_gateways_and_workers_and_opens_the_gateways_https_egress() -> None:
    hooks = {"secrets.webhookSecret.key": "webhook-secret", "networkPolicy.enabled": True}
    rendered = render(MINIMAL, settings=hooks)
    for component in ("gateway", "worker"):
        container = find(rendered, "Deployment", component)["spec"]["template"]["spec"]["containers"][0]
        [entry] = [e for e in container["env"] if e["name"] == "FLEET_WEBHOOK_SECRET"]
        assert entry["valueFrom"]["secretKeyRef"] == {"name": "fleet-credentials", "key": "webhook-secret"}
    plain = render(MINIMAL, settings={"networkPolicy.enabled": True})
    gateway = find(plain, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "FLEET_WEBHOOK_SECRET" not in {e["name"] for e in gateway["env"]}

    def https_rules(manifests: list[Manifest]) -> int:
        egress = find(manifests, "NetworkPolicy", "gateway")["spec"]["egress"]
        return sum({"port": 443, "protocol": "TCP"} in rule.get("ports", []) for rule in egress)

    assert https_rules(rendered) == https_rules(plain) + 1


def test_names_fit_in_63_characters() -> None:
    release = "r" * 53  # helm's longest release name
    for values in values_files():
        for manifest in render(values, release=release):
            name = manifest["metadata"]["name"]
            assert len(name) <= 63, name
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_hooks_and_tests_are_the_expected_ones() -> None:
    manifests = render(MINIMAL)
    hooks = {(m["kind"], m["metadata"]["name"]): hook_of(m) for m in manifests if hook_of(m)}
    assert hooks == {
        ("ServiceAccount", "t-fleet-migrate"): "pre-install,pre-upgrade",
        ("ConfigMap", "t-fleet-migrate-config"): "pre-install,pre-upgrade",
        ("NetworkPolicy", "t-fleet-migrate"): "pre-install,pre-upgrade",
        ("Job", "t-fleet-migrate"): "pre-install,pre-upgrade",
        ("Pod", "t-fleet-doctor"): "test",
    }
    doctor = find(manifests, "Pod", "doctor")
    assert doctor["spec"]["containers"][0]["args"] == ["doctor"]
    assert doctor["spec"]["restartPolicy"] == "Never"


def test_notes_read_secret_keys_with_dots_and_offer_helm_test() -> None:
    text = notes(MINIMAL, settings={"secrets.apiToken.key": "api.token"})
    assert """get secret fleet-credentials -o go-template='{{ index .data "api.token" }}'""" in text
    assert "jsonpath" not in text, "jsonpath's {.data.a.b} cannot name a key with a dot"
    assert "helm test t -n fleet --logs" in text
    assert "works with zero workers" in text


def test_notes_warn_about_userns_requirements() -> None:
    old = notes(MINIMAL, kube_version="1.32.4")
    assert "on by default only from Kubernetes 1.33; this cluster is v1.32.4" in old
    current = notes(MINIMAL, kube_version="1.33.0")
    assert "this cluster is" not in current
    for text in (old, current):
        assert "ID-mapped mounts" in text and "NFS/EFS do not" in text
        assert "pod-security.kubernetes.io/enforce=privileged" in text
    assert "ID-mapped" not in notes(values_file("privileged"), kube_version="1.32.4")


def test_notes_tell_how_to_migrate_a_restarted_dev_postgresql() -> None:
    assert "helm upgrade t <chart> -n fleet --reuse-values" in notes(values_file("dev"))
    assert "--reuse-values" not in notes(MINIMAL)
