"""The escape and abuse suite: each attack runs as a real Turn (real arq worker, real bwrap sandbox,
real Redis and SQLite), must be contained with a clear error to the RLM, and the session's next
Turn must succeed. The LM is the scripted LM: its actions branch on the Turn's request, so the
follow-up Turn ("hello") runs the same script without the attack.

Run alone with `uv run pytest -m escape`.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from fleet_shared.db import queries
from fleet_shared.events import CellOutput, LMQueryStarted, RunWarning
from fleet_worker.sandbox.jail import LocalSandboxConfig
from tests.integration.attacks import Attack, HarnessFactory, attack, attack_script

pytestmark = pytest.mark.escape

# Without volumes (a non-root worker's way): workspace folders stay on the host after the worker
# stops, for a test to look at what the host's sanitize pass left.
HOST_FOLDERS = {"workspace_volumes": False}


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: the sandbox is the subject here, not the database."""
    return sqlite_url


def workspace_folders(outcome: Attack) -> list[Path]:
    return sorted(Path(outcome.harness.settings.workspaces_dir).iterdir())


async def test_sessions_cannot_see_each_others_files(harness_factory: HarnessFactory) -> None:
    harness = harness_factory(
        *attack_script(
            "open('/workspace/memory/secret.txt', 'w').write('A-secret')\n"
            "result = sorted(os.listdir('/workspace/memory')) if False else 'written'\n"
            "import os",
            answer="str(sorted(__import__('os').listdir('/workspace/memory')))",
        )
    )
    first = await harness.submit("attack")
    other = await harness.submit("hello")  # another session, same script, no attack
    await harness.work()
    async with harness.db_sessions() as db:
        runs = [await queries.get_run(db, r) for r in (first, other)]
        turns = [await queries.list_turns(db, r.session_id, after_sequence=0, limit=5) for r in runs if r]
    answers = ["".join(p.get("text", "") for p in t[1].parts if p["type"] == "text") for t in turns]
    assert answers == ["['secret.txt']", "[]"]


async def test_a_symlink_where_a_folder_belongs_is_replaced_not_followed(
    harness_factory: HarnessFactory,
) -> None:
    outcome = await attack(
        harness_factory,
        "import os, shutil\nshutil.rmtree('/workspace/memory')\nos.symlink('/etc', '/workspace/memory')\n"
        "result = os.readlink('/workspace/memory')",
        answer="str(__import__('os').path.islink('/workspace/memory'))",
        local=HOST_FOLDERS,
    )
    assert outcome.run.status == "completed"
    memories = [folder / "memory" for folder in workspace_folders(outcome)]
    assert memories and all(m.is_dir() and not m.is_symlink() for m in memories)  # real again


async def test_memory_is_limited_for_the_whole_sandbox(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import subprocess, sys\n"
        "code = 'x = bytearray(200 * 2**20); x[::4096] = b\"1\" * len(x[::4096]); '\n"
        "code += 'import time; time.sleep(2)'\n"
        "procs = [subprocess.Popen([sys.executable, '-c', code]) for _ in range(4)]\n"
        "result = sorted(p.wait() for p in procs)",
        local={"memory_mb": 512, "cell_timeout_seconds": 20},
    )
    assert outcome.answer.startswith("["), outcome.cell_outputs
    codes = json.loads(outcome.answer)
    assert -9 in codes, "four 200 MB processes fit a 512 MB sandbox: the limit is not whole-sandbox"


async def test_a_memory_bomb_is_a_memory_error(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "try:\n    x = bytearray(64 * 2**30)\n    result = 'allocated'\n"
        "except MemoryError:\n    result = 'MemoryError'",
    )
    assert outcome.answer == "MemoryError"


async def test_tmp_is_a_bounded_tmpfs(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import errno\nresult = 'wrote all'\ntry:\n    with open('/tmp/fill', 'wb') as f:\n"
        "        for _ in range(100):\n            f.write(b'x' * 2**20)\nexcept OSError as exc:\n"
        "    result = errno.errorcode[exc.errno]",
        local={"tmp_mb": 32},
    )
    assert outcome.answer == "ENOSPC"


async def test_the_workspace_has_a_byte_budget(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import time\nfor i in range(200):\n"
        "    open(f'/workspace/artifacts/f{i}', 'wb').write(b'x' * 2**20)\n"
        "    time.sleep(0.02)\nresult = 'wrote 200 MB'",
        answer="'finished'",
        local={"workspace_mb": 20, "cell_timeout_seconds": 30},
    )
    errors = [o.error for o in outcome.cell_outputs if o.error]
    assert errors and "budget" in errors[0] and "sandbox.local.workspace_mb" in errors[0]


