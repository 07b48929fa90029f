/** TurnView → terminal lines (pure apart from Markdown, which is passed in). */

import { FOLD_KEY_HINT, foldHint, foldLines } from "./fold.js";
import { highlightPython } from "./highlight.js";
import { record, str } from "./reducer.js";
import { style } from "./theme.js";
import type { ApprovalPart, ChildPart, Part, ToolPart, TurnView, Usage } from "./turn-view.js";
import { visibleWidth, wrapTextWithAnsi } from "./ui.js";

export interface RenderOptions {
  /** Show folded outputs in full. */
  readonly expanded: boolean;
  /** Lines kept of a long output, code cell or reasoning before the fold. */
  readonly foldAt: number;
  /** Renders the answer's Markdown (pi-tui's component) for a text part id. */
  readonly markdown: (partId: string, text: string, width: number) => string[];
}

const SUB_LM_TOOLS = new Set(["llm_query", "llm_query_batched", "rlm_query"]);

/** All lines of one Turn, each at most `width` columns wide. */
export function renderTurn(view: TurnView, width: number, options: RenderOptions): string[] {
  const out: string[] = [];
  if (view.userText) out.push(...renderPrompt(view.userText, width, options));
  const tags = [
    ...view.skills.map((s) => `skill ${s.name} ${s.version} ${s.phase}`),
    ...view.attachments.map((a) => `attachment ${a.filename} (${formatBytes(a.byteSize)})`),
  ];
  if (tags.length) out.push(...block("  ", [style.gray(tags.map((t) => `[${t}]`).join(" "))], width));
  for (const part of view.parts) out.push(...renderPart(part, width, options));
  if (view.outcome === "failed") out.push(...block("  ", [style.red(`✗ ${view.errorText ?? "the Turn failed"}`)], width));
  if (view.outcome === "cancelled") out.push(...block("  ", [style.yellow(`■ ${view.abortReason ?? "cancelled"}`)], width));
  out.push(...renderFooter(view, width));
  return out;
}

/** The user's prompt. Folded, only its start is wrapped: a 100,000-character prompt would be
 * ~850 lines, re-wrapped on every render. */
function renderPrompt(text: string, width: number, options: RenderOptions): string[] {
  const prefix = style.bold(style.cyan("› "));
  const room = options.foldAt * Math.max(1, width - visibleWidth(prefix)); // what the kept lines can hold
  if (options.expanded || text.length <= room) return block(prefix, text.split("\n").map(style.bold), width);
  const shown = block(prefix, text.slice(0, room).split("\n").map(style.bold), width).slice(0, Math.max(1, options.foldAt - 1));
  const keptChars = shown.reduce((sum, line) => sum + visibleWidth(line) - visibleWidth(prefix), 0);
  const hint = `… ${(text.length - keptChars).toLocaleString("en")} more characters (${FOLD_KEY_HINT} to expand)`;
  return [...shown, ...block("  ", [style.gray(hint)], width)];
}

function renderPart(part: Part, width: number, options: RenderOptions): string[] {
  switch (part.kind) {
    case "step":
      return block("  ", [style.gray(`· step ${part.index}`)], width);
    case "reasoning":
      return folded("  ", part.text.split("\n").map((l) => style.dim(style.italic(l))), width, options);
    case "text": {
      // The answer, set apart from the work above it: a heading and a bar beside each line.
      const bar = style.green("▌ ");
      return [
        "",
        `  ${style.bold(style.green("answer"))}`,
        ...options.markdown(part.id, part.text, Math.max(1, width - 4)).map((l) => `  ${bar}${l}`),
      ];
    }
    case "tool":
      return part.toolName === "python" ? renderCell(part, width, options) : renderCall(part, width, options);
    case "child":
      return block("  ", [renderChild(part)], width);
    case "approval":
      return renderApproval(part, width, options);
  }
}

function renderCell(part: ToolPart, width: number, options: RenderOptions): string[] {
  const input = record(part.input);
  const code = str(input["code"]) ?? (part.input === undefined ? "" : JSON.stringify(part.input));
  const out = block("  ", [style.gray(`┌ python ${part.toolCallId}`)], width);
  out.push(...folded(style.gray("  │ "), highlightPython(code), width, options));
  if (part.state === "error") {
    out.push(...folded(style.gray("  └ "), (part.errorText ?? "error").split("\n").map(style.red), width, options, "    "));
  } else if (part.state === "output") {
    const output = record(part.output);
    const stdout = (str(output["stdout"]) ?? "").replace(/\n$/, "");
    const lines = stdout ? stdout.split("\n") : [style.gray("(no output)")];
    if (output["truncated"] === true) lines.push(style.yellow("[output truncated by the sandbox]"));
    out.push(...folded(style.gray("  └ "), lines, width, options, "    "));
  } else {
    // Its code still arriving (input deltas, no whole input yet), or running.
    out.push(...block("  ", [style.gray(part.inputText !== undefined ? "└ writing…" : "└ running…")], width));
  }
  return out;
}

