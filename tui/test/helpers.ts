/** Test helpers: fixtures and frames. */

import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { readFrames, streamOfText, type Frame } from "../src/sse.ts";

export function fixture(name: string): string {
  return readFileSync(fileURLToPath(new URL(`./fixtures/${name}`, import.meta.url)), "utf8");
}

export async function framesOf(sse: string): Promise<Frame[]> {
  const frames: Frame[] = [];
  for await (const frame of readFrames(streamOfText(sse))) frames.push(frame);
  return frames;
}

export async function fixtureFrames(name: string): Promise<Frame[]> {
  return framesOf(fixture(name));
}

/** An SSE text of frames (what a gateway would send). */
export function sseOf(frames: readonly { id?: string; data: unknown }[], done = true): string {
  const body = frames.map((f) => `${f.id !== undefined ? `id: ${f.id}\n` : ""}data: ${JSON.stringify(f.data)}\n\n`).join("");
  return done ? `${body}data: [DONE]\n\n` : body;
}
