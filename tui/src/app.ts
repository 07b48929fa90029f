/** The chat: pi-tui layout, keys, the active Turn, and session state. */

import type { AttachmentInfo, FleetApi, SkillSelection } from "./api.js";
import { parseCommand, slashCommands, type Command } from "./commands.js";
import { InfoLine, NoticeComponent, TurnComponent, type Display, type NoticeTone } from "./components.js";
import { describeError } from "./errors.js";
import { turnsFromHistory, type HistoryMessage } from "./history.js";
import { runCommand } from "./session-commands.js";
import { style } from "./theme.js";
import { runTurn, type Backoff, type RunnerEvent } from "./turn-runner.js";
import { emptyTurn, type Artifact, type TurnView } from "./turn-view.js";
import { CombinedAutocompleteProvider, Container, Editor, Key, Loader, TUI, editorTheme, matchesKey, type Terminal } from "./ui.js";

export interface AppOptions {
  readonly api: FleetApi;
  readonly terminal: Terminal;
  readonly sessionId?: string;
  readonly backoff?: Backoff;
  readonly idleTimeoutMs?: number;
}

interface ActiveTurn {
  readonly abort: AbortController;
  readonly component: TurnComponent;
  runId?: string;
  cancelRequested: boolean;
  done?: boolean;
}

export class App {
  readonly tui: TUI;
  readonly display: Display = { expanded: false, foldAt: 8 };
  sessionId: string | undefined;
  sessionTitle: string | null = null;
  readonly skills: (SkillSelection & { name: string })[] = [];
  pendingAttachments: AttachmentInfo[] = [];
  lastListedSessions: string[] = [];
  private readonly chat = new Container();
  private readonly statusArea = new Container();
  private readonly info = new InfoLine();
  private readonly editor: Editor;
  private loader: Loader | undefined;
  private switching: Promise<void> = Promise.resolve(); // the /new or /resume under way, if any
  private loaderMessage = "";
  private loaderStarted = 0;
  private loaderClock: ReturnType<typeof setInterval> | undefined;
  private active: ActiveTurn | undefined;
  // Turns sent with /queue, waiting on the server behind the active one, oldest first: each
  // streams already (heartbeats until it starts) and becomes the active one when that one ends.
  private readonly queued: ActiveTurn[] = [];
  private refusedPrompt: string | undefined;
  private readonly deciding = new Set<string>(); // approvals this client sent a decision for // typed while a Turn ran: what a bare /queue or /interrupt sends
  private readonly turns: TurnComponent[] = [];
  private exitResolve: ((code: number) => void) | undefined;
  private exiting = false;

  constructor(private readonly options: AppOptions) {
    this.tui = new TUI(options.terminal);
    this.editor = new Editor(this.tui, editorTheme);
    // `/` lists the commands, Tab completes a command or (after /attach) a path.
    this.editor.setAutocompleteProvider(new CombinedAutocompleteProvider(slashCommands(), process.cwd(), null));
    this.editor.onSubmit = (text) => this.submit(text);
    this.tui.addChild(this.chat);
    this.tui.addChild(this.statusArea);
    this.tui.addChild(this.editor);
    this.tui.addChild(this.info);
    this.tui.setFocus(this.editor);
    this.tui.addInputListener((data) => this.onKey(data));
  }

  get api(): FleetApi {
    return this.options.api;
  }

  /** Starts the UI and opens the session; resolves with the exit code when the user quits. */
  async run(): Promise<number> {
    const exited = new Promise<number>((resolve) => (this.exitResolve = resolve));
    this.tui.start();
    try {
      if (this.options.sessionId) await this.openSession(this.options.sessionId);
      else await this.newSession();
      this.notice(`fleet · ${this.api.baseUrl}`, ["Type a prompt and press Enter. /help lists the commands; Esc or Ctrl+C cancels a running Turn."]);
    } catch (error) {
      this.notice("could not open a session", [describeError(error), "Use /new or /resume <id> once the gateway answers."], "error");
    }
    return exited;
  }

  /** What to print once the client has quit: how to come back to this session. */
  exitHint(): string | undefined {
    return this.sessionId ? `to come back to this session: uv run fleet cli --session ${this.sessionId}` : undefined;
  }

