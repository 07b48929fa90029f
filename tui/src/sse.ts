/** Reads a Turn stream body into frames with the AI SDK's own parser (`parseJsonEventStream`). */

import { parseJsonEventStream, uiMessageChunkSchema, type UIMessageChunk } from "ai";
import { EventSourceParserStream } from "eventsource-parser/stream";

/** One SSE event of the stream: a chunk the SDK accepted, one it rejected, or the final `[DONE]`. */
export type Frame =
  | { readonly kind: "chunk"; readonly id: string | undefined; readonly chunk: UIMessageChunk }
  | { readonly kind: "invalid"; readonly id: string | undefined; readonly data: string; readonly error: string }
  | { readonly kind: "done" };

/**
 * Yields the frames of an SSE body as they arrive.
 *
 * The bytes are teed: one branch goes through `parseJsonEventStream` + `uiMessageChunkSchema`
 * (exactly what the AI SDK's chat transport does), the other through the same
 * `EventSourceParserStream` to keep each event's `id`, which the SDK drops but resume needs.
 * The SDK skips `[DONE]`; every other event comes out of both branches in the same order.
 */
export async function* readFrames(body: ReadableStream<Uint8Array>): AsyncGenerator<Frame> {
  const [forSdk, forIds] = body.tee();
  const parsed = parseJsonEventStream({ stream: forSdk, schema: uiMessageChunkSchema }).getReader();
  const events = forIds.pipeThrough(new TextDecoderStream()).pipeThrough(new EventSourceParserStream()).getReader();
  try {
    for (;;) {
      const event = await events.read();
      if (event.done) return;
      if (event.value.data === "[DONE]") {
        yield { kind: "done" };
        continue;
      }
      const result = await parsed.read();
      if (result.done) return;
      const id = event.value.id;
      if (result.value.success) {
        yield { kind: "chunk", id, chunk: result.value.value };
      } else {
        yield { kind: "invalid", id, data: event.value.data, error: String(result.value.error?.message ?? result.value.error) };
      }
    }
  } finally {
    await Promise.allSettled([events.cancel(), parsed.cancel()]);
  }
}

/** A whole SSE text (a fixture) as a byte stream. */
export function streamOfText(text: string): ReadableStream<Uint8Array> {
  const bytes = new TextEncoder().encode(text);
  return new ReadableStream({
    start(controller) {
      controller.enqueue(bytes);
      controller.close();
    },
  });
}
