import assert from "node:assert/strict";
import { test } from "node:test";
import { foldHint, foldLines } from "../src/fold.ts";
import { highlightPython } from "../src/highlight.ts";
import { turnsFromHistory } from "../src/history.ts";
import { reduceFrames } from "../src/reducer.ts";
import { formatUsage, renderTurn, type RenderOptions } from "../src/render.ts";
import { stripAnsi } from "../src/theme.ts";
import { emptyTurn } from "../src/turn-view.ts";
import { visibleWidth } from "../src/ui.ts";
import { fixture, fixtureFrames, framesOf, sseOf } from "./helpers.ts";

const plainMarkdown = (_id: string, text: string): string[] => text.split("\n");
const options = (expanded: boolean): RenderOptions => ({ expanded, foldAt: 8, markdown: plainMarkdown });

test("folding keeps the first lines and says how many are hidden", () => {
  const lines = Array.from({ length: 30 }, (_, i) => `line ${i}`);
  assert.deepEqual(foldLines(lines, 8, false), { lines: lines.slice(0, 7), hidden: 23 });
  assert.deepEqual(foldLines(lines, 8, true), { lines, hidden: 0 });
  assert.deepEqual(foldLines(lines.slice(0, 8), 8, false), { lines: lines.slice(0, 8), hidden: 0 });
  assert.equal(foldHint(1), "… 1 more line (ctrl+o to expand)");
});

test("a long cell output is folded until expanded; no line is wider than the terminal", async () => {
  const stdout = Array.from({ length: 40 }, (_, i) => `row ${i} ${"x".repeat(i * 3)}`).join("\n");
  const frames = await framesOf(
    sseOf([
      { id: "0.0.1", data: { type: "start", messageId: "r" } },
      { id: "1.0", data: { type: "tool-input-available", toolCallId: "c1", toolName: "python", input: { code: "for i in range(40):\n    print(i)" }, dynamic: true } },
      { id: "2.0", data: { type: "tool-output-available", toolCallId: "c1", output: { stdout, truncated: true }, dynamic: true } },
      { id: "3.0", data: { type: "tool-output-error", toolCallId: "c2", errorText: "late" } },
    ]),
  );
  const view = reduceFrames(emptyTurn("print rows"), frames);
  for (const width of [20, 60, 120]) {
    for (const expanded of [false, true]) {
      for (const line of renderTurn(view, width, options(expanded))) assert.ok(visibleWidth(line) <= width, `${width}: ${stripAnsi(line)}`);
    }
  }
  const folded = renderTurn(view, 120, options(false)).map(stripAnsi);
  assert.ok(folded.some((l) => /… \d+ more lines \(ctrl\+o to expand\)/.test(l)), folded.join("\n"));
  assert.ok(!folded.some((l) => l.includes("row 39")));
  const expanded = renderTurn(view, 120, options(true)).map(stripAnsi);
  assert.ok(expanded.some((l) => l.includes("row 39")));
  assert.ok(expanded.some((l) => l.includes("[output truncated by the sandbox]")));
});

test("a finished Turn renders reasoning, cells, sub-LM calls, the answer and the footer", async () => {
  const view = reduceFrames(emptyTurn("write me a reply"), await fixtureFrames("answer-artifact.sse"));
  const text = renderTurn(view, 100, options(false)).map(stripAnsi).join("\n");
  for (const expected of ["› write me a reply", "· step 1", "Measure the request first.", "┌ python cell-1", "│ words = request.split()", "└ 4 words", "↳ llm_query Reply in one line to: write me a reply", "⇒ Hello from the scripted sub-LM.", "## Scripted answer", "artifact reply.md 32 B text/markdown", "usage: 2 iterations"]) {
    assert.ok(text.includes(expected), `missing ${expected}\n${text}`);
  }
  const cancelled = renderTurn(reduceFrames(emptyTurn("cancel"), await fixtureFrames("cancelled.sse")), 100, options(false)).map(stripAnsi).join("\n");
  assert.ok(cancelled.includes("■ Turn cancelled"));
});

test("history renders like the live stream", async () => {
  const [fromHistory] = turnsFromHistory(JSON.parse(fixture("demo-turns.json")).items);
  const live = reduceFrames(emptyTurn("hello from the fixture"), await fixtureFrames("demo-live.sse"));
  assert.ok(fromHistory);
  const render = (v: typeof live) => renderTurn(v, 100, options(false)).map(stripAnsi);
  assert.deepEqual(render(fromHistory), render(live));
  const turns = turnsFromHistory(JSON.parse(fixture("cancel-turns.json")).items);
  assert.deepEqual(turns.map((t) => t.outcome), ["finished", "cancelled"]);
  assert.ok(!turns[1]!.parts.some((p) => p.kind === "text"), "the tombstone text is shown as the abort line only");
});

