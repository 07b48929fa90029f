/** The pure stream reducer: (TurnView, frame) → TurnView, idempotent on replayed frame ids. */

import type { UIMessageChunk } from "ai";
import { compareFrameIds, parseFrameId } from "./frame-id.js";
import type { Frame } from "./sse.js";
import type { ApprovalPart, Artifact, ChildPart, Part, Skill, TurnView, Usage, Warning } from "./turn-view.js";

type DataChunk = Extract<UIMessageChunk, { data: unknown }>;

/**
 * Applies one frame. A content frame (`s.k`) at or before the last one applied is a replay
 * (an overlapping resume, an idempotent POST) and changes nothing. Control frames (`s.k.n`:
 * `start`, heartbeats) are idempotent by nature and always applied.
 */
export function reduceFrame(view: TurnView, frame: Frame): TurnView {
  if (frame.kind === "done") return view.done ? view : { ...view, done: true };
  const id = parseFrameId(frame.id);
  if (id?.isContent && view.lastContentId !== undefined) {
    const last = parseFrameId(view.lastContentId);
    if (last && compareFrameIds(id, last) <= 0) return view;
  }
  const next = frame.kind === "chunk" ? reduceChunk(view, frame.chunk) : { ...view, ignored: view.ignored + 1 };
  if (id === undefined) return next;
  const last = parseFrameId(view.lastEventId);
  const lastEventId = last && compareFrameIds(id, last) <= 0 ? last.raw : id.raw; // only ever moves forward
  return { ...next, lastEventId, ...(id.isContent ? { lastContentId: id.raw } : {}) };
}

/** Applies a list of frames in order. */
export function reduceFrames(view: TurnView, frames: Iterable<Frame>): TurnView {
  let current = view;
  for (const frame of frames) current = reduceFrame(current, frame);
  return current;
}

/** Applies one chunk, ignoring its id. Unknown chunk and data types are counted, never thrown on. */
export function reduceChunk(view: TurnView, chunk: UIMessageChunk): TurnView {
  if (view.outcome !== "streaming" && chunk.type !== "start") return view; // nothing after a terminal
  switch (chunk.type) {
    case "start":
      return applyStart(view, chunk.messageId, chunk.messageMetadata);
    case "start-step":
      return { ...view, parts: [...view.parts, { kind: "step", index: view.parts.filter((p) => p.kind === "step").length + 1 }] };
    case "finish-step":
      return view;
    case "reasoning-start":
    case "text-start":
      return upsertStreamed(view, chunk.type === "text-start" ? "text" : "reasoning", chunk.id, "", false);
    case "reasoning-delta":
    case "text-delta":
      return upsertStreamed(view, chunk.type === "text-delta" ? "text" : "reasoning", chunk.id, chunk.delta, false);
    case "reasoning-end":
    case "text-end":
      return upsertStreamed(view, chunk.type === "text-end" ? "text" : "reasoning", chunk.id, "", true);
    case "tool-input-start":
    case "tool-input-available":
      return upsertTool(view, chunk.toolCallId, { toolName: chunk.toolName, input: "input" in chunk ? chunk.input : undefined });
    case "tool-input-delta":
      return appendToolInput(view, chunk.toolCallId, chunk.inputTextDelta);
    case "tool-input-error":
      return upsertTool(view, chunk.toolCallId, { toolName: chunk.toolName, input: chunk.input, state: "error", errorText: chunk.errorText });
    case "tool-output-available":
      return chunk.preliminary ? view : upsertTool(view, chunk.toolCallId, { state: "output", output: chunk.output });
    case "tool-output-error":
      return upsertTool(view, chunk.toolCallId, { state: "error", errorText: chunk.errorText });
    case "tool-output-denied":
      return upsertTool(view, chunk.toolCallId, { state: "error", errorText: "denied" });
    case "error":
      return { ...view, errorText: chunk.errorText };
    case "finish": {
      const meta = record(chunk.messageMetadata);
      const failed = chunk.finishReason === "error" || view.errorText !== undefined;
      const durationMs = num(meta["durationMs"]);
      return { ...view, outcome: failed ? "failed" : "finished", status: undefined, ...(durationMs !== undefined ? { durationMs } : {}) };
    }
    case "abort":
      return { ...view, outcome: "cancelled", status: undefined, abortReason: chunk.reason ?? "aborted" };
    default:
      if (chunk.type.startsWith("data-")) return reduceData(view, chunk as DataChunk);
      return { ...view, ignored: view.ignored + 1 };
  }
}

