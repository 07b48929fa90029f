"""A fake Daytona on loopback: the HTTP and WebSocket API the `daytona` SDK speaks, for tests.

Daytona cannot be reached from the test machine, so the provider is tested at the SDK's HTTP
boundary: the real SDK (and our relay and bridge) talk to this server, not to mocks of our code.
A "sandbox" here is a folder; a session command is a real local process (the bridge and the REPL
driver, unjailed), so the frame round trip is real. Absolute sandbox paths (`/workspace/...`,
`/tmp/fleet-repl/...`) map into the sandbox's folder. Every request is recorded for assertions.
The toolbox's file API is in fake_daytona_files.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.fake_daytona_files import FakeFiles

STDOUT_PREFIX, STDERR_PREFIX = b"\x01\x01\x01", b"\x02\x02\x02"
MAPPED = ("/workspace", "/tmp/fleet-repl")


def kill_tree(process: asyncio.subprocess.Process) -> None:
    """What Daytona does to a deleted session: its command and everything it started go."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Command:
    id: str
    process: asyncio.subprocess.Process
    exit_code: int | None = None


@dataclass
class FakeSandbox:
    id: str
    labels: dict[str, str]
    root: Path
    state: str = "started"
    sessions: dict[str, dict[str, Command]] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)

    def local(self, path: str) -> Path:
        for prefix in MAPPED:
            if path == prefix or path.startswith(prefix + "/"):
                return self.root / path.lstrip("/")
        raise web.HTTPForbidden(text=f"the fake maps only {MAPPED}, not {path}")