  exit(code = 0): void {
    if (this.exiting) return;
    this.exiting = true;
    this.active?.abort.abort();
    for (const waiting of this.queued) waiting.abort.abort();
    this.stopLoader();
    this.tui.stop();
    this.exitResolve?.(code);
  }

  notice(title: string, body: readonly string[] = [], tone: NoticeTone = "info"): void {
    this.chat.addChild(new NoticeComponent(this.display, title, body, tone));
    this.refresh();
  }

  /** Every artifact the Turns on screen announced, newest last. */
  artifacts(): Artifact[] {
    const seen = new Map<string, Artifact>();
    for (const turn of this.turns) for (const a of turn.current.artifacts) seen.set(a.artifactId, a);
    return [...seen.values()];
  }

  async newSession(): Promise<void> {
    const session = await this.api.createSession();
    this.resetChat();
    this.sessionId = session.id;
    this.sessionTitle = session.title;
    this.notice(`new session ${session.id}`);
  }

  async openSession(id: string): Promise<void> {
    const session = await this.api.getSession(id);
    const messages: HistoryMessage[] = [];
    for (let after: number | null = 0; after !== null; ) {
      const page = await this.api.historyPage(id, after);
      messages.push(...page.items);
      after = page.next_after_sequence;
    }
    this.resetChat();
    this.sessionId = session.id;
    this.sessionTitle = session.title;
    this.notice(`session ${session.id}${session.title ? ` · ${session.title}` : ""}`, [`${messages.length} message(s) of history`]);
    for (const view of turnsFromHistory(messages)) this.addTurn(view);
    this.refresh();
  }

  /** Requests cancellation of the running Turn (Esc, /cancel), or of `active`. */
  async cancel(active: ActiveTurn | undefined = this.active): Promise<void> {
    if (!active) {
      this.notice("no Turn is running");
      return;
    }
    active.cancelRequested = true;
    if (!active.runId) {
      this.setStatus("cancel requested; waiting for the gateway to name the Run… (Ctrl+C again quits)");
      this.refresh();
      return;
    }
    try {
      const answer = await this.api.cancelRun(active.runId);
      this.setStatus(`cancel ${answer.state.replace(/_/g, " ")}; waiting for the abort… (Ctrl+C again quits)`);
      this.refresh();
    } catch (error) {
      this.notice("cancel failed", [describeError(error)], "error");
    }
  }

  refresh(): void {
    this.info.text = this.infoText();
    this.tui.requestRender();
  }

  private resetChat(): void {
    this.chat.clear();
    this.turns.length = 0;
    this.tui.requestRender(true);
  }

  private addTurn(view: TurnView): TurnComponent {
    const component = new TurnComponent(this.display, view);
    this.turns.push(component);
    this.chat.addChild(component);
    return component;
  }

  /** The cell of the current Turn that waits for a decision (and none was sent for), if any. */
  private pendingApproval(): { runId: string; approvalId: string } | undefined {
    const runId = this.active?.runId;
    const view = this.active?.component.current;
    const part = view?.outcome === "streaming" ? view.parts.find((p) => p.kind === "approval" && p.state === "pending" && !this.deciding.has(p.approvalId)) : undefined;
    return runId && part?.kind === "approval" ? { runId, approvalId: part.approvalId } : undefined;
  }

  /** Approves or denies the waiting cell, once; the stream then shows how it was decided. */
  async decide(decision: "approve" | "deny", note = ""): Promise<void> {
    const pending = this.pendingApproval();
    if (!pending) {
      this.notice("no cell is waiting for approval", [], "error");
      return;
    }
    this.deciding.add(pending.approvalId);
    try {
      await this.api.decideApproval(pending.runId, pending.approvalId, decision, note || undefined);
    } catch (error) {
      this.deciding.delete(pending.approvalId); // not recorded: it may be decided again
      throw error;
    }
  }

