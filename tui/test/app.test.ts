/** The App's keys in a virtual terminal, against an in-process fake gateway (no network). */

import assert from "node:assert/strict";
import { test } from "node:test";
import { FleetApi, type FetchLike } from "../src/api.ts";
import { App } from "../src/app.ts";
import { VirtualTerminal } from "./e2e/virtual-terminal.ts";
import { sseOf } from "./helpers.ts";

const RUN_ID = "run-1";
const CTRL_C = "\x03";
const ESC = "\x1b";

/** A gateway with one session whose Turn streams a step and then waits; a cancel may end it. */
function fakeGateway(options: { abortOnCancel: boolean; refuseInterrupt?: boolean }) {
  const calls: string[] = [];
  let created = 0;
  let turn: ReadableStreamDefaultController<Uint8Array> | undefined;
  let approvalStream: ReadableStreamDefaultController<Uint8Array> | undefined;
  const decisions: string[] = [];
  let endFirst: () => void = () => {};
  const firstEnded = new Promise<void>((resolve) => (endFirst = resolve));
  const encoder = new TextEncoder();
  const json = (body: unknown): Response => new Response(JSON.stringify(body), { headers: { "content-type": "application/json" } });
  const fetcher: FetchLike = async (url, init) => {
    const method = init?.method ?? "GET";
    const path = new URL(url).pathname;
    calls.push(`${method} ${path}`);
    if (method === "POST" && path === "/api/sessions") {
      created += 1;
      if (created === 1) return json({ id: "session-1", title: null, status: "idle" });
      await new Promise((r) => setTimeout(r, 300)); // a slow /new: a prompt typed meanwhile waits for it
      return json({ id: "session-new", title: null, status: "idle" });
    }
    if (method === "GET" && path === "/api/sessions") {
      const items = ["session-1", "session-2-abcdef"].map((id) => ({ id, title: null, status: "idle" }));
      return json({ items, total: items.length });
    }
    if (method === "GET" && path === "/api/sessions/session-2-abcdef") return json({ id: "session-2-abcdef", title: "older", status: "idle" });
    if (method === "GET" && path === "/api/sessions/session-2-abcdef/turns") return json({ items: [], next_after_sequence: null });
    if (method === "DELETE" && /^\/api\/sessions\/session-(1|2-abcdef)$/.test(path)) return new Response(null, { status: 204 });
    if (method === "POST" && /^\/api\/sessions\/[^/]+\/turns$/.test(path) && String(init?.body).includes("needs approval")) {
      // Its cell waits for a decision; a decision on it (below) lets it run.
      const body = new ReadableStream<Uint8Array>({
        start(controller) {
          approvalStream = controller;
          const pending = { approval_id: "ap-1", call_id: "cell-1", code: "import subprocess", reason: "it starts processes (subprocess)", state: "pending", timeout_seconds: 300 };
          const frames = [
            { id: "0.0.1", data: { type: "start", messageId: "run-4", messageMetadata: { runId: "run-4" } } },
            { id: "1.0", data: { type: "data-approval", id: "ap-1", data: pending } },
          ];
          controller.enqueue(encoder.encode(sseOf(frames, false)));
        },
      });
      return new Response(body, { headers: { "content-type": "text/event-stream", "x-fleet-run-id": "run-4" } });
    }
    if (method === "POST" && path === "/api/runs/run-4/approvals/ap-1") {
      decisions.push(String(init?.body));
      const approved = { approval_id: "ap-1", call_id: "cell-1", code: "import subprocess", reason: "it starts processes (subprocess)", state: "approved", timeout_seconds: 300, decided_by: "me" };
      const frames = [
        { id: "2.0", data: { type: "data-approval", id: "ap-1", data: approved } },
        { id: "3.0", data: { type: "text-start", id: "text-answer" } },
        { id: "3.1", data: { type: "text-delta", id: "text-answer", delta: "Ran it after approval." } },
        { id: "3.2", data: { type: "text-end", id: "text-answer" } },
        { id: "4.0", data: { type: "finish", finishReason: "stop" } },
      ];
      approvalStream?.enqueue(encoder.encode(sseOf(frames)));
      approvalStream?.close();
      return json({ run_id: "run-4", approval_id: "ap-1", decision: "approve" });
    }
    if (method === "POST" && /^\/api\/sessions\/[^/]+\/turns$/.test(path) && String(init?.body).includes('"multitask":"enqueue"')) {
      // It waits on the server (heartbeats only) until the running Turn has ended, then runs.
      const body = new ReadableStream<Uint8Array>({
        async start(controller) {
          controller.enqueue(encoder.encode(sseOf([{ id: "0.0.1", data: { type: "start", messageId: "run-3", messageMetadata: { runId: "run-3" } } }], false)));
          await firstEnded;
          const frames = [
            { id: "1.0", data: { type: "text-start", id: "text-answer" } },
            { id: "1.1", data: { type: "text-delta", id: "text-answer", delta: "Answered after it." } },
            { id: "1.2", data: { type: "text-end", id: "text-answer" } },
            { id: "2.0", data: { type: "finish", finishReason: "stop" } },
          ];
          controller.enqueue(encoder.encode(sseOf(frames)));
          controller.close();
        },
      });
      return new Response(body, { headers: { "content-type": "text/event-stream", "x-fleet-run-id": "run-3" } });
    }
    if (method === "POST" && /^\/api\/sessions\/[^/]+\/turns$/.test(path) && String(init?.body).includes('"multitask":"interrupt"')) {
      if (options.refuseInterrupt) {
        return new Response(JSON.stringify({ code: "turn_in_progress", message: "the running Turn did not end in time" }), { status: 409, headers: { "content-type": "application/json" } });
      }
      turn?.enqueue(encoder.encode(sseOf([{ id: "3.0", data: { type: "abort", reason: "Turn cancelled" } }])));
      turn?.close(); // the server cancelled the running Turn; then this one runs
      const frames = [
        { id: "0.0.1", data: { type: "start", messageId: "run-2", messageMetadata: { runId: "run-2" } } },
        { id: "1.0", data: { type: "text-start", id: "text-answer" } },
        { id: "1.1", data: { type: "text-delta", id: "text-answer", delta: "Answered instead." } },
        { id: "1.2", data: { type: "text-end", id: "text-answer" } },
        { id: "2.0", data: { type: "finish", finishReason: "stop" } },
      ];
      return new Response(sseOf(frames), { headers: { "content-type": "text/event-stream", "x-fleet-run-id": "run-2" } });
    }
    if (method === "POST" && /^\/api\/sessions\/[^/]+\/turns$/.test(path)) {
      const body = new ReadableStream<Uint8Array>({
        start(controller) {
          turn = controller;
          const frames = [
            { id: "0.0.1", data: { type: "start", messageId: RUN_ID, messageMetadata: { runId: RUN_ID } } },
            { id: "1.0", data: { type: "start-step" } },
            { id: "2.0", data: { type: "reasoning-start", id: "r1" } },
            { id: "2.1", data: { type: "reasoning-delta", id: "r1", delta: "Thinking slowly." } },
            { id: "2.2", data: { type: "reasoning-end", id: "r1" } },
          ];
          controller.enqueue(encoder.encode(sseOf(frames, false)));
          init?.signal?.addEventListener("abort", () => controller.error(init.signal?.reason));
        },
      });
      return new Response(body, { headers: { "content-type": "text/event-stream", "x-fleet-run-id": RUN_ID } });
    }
    if (method === "PUT" && path === `/api/runs/${RUN_ID}/cancellation`) {
      if (options.abortOnCancel) {
        setTimeout(() => {
          turn?.enqueue(encoder.encode(sseOf([{ id: "3.0", data: { type: "abort", reason: "Turn cancelled" } }])));
          turn?.close();
          endFirst();
        }, 20);
      }
      return json({ run_id: RUN_ID, state: "requested" });
    }
    return new Response(JSON.stringify({ code: "not_found", message: "Not Found" }), { status: 404 });
  };
  return { calls, decisions, api: new FleetApi("http://fake.invalid", undefined, fetcher) };
}

