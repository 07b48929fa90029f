import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { reduceFrame, reduceFrames } from "../src/reducer.ts";
import { emptyTurn, type TurnView } from "../src/turn-view.ts";
import type { Frame } from "../src/sse.ts";
import { fixtureFrames, framesOf, sseOf } from "./helpers.ts";

const ANSWER = "Hello from fleet's offline demo: your request reached a sandboxed REPL and came back. (Your request had 4 words.)";
const FIXTURES = ["demo-live.sse", "demo-replay.sse", "demo-resume-after-3.0.sse", "answer-artifact.sse", "cancelled.sse", "slow-resumed.sse", "slow-full-replay.sse", "slow-dropped.sse"];

function answerOf(view: TurnView): string {
  return view.parts.flatMap((p) => (p.kind === "text" ? [p.text] : [])).join("");
}

/** What the user sees: everything except how it was delivered. */
function visible(view: TurnView): unknown {
  const { delivery: _d, status: _s, lastEventId: _l, lastContentId: _c, done: _done, ...rest } = view;
  return rest;
}

function cutAfter(frames: Frame[], id: string): Frame[] {
  const index = frames.findIndex((f) => f.kind !== "done" && f.id === id);
  assert.ok(index >= 0, `no frame ${id}`);
  return frames.slice(0, index + 1);
}

describe("stream reducer on captured gateway streams", () => {
  test("every captured frame passes the AI SDK's chunk schema", async () => {
    for (const name of FIXTURES) {
      const frames = await fixtureFrames(name);
      assert.ok(frames.length > 0, name);
      assert.deepEqual(frames.filter((f) => f.kind === "invalid"), [], name);
    }
  });

  test("a live Turn: steps, reasoning, cells, llm_query, answer, usage", async () => {
    const view = reduceFrames(emptyTurn("hello from the fixture"), await fixtureFrames("demo-live.sse"));
    assert.equal(view.outcome, "finished");
    assert.equal(view.done, true);
    assert.equal(view.delivery, "live");
    assert.equal(view.model, "scripted/demo");
    assert.equal(answerOf(view), ANSWER);
    assert.equal(view.parts.filter((p) => p.kind === "step").length, 3);
    assert.equal(view.parts.filter((p) => p.kind === "reasoning" && p.done).length, 3);
    const tools = view.parts.flatMap((p) => (p.kind === "tool" ? [`${p.toolName}:${p.state}`] : []));
    assert.deepEqual(tools, ["python:output", "python:output", "llm_query:output", "python:output"]);
    assert.deepEqual(view.usage?.models, [{ model: "scripted/demo", promptTokens: 1116, completionTokens: 191 }]);
    assert.equal(view.durationMs, 97);
    assert.equal(view.status, undefined, "the spinner line goes away at the terminal chunk");
    assert.equal(view.lastEventId, "23.0");
    assert.equal(view.ignored, 0);
  });

  test("an artifact and a cancelled Turn", async () => {
    const answer = reduceFrames(emptyTurn("write me a reply"), await fixtureFrames("answer-artifact.sse"));
    assert.equal(answer.artifacts.length, 1);
    assert.equal(answer.artifacts[0]?.name, "reply.md");
    assert.equal(answer.artifacts[0]?.checksumSha256.length, 64);
    const cancelled = reduceFrames(emptyTurn("cancel"), await fixtureFrames("cancelled.sse"));
    assert.equal(cancelled.outcome, "cancelled");
    assert.equal(cancelled.abortReason, "Turn cancelled");
    assert.equal(answerOf(cancelled), "");
  });

  test("replaying the whole stream again changes nothing (idempotent by frame id)", async () => {
    const live = await fixtureFrames("demo-live.sse");
    const once = reduceFrames(emptyTurn("x"), live);
    const twice = reduceFrames(once, [...live, ...(await fixtureFrames("demo-replay.sse"))]);
    assert.deepEqual(twice, once);
  });

  test("a resume after frame 3.0 continues exactly where the live stream was cut", async () => {
    const live = await fixtureFrames("demo-live.sse");
    const full = reduceFrames(emptyTurn("x"), live);
    const resumed = reduceFrames(reduceFrames(emptyTurn("x"), cutAfter(live, "3.0")), await fixtureFrames("demo-resume-after-3.0.sse"));
    assert.deepEqual(visible(resumed), visible(full));
    assert.equal(resumed.delivery, "live", "the first connection's delivery is kept");
    assert.equal(answerOf(resumed), ANSWER);
  });

  test("a cut at any frame, then an overlapping stream, never duplicates or loses output", async () => {
    const live = await fixtureFrames("demo-live.sse");
    const replay = await fixtureFrames("demo-replay.sse");
    const full = visible(reduceFrames(emptyTurn("x"), live));
    for (let k = 0; k <= live.length; k++) {
      const view = reduceFrames(reduceFrames(emptyTurn("x"), live.slice(0, k)), replay);
      assert.deepEqual(visible(view), full, `cut after ${k} frames`);
    }
  });

  test("the slow Turn dropped after its start and resumed from there", async () => {
    const dropped = reduceFrames(emptyTurn("slow"), await fixtureFrames("slow-dropped.sse"));
    assert.equal(dropped.outcome, "streaming");
    assert.equal(dropped.lastEventId, "0.0.1");
    const resumed = reduceFrames(dropped, await fixtureFrames("slow-resumed.sse"));
    const direct = reduceFrames(emptyTurn("slow"), await fixtureFrames("slow-full-replay.sse"));
    assert.deepEqual(visible(resumed), visible(direct));
    assert.match(answerOf(resumed), /finished after the slow step/);
  });
});

