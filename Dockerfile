# syntax=docker/dockerfile:1
#
# fleet's images. One Dockerfile, three targets:
#
#   docker build --target gateway -t fleet-gateway .   # `fleet gateway`: no dspy, no daytona
#   docker build --target worker  -t fleet-worker  .   # `fleet worker`: dspy, bubblewrap
#   docker build --target migrate -t fleet-migrate .   # `fleet db upgrade` (the chart's hook Job)
#
# Every target runs `tini -- fleet <args>` as uid/gid 10001, works in /app, has its venv at
# /app/.venv (on PATH) and reads /etc/fleet/fleet.toml (FLEET_CONFIG). Secrets come from the
# environment at run time (FLEET_API_TOKEN, FLEET_DATABASE_URL, ...): no ARG or ENV here holds
# one, and the build needs none.
#
# There is no container engine on the development machines: tests/deploy/ lints this file,
# checks its shape, and builds each target's venv with the exact `uv sync` commands below.

# ---------------------------------------------------------------------------------------------
# base: the interpreter every stage shares. The venv built in `build` points at this image's
# /usr/local/bin/python3.11, so the runtime stages must start from the same image.
FROM python:3.11.14-slim-bookworm AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------------------------------------
# build: uv and the workspace's metadata. The lock and the pyprojects come first so that the
# dependency layers below are rebuilt only when they change, not on every source edit.
FROM base AS build

RUN pip install --no-cache-dir uv==0.13.9

# Bytecode is compiled once here (the runtime filesystem may be read-only); the cache lives on a
# build cache mount, another filesystem, hence copies instead of hard links.
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv

WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY shared/pyproject.toml shared/
COPY gateway/pyproject.toml gateway/
COPY worker/pyproject.toml worker/
COPY cli/pyproject.toml cli/

# ---------------------------------------------------------------------------------------------
# The gateway side's venv: fleet-cli[gateway] as real copies (--no-editable), no dev tools.
FROM build AS build-gateway

RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-editable --package fleet-cli --extra gateway --no-install-workspace

COPY shared/src shared/src
COPY gateway/src gateway/src
COPY cli/src cli/src
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-editable --package fleet-cli --extra gateway

# ---------------------------------------------------------------------------------------------
# The worker side's venv: fleet-cli[worker] (dspy, daytona, arq; no Litestar, no Granian).
FROM build AS build-worker

RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-editable --package fleet-cli --extra worker --no-install-workspace

COPY shared/src shared/src
COPY worker/src worker/src
COPY cli/src cli/src
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-editable --package fleet-cli --extra worker

# ---------------------------------------------------------------------------------------------
# runtime: what every target shares. tini is PID 1: it forwards SIGTERM to fleet (so gateways
# and workers drain) and reaps the zombie each bwrap leaves behind. e2fsprogs: mkfs.ext4, for a
# privileged worker's workspace volumes (the kernel-enforced workspace budget).
FROM base AS runtime

RUN apt-get update \
    && apt-get install -y --no-install-recommends tini e2fsprogs \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 fleet \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin fleet \
    && mkdir -p /app/.fleet /var/lib/fleet \
    && chown 10001:10001 /app/.fleet /var/lib/fleet \
    && chmod 0711 /app/.fleet

# /etc/fleet holds fleet.toml (the chart mounts its ConfigMap over that one file), the built-in
# skill cards `fleet db upgrade` seeds, and the offline profile's LM script. FLEET_SKILLS_DIR is
# explicit so that a fleet.toml mounted elsewhere still finds the skills.
COPY config/ /etc/fleet/
# `fleet db upgrade` finds alembic.ini in its working directory.
COPY alembic.ini /app/
COPY migrations/ /app/migrations/

# The profiles' storage.data_dir (".fleet") resolves to /app/.fleet: SQLite for a single-host
# run, and the worker's workspaces. With a read-only root filesystem, mount a volume there.
ENV PATH="/app/.venv/bin:${PATH}" \
    FLEET_CONFIG=/etc/fleet/fleet.toml \
    FLEET_SKILLS_DIR=/etc/fleet/skills