async function open(abortOnCancel: boolean, refuseInterrupt = false) {
  const gateway = fakeGateway({ abortOnCancel, refuseInterrupt });
  const term = new VirtualTerminal(100, 40);
  const app = new App({ api: gateway.api, terminal: term });
  let code: number | undefined;
  const exited = app.run().then((c) => (code = c));
  await term.waitFor("the session", (s) => s.includes("new session session-1") && s.includes("/help lists the commands"), 5_000);
  return { ...gateway, term, exited, code: () => code };
}

async function startTurn(term: VirtualTerminal): Promise<void> {
  term.type("go slow");
  term.type("\r");
  await term.waitFor("the first step", (s) => s.includes("Thinking slowly.") && s.includes("esc/ctrl+c cancel"), 5_000);
}

const settle = (): Promise<void> => new Promise((r) => setTimeout(r, 50));

test("Ctrl+C during a Turn cancels it (like Esc); the client keeps running", async () => {
  const { calls, term, exited, code } = await open(true);
  await startTurn(term);
  term.type(CTRL_C);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  await settle();
  assert.equal(code(), undefined, "the first Ctrl+C does not quit");
  assert.deepEqual(calls.filter((c) => c.startsWith("PUT")), [`PUT /api/runs/${RUN_ID}/cancellation`]);
  await term.waitFor("the idle info line", (s) => s.includes("ctrl+c quit"), 5_000);
  term.type(CTRL_C); // idle now: quits
  await exited;
  assert.equal(code(), 0);
});