  private onKey(data: string): { consume: boolean } | undefined {
    if ((data === "y" || data === "n") && this.editor.getText() === "" && this.pendingApproval()) {
      const decision = data === "y" ? "approve" : "deny";
      void this.decide(decision).catch((error: unknown) => this.notice(`${decision} failed`, [describeError(error)], "error"));
      return { consume: true };
    }
    if (matchesKey(data, Key.escape) && this.active) {
      void this.cancel();
      return { consume: true };
    }
    if (matchesKey(data, Key.ctrl("o"))) {
      this.display.expanded = !this.display.expanded;
      this.tui.invalidate();
      this.refresh();
      return { consume: true };
    }
    if (matchesKey(data, Key.ctrl("c"))) {
      // The first Ctrl+C cancels a running Turn (like Esc); a second one, or one when idle, quits.
      if (this.active && !this.active.cancelRequested) void this.cancel();
      else this.exit(0);
      return { consume: true };
    }
    if (matchesKey(data, Key.ctrl("d")) && this.editor.getText() === "") {
      this.exit(0);
      return { consume: true };
    }
    return undefined;
  }

  /** Runs what was typed. Anything typed while /new, /resume or /delete switches sessions waits for
   * the switch (chained here, synchronously, in the order it was typed), so it reaches the new
   * session and its output is not cleared with the old one's. */
  private submit(line: string): void {
    const command = parseCommand(line);
    if (line.trim()) this.editor.addToHistory(line);
    const run = this.switching.then(() => this.dispatch(command));
    if (command.kind === "new" || command.kind === "resume" || command.kind === "delete") this.switching = run.then(noop, noop);
    run.then(noop, (error: unknown) => this.notice(`${line.trim().split(/\s/)[0]} failed`, [describeError(error)], "error")).finally(() => this.refresh());
  }

  private async dispatch(command: Command): Promise<void> {
    switch (command.kind) {
      case "prompt":
        if (command.text) await this.prompt(command.text);
        return;
      case "interrupt": // with no Turn running here, a plain prompt (never another client's Turn)
      case "queue": {
        const text = command.text || this.refusedPrompt;
        this.refusedPrompt = undefined;
        if (!text) {
          this.notice(`usage: /${command.kind} <text> (or type the prompt, then /${command.kind})`, [], "error");
          return;
        }
        await this.prompt(text, this.active ? (command.kind === "queue" ? "enqueue" : "interrupt") : "plain");
        return;
      }
      case "exit":
        this.exit(0);
        return;
      case "cancel":
        await this.cancel();
        return;
      default:
        await runCommand(this, command);
    }
  }

  /** Sends a Turn; with `interrupt`, one that cancels the running Turn on the server (whose
   * stream then ends with its abort) and takes its place; with `enqueue`, one that waits on the
   * server behind it and becomes the current Turn when the ones ahead have ended. */
  private async prompt(text: string, mode: "plain" | "enqueue" | "interrupt" = "plain"): Promise<void> {
    if (this.active && mode === "plain") {
      this.refusedPrompt = text;
      this.notice("a Turn is still running: queue this prompt, or interrupt?", ["/queue sends it once the running Turn has ended; /interrupt cancels that Turn and sends it now; Esc cancels the running Turn"], "error");
      return;
    }
    if (!this.sessionId) {
      this.notice("no session yet: /new or /resume <id>", [], "error");
      return;
    }
    const attached = this.pendingAttachments; // this Turn's: the next one starts with none
    this.pendingAttachments = [];
    const body = {
      text,
      attachment_ids: attached.map((a) => a.id),
      skill_selections: this.skills.map(({ id, expected_version }) => ({ id, expected_version })),
      ...(mode === "plain" ? {} : { multitask: mode }),
    };
    const component = this.addTurn(emptyTurn(text));
    const active: ActiveTurn = { abort: new AbortController(), component, cancelRequested: false };
    const previous = this.active; // the Turn this one interrupts, still streaming to its abort
    if (mode === "enqueue") {
      this.queued.push(active);
      this.notice(`queued: it runs once the ${this.queued.length === 1 ? "running Turn has" : `${this.queued.length} Turns ahead have`} ended`);
    } else {
      this.active = active;
      this.startLoader("sending…");
    }
    try {
      const view = await runTurn({
        api: this.api,
        sessionId: this.sessionId,
        body,
        signal: active.abort.signal,
        ...(this.options.backoff ? { backoff: this.options.backoff } : {}),
        ...(this.options.idleTimeoutMs ? { idleTimeoutMs: this.options.idleTimeoutMs } : {}),
        onView: (next) => this.onView(active, next),
        onEvent: (event) => this.onRunnerEvent(active, event),
      });
      component.update(view);
    } catch (error) {
      if (!active.abort.signal.aborted) this.notice("the Turn's stream failed", [describeError(error)], "error");
      if (!active.runId && this.pendingAttachments.length === 0) this.pendingAttachments = attached; // never sent
    } finally {
      active.done = true;
      const waited = this.queued.indexOf(active);
      if (waited >= 0) this.queued.splice(waited, 1); // ended before its turn came (an interrupt cancelled it)
      if (this.active === active) {
        // An interrupt that failed leaves the Turn it meant to replace running: that one is current
        // again; otherwise the first queued Turn (its stream already open) is now the current one.
        this.active = previous && !previous.done && mode === "interrupt" ? previous : this.queued.shift();
        if (this.active) this.startLoader(`run ${this.active.runId?.slice(0, 8) ?? ""} · queued`);
        else this.stopLoader();
      }
      this.refresh();
    }
  }