class FakeDaytona(FakeFiles):
    def __init__(self) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.requests: list[tuple[str, str]] = []
        self.snapshots: dict[str, dict[str, Any]] = {}
        FakeFiles.__init__(self)
        self.fail_next: dict[str, tuple[int, str]] = {}  # "POST /sandbox" → (status, message)
        self.folder = Path(tempfile.mkdtemp(prefix="fake-daytona-"))
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count(1)
        self.url = ""
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeDaytona:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._record], client_max_size=2**30)
        api, box = "/api", "/toolbox/{sandbox}"
        app.add_routes(
            [
                web.post(f"{api}/sandbox", self.create_sandbox),
                web.get(f"{api}/sandbox", self.list_sandboxes),
                web.get(f"{api}/sandbox/{{id}}", self.get_sandbox),
                web.delete(f"{api}/sandbox/{{id}}", self.delete_sandbox),
                web.put(f"{api}/sandbox/{{id}}/labels", self.set_labels),
                web.post(f"{api}/sandbox/{{id}}/start", self.start_sandbox),
                web.post(f"{api}/snapshots", self.create_snapshot),
                web.post(f"{box}/process/session", self.create_session),
                web.delete(f"{box}/process/session/{{session}}", self.delete_session),
                web.post(f"{box}/process/session/{{session}}/exec", self.exec_command),
                web.post(f"{box}/process/session/{{session}}/command/{{cmd}}/input", self.send_input),
                web.get(f"{box}/process/session/{{session}}/command/{{cmd}}/logs", self.logs),
                web.get(f"{box}/process/session/{{session}}/command/{{cmd}}", self.get_command),
                web.post(f"{box}/files/bulk-upload", self.upload),
                web.post(f"{box}/files/folder", self.create_folder),
                web.post(f"{box}/files/bulk-download", self.download),
                web.get(f"{box}/files/info", self.file_info),
                web.get(f"{box}/files", self.list_files),
                web.delete(f"{box}/files", self.delete_file),
                web.post(f"{box}/files/permissions", self.set_permissions),
            ]
        )
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _shutdown(self) -> None:
        for sandbox in self.sandboxes.values():
            for commands in sandbox.sessions.values():
                for command in commands.values():
                    kill_tree(command.process)
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = f"{request.method} {resource.canonical if resource is not None else request.path}"
        self.requests.append((request.method, request.path))
        failure = self.fail_next.pop(route, None)
        if failure is not None:
            status, message = failure
            return web.json_response({"message": message, "statusCode": status}, status=status)
        return await handler(request)

    # --- control plane -----------------------------------------------------------------------

    def sandbox_json(self, sandbox: FakeSandbox) -> dict[str, Any]:
        return {
            "id": sandbox.id,
            "organizationId": "org",
            "name": sandbox.id,
            "user": "daytona",
            "env": {},
            "labels": sandbox.labels,
            "public": False,
            "networkBlockAll": True,
            "kvm": False,
            "target": "local",
            "cpu": 1,
            "gpu": 0,
            "memory": 1,
            "disk": 3,
            "state": sandbox.state,
            "toolboxProxyUrl": f"{self.url}/toolbox",
        }

    async def create_sandbox(self, request: web.Request) -> web.Response:
        body = await request.json()
        sandbox_id = f"sb-{next(self.ids)}"
        root = self.folder / sandbox_id
        root.mkdir()  # as on Daytona without a Volume: no /workspace until something makes it
        sandbox = FakeSandbox(sandbox_id, dict(body.get("labels") or {}), root, body=body)
        self.sandboxes[sandbox_id] = sandbox
        return web.json_response(self.sandbox_json(sandbox))

    def find(self, request: web.Request, key: str = "id") -> FakeSandbox:
        sandbox = self.sandboxes.get(request.match_info[key])
        if sandbox is None:
            raise web.HTTPNotFound(text=json.dumps({"message": "sandbox not found", "statusCode": 404}))
        return sandbox

    async def list_sandboxes(self, request: web.Request) -> web.Response:
        wanted = json.loads(request.query.get("labels") or "{}")
        items = [
            self.sandbox_json(s)
            for s in self.sandboxes.values()
            if all(s.labels.get(k) == v for k, v in wanted.items())
        ]
        return web.json_response({"items": items, "nextCursor": None})

    async def get_sandbox(self, request: web.Request) -> web.Response:
        return web.json_response(self.sandbox_json(self.find(request)))

    async def delete_sandbox(self, request: web.Request) -> web.Response:
        sandbox = self.find(request)
        await self._shutdown_sessions(sandbox)
        del self.sandboxes[sandbox.id]
        sandbox.state = "destroyed"
        return web.json_response(self.sandbox_json(sandbox))

    async def set_labels(self, request: web.Request) -> web.Response:
        sandbox = self.find(request)
        sandbox.labels = dict((await request.json())["labels"])
        return web.json_response({"labels": sandbox.labels})

    async def start_sandbox(self, request: web.Request) -> web.Response:
        sandbox = self.find(request)
        sandbox.state = "started"
        return web.json_response(self.sandbox_json(sandbox))

    async def create_snapshot(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.snapshots[body["name"]] = body
        stamp = now()
        return web.json_response(
            {
                "id": f"snap-{next(self.ids)}",
                "general": False,
                "name": body["name"],
                "state": "active",  # built at once: the SDK does not poll or follow logs
                "cpu": 1,
                "gpu": 0,
                "mem": 1,
                "disk": 3,
                "createdAt": stamp,
                "updatedAt": stamp,
                "lastUsedAt": None,
                "errorReason": None,
                "sourceSandboxId": None,
            }
        )

    # --- toolbox: processes ------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        sandbox = self.find(request, "sandbox")
        name = (await request.json())["sessionId"]
        if name in sandbox.sessions:  # as Daytona: a session id is used once
            return web.json_response({"message": "session already exists", "statusCode": 409}, status=409)
        sandbox.sessions[name] = {}
        return web.json_response({}, status=201)

    async def _shutdown_sessions(self, sandbox: FakeSandbox, only: str | None = None) -> None:
        for name, commands in list(sandbox.sessions.items()):
            if only is not None and name != only:
                continue
            for command in commands.values():
                if command.process.returncode is None:
                    kill_tree(command.process)
                    await command.process.wait()
            del sandbox.sessions[name]

    async def delete_session(self, request: web.Request) -> web.Response:
        sandbox = self.find(request, "sandbox")
        if request.match_info["session"] not in sandbox.sessions:
            return web.json_response({"message": "session not found", "statusCode": 404}, status=404)
        await self._shutdown_sessions(sandbox, request.match_info["session"])
        return web.json_response({})

    async def exec_command(self, request: web.Request) -> web.Response:
        sandbox = self.find(request, "sandbox")
        body = await request.json()
        command = body["command"]
        for prefix in MAPPED:
            command = command.replace(prefix, str(sandbox.root / prefix.lstrip("/")))
        command = command.replace("python3 -I -S", f"{shutil.which('python3')} -I -S")
        process = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        command_id = str(uuid.uuid4())
        sandbox.sessions.setdefault(request.match_info["session"], {})[command_id] = Command(
            command_id, process
        )
        return web.json_response({"cmdId": command_id})

    def command(self, request: web.Request) -> Command:
        sandbox = self.find(request, "sandbox")
        try:
            return sandbox.sessions[request.match_info["session"]][request.match_info["cmd"]]
        except KeyError:
            raise web.HTTPNotFound(
                text=json.dumps({"message": "command not found", "statusCode": 404})
            ) from None

    async def send_input(self, request: web.Request) -> web.Response:
        process = self.command(request).process
        assert process.stdin is not None
        process.stdin.write((await request.json())["data"].encode())
        await process.stdin.drain()
        return web.json_response({})

    async def get_command(self, request: web.Request) -> web.Response:
        command = self.command(request)
        result: dict[str, Any] = {"id": command.id, "command": "fake"}
        if command.process.returncode is not None:
            result["exitCode"] = command.process.returncode
        return web.json_response(result)

    async def logs(self, request: web.Request) -> web.StreamResponse:
        command = self.command(request)
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        lock = asyncio.Lock()

        async def pump(stream: asyncio.StreamReader | None, prefix: bytes) -> None:
            assert stream is not None
            while chunk := await stream.read(65536):
                async with lock:
                    await socket.send_bytes(prefix + chunk)

        await asyncio.gather(
            pump(command.process.stdout, STDOUT_PREFIX), pump(command.process.stderr, STDERR_PREFIX)
        )
        command.exit_code = await command.process.wait()
        await socket.close(code=1000)
        return socket