function applyStart(view: TurnView, messageId: string | undefined, metadata: unknown): TurnView {
  const meta = record(metadata);
  const runId = str(meta["runId"]) ?? messageId ?? view.runId;
  const model = str(meta["model"]) ?? view.model;
  const delivery = view.delivery ?? str(meta["delivery"]); // the first connection's delivery stays
  return { ...view, ...(runId ? { runId } : {}), ...(model ? { model } : {}), ...(delivery ? { delivery } : {}) };
}

const RESTATED = "-restated";

function upsertStreamed(view: TurnView, kind: "text" | "reasoning", id: string, delta: string, end: boolean): TurnView {
  const index = view.parts.findIndex((p) => p.kind === kind && p.id === id);
  if (index < 0) {
    // `<id>-restated` is the parsed text of a part whose stream showed other text: it takes that part's place.
    const base = id.endsWith(RESTATED) ? id.slice(0, -RESTATED.length) : undefined;
    const shown = view.parts.findIndex((p) => p.kind === kind && p.id === base);
    const part = { kind, id, text: delta, done: end };
    return shown < 0 ? { ...view, parts: [...view.parts, part] } : replaceAt(view, shown, part);
  }
  const part = view.parts[index] as Extract<Part, { kind: "text" | "reasoning" }>;
  return replaceAt(view, index, { ...part, text: part.text + delta, done: part.done || end });
}

interface ToolPatch {
  readonly toolName?: string;
  readonly input?: unknown;
  readonly state?: "output" | "error";
  readonly output?: unknown;
  readonly errorText?: string;
}

function upsertTool(view: TurnView, toolCallId: string, patch: ToolPatch): TurnView {
  const index = view.parts.findIndex((p) => p.kind === "tool" && p.toolCallId === toolCallId);
  if (index < 0) {
    const part: Part = { kind: "tool", toolCallId, toolName: patch.toolName ?? "tool", input: patch.input, state: patch.state ?? "running", ...outputOf(patch) };
    return { ...view, parts: [...view.parts, part] };
  }
  const { inputText, ...old } = view.parts[index] as Extract<Part, { kind: "tool" }>;
  return replaceAt(view, index, {
    ...old,
    ...(patch.input === undefined && inputText !== undefined ? { inputText } : {}), // a whole input ends the streamed one
    ...(patch.toolName !== undefined ? { toolName: patch.toolName } : {}),
    ...(patch.input !== undefined ? { input: patch.input } : {}),
    ...(patch.state !== undefined ? { state: patch.state } : {}),
    ...outputOf(patch),
  });
}

function appendToolInput(view: TurnView, toolCallId: string, delta: string): TurnView {
  const index = view.parts.findIndex((p) => p.kind === "tool" && p.toolCallId === toolCallId);
  if (index < 0) return { ...view, ignored: view.ignored + 1 }; // a delta without its tool-input-start
  const old = view.parts[index] as Extract<Part, { kind: "tool" }>;
  const inputText = (old.inputText ?? "") + delta;
  return replaceAt(view, index, { ...old, inputText, input: partialJson(inputText) ?? old.input });
}

/** A streamed input's JSON text, cut anywhere in its last string value, read as if it ended there. */
export function partialJson(text: string): unknown {
  // An escape cut in its middle (`\u00`) is at most 5 characters: drop up to that many and retry.
  for (let cut = 0; cut <= Math.min(5, text.length); cut++) {
    try {
      return JSON.parse(`${text.slice(0, text.length - cut)}"}`);
    } catch {
      // try a shorter text
    }
  }
  return undefined;
}

function outputOf(patch: ToolPatch): { output?: unknown; errorText?: string } {
  return { ...(patch.output !== undefined ? { output: patch.output } : {}), ...(patch.errorText !== undefined ? { errorText: patch.errorText } : {}) };
}