test("a second Ctrl+C while the cancel is pending quits", async () => {
  const { calls, term, exited, code } = await open(false);
  await startTurn(term);
  term.type(CTRL_C);
  await term.waitFor("the pending cancel", (s) => s.includes("Ctrl+C again quits"), 5_000);
  assert.equal(code(), undefined);
  term.type(CTRL_C);
  await exited;
  assert.equal(code(), 0);
  assert.equal(calls.filter((c) => c.startsWith("PUT")).length, 1, "one cancellation request");
});

test("Esc cancels; Ctrl+C when no Turn runs quits at once", async () => {
  const { calls, term, exited, code } = await open(true);
  await startTurn(term);
  term.type(ESC);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  assert.equal(code(), undefined);
  assert.equal(calls.filter((c) => c.startsWith("PUT")).length, 1);
  term.type(CTRL_C);
  await exited;
  assert.equal(code(), 0);
});


test("the status line shows how long the Turn has run", async () => {
  const { term, exited } = await open(true);
  await startTurn(term);
  await term.waitFor("an elapsed time", (s) => /· [1-9]\d*s\b/.test(s), 5_000);
  term.type(ESC);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  term.type(CTRL_C);
  await exited;
});

test("quitting says how to come back to the session", async () => {
  const gateway = fakeGateway({ abortOnCancel: true });
  const term = new VirtualTerminal(100, 40);
  const app = new App({ api: gateway.api, terminal: term });
  const exited = app.run();
  await term.waitFor("the session", (s) => s.includes("new session session-1"), 5_000);
  term.type(CTRL_C);
  await exited;
  assert.equal(app.exitHint(), "to come back to this session: uv run fleet cli --session session-1");
});

test("/attach of a missing file names the file and the folder it was looked for in", async () => {
  const { term, exited } = await open(true);
  term.type("/attach no-such-dir/notes.txt");
  term.type("\r");
  const screen = await term.waitFor("the error", (s) => s.includes("no such file"), 5_000);
  assert.ok(screen.includes("no-such-dir/notes.txt") && screen.includes(process.cwd()), screen);
  term.type(CTRL_C);
  await exited;
});

test("/resume takes any unique prefix of a session id, listed or not", async () => {
  const { term, exited } = await open(true);
  term.type("/resume session-2");
  term.type("\r");
  await term.waitFor("the older session", (s) => s.includes("session-2-abcdef"), 5_000);
  term.type(CTRL_C);
  await exited;
});


test("/delete takes a session id's prefix; deleting the current session starts a new one", async () => {
  const { calls, term, exited } = await open(true);
  term.type("/delete session-2");
  term.type("\r");
  await term.waitFor("the older session's deletion", (s) => s.includes("deleted session session-2-abcdef"), 5_000);
  assert.ok(!calls.includes("POST /api/sessions/session-new/turns") && calls.filter((c) => c === "POST /api/sessions").length === 1);
  term.type("/delete session-1");
  term.type("\r");
  term.type("go slow");
  term.type("\r");
  await term.waitFor("a new session, then the Turn in it", (s) => s.includes("Thinking slowly."), 5_000);
  assert.deepEqual(calls.filter((c) => c.startsWith("DELETE")), ["DELETE /api/sessions/session-2-abcdef", "DELETE /api/sessions/session-1"]);
  assert.deepEqual(calls.filter((c) => c.endsWith("/turns") && c.startsWith("POST")), ["POST /api/sessions/session-new/turns"]);
  term.type(ESC);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  term.type(CTRL_C);
  await exited;
});