describe("stream reducer on synthetic chunks", () => {
  const start = { id: "0.0.1", data: { type: "start", messageId: "r1", messageMetadata: { runId: "r1", delivery: "live", model: "m" } } };

  test("unknown data parts and rejected chunks are counted, never thrown on", async () => {
    const frames = await framesOf(
      sseOf([
        start,
        { id: "1.0", data: { type: "data-something-new", data: { x: 1 } } },
        { id: "1.1", data: { type: "data-structured-result", data: null } },
        { id: "1.2", data: { type: "no-such-chunk-type", foo: 1 } },
        { id: "2.0", data: { type: "text-start", id: "t" } },
        { id: "2.1", data: { type: "text-delta", id: "t", delta: "ok" } },
        { id: "2.2", data: { type: "text-end", id: "t" } },
        { id: "3.0", data: { type: "finish", finishReason: "stop" } },
      ]),
    );
    assert.equal(frames.filter((f) => f.kind === "invalid").length, 1);
    const view = reduceFrames(emptyTurn("x"), frames);
    assert.equal(view.ignored, 3);
    assert.equal(view.outcome, "finished");
    assert.equal(answerOf(view), "ok");
    assert.equal(view.lastEventId, "3.0");
  });

  test("child progress is replaced by id; warnings, status and errors", async () => {
    const child = (id: string, state: string, cleanup: string) => ({ type: "data-child-progress", id, data: { child_id: id, task_label: `task ${id}`, state, cleanup_state: cleanup, elapsed_ms: 5 } });
    const frames = await framesOf(
      sseOf([
        start,
        { id: "1.0", data: { type: "data-status", data: { phase: "execution", status: "started" }, transient: true } },
        { id: "2.0", data: child("c1", "started", "pending") },
        { id: "3.0", data: child("c2", "started", "pending") },
        { id: "4.0", data: child("c1", "completed", "released") },
        { id: "5.0", data: { type: "data-warning", data: { code: "max_iters", message: "out of iterations" } } },
        { id: "6.0", data: { type: "error", errorText: "lm_error: boom" } },
        { id: "6.1", data: { type: "finish", finishReason: "error" } },
      ]),
    );
    let view = emptyTurn("x");
    for (const frame of frames) {
      view = reduceFrame(view, frame);
      if (frame.kind === "chunk" && frame.id === "1.0") assert.deepEqual(view.status, { phase: "execution", detail: "started" });
    }
    const children = view.parts.flatMap((p) => (p.kind === "child" ? [`${p.childId}:${p.state}:${p.cleanupState}`] : []));
    assert.deepEqual(children, ["c1:completed:released", "c2:started:pending"]);
    assert.deepEqual(view.warnings, [{ code: "max_iters", message: "out of iterations" }]);
    assert.equal(view.outcome, "failed");
    assert.equal(view.errorText, "lm_error: boom");
  });

  test("control frames never move the resume point back, content frames at or before it are skipped", async () => {
    const frames = await framesOf(sseOf([start, { id: "5.0", data: { type: "text-start", id: "t" } }, { id: "5.1", data: { type: "text-delta", id: "t", delta: "a" } }]));
    const view = reduceFrames(emptyTurn("x"), frames);
    const again = reduceFrames(view, await framesOf(sseOf([{ id: "5.0.1", data: start.data }, { id: "5.1", data: { type: "text-delta", id: "t", delta: "a" } }, { id: "5.2", data: { type: "text-delta", id: "t", delta: "b" } }], false)));
    assert.equal(answerOf(again), "ab");
    assert.equal(again.lastEventId, "5.2");
    const old = reduceFrames(again, await framesOf(sseOf([{ id: "0.0.1", data: start.data }], false)));
    assert.equal(old.lastEventId, "5.2");
  });

  test("a restated answer or reasoning takes the place of what its stream showed", async () => {
    // A part streamed as `shown`, ended, then restated whole as `parsed` (frames from `seq`).
    const restated = (kind: string, id: string, seq: number, shown: string, parsed: string) =>
      [
        { type: `${kind}-start`, id },
        { type: `${kind}-delta`, id, delta: shown },
        { type: `${kind}-end`, id },
        { type: `${kind}-start`, id: `${id}-restated` },
        { type: `${kind}-delta`, id: `${id}-restated`, delta: parsed },
        { type: `${kind}-end`, id: `${id}-restated` },
      ].map((data, k) => ({ id: `${seq}.${k}`, data }));
    const frames = await framesOf(
      sseOf([start, ...restated("reasoning", "reasoning-1", 2, "garbled", "Think again."), ...restated("text", "text-answer", 3, "A first try", "The answer.")]),
    );
    const view = reduceFrames(emptyTurn("q"), frames);
    assert.equal(answerOf(view), "The answer.");
    const texts = view.parts.flatMap((p) => (p.kind === "text" || p.kind === "reasoning" ? [`${p.kind}:${p.text}`] : []));
    assert.deepEqual(texts, ["reasoning:Think again.", "text:The answer."]);
  });

  test("a cell's code shows as its input deltas arrive, then whole", async () => {
    const code = 'print("a\\tb")\nx = "\u00fc"';
    const json = JSON.stringify({ code }); // what the deltas add up to, but for its closing `"}`
    const text = json.slice(0, -2);
    const cuts = [3, 12, 16, 21, text.length]; // 3: inside the key; 16: between the two halves of `\"`
    const deltas = cuts.map((end, k) => text.slice(k === 0 ? 0 : cuts[k - 1], end));
    const frames = (n: number) => [
      start,
      { id: "2.0", data: { type: "tool-input-start", toolCallId: "cell-1", toolName: "python", dynamic: true, providerExecuted: true } },
      ...deltas.slice(0, n).map((inputTextDelta, k) => ({ id: `${3 + k}.0`, data: { type: "tool-input-delta", toolCallId: "cell-1", inputTextDelta } })),
    ];
    const codeAfter = async (n: number) => {
      const view = reduceFrames(emptyTurn("q"), await framesOf(sseOf(frames(n), false)));
      const tool = view.parts.find((p) => p.kind === "tool");
      assert.ok(tool && tool.kind === "tool" && tool.state === "running");
      return (tool.input as { code?: string } | undefined)?.code ?? "";
    };
    let shown = "";
    for (let n = 1; n <= deltas.length; n++) {
      const now = await codeAfter(n);
      assert.ok(code.startsWith(now) && now.startsWith(shown), `${n}: ${JSON.stringify(now)}`);
      shown = now;
    }
    assert.equal(shown, code);
    const whole = [...frames(deltas.length), { id: "9.0", data: { type: "tool-input-available", toolCallId: "cell-1", toolName: "python", input: { code: "print(1)" } } }];
    const view = reduceFrames(emptyTurn("q"), await framesOf(sseOf(whole, false)));
    assert.deepEqual(view.parts.flatMap((p) => (p.kind === "tool" ? [p.input] : [])), [{ code: "print(1)" }]);
  });

  test("nothing is applied after a terminal chunk", async () => {
    const frames = await framesOf(sseOf([start, { id: "1.0", data: { type: "abort", reason: "Turn cancelled" } }, { id: "2.0", data: { type: "text-start", id: "t" } }]));
    const view = reduceFrames(emptyTurn("x"), frames);
    assert.equal(view.outcome, "cancelled");
    assert.equal(view.parts.length, 0);
  });
});

test("data-usage carries the cost when the server knows it, and none when it is left out", async () => {
  const usage = (cost?: number) => ({ type: "data-usage", data: { usage: { iterations: 1, duration_ms: 5, observed_lm_usage: { m: { prompt_tokens: 1, completion_tokens: 2, ...(cost === undefined ? {} : { cost_usd: cost }) } }, ...(cost === undefined ? {} : { cost_usd: cost }) } } });
  for (const [cost, expected] of [[0.25, 0.25], [undefined, undefined]] as const) {
    const frames = await framesOf(sseOf([{ id: "1.0", data: usage(cost) }]));
    let view = emptyTurn("x");
    for (const frame of frames) view = reduceFrame(view, frame);
    assert.equal(view.usage?.costUsd, expected);
  }
});
