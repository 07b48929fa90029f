/** What the client shows of one Turn: plain immutable data, built by `reducer.ts`. */

export interface ReasoningPart {
  readonly kind: "reasoning";
  readonly id: string;
  readonly text: string;
  readonly done: boolean;
}

export interface TextPart {
  readonly kind: "text";
  readonly id: string;
  readonly text: string;
  readonly done: boolean;
}

/** A code cell (`python`) or a sub-LM call (`llm_query`, `llm_query_batched`, `rlm_query`). */
export interface ToolPart {
  readonly kind: "tool";
  readonly toolCallId: string;
  readonly toolName: string;
  readonly input: unknown;
  /** The input's JSON text as its `tool-input-delta`s brought it (a cell's code as the LM writes it). */
  readonly inputText?: string;
  readonly state: "running" | "output" | "error";
  readonly output?: unknown;
  readonly errorText?: string;
}

/** `data-child-progress`: one per child, each report replaces the last. */
export interface ChildPart {
  readonly kind: "child";
  readonly childId: string;
  readonly taskLabel: string;
  readonly state: string;
  readonly cleanupState: string;
  readonly elapsedMs?: number;
}

/** `data-approval`: a cell waiting for (or given) a person's decision; each report replaces the last. */
export interface ApprovalPart {
  readonly kind: "approval";
  readonly approvalId: string;
  readonly callId: string;
  readonly code: string;
  readonly reason: string;
  readonly state: string;
  readonly note?: string;
  readonly decidedBy?: string;
}

export interface StepPart {
  readonly kind: "step";
  readonly index: number;
}

export type Part = ReasoningPart | TextPart | ToolPart | ChildPart | ApprovalPart | StepPart;

export interface Artifact {
  readonly artifactId: string;
  readonly name: string;
  readonly mediaType: string;
  readonly byteSize: number;
  readonly checksumSha256: string;
}

export interface Warning {
  readonly code: string;
  readonly message: string;
}

export interface ModelUsage {
  readonly model: string;
  readonly promptTokens: number;
  readonly completionTokens: number;
}

export interface Usage {
  readonly iterations?: number;
  readonly durationMs?: number;
  readonly models: readonly ModelUsage[];
  /** USD for the priced models; absent when no model has a known price (never shown as $0). */
  readonly costUsd?: number;
}

export interface Skill {
  readonly skillId: string;
  readonly name: string;
  readonly version: string;
  readonly phase: string;
}

export interface Attachment {
  readonly attachmentId: string;
  readonly filename: string;
  readonly byteSize: number;
}

export interface Status {
  readonly phase: string;
  readonly detail: string;
}

export type Outcome = "streaming" | "finished" | "failed" | "cancelled";

export interface TurnView {
  readonly userText: string;
  readonly runId?: string;
  readonly model?: string;
  readonly delivery?: string;
  readonly parts: readonly Part[];
  readonly status?: Status;
  readonly skills: readonly Skill[];
  readonly attachments: readonly Attachment[];
  readonly artifacts: readonly Artifact[];
  readonly warnings: readonly Warning[];
  readonly usage?: Usage;
  readonly outcome: Outcome;
  readonly errorText?: string;
  readonly abortReason?: string;
  readonly durationMs?: number;
  /** The last frame id applied (any kind): what a resume sends as `Last-Event-ID`. */
  readonly lastEventId?: string;
  /** The last content frame id applied: frames at or before it are replays and are skipped. */
  readonly lastContentId?: string;
  /** `data: [DONE]` was seen. */
  readonly done: boolean;
  /** Chunks and data parts this client does not show (unknown `data-*`, rejected frames). */
  readonly ignored: number;
}

export function emptyTurn(userText: string): TurnView {
  return { userText, parts: [], skills: [], attachments: [], artifacts: [], warnings: [], outcome: "streaming", done: false, ignored: 0 };
}

/** True once a terminal chunk (`finish`, `abort`) arrived: nothing is left to resume. */
export function isSettled(view: TurnView): boolean {
  return view.outcome !== "streaming";
}
