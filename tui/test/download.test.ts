import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { mkdtemp as makeTemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { FleetApi } from "../src/api.ts";
import { downloadArtifact, sha256FromEtag } from "../src/download.ts";
import { RouteMissingError, VerificationError } from "../src/errors.ts";

const BODY = Buffer.from("artifact bytes\n".repeat(1000));
const SHA = createHash("sha256").update(BODY).digest("hex");
let server: Server;
let api: FleetApi;
let seenAuth: string | undefined;

before(async () => {
  server = createServer((req, res) => {
    seenAuth = req.headers.authorization;
    const kind = /\/api\/artifacts\/([^/]+)\/content/.exec(req.url ?? "")?.[1];
    const send = (headers: Record<string, string>, body: Buffer) => {
      res.writeHead(200, headers);
      res.end(body);
    };
    switch (kind) {
      case "good":
        return send({ "content-length": String(BODY.length), etag: `"${SHA}"` }, BODY);
      case "bad-etag":
        return send({ "content-length": String(BODY.length), etag: `"${"0".repeat(64)}"` }, BODY);
      case "no-etag":
        return send({ "content-length": String(BODY.length) }, BODY);
      case "short": // promises more than it sends, then closes
        res.writeHead(200, { "content-length": String(BODY.length + 10), etag: `"${SHA}"` });
        res.write(BODY);
        return setTimeout(() => res.destroy(), 20);
      case "gone":
        res.writeHead(404, { "content-type": "application/json" });
        return res.end(JSON.stringify({ code: "not_found", message: "artifact not found" }));
      default:
        res.writeHead(404, { "content-type": "application/json" });
        return res.end(JSON.stringify({ code: "not_found", message: "Not Found" }));
    }
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  api = new FleetApi(`http://127.0.0.1:${(server.address() as AddressInfo).port}`, "secret-token");
});

const temps: string[] = [];

/** A temp folder, removed after the file's tests. */
async function mkdtemp(prefix: string): Promise<string> {
  const dir = await makeTemp(prefix);
  temps.push(dir);
  return dir;
}

after(async () => {
  server.close();
  await Promise.all(temps.map((dir) => rm(dir, { recursive: true, force: true })));
});

test("a verified artifact is renamed into place; the bearer token is sent", async () => {
  const dir = await mkdtemp(join(tmpdir(), "fleet-tui-dl-"));
  const saved = await downloadArtifact(api, "good", join(dir, "out.txt"));
  assert.equal(saved.bytes, BODY.length);
  assert.equal(saved.sha256, SHA);
  assert.deepEqual(await readFile(join(dir, "out.txt")), BODY);
  assert.deepEqual(await readdir(dir), ["out.txt"], "no temp file is left");
  assert.equal(seenAuth, "Bearer secret-token");
});

test("a wrong sha256, a missing ETag or a short body leave the target untouched and no temp file", async () => {
  for (const id of ["bad-etag", "no-etag", "short"]) {
    const dir = await mkdtemp(join(tmpdir(), "fleet-tui-dl-"));
    await writeFile(join(dir, "out.txt"), "old");
    await assert.rejects(downloadArtifact(api, id, join(dir, "out.txt")), (e: unknown) => id === "short" ? e instanceof Error : e instanceof VerificationError, id);
    assert.equal(await readFile(join(dir, "out.txt"), "utf8"), "old", id);
    assert.deepEqual(await readdir(dir), ["out.txt"], id);
  }
});

test("an unknown artifact is an API error; an unknown route says the route is missing", async () => {
  const dir = await mkdtemp(join(tmpdir(), "fleet-tui-dl-"));
  await assert.rejects(downloadArtifact(api, "gone", join(dir, "x")), (e: unknown) => !(e instanceof RouteMissingError) && /artifact not found/.test(String(e)));
  await assert.rejects(api.getTask("s1"), RouteMissingError);
  await assert.rejects(api.getTask("s1"), /has no route GET \/api\/sessions\/s1\/task/);
});

test("ETag parsing", () => {
  assert.equal(sha256FromEtag(`"${SHA}"`), SHA);
  assert.equal(sha256FromEtag(`W/"${SHA.toUpperCase()}"`), SHA);
  assert.equal(sha256FromEtag('"abc"'), undefined);
  assert.equal(sha256FromEtag(null), undefined);
});
