"""The chart's workloads: independent replica counts and scaling, the migration, probes, grace
periods against the drain, the worker sandbox modes' security contexts, and the network policy."""

from __future__ import annotations

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
    egress_ports,
    env_of,
    find,
    hook_of,
    kinds,
    pod_spec,
    render,
    render_error,
    workloads,
)

pytestmark = pytest.mark.deploy


def container(manifest: Manifest) -> dict[str, Any]:
    main: dict[str, Any] = pod_spec(manifest)["containers"][0]
    return main


@pytest.mark.parametrize(("gateways", "workers"), [(2, 7), (5, 1), (0, 3)])
def test_gateway_and_worker_replicas_render_independently(gateways: int, workers: int) -> None:
    manifests = render(MINIMAL, settings={"gateway.replicas": gateways, "worker.replicas": workers})
    assert find(manifests, "Deployment", "gateway")["spec"]["replicas"] == gateways
    assert find(manifests, "Deployment", "worker")["spec"]["replicas"] == workers


def test_autoscalers_own_the_replicas_when_enabled() -> None:
    manifests = render(KEDA)
    assert "replicas" not in find(manifests, "Deployment", "gateway")["spec"]
    assert "replicas" not in find(manifests, "Deployment", "worker")["spec"]
    hpa = find(manifests, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    scaled = find(manifests, "ScaledObject", "worker")
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 12)
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "2"  # worker.concurrency
    # KEDA owns the workers' HPA: the chart renders none of its own for them.
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "HorizontalPodAutoscaler"] == [
        "t-fleet-gateway"
    ]


def test_keda_query_follows_the_profile_queue_name() -> None:
    custom = (
        '[config]\ndefault_profile = "p"\n[profiles.p.llm.root]\nmodel = "scripted/x"\n'
        '[profiles.p.worker]\nqueue_name = "tenant-a:queue"\ndrain_seconds = 5\n'
    )
    manifests = render(KEDA, settings={"config.fleetToml": custom, "config.profile": "p"})
    query = find(manifests, "ScaledObject", "worker")["spec"]["triggers"][0]["metadata"]["query"]
    selector = '{queue="tenant-a:queue",namespace="fleet"}'
    assert query == f"max(fleet_queue_depth{selector}) + max(fleet_queue_in_progress{selector})"


def keda_trigger(**settings: object) -> dict[str, str]:
    manifests = render(KEDA, settings=settings)
    metadata: dict[str, str] = find(manifests, "ScaledObject", "worker")["spec"]["triggers"][0]["metadata"]
    return metadata


def test_keda_scales_on_demand_per_worker_and_errs_on_an_empty_result() -> None:
    """Demand is waiting + running Turns of this release's namespace, one replica per
    worker's worth of it; an absent series is an error (then `fallback`), never a 0."""
    trigger = keda_trigger()
    assert trigger["ignoreNullValues"] == "false"
    assert "fleet_queue_in_progress" in trigger["query"] and 'namespace="fleet"' in trigger["query"]
    assert keda_trigger(**{"worker.concurrency": "null"})["threshold"] == "4"  # profile local's
    assert keda_trigger(**{"keda.threshold": 3})["threshold"] == "3"
    assert keda_trigger(**{"keda.query": "vector(1)"})["query"] == "vector(1)"


