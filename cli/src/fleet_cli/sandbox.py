"""`fleet sandbox build`: build the sandbox's packages (sandbox.python.packages) on this host."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from fleet_shared.config import load_settings


def run_sandbox(action: str, environ: Mapping[str, str]) -> int:
    settings = load_settings(environ, lm_credentials=False)
    from fleet_worker.sandbox.jail import local_sandbox_config, resolve_python
    from fleet_worker.sandbox.python_env import EnvironmentUnavailable, ensure_environment, environments_dir
    from fleet_worker.sandbox.trust import sandbox_roots

    assert action == "build"
    sandbox = settings.profile.sandbox
    if not sandbox.python.packages:
        print("sandbox.python.packages is empty: cells have the standard library only")
        return 0
    if sandbox.provider == "daytona":
        print("sandbox.provider = daytona: `fleet daytona snapshot` installs the packages in the snapshot")
        return 0
    python = resolve_python(local_sandbox_config(sandbox.local))
    root = environments_dir()
    print(f"building {', '.join(sandbox.python.packages)} for {python} in {root}", flush=True)
    started = time.monotonic()
    try:
        built = ensure_environment(
            sandbox.python.packages,
            python,
            root,
            on_output=lambda line: print(f"  {line}", flush=True),
            sandbox_roots=sandbox_roots(settings),
        )
    except EnvironmentUnavailable as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 1
    assert built is not None
    print(
        f"ready in {time.monotonic() - started:.1f}s: {len(built.installed)} distributions in {built.site} "
        f"({', '.join(built.installed)})"
    )
    return 0