async def test_background_processes_do_not_outlive_their_cell(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import subprocess\nsubprocess.Popen(['sh', '-c', 'while :; do :; done'], start_new_session=True)\n"
        "result = 'spawned'",
        answer="str(sorted(open(f'/proc/{p}/comm').read().strip() for p in __import__('os').listdir('/proc') "
        "if p.isdigit() and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'))",
    )
    assert "sh" not in json.loads(outcome.answer.replace("'", '"'))


async def test_fifty_megabytes_of_output_are_capped_on_the_host(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import sys, os\nsys.stdout.limit = 10**9\n"
        "for _ in range(50):\n    os.write(1, b'y' * 2**20)\nresult = 'printed'",
    )
    first = outcome.cell_outputs[0]
    limit = outcome.harness.settings.profile.rlm.max_output_chars
    assert first.truncated is True and len(first.stdout) <= limit
    assert outcome.answer == "printed"


async def test_an_oversized_answer_is_refused_and_the_rlm_can_retry(harness_factory: HarnessFactory) -> None:
    harness = harness_factory(
        {
            "lm": "root",
            "reasoning": "big",
            "code": "SUBMIT(answer='z' * (50 * 2**20)) if request == 'attack' else None",
        },
        {"lm": "root", "reasoning": "small", "code": "SUBMIT(answer='short')"},
        local={"cell_timeout_seconds": 30},  # 50 MiB crossing the jail is slow on a loaded machine
    )
    run_id = await harness.submit("attack")
    await harness.work()
    events = await harness.events(run_id)
    errors = [e.error for e in events if isinstance(e, CellOutput) and e.error]
    assert errors and "rlm.max_answer_chars" in errors[0]
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None and run.status == "completed"
        turns = await queries.list_turns(db, run.session_id, after_sequence=0, limit=5)
    assert [p["text"] for p in turns[1].parts if p["type"] == "text"] == ["short"]


async def test_a_flood_of_refused_llm_calls_makes_one_warning(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "refused = 0\nfor _ in range(2000):\n    try:\n        llm_query('hi')\n    except Exception:\n"
        "        refused += 1\nresult = refused",
        rlm={"max_llm_calls": 2},
        local={"cell_timeout_seconds": 60},  # a loaded machine: the flood, not the clock, is the test
    )
    assert int(outcome.answer) >= 1990
    warnings = [e for e in outcome.events if isinstance(e, RunWarning) and e.code == "llm_budget_exhausted"]
    assert len(warnings) == 1
    assert len([e for e in outcome.events if isinstance(e, LMQueryStarted)]) <= 2
    assert len(outcome.events) < 60


async def test_lone_surrogates_end_in_a_normal_turn(harness_factory: HarnessFactory) -> None:
    outcome = await attack(harness_factory, "print('bad \\ud800 text')\nresult = 'x\\udfffy'")
    assert outcome.run.status == "completed"
    assert outcome.answer == "x\ufffdy"


async def test_no_user_namespace_and_no_ptrace_inside(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import ctypes, os, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "unshare = libc.unshare(0x10000000)\nunshare_errno = ctypes.get_errno()\n"
        "ptrace = libc.ptrace(16, 1, 0, 0)\nptrace_errno = ctypes.get_errno()\n"
        "result = [unshare, errno.errorcode.get(unshare_errno), ptrace, errno.errorcode.get(ptrace_errno)]",
    )
    unshare, unshare_errno, ptrace, ptrace_errno = json.loads(outcome.answer.replace("'", '"'))
    assert (unshare, ptrace) == (-1, -1)
    assert unshare_errno in ("EPERM", "ENOSPC", "EINVAL") and ptrace_errno == "EPERM"


async def test_setuid_bits_do_not_survive_on_the_host(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import os, shutil\nshutil.copy('/usr/bin/true', '/workspace/memory/suid')\n"
        "os.chmod('/workspace/memory/suid', 0o4755)\nresult = oct(os.stat('/workspace/memory/suid').st_mode)",
        local=HOST_FOLDERS,
    )
    planted = [folder / "memory" / "suid" for folder in workspace_folders(outcome)]
    assert planted and not planted[0].stat().st_mode & (stat.S_ISUID | stat.S_ISGID)


