"""The Dockerfile's shape, since it cannot be built here: hadolint, the targets, pinned bases,
non-root users, tini, health checks, no secrets, and a build context that holds every COPY."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.dockerfile import (
    DOCKERFILE,
    REPO,
    Stage,
    copies,
    exec_form,
    extras_of,
    in_context,
    install_command,
    parse_dockerfile,
    read_dockerignore,
    split_flags,
    uv_syncs,
    venv_stage,
)

pytestmark = pytest.mark.deploy

STAGES = parse_dockerfile()
TARGETS = ("gateway", "worker", "migrate")
# The side whose venv each target carries, and the port its HEALTHCHECK probes (None: no probe).
TARGET_SIDE = {"gateway": "gateway", "worker": "worker", "migrate": "gateway"}
TARGET_PORT = {"gateway": 8000, "worker": 9100, "migrate": None}
RUNTIME_UID = "10001:10001"
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|PRIVATE|CREDENTIAL|AUTH", re.IGNORECASE)
URL_WITH_PASSWORD = re.compile(r"://[^/@\s]*:[^/@\s]*@")


def test_hadolint_is_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run(
        [str(hadolint), "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_every_hadolint_ignore_says_why() -> None:
    lines = (REPO / ".hadolint.yaml").read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if re.match(r"\s+- DL\d+", line)]
    assert ignores
    for index in ignores:
        assert lines[index - 1].strip().startswith("#"), f"no reason given above {lines[index]!r}"


def test_the_targets_exist() -> None:
    assert set(TARGETS) <= set(STAGES)


def test_base_images_are_pinned_to_an_exact_tag() -> None:
    images = [stage.base for stage in STAGES.values() if stage.base not in STAGES]
    assert images
    for image in images:
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name, f"{image} has no tag"
        assert re.match(r"\d+\.\d+\.\d+-", tag), f"{image}: not an exact version tag"


def test_uv_is_pinned() -> None:
    runs = " ".join(ins.args for stage in STAGES.values() for ins in stage.own if ins.keyword == "RUN")
    assert re.search(r"\buv==\d+\.\d+\.\d+\b", runs)


@pytest.mark.parametrize("target", TARGETS)
def test_targets_run_as_the_non_root_uid(target: str) -> None:
    user = STAGES[target].last("USER")
    assert user is not None
    assert user.args == RUNTIME_UID


@pytest.mark.parametrize("target", TARGETS)
def test_targets_run_fleet_under_tini(target: str) -> None:
    stage = STAGES[target]
    entrypoint = stage.last("ENTRYPOINT")
    assert entrypoint is not None
    assert exec_form(entrypoint.args) == ["tini", "--", "fleet"]
    assert "tini" in apt_packages(stage)
    assert exec_form(stage.instructions("CMD")[-1].args)[0] in ("gateway", "worker", "db")


@pytest.mark.parametrize("target", TARGETS)
def test_healthchecks_probe_the_target_port(target: str) -> None:
    stage = STAGES[target]
    port = TARGET_PORT[target]
    checks = stage.instructions("HEALTHCHECK")
    if port is None:  # a Job: it runs to completion, nothing to probe
        assert checks == []
        assert stage.instructions("EXPOSE") == []
        return
    assert len(checks) == 1
    flags, rest = split_flags(checks[0].args)
    assert {"interval", "timeout", "retries"} <= set(flags)
    probe = " ".join(exec_form(rest.removeprefix("CMD").strip()))
    assert f"http://127.0.0.1:{port}/health" in probe
    assert [ins.args for ins in stage.instructions("EXPOSE")] == [str(port)]
    # The default command listens where the probe and EXPOSE point.
    cmd = exec_form(stage.instructions("CMD")[-1].args)
    assert str(port) in cmd
    assert "0.0.0.0" in cmd


def test_no_secret_looking_arg_or_env() -> None:
    for stage in STAGES.values():
        for ins in stage.own:
            if ins.keyword not in ("ARG", "ENV"):
                continue
            for item in shlex.split(ins.args):
                name, _, value = item.partition("=")
                assert not SECRET_NAME.search(name), f"line {ins.line}: {name} looks like a secret"
                assert not URL_WITH_PASSWORD.search(value), f"line {ins.line}: a URL with a password"


def test_the_build_mounts_no_secrets() -> None:
    mounts = [
        mount
        for stage in STAGES.values()
        for ins in stage.own
        if ins.keyword == "RUN"
        for mount in split_flags(ins.args)[0].get("mount", [])
    ]
    assert mounts  # the uv cache mounts, at least
    assert [m for m in mounts if "type=secret" in m or "type=ssh" in m] == []


def test_images_find_their_config_and_run_unbuffered() -> None:
    for target in TARGETS:
        env = STAGES[target].env()
        assert env["FLEET_CONFIG"] == "/etc/fleet/fleet.toml"
        assert env["FLEET_SKILLS_DIR"] == "/etc/fleet/skills"
        assert env["PYTHONDONTWRITEBYTECODE"] == env["PYTHONUNBUFFERED"] == "1"
        assert env["PATH"].startswith("/app/.venv/bin:")
        assert STAGES[target].instructions("WORKDIR")[-1].args == "/app"
        config = [c for c in copies(STAGES[target]) if c.sources == ["config/"]]
        assert [c.dest for c in config] == ["/etc/fleet/"]


def test_every_copy_source_is_in_the_build_context() -> None:
    patterns = read_dockerignore()
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    sources = {
        source for stage in STAGES.values() for c in copies(stage) if not c.from_stage for source in c.sources
    }
    assert sources
    for source in sources:
        path = source.rstrip("/")
        assert (REPO / path).exists(), f"COPY {source}: no such file"
        assert in_context(path, patterns), f"COPY {source}: .dockerignore leaves it out"
        inside = [f for f in tracked if f == path or f.startswith(f"{path}/")]
        assert inside, f"COPY {source}: no file there"
        left_out = [f for f in inside if not in_context(f, patterns)]
        assert left_out == [], f"COPY {source}: .dockerignore drops {left_out}"


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".fleet/fleet.db",
        "tests/conftest.py",
        "docs/deployment.md",
        "README.md",
        "shared/src/fleet_shared/__pycache__/config.cpython-311.pyc",
        ".env",
    ],
)
def test_the_build_context_leaves_out_local_state(path: str) -> None:
    assert not in_context(path, read_dockerignore())


def test_copy_from_names_earlier_stages() -> None:
    names = list(STAGES)
    for index, stage in enumerate(STAGES.values()):
        for copy in copies(stage):
            if copy.from_stage is not None:
                assert copy.from_stage in names[:index], f"{stage.name}: COPY --from={copy.from_stage}"


@pytest.mark.parametrize("target", TARGETS)
def test_targets_carry_the_venv_of_their_side(target: str) -> None:
    builder = venv_stage(STAGES[target], STAGES)
    side = TARGET_SIDE[target]
    assert install_command(side, STAGES) in uv_syncs(builder)
    assert {extra for argv in uv_syncs(builder) for extra in extras_of(argv)} == {side}


@pytest.mark.parametrize("side", ["gateway", "worker"])
def test_uv_sync_installs_one_side_from_the_lock(side: str) -> None:
    """The command test_packaging runs, and its dependencies-only layer: the same plus
    --no-install-workspace, both with the uv cache on a cache mount."""
    command = install_command(side, STAGES)
    expected = "uv sync --locked --no-dev --no-editable --package fleet-cli --extra"
    assert command == [*expected.split(), side]
    builder = next(stage for stage in STAGES.values() if command in uv_syncs(stage))
    assert uv_syncs(builder) == [[*command, "--no-install-workspace"], command]
    for ins in builder.own:
        if ins.keyword == "RUN" and "uv sync" in ins.args:
            mounts = split_flags(ins.args)[0]["mount"]
            assert mounts == ["type=cache,target=/root/.cache/uv"]
    env = builder.env()
    assert env["UV_COMPILE_BYTECODE"] == "1"
    assert env["UV_LINK_MODE"] == "copy"
    assert env["UV_PROJECT_ENVIRONMENT"] == "/app/.venv"


@pytest.mark.parametrize("side", ["gateway", "worker"])
def test_dependencies_install_before_the_sources_are_copied(side: str) -> None:
    """Layer caching: a source edit must not reinstall the dependencies."""
    builder = next(stage for stage in STAGES.values() if install_command(side, STAGES) in uv_syncs(stage))
    keywords = [
        "DEPS" if ins.keyword == "RUN" and "--no-install-workspace" in ins.args else ins.keyword
        for ins in builder.instructions()
    ]
    source_copies = [
        i
        for i, ins in enumerate(builder.instructions())
        if ins.keyword == "COPY" and "/src" in ins.args.split()[0]
    ]
    assert source_copies
    assert keywords.index("DEPS") < min(source_copies)


def apt_packages(stage: Stage) -> set[str]:
    packages: set[str] = set()
    for ins in stage.instructions("RUN"):
        for command in ins.args.split("&&"):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                packages |= {word for word in words[2:] if not word.startswith("-")}
    return packages


def test_the_worker_has_the_sandbox_tools_and_the_gateway_does_not() -> None:
    sandbox = {"bubblewrap", "libseccomp2", "util-linux", "python3"}
    assert sandbox <= apt_packages(STAGES["worker"])
    assert apt_packages(STAGES["gateway"]) & sandbox == set()
    assert apt_packages(STAGES["migrate"]) & sandbox == set()