  private onView(active: ActiveTurn, view: TurnView): void {
    active.component.update(view);
    if (view.runId && !active.runId) this.onRunId(active, view.runId);
    if (view.status && this.active === active) this.setStatus(`${view.status.phase}${view.status.detail ? ` · ${view.status.detail}` : ""}`);
    this.refresh();
  }

  private onRunnerEvent(active: ActiveTurn, event: RunnerEvent): void {
    if (event.kind === "posted") this.onRunId(active, event.runId);
    if (this.active !== active) return; // an interrupted Turn's stream, ending: the status line is the new one's
    switch (event.kind) {
      case "posted":
        this.setStatus(`run ${event.runId.slice(0, 8)} · queued`);
        return;
      case "retrying-post":
        this.setStatus(`gateway unreachable (${event.error}); retrying the same request in ${event.delayMs} ms (attempt ${event.attempt})`);
        return;
      case "reconnecting":
        this.setStatus(`stream dropped (${event.reason}); resuming in ${event.delayMs} ms (attempt ${event.attempt})`);
        return;
      case "resumed":
        this.setStatus(`resumed after ${event.lastEventId ?? "the start"}`);
        return;
    }
  }

  private onRunId(active: ActiveTurn, runId: string): void {
    if (active.runId) return;
    active.runId = runId;
    if (active.cancelRequested) void this.cancel(active);
  }

  private startLoader(message: string): void {
    this.stopLoader();
    this.loaderMessage = message;
    this.loaderStarted = Date.now();
    this.loader = new Loader(this.tui, style.cyan, style.gray, message);
    this.statusArea.addChild(this.loader);
    this.loader.start();
    this.loaderClock = setInterval(() => this.showStatus(), 1_000); // the elapsed time moves on its own
  }

  private setStatus(message: string): void {
    this.loaderMessage = message;
    this.showStatus();
  }

  private showStatus(): void {
    this.loader?.setMessage(`${this.loaderMessage} · ${elapsed(Date.now() - this.loaderStarted)}`);
  }

  private stopLoader(): void {
    clearInterval(this.loaderClock);
    this.loaderClock = undefined;
    if (!this.loader) return;
    this.loader.stop();
    this.statusArea.clear();
    this.loader = undefined;
  }

  private infoText(): string {
    const parts = [this.sessionId ? `session ${this.sessionId}` : "no session"];
    if (this.skills.length) parts.push(`skills: ${this.skills.map((s) => s.name).join(", ")}`);
    if (this.pendingAttachments.length) parts.push(`${this.pendingAttachments.length} attachment(s) for the next Turn`);
    const keys = !this.active ? "/help · ctrl+c quit" : this.active.cancelRequested ? "cancelling · ctrl+c quit" : "esc/ctrl+c cancel";
    parts.push(keys, `ctrl+o ${this.display.expanded ? "fold" : "expand"}`);
    return parts.join(" · ");
  }
}

/** 7s, 1m 05s: how long the Turn has run, for the status line. */
export function elapsed(ms: number): string {
  const seconds = Math.floor(ms / 1000);
  return seconds < 60 ? `${seconds}s` : `${Math.floor(seconds / 60)}m ${String(seconds % 60).padStart(2, "0")}s`;
}

function noop(): void {}