test("the Python highlighter keeps the text and one entry per line", () => {
  const code = "def f(x):  # add\n    return x + 1.5 if x else 'no'\n\"\"\"doc\nstring\"\"\"";
  const lines = highlightPython(code);
  assert.equal(lines.length, 4);
  assert.equal(lines.map(stripAnsi).join("\n"), code);
  assert.ok(lines[0]!.includes("\x1b[35mdef\x1b[39m"));
});

test("a failed Turn from history says its failure code and message, as the live stream did", () => {
  const items = [
    { id: "u1", role: "user", parts: [{ type: "text", text: "do it" }], metadata: { runId: "r1", sequence: 0, status: "completed" } },
    {
      id: "r1",
      role: "assistant",
      parts: [],
      metadata: { runId: "r1", sequence: 1, status: "failed", failureCode: "script_exhausted", failureMessage: "the script has no more lines" },
    },
  ];
  const [turn] = turnsFromHistory(items);
  assert.ok(turn);
  assert.equal(turn.outcome, "failed");
  const shown = renderTurn(turn, 100, options(false)).map(stripAnsi).join("\n");
  assert.match(shown, /✗ script_exhausted: the script has no more lines/);
});

test("the answer is set apart from the work: a heading, and a bar beside each of its lines", async () => {
  const view = reduceFrames(emptyTurn("write me a reply"), await fixtureFrames("answer-artifact.sse"));
  const lines = renderTurn(view, 100, options(false)).map(stripAnsi);
  const heading = lines.findIndex((l) => l.trim() === "answer");
  assert.ok(heading >= 0, lines.join("\n"));
  const answer = lines.findIndex((l, i) => i > heading && l.includes("## Scripted answer"));
  assert.ok(answer > heading, "the answer follows the heading");
  assert.ok(lines[answer]!.startsWith("  ▌ "), lines[answer]);
  assert.ok(!lines.some((l) => l.includes("┌ python") && l.startsWith("  ▌")), "cells carry no bar");
});

test("a huge prompt is folded to a few lines until expanded, without wrapping all of it", () => {
  const huge = "word ".repeat(20_000); // 100,000 characters, as the gateway accepts
  const folded = renderTurn(emptyTurn(huge), 100, options(false)).map(stripAnsi);
  const prompt = folded.filter((l) => l.startsWith("› ") || l.startsWith("  word"));
  assert.ok(prompt.length <= 8, `${prompt.length} lines of prompt shown`);
  assert.ok(folded.some((l) => /more characters \(ctrl\+o to expand\)/.test(l)), folded.join("\n"));
  const expanded = renderTurn(emptyTurn(huge), 100, options(true)).map(stripAnsi);
  assert.ok(expanded.length > 800);
});

test("a Turn component renders once per width and fold state, not on every keystroke", async () => {
  const { TurnComponent } = await import("../src/components.ts");
  const display = { expanded: false, foldAt: 8 };
  const component = new TurnComponent(display, emptyTurn("word ".repeat(20_000)));
  const first = component.render(100);
  assert.equal(component.render(100), first, "the same view, width and fold state: the same lines");
  display.expanded = true;
  assert.notEqual(component.render(100), first);
  component.update(emptyTurn("another"));
  assert.ok(component.render(100).some((l) => stripAnsi(l).includes("another")));
});

test("the usage line shows the Turn's cost only when a model had a price", () => {
  const models = [{ model: "openai/gpt-4o-mini", promptTokens: 44, completionTokens: 28 }];
  assert.equal(formatUsage({ models, iterations: 3, costUsd: 0.0000234 }), "usage: 3 iterations · openai/gpt-4o-mini 44→28 tokens · $0.000023");
  assert.equal(formatUsage({ models, costUsd: 1.5 }), "usage: openai/gpt-4o-mini 44→28 tokens · $1.50");
  assert.ok(!formatUsage({ models }).includes("$"));
});

test("a cell whose code is still arriving shows it as far as it came, writing, then running", async () => {
  const start = { id: "0.0.1", data: { type: "start", messageId: "r" } };
  const opened = { id: "1.0", data: { type: "tool-input-start", toolCallId: "c1", toolName: "python", dynamic: true } };
  const delta = { id: "1.1", data: { type: "tool-input-delta", toolCallId: "c1", inputTextDelta: '{"code":"for i in ran' } };
  const whole = { id: "2.0", data: { type: "tool-input-available", toolCallId: "c1", toolName: "python", input: { code: "for i in range(3): pass" }, dynamic: true } };
  const writing = reduceFrames(emptyTurn("q"), await framesOf(sseOf([start, opened, delta], false)));
  const lines = renderTurn(writing, 80, options(true)).map(stripAnsi);
  assert.ok(lines.some((l) => l.includes("│ for i in ran")) && lines.some((l) => l.includes("└ writing…")), lines.join("\n"));
  const running = reduceFrames(writing, await framesOf(sseOf([whole], false)));
  const after = renderTurn(running, 80, options(true)).map(stripAnsi);
  assert.ok(after.some((l) => l.includes("│ for i in range(3): pass")) && after.some((l) => l.includes("└ running…")), after.join("\n"));
  assert.ok(!after.some((l) => l.includes("writing")));
});
