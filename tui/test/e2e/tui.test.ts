/** The real client in a virtual terminal against a real gateway + worker on the scripted LM. */

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { FleetApi } from "../../src/api.ts";
import { App } from "../../src/app.ts";
import { CuttableProxy, TUI_DIR, startStack, type Stack } from "./stack.ts";
import { VirtualTerminal } from "./virtual-terminal.ts";

let stack: Stack;

before(async () => {
  stack = await startStack();
});

after(async () => {
  await stack?.stop();
});

function count(haystack: string, needle: string): number {
  return haystack.split(needle).length - 1;
}

async function openClient(url: string, backoff = { initialMs: 100, maxMs: 1_000, giveUpMs: 60_000 }): Promise<{ term: VirtualTerminal; app: App; exited: Promise<number> }> {
  const term = new VirtualTerminal(100, 50);
  const app = new App({ api: new FleetApi(url, process.env["FLEET_API_TOKEN"]), terminal: term, backoff });
  const exited = app.run();
  await term.waitFor("a new session", (s) => s.includes("new session") && s.includes("/help lists the commands"));
  return { term, app, exited };
}

test("a prompt streams to the scripted answer", async () => {
  const { term, app, exited } = await openClient(stack.url);
  term.type("write me a reply");
  term.type("\r");
  const screen = await term.waitFor("the rendered answer", (s) => s.includes("Hello from the scripted sub-LM. (4 words)") && s.includes("usage:"));
  for (const expected of ["› write me a reply", "┌ python cell-1", "└ 4 words", "↳ llm_query Reply in one line to: write me a reply", "Scripted answer", "artifact reply.md 32 B"]) {
    assert.ok(screen.includes(expected), `missing ${expected}`);
  }
  if (process.env["FLEET_TUI_WRITE_SCREEN"]) writeFileSync(join(TUI_DIR, "test", "fixtures", "screen-finished.txt"), `${screen}\n`);
  app.exit(0);
  assert.equal(await exited, 0);
});

test("typing stays fast with a 100,000-character prompt in view", async () => {
  const { term, app, exited } = await openClient(stack.url);
  const huge = "0123456789".repeat(10_000); // one word: the wrap breaks it at the width, as the report had
  term.type(huge);
  term.type("\r");
  await term.waitFor("the Turn to settle", (s) => s.includes("usage:"));
  const latencies: number[] = [];
  for (let key = 1; key <= 40; key++) {
    const shown = term.nextWriteWith("z".repeat(key)); // the editor's line with every key typed so far
    const started = performance.now();
    term.type("z");
    await shown;
    latencies.push(performance.now() - started);
  }
  latencies.sort((a, b) => a - b);
  const median = latencies[latencies.length >> 1] ?? 0;
  const worst = latencies[latencies.length - 1] ?? 0;
  process.stdout.write(`# typing latency, 100,000-character prompt in view: median ${median.toFixed(1)} ms, worst ${worst.toFixed(1)} ms over ${latencies.length} keys\n`);
  assert.ok(median < 50, `median ${median.toFixed(1)} ms per key`); // folded, the prompt is not re-wrapped per key
  app.exit(0);
  await exited;
});

test("Esc cancels a running Turn and the abort is shown", async () => {
  const { term, app, exited } = await openClient(stack.url);
  term.type("cancel");
  term.type("\r");
  await term.waitFor("the slow LM call", (s) => s.includes("└ taking my time")); // the next LM answer takes 5 s
  term.type("\x1b");
  const screen = await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"));
  assert.ok(!screen.includes("finished after the slow step"));
  app.exit(0);
  await exited;
});

test("/interrupt cancels the running Turn on the server and streams the new one", async () => {
  const { term, app, exited } = await openClient(stack.url);
  term.type("cancel");
  term.type("\r");
  await term.waitFor("the slow LM call", (s) => s.includes("└ taking my time")); // the next LM answer takes 5 s
  term.type("/interrupt write me a reply");
  term.type("\r");
  const screen = await term.waitFor("the abort, then the new answer", (s) => s.includes("■ Turn cancelled") && s.includes("Hello from the scripted sub-LM. (4 words)"));
  assert.ok(!screen.includes("finished after the slow step"));
  assert.ok(screen.indexOf("■ Turn cancelled") < screen.lastIndexOf("Hello from the scripted sub-LM. (4 words)"), screen);
  app.exit(0);
  await exited;
});