def test_worker_hpa_fallback_without_keda() -> None:
    manifests = render(DAYTONA)
    assert "ScaledObject" not in kinds(manifests)
    metric = find(manifests, "HorizontalPodAutoscaler", "worker")["spec"]["metrics"][0]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "fleet_queue_demand"
    assert metric["external"]["target"]["averageValue"] == "8"  # daytona-recursive's concurrency
    cpu = render(MINIMAL, settings={"worker.autoscaling.enabled": True})
    assert find(cpu, "HorizontalPodAutoscaler", "worker")["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_scale_to_zero_needs_a_readiness_that_does_not_wait_for_workers() -> None:
    settings: dict[str, object] = {"keda.minReplicas": 0}
    assert "keda.minReplicas=0 with gateway.readinessPath=/ready" in render_error(KEDA, settings=settings)
    settings["gateway.readinessPath"] = "/health"
    assert find(render(KEDA, settings=settings), "ScaledObject", "worker")["spec"]["minReplicaCount"] == 0


def test_pdb_for_each_deployment() -> None:
    manifests = render(MINIMAL)
    for component in ("gateway", "worker"):
        pdb = find(manifests, "PodDisruptionBudget", component)
        deployment = find(manifests, "Deployment", component)
        assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_migration_hook_runs_fleet_db_upgrade_before_install_and_upgrade() -> None:
    manifests = render(MINIMAL)
    job = find(manifests, "Job", "migrate")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    assert container(job)["args"] == ["db", "upgrade"]
    assert container(job)["image"] == "fleet-migrate:0.1.0"
    # Its ConfigMap and ServiceAccount are hooks of a lower weight: they exist before it runs.
    spec = pod_spec(job)
    assert spec["serviceAccountName"] == "t-fleet-migrate"
    assert spec["volumes"][0]["configMap"]["name"] == "t-fleet-migrate-config"
    job_weight = int(annotations["helm.sh/hook-weight"])
    for kind, suffix in (("ServiceAccount", "migrate"), ("ConfigMap", "migrate-config")):
        support = find(manifests, kind, suffix)
        assert hook_of(support) == "pre-install,pre-upgrade"
        assert int(support["metadata"]["annotations"]["helm.sh/hook-weight"]) < job_weight
    # The migration gets the database and nothing else: no Redis, no LM key, no API token.
    assert set(env_of(container(job))) == {"FLEET_CONFIG", "FLEET_PROFILE", "FLEET_DATABASE_URL", "HOME"}


def test_migration_runs_as_the_release_identity() -> None:
    """The hook's ServiceAccount carries serviceAccount.annotations (IRSA, Workload Identity,
    e.g. for an IAM-authenticated database); without create, the Job runs as the named one."""
    irsa = {"serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn": "arn:aws:iam::1:role/fleet"}
    account = find(render(MINIMAL, settings=irsa), "ServiceAccount", "migrate")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:aws:iam::1:role/fleet"
    assert hook_of(account) == "pre-install,pre-upgrade"
    named = render(MINIMAL, settings={"serviceAccount.create": False, "serviceAccount.name": "fleet-irsa"})
    assert pod_spec(find(named, "Job", "migrate"))["serviceAccountName"] == "fleet-irsa"
    assert "ServiceAccount" not in kinds(named)


def test_dev_postgresql_migrates_from_a_plain_job_that_waits_for_it() -> None:
    manifests = render(DEV)
    assert {"t-fleet-redis", "t-fleet-postgresql"} <= {
        m["metadata"]["name"] for m in manifests if m["kind"] in ("Deployment", "Service")
    }
    job = find(manifests, "Job", "migrate-1")
    assert hook_of(job) is None, "a hook would run before the dev PostgreSQL exists"
    (wait,) = pod_spec(job)["initContainers"]
    assert "pg_isready" in " ".join(wait["command"])
    assert container(job)["args"] == ["db", "upgrade"]
    assert not [m for m in manifests if hook_of(m) == "pre-install,pre-upgrade"]


def test_probes() -> None:
    manifests = render(MINIMAL)
    gateway = container(find(manifests, "Deployment", "gateway"))
    local = [{"name": "Host", "value": "localhost"}]  # the gateway answers to names it knows only
    for probe, path in (
        ("startupProbe", "/health"),
        ("livenessProbe", "/health"),
        ("readinessProbe", "/ready"),
    ):
        assert gateway[probe]["httpGet"] == {"path": path, "port": "http", "httpHeaders": local}
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    worker = container(find(manifests, "Deployment", "worker"))
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert worker["args"][:3] == ["worker", "--metrics-host=0.0.0.0", "--metrics-port=9100"]


def test_the_gateway_answers_to_its_service_names_and_the_listed_hosts() -> None:
    hosts = {"gateway.allowedHosts[0]": "fleet.example.com", "gateway.allowedHosts[1]": ".corp.example"}
    manifests = render(MINIMAL, settings=hosts)
    env = {e["name"]: e.get("value") for e in container(find(manifests, "Deployment", "gateway"))["env"]}
    service = find(manifests, "Service", "gateway")["metadata"]
    name, namespace = service["name"], service["namespace"]
    assert env["FLEET_ALLOWED_HOSTS"].split(",") == [
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
        "fleet.example.com",
        ".corp.example",
    ]


def grace(manifests: list[Manifest], component: str) -> int:
    value: int = pod_spec(find(manifests, "Deployment", component))["terminationGracePeriodSeconds"]
    return value


@pytest.mark.parametrize(
    ("profile_values", "drain"),
    [(MINIMAL, 5), (KEDA, 60), (DAYTONA, 60)],
    ids=["offline", "local", "daytona-recursive"],
)
def test_grace_periods_exceed_the_drain(profile_values: Any, drain: int) -> None:
    """drain_seconds comes from the profile in fleet.toml (offline: 5, local and daytona: 60)."""
    manifests = render(profile_values)
    assert grace(manifests, "worker") == drain + 45
    gateway = container(find(manifests, "Deployment", "gateway"))
    pre_stop = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace(manifests, "gateway") > pre_stop + 5  # the profiles' shutdown_grace_seconds


def test_grace_period_values_that_cut_the_drain_are_refused() -> None:
    """After the drain a worker settles, closes its pools and kills its sandboxes (up to
    SANDBOX_CLOSE_SECONDS, 30): the grace must leave it drain_seconds + 45."""
    error = render_error(KEDA, settings={"worker.terminationGracePeriodSeconds": 104})
    assert "must be at least the profile's worker.drain_seconds (60) + 45 s" in error
    assert grace(render(KEDA, settings={"worker.terminationGracePeriodSeconds": 105}), "worker") == 105
    error = render_error(MINIMAL, settings={"gateway.terminationGracePeriodSeconds": 10})
    assert (
        "must exceed gateway.preStopSleepSeconds (5) + the profile's gateway.shutdown_grace_seconds (5)"
        in error
    )


def test_gateway_is_restricted() -> None:
    for values in (MINIMAL, KEDA, DEV, DAYTONA):
        deployment = find(render(values), "Deployment", "gateway")
        assert pod_spec(deployment)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(deployment)["securityContext"]["runAsUser"] == 10001
        assert container(deployment)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "privileged": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }


