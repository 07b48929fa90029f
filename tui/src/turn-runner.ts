/** Runs one Turn's stream to its end: POST with a stable Idempotency-Key, then resume on drops. */

import { randomUUID } from "node:crypto";
import type { FleetApi, TurnBody } from "./api.js";
import { ApiError, NetworkError } from "./errors.js";
import { reduceFrame } from "./reducer.js";
import { readFrames } from "./sse.js";
import { emptyTurn, isSettled, type TurnView } from "./turn-view.js";

export interface Backoff {
  readonly initialMs: number;
  readonly maxMs: number;
  /** Give up reconnecting after this long without a working connection. */
  readonly giveUpMs: number;
}

export const DEFAULT_BACKOFF: Backoff = { initialMs: 250, maxMs: 5_000, giveUpMs: 120_000 };

/** The delay before retry number `attempt` (from 0): doubling from `initialMs`, capped at `maxMs`. */
export function backoffDelay(backoff: Backoff, attempt: number): number {
  return Math.min(backoff.maxMs, backoff.initialMs * 2 ** Math.min(attempt, 30));
}

export type RunnerEvent =
  | { readonly kind: "posted"; readonly runId: string; readonly idempotencyKey: string }
  | { readonly kind: "retrying-post"; readonly attempt: number; readonly delayMs: number; readonly error: string }
  | { readonly kind: "reconnecting"; readonly attempt: number; readonly delayMs: number; readonly reason: string }
  | { readonly kind: "resumed"; readonly lastEventId: string | undefined };

export interface RunTurnOptions {
  readonly api: FleetApi;
  readonly sessionId: string;
  readonly body: TurnBody;
  /** Called with each new view (only when it changed). */
  readonly onView: (view: TurnView) => void;
  readonly onEvent?: (event: RunnerEvent) => void;
  readonly signal?: AbortSignal;
  readonly backoff?: Backoff;
  /** Abort and resume a connection that sent nothing for this long (heartbeats come every 10 s). */
  readonly idleTimeoutMs?: number;
  readonly idempotencyKey?: string;
  readonly sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
}

/** POSTs the Turn and follows it to a terminal chunk, resuming as often as needed. */
export async function runTurn(options: RunTurnOptions): Promise<TurnView> {
  const backoff = options.backoff ?? DEFAULT_BACKOFF;
  const sleep = options.sleep ?? sleepFor;
  const key = options.idempotencyKey ?? randomUUID();
  let view = emptyTurn(options.body.text);
  const apply = (next: TurnView): void => {
    if (next !== view) {
      view = next;
      options.onView(view);
    }
  };

  const response = await postWithRetry(options, key, backoff, sleep);
  const runId = response.headers.get("x-fleet-run-id") ?? undefined;
  if (runId) {
    apply({ ...view, runId });
    options.onEvent?.({ kind: "posted", runId, idempotencyKey: key });
  }
  let body: ReadableStream<Uint8Array> | null = response.body;
  let attempt = 0;
  let failingSince: number | undefined;
  let resumeFailure: string | undefined; // why the last resume got no stream (the gateway is down)
  for (;;) {
    let reason = resumeFailure ?? "the stream ended early";
    resumeFailure = undefined;
    if (body) {
      const before = view.lastEventId;
      try {
        await consume(body, view, apply, options);
      } catch (error) {
        if (options.signal?.aborted) throw error;
        reason = error instanceof Error ? error.message : String(error);
      }
      // Progress, even on a connection that then broke, starts the back-off and the give-up clock over.
      if (view.lastEventId !== before) {
        attempt = 0;
        failingSince = undefined;
      }
    }
    if (isSettled(view) || view.done) return view;
    const resumeId = view.runId ?? runId;
    if (!resumeId) throw new Error("the stream ended before the gateway named its Run");
    failingSince ??= Date.now();
    if (Date.now() - failingSince > backoff.giveUpMs) throw new NetworkError(`gave up resuming run ${resumeId}: ${reason}`);
    const delayMs = backoffDelay(backoff, attempt);
    options.onEvent?.({ kind: "reconnecting", attempt: attempt + 1, delayMs, reason });
    await sleep(delayMs, options.signal);
    attempt++;
    body = null;
    try {
      const resumed = await options.api.resumeStream(resumeId, view.lastEventId, options.signal);
      if (resumed === null) throw new Error(`the gateway does not know run ${resumeId}`);
      body = resumed.body;
      options.onEvent?.({ kind: "resumed", lastEventId: view.lastEventId });
    } catch (error) {
      if (options.signal?.aborted) throw error;
      if (error instanceof ApiError && error.status !== 503) throw error; // 204/404/422 will not heal
      if (!(error instanceof NetworkError) && !(error instanceof ApiError)) throw error;
      resumeFailure = error.message;
    }
  }
}

/** POSTs until an HTTP answer arrives; the same key every time, so a retry never starts a second Run. */
async function postWithRetry(options: RunTurnOptions, key: string, backoff: Backoff, sleep: NonNullable<RunTurnOptions["sleep"]>): Promise<Response> {
  const started = Date.now();
  for (let attempt = 0; ; attempt++) {
    try {
      return await options.api.postTurn(options.sessionId, options.body, key, options.signal);
    } catch (error) {
      const retryable = error instanceof NetworkError || (error instanceof ApiError && error.code === "service_unavailable");
      if (!retryable || options.signal?.aborted || Date.now() - started > backoff.giveUpMs) throw error;
      const delayMs = backoffDelay(backoff, attempt);
      options.onEvent?.({ kind: "retrying-post", attempt: attempt + 1, delayMs, error: error.message });
      await sleep(delayMs, options.signal);
    }
  }
}

/** Reads one connection's frames into the view. */
async function consume(body: ReadableStream<Uint8Array>, start: TurnView, apply: (view: TurnView) => void, options: RunTurnOptions): Promise<void> {
  let view = start;
  const idle = new IdleWatch(body, options.idleTimeoutMs ?? 35_000);
  try {
    for await (const frame of readFrames(idle.stream)) {
      idle.touch();
      view = reduceFrame(view, frame);
      apply(view);
      if (frame.kind === "done") break;
    }
  } finally {
    idle.stop();
  }
  if (idle.fired) throw new Error("the stream went silent");
}

/** Errors a body that sends nothing for `timeoutMs`, so a half-open connection gets resumed. */
class IdleWatch {
  readonly stream: ReadableStream<Uint8Array>;
  fired = false;
  private timer: NodeJS.Timeout | undefined;
  private readonly controller = new AbortController();
  private readonly reader: ReadableStreamDefaultReader<Uint8Array>;

  constructor(body: ReadableStream<Uint8Array>, private readonly timeoutMs: number) {
    const reader = body.getReader();
    this.reader = reader;
    const signal = this.controller.signal;
    // One listener for the whole connection (one per read would pile up on a long stream).
    const idle = new Promise<never>((_, reject) => signal.addEventListener("abort", () => reject(new Error("idle")), { once: true }));
    idle.catch(() => undefined); // observed by the race below; never an unhandled rejection
    this.stream = new ReadableStream<Uint8Array>({
      pull: async (controller) => {
        const result = await Promise.race([reader.read(), idle]);
        if (result.done) controller.close();
        else controller.enqueue(result.value);
      },
      cancel: async () => {
        await reader.cancel().catch(() => undefined);
      },
    });
    this.touch();
  }

  touch(): void {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      this.fired = true;
      this.controller.abort();
      this.reader.cancel().catch(() => undefined);
    }, this.timeoutMs);
    this.timer.unref();
  }

  stop(): void {
    clearTimeout(this.timer);
  }
}

function sleepFor(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
