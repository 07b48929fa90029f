"""The supervisor's census of leftovers (repl_main.Census, await_stop) on real processes.

Each case runs in a fresh Python process (a `probe`) that plays the supervisor: it forks the
interpreter and whatever the case leaves behind, stops the interpreter as the supervisor does
at a cell's end, and says what the census answered. A probe of its own, because the census
reads its parent's children from /proc: pytest's own children (servers, workers) would be in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fleet_worker.sandbox import repl_main

PROBE = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    sys.path.insert(0, {driver_dir!r})
    import repl_main

    case = {case!r}
    ready_r, ready_w = os.pipe()

    def quiet():  # a forked process keeps no end of the test's pipes open
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)

    def interpreter():
        quiet()
        if case == "grandchild" and os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        if case == "thread":
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        if case == "exits":
            os._exit(0)
        os.write(ready_w, b"!")
        if case == "busy":
            while True:
                pass
        time.sleep(60)
        os._exit(0)

    pid = os.fork()
    if pid == 0:
        interpreter()
    if case == "orphan" and os.fork() == 0:  # as a leftover reparented to the supervisor
        quiet()
        time.sleep(60)
        os._exit(0)
    if case != "exits":
        os.read(ready_r, 1)
    while case == "exits" and repl_main.process_state(pid) != "Z":  # ended, not yet reaped
        time.sleep(0.01)
    census = repl_main.Census(pid)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    stopped = repl_main.await_stop(pid)
    waited = time.monotonic() - started
    state = repl_main.process_state(pid)
    alone = stopped and census.alone()
    census.close()
    print(json.dumps({{"stopped": stopped, "alone": alone, "state": state, "waited": waited}}))
    """
)


def probe(case: str) -> dict[str, object]:
    driver_dir = str(repl_main.__file__).rsplit("/", 1)[0]
    code = PROBE.format(driver_dir=driver_dir, case=case)
    # Its own session: what the case leaves behind is killed with the probe's process group.
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_a_stopped_interpreter_alone_passes_without_a_scan() -> None:
    answer = probe("alone")
    assert answer["stopped"] is True and answer["state"] == "T"
    assert answer["alone"] is True


def test_a_running_interpreter_is_waited_for_until_it_has_stopped() -> None:
    # kill(2) returns before the stop: a thread inside fork() would finish it after the scan.
    answer = probe("busy")
    assert answer["stopped"] is True and answer["state"] == "T"
    assert answer["alone"] is True


@pytest.mark.parametrize("case", ["grandchild", "orphan", "thread"])
def test_anything_besides_the_interpreter_means_a_full_scan(case: str) -> None:
    answer = probe(case)
    assert answer["stopped"] is True
    assert answer["alone"] is False


def test_an_interpreter_that_ended_is_not_waited_for() -> None:
    answer = probe("exits")
    assert answer["stopped"] is False and answer["alone"] is False
    assert isinstance(answer["waited"], float) and answer["waited"] < 0.5  # no 1 s wait for a stop