def test_worker_sandbox_modes() -> None:
    userns = find(render(MINIMAL), "Deployment", "worker")
    assert pod_spec(userns)["hostUsers"] is False
    context = container(userns)["securityContext"]
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["procMount"] == "Unmasked"
    assert context["seccompProfile"] == context["appArmorProfile"] == {"type": "Unconfined"}

    privileged = find(render(PRIVILEGED), "Deployment", "worker")
    assert "hostUsers" not in pod_spec(privileged)
    assert pod_spec(privileged)["securityContext"]["runAsUser"] == 0
    assert container(privileged)["securityContext"]["privileged"] is True
    assert container(privileged)["securityContext"]["readOnlyRootFilesystem"] is True

    daytona = find(render(DAYTONA), "Deployment", "worker")
    assert "hostUsers" not in pod_spec(daytona)
    assert container(daytona)["securityContext"]["privileged"] is False
    assert container(daytona)["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "FLEET_DAYTONA_API_KEY" in env_of(container(daytona))


def test_writable_paths_are_volumes() -> None:
    for manifests in (render(MINIMAL), render(KEDA)):
        for component in ("gateway", "worker"):
            mounts = {
                m["mountPath"] for m in container(find(manifests, "Deployment", component))["volumeMounts"]
            }
            assert {"/tmp", "/app/.fleet", "/etc/fleet/fleet.toml"} <= mounts
    data = pod_spec(find(render(KEDA), "Deployment", "worker"))["volumes"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "fleet-data"}} in data


