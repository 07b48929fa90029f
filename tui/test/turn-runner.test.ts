import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";
import { FleetApi } from "../src/api.ts";
import { reduceFrames } from "../src/reducer.ts";
import { backoffDelay, runTurn, type RunnerEvent } from "../src/turn-runner.ts";
import { emptyTurn } from "../src/turn-view.ts";
import { fixture, fixtureFrames } from "./helpers.ts";

/** The demo stream split into SSE events, to serve in pieces. */
const EVENTS = fixture("demo-live.sse").split("\n\n").filter((e) => e.trim()).map((e) => `${e}\n\n`);
const RUN_ID = "f610c750-11e8-4717-ba4e-aaf4d0d77bbc";

interface Scenario {
  postFailures: number; // POSTs answered by closing the socket before any response
  cutAfter: number; // events sent on the POST stream before the connection drops
  refusedResumes: number; // resume GETs answered 503 first
  resumeEvents?: number; // events each resume sends before its connection drops (default: all, then end)
}

let server: Server;
let base: string;
let scenario: Scenario;
const keys: string[] = [];
const lastEventIds: (string | undefined)[] = [];

function sendEvents(res: ServerResponse, events: string[], end: boolean): void {
  res.writeHead(200, { "content-type": "text/event-stream", "x-fleet-run-id": RUN_ID });
  for (const e of events) res.write(e);
  if (end) res.end();
  else setTimeout(() => res.destroy(), 20); // a dropped connection: no [DONE]
}

before(async () => {
  server = createServer((req: IncomingMessage, res: ServerResponse) => {
    if (req.method === "POST" && req.url?.endsWith("/turns")) {
      keys.push(String(req.headers["idempotency-key"]));
      if (keys.length <= scenario.postFailures) return req.socket.destroy();
      return sendEvents(res, EVENTS.slice(0, scenario.cutAfter), false);
    }
    if (req.method === "GET" && req.url === `/api/runs/${RUN_ID}/stream`) {
      const last = req.headers["last-event-id"] as string | undefined;
      lastEventIds.push(last);
      if (scenario.refusedResumes-- > 0) {
        res.writeHead(503, { "content-type": "application/json" });
        return res.end(JSON.stringify({ code: "service_unavailable", message: "redis down" }));
      }
      // Resume after `last`: the events whose id line comes after it (control frames re-sent too).
      const index = EVENTS.findIndex((e) => e.startsWith(`id: ${last}\n`));
      const n = scenario.resumeEvents;
      return sendEvents(res, EVENTS.slice(index + 1, n === undefined ? undefined : index + 1 + n), n === undefined);
    }
    res.writeHead(404).end();
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

after(() => server.close());

test("backoff doubles and is capped", () => {
  const b = { initialMs: 100, maxMs: 1000, giveUpMs: 10_000 };
  assert.deepEqual([0, 1, 2, 3, 4, 5, 60].map((n) => backoffDelay(b, n)), [100, 200, 400, 800, 1000, 1000, 1000]);
});

test("a POST that fails before any response is retried with the same key; a dropped stream is resumed exactly", async () => {
  scenario = { postFailures: 2, cutAfter: 12, refusedResumes: 1 };
  keys.length = 0;
  lastEventIds.length = 0;
  const events: RunnerEvent[] = [];
  const slept: number[] = [];
  const view = await runTurn({
    api: new FleetApi(base, undefined),
    sessionId: "s1",
    body: { text: "hello from the fixture", attachment_ids: [], skill_selections: [] },
    onView: () => undefined,
    onEvent: (e) => events.push(e),
    backoff: { initialMs: 1, maxMs: 4, giveUpMs: 5_000 },
    sleep: async (ms) => void slept.push(ms),
  });
  assert.equal(keys.length, 3);
  assert.equal(new Set(keys).size, 1, "one Idempotency-Key for every attempt");
  assert.match(keys[0]!, /^[0-9a-f-]{36}$/);
  const expected = reduceFrames(emptyTurn("hello from the fixture"), await fixtureFrames("demo-live.sse"));
  const { delivery: _a, lastEventId: _b, ...got } = view;
  const { delivery: _c, lastEventId: _d, ...want } = expected;
  assert.deepEqual(got, want, "no output lost or duplicated");
  const lastSent = EVENTS[11]!.split("\n")[0]!.slice(4);
  assert.deepEqual(lastEventIds, [lastSent, lastSent], "both resumes ask for the frames after the last one received");
  assert.deepEqual(events.map((e) => e.kind), ["retrying-post", "retrying-post", "posted", "reconnecting", "reconnecting", "resumed"]);
  assert.deepEqual(slept, [1, 2, 1, 2]);
});

test("a connection that streams, then breaks, starts the back-off and the give-up clock over", async () => {
  scenario = { postFailures: 0, cutAfter: 4, refusedResumes: 0, resumeEvents: 2 };
  keys.length = 0;
  lastEventIds.length = 0;
  const slept: number[] = [];
  const view = await runTurn({
    api: new FleetApi(base, undefined),
    sessionId: "s1",
    body: { text: "hello from the fixture", attachment_ids: [], skill_selections: [] },
    onView: () => undefined,
    // Every drop follows progress: neither the delay nor the give-up clock may build up.
    backoff: { initialMs: 1, maxMs: 64, giveUpMs: 60 },
    sleep: async (ms) => {
      slept.push(ms);
      await new Promise((resolve) => setTimeout(resolve, 10));
    },
  });
  const expected = reduceFrames(emptyTurn("hello from the fixture"), await fixtureFrames("demo-live.sse"));
  assert.equal(view.done, expected.done);
  assert.ok(slept.length > 6, `the stream was resumed many times (${slept.length})`);
  assert.deepEqual(new Set(slept), new Set([1]), "each resume waited the initial delay only");
});

test("a client error on the POST is not retried", async () => {
  const api = new FleetApi("http://127.0.0.1:9", undefined, async () => new Response(JSON.stringify({ code: "turn_in_progress", message: "busy" }), { status: 409 }));
  await assert.rejects(runTurn({ api, sessionId: "s", body: { text: "x", attachment_ids: [], skill_selections: [] }, onView: () => undefined }), /busy/);
});
