/** Folding long outputs: the first lines and a hint, until the user expands them. */

export const FOLD_KEY_HINT = "ctrl+o";

export interface Folded {
  readonly lines: readonly string[];
  readonly hidden: number;
}

/** Keeps `limit` lines (the hint takes the last one's place) unless `expanded`. */
export function foldLines(lines: readonly string[], limit: number, expanded: boolean): Folded {
  if (expanded || lines.length <= limit) return { lines, hidden: 0 };
  const keep = Math.max(1, limit - 1);
  return { lines: lines.slice(0, keep), hidden: lines.length - keep };
}

export function foldHint(hidden: number): string {
  return `… ${hidden} more line${hidden === 1 ? "" : "s"} (${FOLD_KEY_HINT} to expand)`;
}