WORKDIR /app
USER 10001:10001
ENTRYPOINT ["tini", "--", "fleet"]

# ---------------------------------------------------------------------------------------------
# migrate: `fleet db upgrade` (migrate, then seed the skills and the shipped program version). It needs no side: the gateway's
# venv is the slimmer of the two.
FROM runtime AS migrate

COPY --from=build-gateway /app/.venv /app/.venv
CMD ["db", "upgrade"]

# ---------------------------------------------------------------------------------------------
# worker: `fleet worker`, running each REPL in a bubblewrap jail.
#
# Host tools: bwrap; libseccomp2 (the jail's syscall filter); setpriv from util-linux (a root
# worker joins a REPL's cgroup, then drops to the sandbox uid); and /usr/bin/python3, which the
# REPL runs on when it exists (sandbox.local.python = "auto"): a distribution build that needs
# nothing the jail hides (it has /usr and /lib but no /etc, so no ld.so.cache), kept apart from
# the interpreter and site-packages of fleet's own venv.
#
# What bubblewrap needs in a pod (the Helm chart sets it; `fleet doctor` reports the mode):
#
# - userns mode, this image's default (uid 10001). bwrap is not setuid: it builds the jail from
#   an unprivileged user namespace, so the pod needs
#     - user namespaces allowed on the node (user.max_user_namespaces > 0; on hosts where AppArmor
#       restricts them, e.g. Ubuntu 23.10+, appArmorProfile: Unconfined),
#     - seccompProfile: Unconfined (the runtimes' default profiles refuse clone/unshare with
#       CLONE_NEWUSER to a process without CAP_SYS_ADMIN),
#     - a /proc bwrap may mount anew for the jail's pid namespace: the runtime's masked /proc
#       blocks that (bwrap: "Can't mount proc"), so procMount: Unmasked (with hostUsers: false)
#       or a privileged container.
#   allowPrivilegeEscalation: false, capabilities drop ALL and readOnlyRootFilesystem (with
#   volumes on /app/.fleet and /tmp) all still work. Limits are per process (rlimits); the
#   pod's memory limit bounds the whole worker.
# - cgroup mode, for whole-sandbox memory/pids/cpu limits: run this image as root (runAsUser: 0,
#   runAsNonRoot: false) in a privileged container, so /sys/fs/cgroup is writable (cgroup v2
#   with the memory, pids and cpu controllers delegated). A root worker never runs cells as
#   root: each workspace's REPLs get a uid of their own from sandbox.local.uid_base.
#
# The image stays non-root: root is an override the operator chooses, not a default.
FROM runtime AS worker

USER 0:0
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 util-linux python3 \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build-worker /app/.venv /app/.venv

# The cells' packages (sandbox.python.packages in the image's fleet.toml), built now for the
# REPL's /usr/bin/python3 by the venv's uv, wheels only: a worker finds them at start and
# builds nothing. The folder is root's and read-only (a root worker trusts nothing else there):
# a profile naming other packages needs an image built FROM this one that runs
# `fleet sandbox build` with that config.
ENV FLEET_SANDBOX_PYTHON_DIR=/opt/fleet/sandbox-python
RUN --mount=type=cache,target=/root/.cache/uv \
    UV_LINK_MODE=copy fleet sandbox build
USER 10001:10001
EXPOSE 9100
# /health is 200 while the worker's event loop beats, 503 when it is stuck. The metrics server
# listens on 0.0.0.0:9100 (CMD below) so that a pod's probe reaches it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/health', timeout=4)"]
CMD ["worker", "--metrics-host", "0.0.0.0", "--metrics-port", "9100"]

# ---------------------------------------------------------------------------------------------
# gateway: `fleet gateway` on Granian. Off loopback it refuses to start without FLEET_API_TOKEN
# (or --allow-unauthenticated when a proxy in front authenticates). Last, so a plain
# `docker build .` builds it.
FROM runtime AS gateway

COPY --from=build-gateway /app/.venv /app/.venv
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000", "--allow-non-loopback-bind"]