test("/interrupt sends a Turn that takes the running one's place; a plain prompt meanwhile asks queue or interrupt", async () => {
  const { calls, term, exited } = await open(false);
  await startTurn(term);
  term.type("another question");
  term.type("\r");
  await term.waitFor("the question", (s) => s.includes("queue this prompt, or interrupt?"), 5_000);
  term.type("/interrupt what about this instead");
  term.type("\r");
  const screen = await term.waitFor("the old abort and the new answer", (s) => s.includes("■ Turn cancelled") && s.includes("Answered instead."), 5_000);
  assert.ok(screen.indexOf("■ Turn cancelled") < screen.indexOf("Answered instead."), screen);
  assert.equal(calls.filter((c) => c.startsWith("POST /api/sessions/session-1/turns")).length, 2);
  assert.deepEqual(calls.filter((c) => c.startsWith("PUT")), [], "the server cancels it: the client sends no cancel");
  term.type(CTRL_C);
  await exited;
});

test("/queue sends the refused prompt to wait behind the running Turn; it runs and becomes current once that one ends", async () => {
  const { calls, term, exited } = await open(true);
  await startTurn(term);
  term.type("and then this");
  term.type("\r");
  await term.waitFor("the question", (s) => s.includes("queue this prompt, or interrupt?"), 5_000);
  term.type("/queue");
  term.type("\r");
  await term.waitFor("the queued notice", (s) => s.includes("queued: it runs once the running Turn has ended"), 5_000);
  const posts = calls.filter((c) => c.startsWith("POST /api/sessions/session-1/turns"));
  assert.equal(posts.length, 2);
  term.type(ESC); // cancels the running Turn, not the queued one
  const screen = await term.waitFor("the abort, then the queued answer", (s) => s.includes("■ Turn cancelled") && s.includes("Answered after it."), 5_000);
  assert.ok(screen.indexOf("■ Turn cancelled") < screen.indexOf("Answered after it."), screen);
  assert.deepEqual(calls.filter((c) => c.startsWith("PUT")), [`PUT /api/runs/${RUN_ID}/cancellation`]);
  await term.waitFor("the idle info line", (s) => s.includes("ctrl+c quit"), 5_000);
  term.type(CTRL_C);
  await exited;
});

test("a cell waiting for approval shows its code; y approves it and the Turn goes on", async () => {
  const { decisions, term, exited } = await open(true);
  term.type("needs approval");
  term.type("\r");
  await term.waitFor("the waiting cell", (s) => s.includes("⚠ approval cell-1") && s.includes("import subprocess") && s.includes("y approves, n denies"), 5_000);
  term.type("y");
  await term.waitFor("the decision and the answer", (s) => s.includes("approved by me") && s.includes("Ran it after approval."), 5_000);
  assert.deepEqual(decisions, [JSON.stringify({ decision: "approve" })]);
  term.type(CTRL_C);
  await exited;
});

test("an interrupt the gateway refuses leaves the running Turn current: Esc still cancels it", async () => {
  const { calls, term, exited } = await open(true, true);
  await startTurn(term);
  term.type("/interrupt now this");
  term.type("\r");
  await term.waitFor("the refusal", (s) => s.includes("the running Turn did not end in time"), 5_000);
  term.type(ESC);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  assert.deepEqual(calls.filter((c) => c.startsWith("PUT")), [`PUT /api/runs/${RUN_ID}/cancellation`]);
  term.type(CTRL_C);
  await exited;
});

test("a prompt typed while /new is still creating the session goes to the new session", async () => {
  const { calls, term, exited } = await open(true);
  term.type("/new");
  term.type("\r");
  term.type("go slow");
  term.type("\r");
  await term.waitFor("the Turn", (s) => s.includes("Thinking slowly."), 5_000);
  assert.deepEqual(calls.filter((c) => c.endsWith("/turns") && c.startsWith("POST")), ["POST /api/sessions/session-new/turns"]);
  term.type(ESC);
  await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"), 5_000);
  term.type(CTRL_C);
  await exited;
});

test("typing / shows the commands, and Tab completes one", async () => {
  const { term, exited } = await open(true);
  term.type("/");
  await term.waitFor("the command menu", (s) => s.includes("resume") && s.includes("continue a session"), 5_000);
  term.type("res");
  await term.waitFor("the menu narrowed to /resume", (s) => s.includes("continue a session") && !s.includes("this list"), 5_000);
  term.type("\t");
  await term.waitFor("the completed command", (s) => /\/resume\s/.test(s), 5_000);
  term.type(CTRL_C);
  await exited;
});

test("Tab after /attach completes a file path from the working folder", async () => {
  const { term, exited } = await open(true);
  term.type("/attach test/fixtures/answer-art");
  term.type("\t");
  await term.waitFor("the completed path", (s) => s.includes("/attach test/fixtures/answer-artifact.sse"), 5_000);
  term.type(CTRL_C);
  await exited;
});
