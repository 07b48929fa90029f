"""prometheus-client's multiprocess directory for `fleet gateway --workers N` (N > 1).

Each Granian process writes its metric values to files there and /metrics sums them. The
directory must be set before those processes import prometheus-client, must start empty (old
files would be counted), and is private to one gateway run: this module creates it fresh and, at
the end, removes only the metric files it may have held, then the directory itself if empty.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path

# Named here as well as in fleet_gateway.metrics on purpose: importing either module that holds
# it would import prometheus-client in this process, which must not happen before it is set.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus-client's file names: <type>_<pid>.db, the type being counter, histogram, summary or
# gauge_<mode> (gauge_livesum, gauge_max, ...).
METRIC_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_\d+\.db")


@contextlib.contextmanager
def multiprocess_metrics(
    workers: int, environ: MutableMapping[str, str] = os.environ
) -> Iterator[Path | None]:
    """A fresh directory in $PROMETHEUS_MULTIPROC_DIR while the block runs, when `workers` > 1.

    A directory the operator already set is used as it is and never cleaned (it is theirs)."""
    if workers <= 1 or environ.get(MULTIPROCESS_ENV):
        given = environ.get(MULTIPROCESS_ENV)
        yield Path(given) if given else None
        return
    path = Path(tempfile.mkdtemp(prefix="fleet-prometheus-"))  # 0700, ours alone
    environ[MULTIPROCESS_ENV] = str(path)
    try:
        yield path
    finally:
        environ.pop(MULTIPROCESS_ENV, None)
        remove_metric_files(path)


def remove_metric_files(path: Path) -> None:
    """Delete the metric files directly in `path`, then `path` if nothing else is left.

    Anything else in it (another file, a folder, a symlink) is left alone; `/` and $HOME are
    refused outright."""
    resolved = path.resolve()
    if resolved == Path("/") or resolved == Path.home().resolve():
        raise ValueError(f"refusing to clean {resolved}")
    for entry in resolved.iterdir():
        if METRIC_FILE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink()
    with contextlib.suppress(OSError):  # not empty: what is left is not ours to delete
        resolved.rmdir()
