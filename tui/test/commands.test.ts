import assert from "node:assert/strict";
import { test } from "node:test";
import { parseCommand, splitArgs } from "../src/commands.ts";
import { loadConfig } from "../src/config.ts";
import { compareFrameIds, parseFrameId } from "../src/frame-id.ts";

test("the command parser", () => {
  const table: [string, unknown][] = [
    ["hello there", { kind: "prompt", text: "hello there" }],
    ["  //etc/passwd please ", { kind: "prompt", text: "/etc/passwd please" }],
    ["/help", { kind: "help" }],
    ["/new", { kind: "new" }],
    ["/new now", { kind: "invalid", message: "/new takes no argument" }],
    ["/sessions", { kind: "sessions" }],
    ["/sessions  my report ", { kind: "sessions", search: "my report" }],
    ["/resume 1234-abcd", { kind: "resume", sessionId: "1234-abcd" }],
    ["/resume", { kind: "invalid", message: "usage: /resume <session id>" }],
    ["/rename The plan", { kind: "rename", title: "The plan" }],
    ["/delete 1234-abcd", { kind: "delete", sessionId: "1234-abcd" }],
    ["/interrupt try this", { kind: "interrupt", text: "try this" }],
    ["/interrupt", { kind: "interrupt", text: "" }],
    ["/queue and then this", { kind: "queue", text: "and then this" }],
    ["/queue", { kind: "queue", text: "" }],
    ["/approve", { kind: "approve", note: "" }],
    ["/deny not that file", { kind: "deny", note: "not that file" }],
    ["/approval on_risk", { kind: "approval", mode: "on_risk" }],
    ["/approval sometimes", { kind: "invalid", message: "usage: /approval never|always|on_risk" }],
    ["/delete", { kind: "invalid", message: "usage: /delete <session id> (its first 8 characters or more confirm it; /sessions lists them)" }],
    ["/delete 1234", { kind: "invalid", message: "usage: /delete <session id> (its first 8 characters or more confirm it; /sessions lists them)" }],
    ["/task", { kind: "task" }],
    ["/cancel", { kind: "cancel" }],
    ["/exit", { kind: "exit" }],
    ["/quit", { kind: "exit" }],
    ["/skills", { kind: "skills" }],
    ["/skills csv", { kind: "skills", query: "csv" }],
    ["/skill csv-analysis", { kind: "skill", name: "csv-analysis" }],
    ["/skill clear", { kind: "skill-clear" }],
    ["/skill", { kind: "invalid", message: "usage: /skill <name|clear>" }],
    ["/attach ./data.csv", { kind: "attach", path: "./data.csv" }],
    ['/attach "my file.txt"', { kind: "attach", path: "my file.txt" }],
    ["/attach list", { kind: "attach-list" }],
    ["/attach clear", { kind: "attach-clear" }],
    ["/files", { kind: "files", path: "" }],
    ["/files artifacts", { kind: "files", path: "artifacts" }],
    ["/file memory/note.txt", { kind: "file", path: "memory/note.txt" }],
    ["/file", { kind: "invalid", message: "usage: /file <path>" }],
    ["/artifacts", { kind: "artifacts" }],
    ["/artifact abc ./out.md", { kind: "artifact", id: "abc", localPath: "./out.md" }],
    ["/artifact abc 'my out.md'", { kind: "artifact", id: "abc", localPath: "my out.md" }],
    ["/artifact abc", { kind: "invalid", message: "usage: /artifact <id> <local-path>" }],
    ["/HELP", { kind: "help" }],
  ];
  for (const [line, expected] of table) assert.deepEqual(parseCommand(line), expected, line);
  const unknown = parseCommand("/frobnicate");
  assert.equal(unknown.kind, "invalid");
  assert.match((unknown as { message: string }).message, /unknown command \/frobnicate/);
  assert.deepEqual(splitArgs(`a "b c" 'd e' f`), ["a", "b c", "d e", "f"]);
});

test("frame id order is numeric on (s, k, n)", () => {
  const ids = ["10.0", "9.2.3", "0.0.1", "9.10", "9.2", "9", "2.0"].map((raw) => parseFrameId(raw)!);
  assert.deepEqual(ids.sort(compareFrameIds).map((i) => i.raw), ["0.0.1", "2.0", "9", "9.2", "9.2.3", "9.10", "10.0"]);
  assert.equal(parseFrameId("9.2")?.isContent, true);
  assert.equal(parseFrameId("9.2.1")?.isContent, false);
  for (const bad of [undefined, "", "a.b", "1.2.3.4", "-1"]) assert.equal(parseFrameId(bad), undefined, String(bad));
});

test("config: --api-url, else FLEET_API_URL, else the default; FLEET_API_TOKEN", () => {
  assert.equal(loadConfig([], {}).apiUrl, "http://127.0.0.1:8000");
  assert.equal(loadConfig([], { FLEET_API_URL: "http://10.0.0.1:9/" }).apiUrl, "http://10.0.0.1:9");
  assert.equal(loadConfig(["--api-url", "http://127.0.0.1:1234"], { FLEET_API_URL: "http://x:1" }).apiUrl, "http://127.0.0.1:1234");
  assert.equal(loadConfig([], { FLEET_API_TOKEN: "t0k" }).token, "t0k");
  assert.equal(loadConfig([], { FLEET_API_TOKEN: "" }).token, undefined);
  assert.equal(loadConfig(["--session", "s1"], {}).sessionId, "s1");
  assert.throws(() => loadConfig(["--api-url", "ftp://x"], {}), /not an http/);
  assert.throws(() => loadConfig(["--bogus"], {}));
});
