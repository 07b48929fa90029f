/** A small Python highlighter for code cells: keywords, builtins, strings, numbers, comments. */

import { style } from "./theme.js";

const KEYWORDS = new Set(
  "False None True and as assert async await break class continue def del elif else except finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case".split(" "),
);
const BUILTINS = new Set("print len range str int float list dict set tuple open sorted sum min max enumerate zip isinstance SUBMIT llm_query llm_query_batched rlm_query".split(" "));

// One alternation, tried left to right at each position: comment, string, number, name, other.
const TOKEN = /(#[^\n]*)|((?:[rRbBfFuU]{0,2})(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?))|(\b\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?\b)|([A-Za-z_]\w*)|([\s\S])/g;

/** Highlights Python source; returns one styled string per source line (styles never span lines). */
export function highlightPython(code: string): string[] {
  const lines: string[] = [""];
  const push = (text: string, paint: (s: string) => string): void => {
    text.split("\n").forEach((piece, i) => {
      if (i > 0) lines.push("");
      if (piece) lines[lines.length - 1] += paint(piece);
    });
  };
  for (let m = TOKEN.exec(code); m; m = TOKEN.exec(code)) {
    const [token, comment, string, number, name] = m;
    if (comment) push(token, style.comment);
    else if (string) push(token, style.string);
    else if (number) push(token, style.number);
    else if (name) push(token, KEYWORDS.has(name) ? style.keyword : BUILTINS.has(name) ? style.builtin : (s) => s);
    else push(token, (s) => s);
  }
  TOKEN.lastIndex = 0;
  return lines;
}