def test_credentials_go_only_where_they_are_used() -> None:
    manifests = render(DAYTONA)
    gateway = env_of(container(find(manifests, "Deployment", "gateway")))
    worker = env_of(container(find(manifests, "Deployment", "worker")))
    assert "FLEET_API_TOKEN" in gateway and "FLEET_API_TOKEN" not in worker
    assert "FLEET_LM_API_KEY" in worker and "FLEET_LM_API_KEY" not in gateway
    assert worker["FLEET_LM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "fleet-lm", "key": "api-key"}
    assert worker["FLEET_PROFILE"]["value"] == gateway["FLEET_PROFILE"]["value"] == "daytona-recursive"
    assert worker["FLEET_CONFIG"]["value"] == "/etc/fleet/fleet.toml"


def test_pods_with_an_fs_group_skip_the_recursive_chown() -> None:
    for values in (MINIMAL, DEV, PRIVILEGED):
        for workload in workloads(render(values)):
            context = pod_spec(workload)["securityContext"]
            if "fsGroup" in context:
                assert context["fsGroupChangePolicy"] == "OnRootMismatch", workload["metadata"]["name"]


MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_network_policy_admits_the_scraper_to_gateways_and_workers() -> None:
    """Prometheus reaches the gateway's /metrics even when gatewayFrom admits only the ingress
    controller; by default the scraper is the monitoring namespace, not every namespace."""
    for values in (MINIMAL, KEDA):
        manifests = render(values)
        gateway_rules = find(manifests, "NetworkPolicy", "gateway")["spec"]["ingress"]
        assert {"ports": [{"port": 8000, "protocol": "TCP"}], "from": [MONITORING]} in gateway_rules
        (scrape,) = find(manifests, "NetworkPolicy", "worker")["spec"]["ingress"]
        assert scrape["from"] == [MONITORING]


def test_network_policy_s3_egress_and_extra_rules_by_component() -> None:
    s3 = (
        '[config]\ndefault_profile = "p"\n[profiles.p.llm.root]\nmodel = "scripted/x"\n'
        '[profiles.p.storage.blobs]\nbackend = "s3"\n'
    )
    manifests = render(  # the profile's own s3 table, without blobStore
        MINIMAL,
        settings={
            "config.fleetToml": s3,
            "config.profile": "p",
            "networkPolicy.egress.s3.ports[0]": 9000,
            **NO_BLOB_STORE,
        },
    )
    for component in ("gateway", "worker", "doctor"):
        assert 9000 in egress_ports(find(manifests, "NetworkPolicy", component)), component
    assert 9000 not in egress_ports(find(manifests, "NetworkPolicy", "migrate"))
    local = render(KEDA, settings={"networkPolicy.egress.s3.ports[0]": 9000})  # local blobs on a claim
    assert 9000 not in egress_ports(find(local, "NetworkPolicy", "gateway"))

    keda = render(KEDA)  # extra: an LM on port 4000
    assert 4000 in egress_ports(find(keda, "NetworkPolicy", "worker"))
    assert 4000 in egress_ports(find(keda, "NetworkPolicy", "doctor"))
    assert 4000 not in egress_ports(find(keda, "NetworkPolicy", "gateway"))
    assert 4000 not in egress_ports(find(keda, "NetworkPolicy", "migrate"))
    widened = render(KEDA, settings={"networkPolicy.egress.extraComponents": "{worker,gateway}"})
    assert 4000 in egress_ports(find(widened, "NetworkPolicy", "gateway"))


def test_network_policy() -> None:
    manifests = render(KEDA)
    gateway = find(manifests, "NetworkPolicy", "gateway")["spec"]
    assert gateway["ingress"][0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert gateway["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress-nginx"
    }
    worker = find(manifests, "NetworkPolicy", "worker")["spec"]
    (scrape,) = worker["ingress"]
    assert scrape["ports"] == [{"port": 9100, "protocol": "TCP"}]
    assert scrape["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    egress_ports = {port["port"] for rule in worker["egress"] for port in rule["ports"]}
    assert {53, 6379, 5432, 443, 4000} <= egress_ports
    gateway_ports = {port["port"] for rule in gateway["egress"] for port in rule["ports"]}
    assert 443 not in gateway_ports, "gateways call no LM"
    assert find(manifests, "NetworkPolicy", "doctor")["spec"]["ingress"] == []