test("a prompt typed while a Turn runs asks queue or interrupt; /queue runs it after the running Turn has settled", async () => {
  const { term, app, exited } = await openClient(stack.url);
  term.type("cancel");
  term.type("\r");
  await term.waitFor("the slow LM call", (s) => s.includes("└ taking my time")); // the next LM answer takes 5 s
  term.type("write me a reply");
  term.type("\r");
  await term.waitFor("the question", (s) => s.includes("queue this prompt, or interrupt?"));
  term.type("/queue");
  term.type("\r");
  await term.waitFor("the queued notice", (s) => s.includes("queued: it runs once the running Turn has ended"));
  const screen = await term.waitFor("the slow Turn's end, then the queued answer", (s) => s.includes("finished after the slow step") && s.includes("Hello from the scripted sub-LM. (4 words)"));
  assert.ok(screen.indexOf("finished after the slow step") < screen.lastIndexOf("Hello from the scripted sub-LM. (4 words)"), screen);
  assert.ok(!screen.includes("■ Turn cancelled"), screen);
  app.exit(0);
  await exited;
});

test("with /approval always each cell waits for y, which runs it, and the answer follows", async () => {
  const { term, app, exited } = await openClient(stack.url);
  term.type("/approval always");
  term.type("\r");
  await term.waitFor("the mode", (s) => s.includes("approval: always"));
  term.type("write me a reply");
  term.type("\r");
  for (let cell = 1; cell <= 2; cell++) {
    // Each cell: its code shown, waiting; y approves it on the server, and it runs.
    await term.waitFor(`cell-${cell} waiting`, (s) => count(s, "y approves, n denies") === 1 && s.includes(`⚠ approval cell-${cell}`));
    term.type("y");
    await term.waitFor(`cell-${cell} approved`, (s) => count(s, "approved by") === cell);
  }
  const screen = await term.waitFor("the answer", (s) => s.includes("Hello from the scripted sub-LM. (4 words)") && s.includes("usage:"));
  assert.ok(screen.includes("└ 4 words"), screen);  // the approved first cell ran
  app.exit(0);
  await exited;
});

test("Ctrl+C cancels a running Turn; a second Ctrl+C quits", async () => {
  const { term, app, exited } = await openClient(stack.url);
  let code: number | undefined;
  void exited.then((c) => (code = c));
  try {
    term.type("cancel");
    term.type("\r");
    await term.waitFor("the slow LM call", (s) => s.includes("└ taking my time"));
    term.type("\x03");
    const screen = await term.waitFor("the abort", (s) => s.includes("■ Turn cancelled"));
    assert.ok(!screen.includes("finished after the slow step"));
    assert.equal(code, undefined, "the first Ctrl+C cancels, it does not quit");
    term.type("\x03");
    assert.equal(await exited, 0);
  } finally {
    app.exit(0);
  }
});

test("a stream cut mid-Turn is resumed without lost or repeated output", async () => {
  const proxy = new CuttableProxy(new URL(stack.url));
  await proxy.start();
  const { term, app, exited } = await openClient(proxy.url);
  try {
    term.type("slow");
    term.type("\r");
    await term.waitFor("the slow LM call", (s) => s.includes("└ taking my time")); // the next LM answer takes 5 s
    proxy.blocked = true;
    proxy.cut();
    await term.waitFor("a reconnect attempt", (s) => s.includes("stream dropped") || s.includes("resuming in"), 15_000);
    proxy.blocked = false;
    const screen = await term.waitFor("the slow answer", (s) => s.includes("finished after the slow step") && s.includes("usage:"));
    for (const once of ["Measure the request first.", "└ taking my time", "slow line 2", "· step 4", "usage:"]) {
      assert.equal(count(screen, once), 1, `${once} appears once`);
    }
    assert.equal(screen.match(/^ +▌ finished after the slow step +$/gm)?.length, 1, "the answer appears once");
  } finally {
    app.exit(0);
    await exited;
    await proxy.stop();
  }
});

