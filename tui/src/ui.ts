/**
 * The only module that imports pi-tui. Moving to `@earendil-works/pi-tui` (its successor, which
 * needs Node ≥ 22) means changing the import below and the dependency in package.json.
 */

import {
  CombinedAutocompleteProvider,
  Container,
  Editor,
  Key,
  Loader,
  Markdown,
  ProcessTerminal,
  TUI,
  Text,
  matchesKey,
  truncateToWidth,
  visibleWidth,
  wrapTextWithAnsi,
  type Component,
  type EditorTheme,
  type MarkdownTheme,
  type Terminal,
} from "@mariozechner/pi-tui";
import { highlightPython } from "./highlight.js";
import { style } from "./theme.js";

export { CombinedAutocompleteProvider, Container, Editor, Key, Loader, ProcessTerminal, TUI, Text, matchesKey, truncateToWidth, visibleWidth, wrapTextWithAnsi };
export type { Component, Terminal };

export const markdownTheme: MarkdownTheme = {
  heading: (s) => style.bold(style.cyan(s)),
  link: style.blue,
  linkUrl: style.gray,
  code: style.yellow,
  codeBlock: (s) => s,
  codeBlockBorder: style.gray,
  quote: style.italic,
  quoteBorder: style.gray,
  hr: style.gray,
  listBullet: style.cyan,
  bold: style.bold,
  italic: style.italic,
  strikethrough: style.strike,
  underline: style.underline,
  highlightCode: (code, lang) => (lang === undefined || lang === "python" || lang === "py" ? highlightPython(code) : code.split("\n")),
};

export const editorTheme: EditorTheme = {
  borderColor: style.gray,
  selectList: {
    selectedPrefix: style.cyan,
    selectedText: style.bold,
    description: style.gray,
    scrollInfo: style.gray,
    noMatch: style.gray,
  },
};

/** Renders Markdown with pi-tui's component; one instance per text part keeps its render cache. */
export class MarkdownBlock {
  private readonly markdown = new Markdown("", 0, 0, markdownTheme);
  private text = "";

  render(text: string, width: number): string[] {
    if (text !== this.text) {
      this.text = text;
      this.markdown.setText(text);
    }
    return this.markdown.render(width);
  }
}
