"""The gateway's prometheus multiprocess directory: fresh, private, and cleaned of nothing but
the metric files it held."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_cli.metrics_dir import MULTIPROCESS_ENV, multiprocess_metrics, remove_metric_files


def test_one_process_needs_no_directory() -> None:
    environ: dict[str, str] = {}
    with multiprocess_metrics(1, environ) as path:
        assert path is None and environ == {}


def test_several_processes_get_a_fresh_directory_removed_afterwards() -> None:
    environ: dict[str, str] = {}
    with multiprocess_metrics(2, environ) as path:
        assert path is not None and path.is_dir() and not any(path.iterdir())
        assert environ[MULTIPROCESS_ENV] == str(path)
        assert path.stat().st_mode & 0o077 == 0  # private
        (path / "counter_123.db").write_bytes(b"x")
        (path / "gauge_livesum_456.db").write_bytes(b"x")
    assert MULTIPROCESS_ENV not in environ
    assert not path.exists()


def test_a_directory_the_operator_set_is_used_and_kept(tmp_path: Path) -> None:
    (tmp_path / "counter_1.db").write_bytes(b"x")
    environ = {MULTIPROCESS_ENV: str(tmp_path)}
    with multiprocess_metrics(4, environ) as path:
        assert path == tmp_path
    assert (tmp_path / "counter_1.db").exists() and environ[MULTIPROCESS_ENV] == str(tmp_path)


def test_only_metric_files_are_removed(tmp_path: Path) -> None:
    keep = [tmp_path / "notes.txt", tmp_path / "counter_1.db.bak", tmp_path / "histogram_x.db"]
    for path in [*keep, tmp_path / "histogram_77.db", tmp_path / "summary_8.db"]:
        path.write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "counter_2.db").write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-target.txt"
    outside.write_bytes(b"x")
    (tmp_path / "gauge_all_3.db").symlink_to(outside)
    remove_metric_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(p.name for p in keep), "sub", "gauge_all_3.db"]
    )
    assert (tmp_path / "sub" / "counter_2.db").exists() and outside.exists()
    outside.unlink()


@pytest.mark.parametrize("path", [Path("/"), Path.home()])
def test_root_and_home_are_refused(path: Path) -> None:
    with pytest.raises(ValueError, match="refusing"):
        remove_metric_files(path)
