/**
 * Real stacks for e2e tests: `uv run fleet up` on a free port (or FLEET_API_URL), and the pieces
 * an operator runs (Redis, `fleet db upgrade`, `fleet gateway`, `fleet worker`) for a test that
 * kills and restarts the gateway alone.
 */

import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { chmodSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { Socket, createServer, type Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

export const TUI_DIR = fileURLToPath(new URL("../../", import.meta.url));
export const REPO = join(TUI_DIR, "..");
export const SCRIPT = join(TUI_DIR, "test", "e2e", "scripts", "tui.jsonl");

export interface Stack {
  readonly url: string;
  stop(): Promise<void>;
}

export async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as { port: number }).port;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** Uses FLEET_API_URL when set (it must run tui.jsonl as its scripted LM); else starts `fleet up`. */
export async function startStack(): Promise<Stack> {
  const external = process.env["FLEET_API_URL"];
  if (external) return { url: external.replace(/\/+$/, ""), stop: async () => undefined };
  const port = await freePort();
  const cwd = mkdtempSync(join(tmpdir(), "fleet-tui-e2e-"));
  chmodSync(cwd, 0o711); // the sandbox's uid must be able to pass through
  const log = openSync(join(cwd, "fleet-up.log"), "w");
  const env: NodeJS.ProcessEnv = { ...process.env, FLEET_CONFIG: join(REPO, "config", "fleet.toml"), FLEET_SCRIPTED_LM: SCRIPT };
  delete env["FLEET_PROFILE"];
  const child = spawnGroup("uv", ["run", "--project", REPO, "fleet", "up", "--port", String(port)], { cwd, env, log });
  const url = `http://127.0.0.1:${port}`;
  try {
    await waitReady(url, [child], 180_000);
  } catch (error) {
    await stopGroup(child);
    throw new Error(`${String(error)} (log: ${join(cwd, "fleet-up.log")})`);
  }
  return {
    url,
    stop: async () => {
      await stopGroup(child);
      removeDir(cwd);
    },
  };
}

/** Polls `/ready`; fails early when one of `children` (the processes it needs) exits. */
async function waitReady(url: string, children: readonly (ChildProcess | undefined)[], timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    for (const child of children) {
      if (child && exited(child)) throw new Error(`\`${nameOf(child)}\` exited with ${child.exitCode ?? child.signalCode}`);
    }
    try {
      if ((await fetch(`${url}/ready`)).ok) return;
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error("the stack never became ready");
}

/** Every process group this test process started and has not yet seen end. */
const groups = new Set<ChildProcess>();

// The last resort when a test process ends without its `after` hooks (a crash, a signal).
process.once("exit", () => {
  for (const child of groups) killGroup(child, "SIGKILL");
});

/** Spawns `command` as the leader of a new process group (everything it forks stays in the group). */
function spawnGroup(command: string, args: readonly string[], options: { cwd: string; env: NodeJS.ProcessEnv; log: number }): ChildProcess {
  const child = spawn(command, args, { cwd: options.cwd, env: options.env, detached: true, stdio: ["ignore", options.log, options.log] });
  groups.add(child);
  child.once("exit", () => killGroup(child, "SIGKILL")); // stragglers (Granian workers, sandboxes) go with the leader
  return child;
}

function killGroup(child: ChildProcess, signal: NodeJS.Signals): void {
  if (child.pid === undefined) return;
  try {
    process.kill(-child.pid, signal);
  } catch {
    // the group is already empty
  }
}

/** `fleet gateway` for `uv run --project <repo> fleet gateway --port …`, else the command. */
function nameOf(child: ChildProcess): string {
  const args = child.spawnargs;
  return args[0] === "uv" ? args.slice(4, 6).join(" ") : (args[0] ?? "?");
}

function exited(child: ChildProcess): boolean {
  return child.exitCode !== null || child.signalCode !== null;
}

/** Signals the whole group and waits for its leader; SIGKILL for the group after `graceMs`. */
async function stopGroup(child: ChildProcess, signal: NodeJS.Signals = "SIGINT", graceMs = 40_000): Promise<void> {
  if (child.pid === undefined) return;
  if (!exited(child)) {
    const gone = new Promise((resolve) => child.once("exit", resolve));
    killGroup(child, signal);
    const timer = setTimeout(() => killGroup(child, "SIGKILL"), graceMs);
    await gone;
    clearTimeout(timer);
  }
  killGroup(child, "SIGKILL");
  groups.delete(child);
}

/** The pieces of a stack, each its own process group; the gateway can be killed and restarted. */
export class PiecesStack implements Stack {
  readonly url: string;
  private redis: ChildProcess | undefined;
  private gateway: ChildProcess | undefined;
  private worker: ChildProcess | undefined;
  private gateways = 0;

  private constructor(
    readonly dir: string,
    readonly redisPort: number,
    readonly port: number,
    private readonly env: NodeJS.ProcessEnv,
  ) {
    this.url = `http://127.0.0.1:${port}`;
  }

  /** Redis on a free loopback port, a migrated SQLite file, one gateway and one worker, all ready. */
  static async start(): Promise<PiecesStack> {
    const dir = mkdtempSync(join(tmpdir(), "fleet-tui-pieces-"));
    chmodSync(dir, 0o711); // the sandbox's uid must be able to pass through
    const redisPort = await freePort();
    const env: NodeJS.ProcessEnv = {
      ...process.env,
      FLEET_CONFIG: join(REPO, "config", "fleet.toml"),
      FLEET_REDIS_URL: `redis://127.0.0.1:${redisPort}/0`,
      FLEET_DATABASE_URL: `sqlite+aiosqlite:///${join(dir, "fleet.db")}`,
      FLEET_SCRIPTED_LM: SCRIPT,
    };
    delete env["FLEET_PROFILE"];
    const stack = new PiecesStack(dir, redisPort, await freePort(), env);
    try {
      stack.redis = spawnGroup("redis-server", ["--port", String(redisPort), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir], { cwd: dir, env, log: stack.log("redis") });
      await waitRedis(redisPort, stack.redis, 20_000);
      const upgrade = spawnSync("uv", ["run", "--project", REPO, "fleet", "db", "upgrade"], { cwd: dir, env, encoding: "utf8", timeout: 120_000 });
      if (upgrade.status !== 0) throw new Error(`fleet db upgrade failed (${upgrade.status ?? upgrade.signal}): ${upgrade.stderr}${upgrade.stdout}`);
      stack.worker = spawnGroup("uv", ["run", "--project", REPO, "fleet", "worker", "--metrics-port", "0"], { cwd: dir, env, log: stack.log("worker") });
      await stack.startGateway();
    } catch (error) {
      await stack.stop({ keepLogs: true });
      throw new Error(`${String(error)} (logs in ${dir})`);
    }
    return stack;
  }

  /** Starts a gateway on the stack's port and waits for /ready (which also needs the worker). */
  async startGateway(timeoutMs = 120_000): Promise<void> {
    this.gateways++;
    const gateway = spawnGroup("uv", ["run", "--project", REPO, "fleet", "gateway", "--port", String(this.port)], { cwd: this.dir, env: this.env, log: this.log(`gateway-${this.gateways}`) });
    this.gateway = gateway;
    try {
      await waitReady(this.url, [gateway, this.worker, this.redis], timeoutMs);
    } catch (error) {
      throw new Error(`${String(error)}\n--- gateway-${this.gateways}.log\n${this.tail(`gateway-${this.gateways}`)}\n--- worker.log\n${this.tail("worker")}`);
    }
  }

  /** SIGKILLs the gateway's whole process group (Granian forks its workers) and waits for it. */
  async killGateway(): Promise<void> {
    if (this.gateway) await stopGroup(this.gateway, "SIGKILL");
  }

  /** The last lines of a process's log, for a failure message. */
  tail(name: string, lines = 20): string {
    try {
      return readFileSync(join(this.dir, `${name}.log`), "utf8").trimEnd().split("\n").slice(-lines).join("\n");
    } catch {
      return "(no log)";
    }
  }

  /** SIGTERM for the worker and the gateway (SIGKILL after 15 s), then Redis; then removes the folder. */
  async stop(options: { keepLogs?: boolean } = {}): Promise<void> {
    const services = [this.worker, this.gateway].filter((c): c is ChildProcess => c !== undefined);
    await Promise.allSettled(services.map((c) => stopGroup(c, "SIGTERM", 15_000)));
    if (this.redis) await stopGroup(this.redis, "SIGTERM", 5_000).catch(() => undefined);
    if (!options.keepLogs) removeDir(this.dir);
  }

  private log(name: string): number {
    return openSync(join(this.dir, `${name}.log`), "a");
  }
}

/** Removes a stack's folder (database, workspaces, logs) unless FLEET_TUI_KEEP_LOGS is set. */
function removeDir(dir: string): void {
  if (process.env["FLEET_TUI_KEEP_LOGS"]) {
    process.stderr.write(`fleet-tui e2e: kept ${dir}\n`);
    return;
  }
  try {
    rmSync(dir, { recursive: true, force: true, maxRetries: 3 });
  } catch {
    // a sandbox may still hold a file; the OS cleans /tmp
  }
}

/** Waits until Redis answers PING. */
async function waitRedis(port: number, child: ChildProcess, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (exited(child)) throw new Error(`redis-server exited with ${child.exitCode ?? child.signalCode}`);
    const pong = await new Promise<boolean>((resolve) => {
      const socket = new Socket();
      const done = (ok: boolean): void => {
        socket.destroy();
        resolve(ok);
      };
      socket.setTimeout(1_000, () => done(false));
      socket.once("error", () => done(false));
      socket.once("data", (data) => done(data.toString().startsWith("+PONG")));
      socket.connect(port, "127.0.0.1", () => socket.write("PING\r\n"));
    });
    if (pong) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error("redis-server never answered PING");
}

/** A TCP proxy in front of the gateway that can cut every connection and refuse new ones. */
export class CuttableProxy {
  private readonly sockets = new Set<Socket>();
  private server: Server | undefined;
  blocked = false;
  url = "";

  constructor(private readonly target: URL) {}

  async start(): Promise<void> {
    this.server = createServer((client) => {
      if (this.blocked) return client.destroy();
      const upstream = new Socket();
      upstream.connect(Number(this.target.port), this.target.hostname);
      for (const s of [client, upstream]) {
        this.sockets.add(s);
        s.on("close", () => this.sockets.delete(s));
        s.on("error", () => undefined);
      }
      client.pipe(upstream).pipe(client);
      client.on("close", () => upstream.destroy());
      upstream.on("close", () => client.destroy());
    });
    await new Promise<void>((resolve) => this.server!.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as { port: number }).port}`;
  }

  /** Drops every open connection (a network failure mid-stream). */
  cut(): void {
    for (const s of this.sockets) s.destroy();
  }

  async stop(): Promise<void> {
    this.cut();
    await new Promise((resolve) => this.server?.close(resolve));
  }
}