function reduceData(view: TurnView, chunk: DataChunk): TurnView {
  const data = record(chunk.data);
  switch (chunk.type) {
    case "data-status":
      return view.outcome === "streaming" ? { ...view, status: { phase: str(data["phase"]) ?? "", detail: str(data["status"]) ?? str(data["message"]) ?? str(data["detail"]) ?? "" } } : view;
    case "data-child-progress":
      return upsertChild(view, chunk.id ?? str(data["child_id"]), data);
    case "data-approval":
      return upsertApproval(view, chunk.id ?? str(data["approval_id"]), data);
    case "data-artifact": {
      const artifact = toArtifact(data);
      if (!artifact) return ignore(view);
      return { ...view, artifacts: [...view.artifacts.filter((a) => a.artifactId !== artifact.artifactId), artifact] };
    }
    case "data-warning": {
      const warning: Warning = { code: str(data["code"]) ?? "warning", message: str(data["message"]) ?? "" };
      const seen = view.warnings.some((w) => w.code === warning.code && w.message === warning.message);
      return seen ? view : { ...view, warnings: [...view.warnings, warning] };
    }
    case "data-usage":
      return { ...view, usage: toUsage(record(data["usage"])) };
    case "data-skill": {
      const skill: Skill = { skillId: str(data["skill_id"]) ?? "?", name: str(data["name"]) ?? "?", version: str(data["version"]) ?? "", phase: str(data["phase"]) ?? "" };
      return { ...view, skills: [...view.skills.filter((s) => s.skillId !== skill.skillId), skill] };
    }
    case "data-attachment": {
      const id = str(data["attachment_id"]);
      if (!id) return ignore(view);
      const attachment = { attachmentId: id, filename: str(data["filename"]) ?? id, byteSize: num(data["byte_size"]) ?? 0 };
      return { ...view, attachments: [...view.attachments.filter((a) => a.attachmentId !== id), attachment] };
    }
    default:
      return ignore(view);
  }
}

function upsertApproval(view: TurnView, approvalId: string | undefined, data: Record<string, unknown>): TurnView {
  if (!approvalId) return ignore(view);
  const note = str(data["note"]);
  const decidedBy = str(data["decided_by"]);
  const part: ApprovalPart = {
    kind: "approval",
    approvalId,
    callId: str(data["call_id"]) ?? "",
    code: str(data["code"]) ?? "",
    reason: str(data["reason"]) ?? "",
    state: str(data["state"]) ?? "pending",
    ...(note !== undefined ? { note } : {}),
    ...(decidedBy !== undefined ? { decidedBy } : {}),
  };
  const index = view.parts.findIndex((p) => p.kind === "approval" && p.approvalId === approvalId);
  return index < 0 ? { ...view, parts: [...view.parts, part] } : replaceAt(view, index, part);
}

function upsertChild(view: TurnView, childId: string | undefined, data: Record<string, unknown>): TurnView {
  if (!childId) return ignore(view);
  const elapsedMs = num(data["elapsed_ms"]);
  const part: ChildPart = {
    kind: "child",
    childId,
    taskLabel: str(data["task_label"]) ?? childId,
    state: str(data["state"]) ?? "",
    cleanupState: str(data["cleanup_state"]) ?? "",
    ...(elapsedMs !== undefined ? { elapsedMs } : {}),
  };
  const index = view.parts.findIndex((p) => p.kind === "child" && p.childId === childId);
  return index < 0 ? { ...view, parts: [...view.parts, part] } : replaceAt(view, index, part);
}

function toArtifact(data: Record<string, unknown>): Artifact | undefined {
  const artifactId = str(data["artifact_id"]);
  if (!artifactId) return undefined;
  return {
    artifactId,
    name: str(data["name"]) ?? artifactId,
    mediaType: str(data["media_type"]) ?? "application/octet-stream",
    byteSize: num(data["byte_size"]) ?? 0,
    checksumSha256: str(data["checksum_sha256"]) ?? "",
  };
}

function toUsage(usage: Record<string, unknown>): Usage {
  const observed = record(usage["observed_lm_usage"]);
  const models = Object.entries(observed).map(([model, value]) => {
    const counts = record(value);
    return { model, promptTokens: num(counts["prompt_tokens"]) ?? 0, completionTokens: num(counts["completion_tokens"]) ?? 0 };
  });
  const iterations = num(usage["iterations"]);
  const durationMs = num(usage["duration_ms"]);
  const costUsd = num(usage["cost_usd"]);
  return {
    models,
    ...(iterations !== undefined ? { iterations } : {}),
    ...(durationMs !== undefined ? { durationMs } : {}),
    ...(costUsd !== undefined ? { costUsd } : {}),
  };
}

function replaceAt(view: TurnView, index: number, part: Part): TurnView {
  const parts = view.parts.slice();
  parts[index] = part;
  return { ...view, parts };
}

function ignore(view: TurnView): TurnView {
  return { ...view, ignored: view.ignored + 1 };
}

export function record(value: unknown): Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value) ? (value as Record<string, unknown>) : {};
}

export function str(value: unknown): string | undefined {
  return typeof value === "string" ? value : undefined;
}

export function num(value: unknown): number | undefined {
  return typeof value === "number" && Number.isFinite(value) ? value : undefined;
}