test("commands against the real gateway: sessions, resume, rename, task, skills, files, artifacts, delete", async () => {
  // A finished Turn that wrote an artifact, from a first client.
  const first = await openClient(stack.url);
  first.term.type("write me a reply");
  first.term.type("\r");
  await first.term.waitFor("the answer", (s) => s.includes("Hello from the scripted sub-LM. (4 words)") && s.includes("usage:"));
  const sessionId = first.app.sessionId ?? "";
  first.app.exit(0);
  await first.exited;

  const { term, app, exited } = await openClient(stack.url);
  const dir = mkdtempSync(join(tmpdir(), "fleet-tui-artifact-"));
  const run = (line: string, what: string, predicate: (screen: string) => boolean): Promise<string> => {
    term.type(line);
    term.type("\r");
    return term.waitFor(what, predicate, 20_000);
  };
  try {
    await run("/sessions", "the session list", (s) => /• \d+ session\(s\)/.test(s) && s.includes(sessionId));

    // A prefix of a listed id is enough; the committed Turn renders from history.
    let screen = await run(`/resume ${sessionId.slice(0, 8)}`, "the loaded history", (s) => s.includes(`• session ${sessionId}`) && s.includes("usage:"));
    assert.equal(app.sessionId, sessionId);
    assert.match(screen, /2 message\(s\) of history/);
    for (const expected of ["› write me a reply", "└ 4 words", "↳ llm_query Reply in one line to: write me a reply", "Hello from the scripted sub-LM. (4 words)"]) {
      assert.equal(count(screen, expected), 1, `history shows ${expected} once`);
    }

    await run("/rename e2e renamed session", "the rename", (s) => s.includes('• renamed to "e2e renamed session"'));
    screen = await run("/sessions renamed session", "the search", (s) => s.includes('matching "renamed session"'));
    assert.match(screen, new RegExp(`${sessionId} +\\S+ +e2e renamed session`));

    await run("/task", "the task", (s) => /• task \(checkpoint \d+\)/.test(s));

    screen = await run("/skills", "the skill list", (s) => /• [1-9]\d* skill\(s\)/.test(s));
    const skill = /^ {2}(\S+) \((.+) (\S+)\): /m.exec(screen.slice(screen.lastIndexOf("skill(s)")));
    assert.ok(skill, `a skill row\n${screen}`);
    const [, skillId, skillName, skillVersion] = skill;
    screen = await run(`/skill ${skillId}`, "the selection", (s) => s.includes(`• skill ${skillName} ${skillVersion} selected for the next Turns`));
    assert.ok(screen.includes(`skills: ${skillName}`), "the info line names the selected skill");

    screen = await run("/files", "the workspace listing", (s) => s.includes("• workspace"));
    assert.match(screen.slice(screen.lastIndexOf("• workspace")), /artifacts\//);
    screen = await run("/files artifacts", "the artifacts folder", (s) => /• workspace \/?artifacts/.test(s));
    assert.match(screen.slice(screen.lastIndexOf("• workspace")), /artifacts\/reply\.md +32 B/);
    screen = await run("/file artifacts/reply.md", "the file", (s) => /• \/?artifacts\/reply\.md\n +Hello from the scripted sub-LM\./.test(s));

    screen = await run("/artifacts", "the artifact list", (s) => s.includes("• 1 artifact(s) in this session's Turns"));
    const row = /^ {2}([0-9a-f-]{36}) {2}reply\.md {2}32 B {2}text\/markdown/m.exec(screen);
    assert.ok(row?.[1], `an artifact row\n${screen}`);
    const artifactId = row[1];
    const target = join(dir, "reply.md");
    screen = await run(`/artifact ${artifactId.slice(0, 8)} ${target}`, "the download", (s) => s.includes(`• saved ${target}`) || s.includes("/artifact failed"));
    const bytes = readFileSync(target);
    assert.equal(bytes.toString("utf8"), "Hello from the scripted sub-LM.\n");
    const sha256 = createHash("sha256").update(bytes).digest("hex");
    assert.ok(screen.includes(`32 B, sha256 ${sha256} (matches the ETag)`), screen);
    assert.equal(app.artifacts()[0]?.checksumSha256, sha256, "the sha the Turn announced");

    // Last, the session goes: the client moves to a new one, and the old id is unknown.
    await run(`/delete ${sessionId.slice(0, 8)}`, "the deletion", (s) => s.includes(`• deleted session ${sessionId}`));
    assert.ok(app.sessionId && app.sessionId !== sessionId, "a new session after deleting the current one");
    screen = await run(`/resume ${sessionId}`, "the refusal", (s) => s.includes("/resume failed"));
    assert.match(screen.slice(screen.lastIndexOf("/resume failed")), /not found|no session/);
  } finally {
    app.exit(0);
    await exited;
    rmSync(dir, { recursive: true, force: true });
  }
});
