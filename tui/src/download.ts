/** Artifact download: stream to a temp file beside the target, verify size and sha256, then rename. */

import { createHash, randomBytes } from "node:crypto";
import { open, rename, stat, unlink } from "node:fs/promises";
import { basename, dirname, join, resolve } from "node:path";
import type { FleetApi } from "./api.js";
import { VerificationError } from "./errors.js";

export interface Downloaded {
  readonly path: string;
  readonly bytes: number;
  readonly sha256: string;
}

/** `"<hex>"` (or `W/"<hex>"`) → lower-case sha256 hex; `undefined` for anything else. */
export function sha256FromEtag(etag: string | null): string | undefined {
  const m = /^(?:W\/)?"?([0-9a-fA-F]{64})"?$/.exec((etag ?? "").trim());
  return m?.[1]?.toLowerCase();
}

/**
 * Downloads an artifact to `localPath`. The bytes go to a hidden temp file in the same folder;
 * only when their count equals `Content-Length` and their sha256 equals the `ETag` is it
 * fsynced and renamed over `localPath` (atomic on one filesystem). Otherwise nothing is left.
 */
export async function downloadArtifact(api: FleetApi, artifactId: string, localPath: string): Promise<Downloaded> {
  const target = resolve(localPath);
  const existing = await stat(target).catch(() => undefined);
  if (existing?.isDirectory()) throw new VerificationError(`${localPath} is a directory; name the file to write`);
  const response = await api.artifactContent(artifactId);
  const expectedLength = Number(response.headers.get("content-length") ?? "NaN");
  const expectedSha = sha256FromEtag(response.headers.get("etag"));
  if (!Number.isSafeInteger(expectedLength) || expectedLength < 0) {
    await response.body?.cancel();
    throw new VerificationError("the gateway sent no valid Content-Length; nothing was written");
  }
  if (!expectedSha) {
    await response.body?.cancel();
    throw new VerificationError("the gateway sent no sha256 ETag; nothing was written");
  }
  const temp = join(dirname(target), `.${basename(target)}.${randomBytes(6).toString("hex")}.part`);
  const file = await open(temp, "wx", 0o644);
  const hash = createHash("sha256");
  let bytes = 0;
  let renamed = false;
  try {
    if (response.body) {
      for await (const chunk of response.body) {
        hash.update(chunk);
        bytes += chunk.byteLength;
        if (bytes > expectedLength) throw new VerificationError(`more bytes than Content-Length ${expectedLength}; discarded`);
        await file.write(chunk);
      }
    }
    const sha256 = hash.digest("hex");
    if (bytes !== expectedLength) throw new VerificationError(`got ${bytes} bytes, Content-Length said ${expectedLength}; discarded`);
    if (sha256 !== expectedSha) throw new VerificationError(`sha256 ${sha256} does not match the ETag ${expectedSha}; discarded`);
    await file.sync();
    await file.close();
    await rename(temp, target);
    renamed = true;
    return { path: target, bytes, sha256 };
  } finally {
    if (!renamed) {
      await file.close().catch(() => undefined);
      await unlink(temp).catch(() => undefined);
    }
  }
}
