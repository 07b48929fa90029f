/** ANSI styles for the client (no colour library: a handful of SGR codes is all it needs). */

const sgr = (open: number, close: number) => (text: string): string => `\x1b[${open}m${text}\x1b[${close}m`;

export const style = {
  bold: sgr(1, 22),
  dim: sgr(2, 22),
  italic: sgr(3, 23),
  underline: sgr(4, 24),
  strike: sgr(9, 29),
  red: sgr(31, 39),
  green: sgr(32, 39),
  yellow: sgr(33, 39),
  blue: sgr(34, 39),
  magenta: sgr(35, 39),
  cyan: sgr(36, 39),
  gray: sgr(90, 39),
  keyword: sgr(35, 39),
  builtin: sgr(36, 39),
  string: sgr(32, 39),
  number: sgr(33, 39),
  comment: (text: string): string => `\x1b[2;3m${text}\x1b[22;23m`,
} as const;

/** Strips SGR and OSC sequences: for screen captures and tests. */
export function stripAnsi(text: string): string {
  // eslint-disable-next-line no-control-regex
  return text.replace(/\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*(?:\x07|\x1b\\)|\x1b_[^\x07]*\x07/g, "");
}