async def test_each_workspace_runs_as_its_own_unprivileged_uid(harness_factory: HarnessFactory) -> None:
    outcome = await attack(harness_factory, "import os\nresult = os.getuid()")
    uid = int(outcome.answer)
    assert uid not in (0, 65534)
    if os.geteuid() == 0:
        config = LocalSandboxConfig()
        assert config.uid_base <= uid < config.uid_base + config.uid_count


async def test_a_stopped_repl_is_noticed_in_seconds(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)",
        local={"cell_timeout_seconds": 60},
    )
    errors = [o.error for o in outcome.cell_outputs if o.error]
    assert errors and "stopped" in errors[0]
    assert outcome.run.finished_at and outcome.run.started_at
    assert (outcome.run.finished_at - outcome.run.started_at).total_seconds() < 20


async def test_a_timed_out_cell_reports_what_it_printed(harness_factory: HarnessFactory) -> None:
    outcome = await attack(harness_factory, "print('before the loop', flush=True)\nwhile True:\n    pass")
    timed_out = [o for o in outcome.cell_outputs if o.error and "timeout" in o.error]
    assert timed_out and timed_out[0].stdout == "before the loop\n"


async def test_services_and_host_files_are_out_of_reach(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    ports = [redis_port, 5432, listener.getsockname()[1]]  # Redis, PostgreSQL, a stand-in gateway
    try:
        outcome = await attack(
            harness_factory,
            "import socket, os\nreach = {}\n"
            f"for port in {ports}:\n"
            "    try:\n        socket.create_connection(('127.0.0.1', port), 1).close()\n"
            "        reach[port] = 'open'\n    except OSError:\n        reach[port] = 'blocked'\n"
            "files = {p: os.path.exists(p) for p in ('/etc/passwd', '/root', '/home', '/var/lib')}\n"
            "result = [sorted(set(reach.values())), sorted(k for k, v in files.items() if v)]",
        )
    finally:
        listener.close()
    reach, visible = json.loads(outcome.answer.replace("'", '"'))
    assert reach == ["blocked"] and visible == []


async def test_a_fork_bomb_is_contained(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import os\nforks = 0\ntry:\n    for _ in range(100000):\n        if os.fork() == 0:\n"
        "            import time\n            time.sleep(30)\n            os._exit(0)\n        forks += 1\n"
        "except OSError as exc:\n    result = ['refused after', forks]",
        local={"max_processes": 32, "cell_timeout_seconds": 20},
    )
    refused, forks = json.loads(outcome.answer.replace("'", '"'))
    assert refused == "refused after" and forks < 64


async def test_the_jail_is_read_only_and_its_pid_1_is_closed(harness_factory: HarnessFactory) -> None:
    """`/`, `/dev` and `/usr` refuse writes; pid 1 is the supervisor, whose memory,
    environment and file descriptors no cell can open."""
    outcome = await attack(
        harness_factory,
        "import errno, os\nresult = {}\n"
        "for path in ('/planted', '/dev/planted', '/usr/planted'):\n"
        "    try:\n        open(path, 'w').close()\n        result[path] = 'written'\n"
        "    except OSError as exc:\n        result[path] = errno.errorcode[exc.errno]\n"
        "for path in ('/proc/1/mem', '/proc/1/environ', '/proc/1/fd'):\n"
        "    try:\n        os.listdir(path) if path.endswith('fd') else open(path, 'rb').read(1)\n"
        "        result[path] = 'opened'\n"
        "    except OSError as exc:\n        result[path] = errno.errorcode[exc.errno]\n"
        "result['/tmp'] = open('/tmp/scratch', 'w').write('ok')",
    )
    found = json.loads(outcome.answer.replace("'", '"'))
    assert {found[p] for p in ("/planted", "/dev/planted", "/usr/planted")} == {"EROFS"}
    assert {found[p] for p in ("/proc/1/mem", "/proc/1/environ", "/proc/1/fd")} <= {"EACCES", "EPERM"}
    assert found["/tmp"] == 2  # scratch space still works


async def test_refused_socket_families_stay_refused_with_high_bits_set(
    harness_factory: HarnessFactory,
) -> None:
    """The kernel reads the family as 32 bits; the filter compares the same 32 bits, so
    `(1 << 32) | AF_NETLINK` passed straight to the syscall is refused like AF_NETLINK."""
    outcome = await attack(
        harness_factory,
        "import ctypes, errno, platform, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "number = {'x86_64': 41, 'aarch64': 198}[platform.machine()]\n"
        "result = []\n"
        "for family in (socket.AF_NETLINK, socket.AF_NETLINK | (1 << 32), socket.AF_PACKET | (1 << 40)):\n"
        "    args = [ctypes.c_long(v) for v in (number, family, socket.SOCK_RAW, 0)]\n"
        "    fd = libc.syscall(*args)\n"
        "    result.append(errno.errorcode.get(ctypes.get_errno()) if fd < 0 else 'opened')",
    )
    assert json.loads(outcome.answer.replace("'", '"')) == ["EAFNOSUPPORT"] * 3


async def test_fifos_links_and_swaps_in_the_workspace_cost_the_host_nothing(
    harness_factory: HarnessFactory,
) -> None:
    """While the host measures the workspace (every second), the cell keeps swapping a folder
    for a FIFO and plants links: the host never blocks on the FIFO or follows a link, and the
    Turn's version holds regular files only, so the next Turn finds neither link nor FIFO."""
    outcome = await attack(
        harness_factory,
        "import os, time\nbase = '/workspace/artifacts'\n"
        "os.mkdir(base + '/swap')\nos.mkfifo(base + '/fifo')\n"
        "os.symlink('/etc/passwd', base + '/link')\nos.symlink('loop', base + '/loop')\n"
        "swaps = 0\nend = time.monotonic() + 3\n"
        "while time.monotonic() < end:\n"
        "    os.rename(base + '/swap', base + '/held')\n    os.rename(base + '/fifo', base + '/swap')\n"
        "    os.rename(base + '/swap', base + '/fifo')\n    os.rename(base + '/held', base + '/swap')\n"
        "    swaps += 1\n"
        "result = 'swapped' if swaps > 100 else swaps",
        local={"cell_timeout_seconds": 30, **HOST_FOLDERS},
    )
    assert outcome.answer == "swapped"
    artifacts = [folder / "artifacts" for folder in workspace_folders(outcome)]
    assert artifacts and (artifacts[0]).is_dir() and not (artifacts[0] / "fifo").exists()
    assert not (artifacts[0] / "link").is_symlink() and not (artifacts[0] / "swap").exists()


async def test_folders_nested_too_deep_are_refused_not_crashed_on(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "import os\npath = '/workspace/artifacts'\nfor _ in range(80):\n"
        "    path += '/d'\n    os.mkdir(path)\nresult = 'built'",
    )
    errors = [o.error for o in outcome.cell_outputs if o.error]
    assert errors and "nested deeper" in errors[0]
    assert outcome.run.status == "completed"  # SUBMIT still ends the Turn; the release still ran


async def test_the_workspace_has_a_file_count_budget(harness_factory: HarnessFactory) -> None:
    outcome = await attack(
        harness_factory,
        "for i in range(300):\n    open(f'/workspace/artifacts/e{i}', 'w').close()\nresult = 'made'",
        local={"workspace_files": 100},
    )
    errors = [o.error for o in outcome.cell_outputs if o.error]
    assert errors and "sandbox.local.workspace_files" in errors[0]


async def test_frames_forged_by_a_cell_carry_nothing_to_the_host(harness_factory: HarnessFactory) -> None:
    """The cell writes forged frames (a result with output and fields of its own, a tool call
    to a tool that does not exist) to every fd it has: the host channel is not among them, and
    what the supervisor relays is rebuilt from the protocol's fields only."""
    outcome = await attack(
        harness_factory,
        "import json, os, struct\nmarker = 'INJ' + 'ECTED'\n"
        "frames = [\n"
        "    {'op': 'tool_call', 'name': 'shell', 'kwargs': {'cmd': marker}},\n"
        "    {'op': 'result', 'id': 999, 'final': {'answer': marker}, 'stdout': marker, 'truncated': True},\n"
        "]\nwritten = 0\n"
        "for message in frames:\n"
        "    payload = json.dumps(message).encode()\n"
        "    for fd in range(3, 64):\n"
        "        try:\n            os.write(fd, struct.pack('>I', len(payload)) + payload)\n"
        "            written += 1\n        except OSError:\n            pass\n"
        "result = written",
        answer="'reported'",
    )
    assert outcome.run.status == "completed" and outcome.answer == "reported"
    errors = [o.error for o in outcome.cell_outputs if o.error]  # the interpreter was reset
    assert errors and "protocol" in errors[0]
    assert all("INJECTED" not in repr(event) for event in outcome.events)
