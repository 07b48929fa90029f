/** Committed history (`GET /api/sessions/{id}/turns` UIMessages) → TurnViews, through the same reducer. */

import type { UIMessageChunk } from "ai";
import { num, record, reduceChunk, str } from "./reducer.js";
import { emptyTurn, type TurnView } from "./turn-view.js";

export interface HistoryMessage {
  readonly id: string;
  readonly role: string;
  readonly parts: readonly unknown[];
  readonly metadata?: unknown;
}

/** Pairs each user message with the assistant message after it (a lone one is shown alone). */
export function turnsFromHistory(messages: readonly HistoryMessage[]): TurnView[] {
  const turns: TurnView[] = [];
  let pendingUser: HistoryMessage | undefined;
  for (const message of messages) {
    if (message.role === "user") {
      if (pendingUser) turns.push(settledUserOnly(pendingUser));
      pendingUser = message;
    } else if (message.role === "assistant") {
      turns.push(turnFromMessages(pendingUser, message));
      pendingUser = undefined;
    }
  }
  if (pendingUser) turns.push(settledUserOnly(pendingUser));
  return turns;
}

function settledUserOnly(user: HistoryMessage): TurnView {
  return { ...emptyTurn(userTextOf(user)), outcome: "finished" };
}

function userTextOf(message: HistoryMessage): string {
  return message.parts
    .map(record)
    .filter((p) => p["type"] === "text")
    .map((p) => str(p["text"]) ?? "")
    .join("\n");
}

/** Replays the committed parts as chunks, so history and live Turns render identically. */
export function turnFromMessages(user: HistoryMessage | undefined, assistant: HistoryMessage): TurnView {
  let view = emptyTurn(user ? userTextOf(user) : "");
  const meta = record(assistant.metadata);
  view = reduceChunk(view, { type: "start", messageId: assistant.id, messageMetadata: { runId: str(meta["runId"]) ?? assistant.id, delivery: "history" } });
  const status = str(meta["status"]);
  const userData = (user?.parts ?? []).map(record).filter((p) => str(p["type"])?.startsWith("data-")); // skills, attachments
  const parts = [...userData, ...assistant.parts.map(record)];
  parts.forEach((part, index) => {
    if (status === "cancelled" && part["type"] === "text" && part["text"] === "Turn cancelled") return; // the tombstone
    for (const chunk of chunksOfPart(part, index)) view = reduceChunk(view, chunk);
  });
  if (status === "cancelled") return reduceChunk(view, { type: "abort", reason: "Turn cancelled" });
  if (status === "failed" || status === "timed_out") {
    const code = str(meta["failureCode"]);
    const message = str(meta["failureMessage"]);
    if (code !== undefined) view = reduceChunk(view, { type: "error", errorText: message !== undefined ? `${code}: ${message}` : code });
    return reduceChunk(view, { type: "finish", finishReason: "error" });
  }
  return reduceChunk(view, { type: "finish", finishReason: "stop" });
}

function chunksOfPart(part: Record<string, unknown>, index: number): UIMessageChunk[] {
  const type = str(part["type"]) ?? "";
  if (type === "step-start") return [{ type: "start-step" }];
  if (type === "reasoning" || type === "text") {
    const id = `history-${type}-${index}`;
    const text = str(part["text"]) ?? "";
    return type === "text"
      ? [{ type: "text-start", id }, { type: "text-delta", id, delta: text }, { type: "text-end", id }]
      : [{ type: "reasoning-start", id }, { type: "reasoning-delta", id, delta: text }, { type: "reasoning-end", id }];
  }
  if (type === "dynamic-tool") return toolChunks(part);
  if (type.startsWith("data-")) {
    const id = str(part["id"]);
    return [{ type: type as `data-${string}`, data: part["data"], ...(id ? { id } : {}) }];
  }
  return [];
}

function toolChunks(part: Record<string, unknown>): UIMessageChunk[] {
  const toolCallId = str(part["toolCallId"]) ?? "";
  const toolName = str(part["toolName"]) ?? "tool";
  const chunks: UIMessageChunk[] = [{ type: "tool-input-available", toolCallId, toolName, input: part["input"], dynamic: true }];
  const state = str(part["state"]);
  if (state === "output-available") chunks.push({ type: "tool-output-available", toolCallId, output: part["output"], dynamic: true });
  if (state === "output-error") chunks.push({ type: "tool-output-error", toolCallId, errorText: str(part["errorText"]) ?? "error", dynamic: true });
  return chunks;
}

/** The sequence to ask for the next page, or `null` at the end. */
export function nextAfterSequence(page: unknown): number | null {
  return num(record(page)["next_after_sequence"]) ?? null;
}
