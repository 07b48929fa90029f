/** The client's own pi-tui components: a Turn, a notice, the bottom info line. */

import { block, renderTurn } from "./render.js";
import { style } from "./theme.js";
import { emptyTurn, type TurnView } from "./turn-view.js";
import { MarkdownBlock, truncateToWidth, type Component } from "./ui.js";
import { foldHint, foldLines } from "./fold.js";

/** Shared display settings that every component reads at render time. */
export interface Display {
  expanded: boolean;
  foldAt: number;
}

export class TurnComponent implements Component {
  private view: TurnView;
  private readonly markdown = new Map<string, MarkdownBlock>();
  private rendered: { view: TurnView; key: string; lines: string[] } | undefined;

  constructor(private readonly display: Display, view: TurnView = emptyTurn("")) {
    this.view = view;
  }

  get current(): TurnView {
    return this.view;
  }

  update(view: TurnView): void {
    this.view = view;
  }

  render(width: number): string[] {
    // The TUI renders every component on every keystroke: a Turn whose view, width and fold
    // state have not changed gives back the lines it gave last time.
    const key = `${width}:${this.display.expanded}:${this.display.foldAt}`;
    if (this.rendered?.view === this.view && this.rendered.key === key) return this.rendered.lines;
    const lines = renderTurn(this.view, width, {
      expanded: this.display.expanded,
      foldAt: this.display.foldAt,
      markdown: (id, text, w) => this.markdownFor(id).render(text, w),
    });
    this.rendered = { view: this.view, key, lines: [...lines, ""] };
    return this.rendered.lines;
  }

  invalidate(): void {
    this.markdown.clear();
    this.rendered = undefined;
  }

  private markdownFor(id: string): MarkdownBlock {
    let block = this.markdown.get(id);
    if (!block) {
      block = new MarkdownBlock();
      this.markdown.set(id, block);
    }
    return block;
  }
}

export type NoticeTone = "info" | "error" | "success";

/** A command's answer: a title line and a body that folds like tool output. */
export class NoticeComponent implements Component {
  constructor(
    private readonly display: Display,
    private readonly title: string,
    private readonly body: readonly string[] = [],
    private readonly tone: NoticeTone = "info",
  ) {}

  render(width: number): string[] {
    const paint = this.tone === "error" ? style.red : this.tone === "success" ? style.green : style.cyan;
    const head = block(paint("• "), [paint(this.title)], width);
    const wrapped = block("  ", this.body, width);
    const { lines, hidden } = foldLines(wrapped, Math.max(this.display.foldAt, 20), this.display.expanded);
    return [...head, ...lines, ...(hidden ? block("  ", [style.gray(foldHint(hidden))], width) : []), ""];
  }

  invalidate(): void {}
}

/** One line at the bottom: the session, selections, pending attachments and the keys. */
export class InfoLine implements Component {
  text = "";

  render(width: number): string[] {
    return [truncateToWidth(style.gray(this.text), width)];
  }

  invalidate(): void {}
}
