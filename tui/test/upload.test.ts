import assert from "node:assert/strict";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { FleetApi, type FetchLike } from "../src/api.ts";

test("an upload carries the header that no plain web form can send", async () => {
  const folder = await mkdtemp(join(tmpdir(), "fleet-tui-upload-"));
  try {
    const file = join(folder, "rows.csv");
    await writeFile(file, "a,b\n1,2\n");
    let seen: Record<string, string> = {};
    const fetcher: FetchLike = async (_url, init) => {
      seen = { ...(init?.headers as Record<string, string>) };
      return new Response(JSON.stringify({ id: "a1", filename: "rows.csv", byte_size: 8 }), { status: 201 });
    };
    const attachment = await new FleetApi("http://fake.invalid", undefined, fetcher).uploadAttachment(file);
    assert.equal(attachment.id, "a1");
    assert.equal(seen["x-requested-with"], "fleet-tui");
  } finally {
    await rm(folder, { recursive: true, force: true });
  }
});