function renderCall(part: ToolPart, width: number, options: RenderOptions): string[] {
  const input = record(part.input);
  const known = SUB_LM_TOOLS.has(part.toolName);
  const count = input["prompt_count"];
  const what = typeof count === "number" ? `${count} prompts` : (str(input["prompt"]) ?? (known ? "" : JSON.stringify(part.input ?? {})));
  const out = folded("  ", [`${style.magenta(`↳ ${part.toolName}`)} ${style.gray(oneLine(what))}`], width, { ...options, foldAt: 2 });
  if (part.state === "error") out.push(...block("    ", [style.red(`✗ ${part.errorText ?? "error"}`)], width));
  if (part.state === "output") {
    const output = record(part.output);
    const texts = Array.isArray(output["texts"]) ? output["texts"].map((t) => String(t)) : [str(output["text"]) ?? JSON.stringify(part.output)];
    const lines = texts.flatMap((t, i) => (texts.length > 1 ? [`[${i}] ${t}`] : [t])).flatMap((t) => t.split("\n"));
    out.push(...folded(style.gray("    ⇒ "), lines, width, options, "      "));
  }
  return out;
}

function renderApproval(part: ApprovalPart, width: number, options: RenderOptions): string[] {
  const out = block("  ", [`${style.yellow(`⚠ approval ${part.callId}`)} ${style.gray(part.reason)}`], width);
  out.push(...folded(style.gray("  │ "), highlightPython(part.code), width, options));
  const note = part.note ? `: ${part.note}` : "";
  const by = part.decidedBy ? ` by ${part.decidedBy}` : "";
  const outcome: Record<string, string> = {
    pending: style.yellow("waiting for you: y approves, n denies (/approve or /deny [note])"),
    approved: style.green(`approved${by}${note}`),
    denied: style.red(`denied${by}${note}: the cell did not run`),
    timed_out: style.red("nobody decided in time: the cell did not run"),
    stopped: style.red("the Turn ended while the cell waited: it did not run"),
  };
  out.push(...block("  ", [`${style.gray("└ ")}${outcome[part.state] ?? part.state}`], width));
  return out;
}

function renderChild(part: ChildPart): string {
  const elapsed = part.elapsedMs !== undefined ? ` · ${(part.elapsedMs / 1000).toFixed(1)}s` : "";
  const state = part.state === "failed" || part.state === "cancelled" ? style.red(part.state) : part.state === "completed" ? style.green(part.state) : style.yellow(part.state);
  return `${style.blue("◆ child")} ${part.taskLabel} ${state}${part.cleanupState ? style.gray(` · ${part.cleanupState}`) : ""}${style.gray(elapsed)}`;
}

function renderFooter(view: TurnView, width: number): string[] {
  const lines: string[] = [];
  for (const a of view.artifacts) lines.push(`${style.green("artifact")} ${a.name} ${style.gray(`${formatBytes(a.byteSize)} ${a.mediaType} id ${a.artifactId}`)}`);
  for (const w of view.warnings) lines.push(style.yellow(`⚠ ${w.code}: ${w.message}`));
  if (view.usage) lines.push(style.gray(formatUsage(view.usage, view.durationMs)));
  if (view.ignored > 0) lines.push(style.gray(`(${view.ignored} part${view.ignored === 1 ? "" : "s"} this client does not show)`));
  if (!lines.length) return [];
  return [...block("  ", [style.gray("─".repeat(Math.min(40, Math.max(1, width - 2))))], width), ...block("  ", lines, width)];
}

export function formatUsage(usage: Usage, durationMs?: number): string {
  const parts: string[] = [];
  if (usage.iterations !== undefined) parts.push(`${usage.iterations} iteration${usage.iterations === 1 ? "" : "s"}`);
  const ms = durationMs ?? usage.durationMs;
  if (ms !== undefined) parts.push(ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${ms} ms`);
  for (const m of usage.models) parts.push(`${m.model} ${m.promptTokens}→${m.completionTokens} tokens`);
  if (usage.costUsd !== undefined) parts.push(formatUsd(usage.costUsd));
  return `usage: ${parts.join(" · ")}`;
}

/** Dollars with enough digits to see a cheap Turn: $0.0023, $1.25. */
export function formatUsd(usd: number): string {
  return usd >= 1 ? `$${usd.toFixed(2)}` : `$${usd.toPrecision(2)}`;
}

export function formatBytes(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}

function oneLine(text: string): string {
  return text.replace(/\s+/g, " ").trim();
}

/** Wraps each line to the width left after `prefix`, then folds the wrapped lines. */
function folded(prefix: string, lines: readonly string[], width: number, options: RenderOptions, restPrefix?: string): string[] {
  const wrapped = block(prefix, lines, width, restPrefix);
  const { lines: kept, hidden } = foldLines(wrapped, options.foldAt, options.expanded);
  return hidden ? [...kept, ...block(restPrefix ?? prefix, [style.gray(foldHint(hidden))], width)] : [...kept];
}

/**
 * Wraps each line to the width left after the prefix; the very first output line gets `prefix`,
 * every later one `restPrefix` (default: the same prefix). Both must be equally wide.
 */
export function block(prefix: string, lines: readonly string[], width: number, restPrefix: string = prefix): string[] {
  const inner = Math.max(1, width - visibleWidth(prefix));
  const out: string[] = [];
  for (const line of lines) {
    const wrapped = line === "" ? [""] : wrapTextWithAnsi(line.replace(/\t/g, "    "), inner);
    for (const w of wrapped) out.push((out.length === 0 ? prefix : restPrefix) + w);
  }
  return out;
}
