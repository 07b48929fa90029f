/** pi-tui's `Terminal` on @xterm/headless: a real terminal emulator in memory, for e2e tests. */

import xterm from "@xterm/headless";
import type { Terminal } from "../../src/ui.ts";

export class VirtualTerminal implements Terminal {
  readonly xterm: InstanceType<typeof xterm.Terminal>;
  private onInput: ((data: string) => void) | undefined;

  constructor(readonly cols = 100, readonly rowCount = 50) {
    this.xterm = new xterm.Terminal({ cols, rows: rowCount, scrollback: 10_000, allowProposedApi: true });
  }

  start(onInput: (data: string) => void, _onResize: () => void): void {
    this.onInput = onInput;
  }

  stop(): void {
    this.onInput = undefined;
  }

  async drainInput(): Promise<void> {}

  private writeWaiters: { needle: string; resolve: () => void }[] = [];

  write(data: string): void {
    this.xterm.write(data);
    const met = this.writeWaiters.filter((waiter) => data.includes(waiter.needle));
    this.writeWaiters = this.writeWaiters.filter((waiter) => !met.includes(waiter));
    for (const waiter of met) waiter.resolve();
  }

  /** Resolves when the client next writes output holding `needle` (the client's own work, before xterm parses it). */
  nextWriteWith(needle: string): Promise<void> {
    return new Promise((resolve) => this.writeWaiters.push({ needle, resolve }));
  }

  get columns(): number {
    return this.cols;
  }

  get rows(): number {
    return this.rowCount;
  }

  get kittyProtocolActive(): boolean {
    return false;
  }

  moveBy(lines: number): void {
    if (lines > 0) this.write(`\x1b[${lines}B`);
    else if (lines < 0) this.write(`\x1b[${-lines}A`);
  }

  hideCursor(): void {
    this.write("\x1b[?25l");
  }

  showCursor(): void {
    this.write("\x1b[?25h");
  }

  clearLine(): void {
    this.write("\x1b[K");
  }

  clearFromCursor(): void {
    this.write("\x1b[J");
  }

  clearScreen(): void {
    this.write("\x1b[2J\x1b[H");
  }

  setTitle(_title: string): void {}

  setProgress(_active: boolean): void {}

  /** Types into the client as a user would (raw bytes, as a terminal sends them). */
  type(data: string): void {
    this.onInput?.(data);
  }

  /** The whole buffer (scrollback and screen) as text, after pending writes are parsed. */
  async screen(): Promise<string> {
    await new Promise<void>((resolve) => this.xterm.write("", resolve));
    const buffer = this.xterm.buffer.active;
    const lines: string[] = [];
    for (let i = 0; i < buffer.length; i++) lines.push(buffer.getLine(i)?.translateToString(true) ?? "");
    while (lines.length && lines[lines.length - 1] === "") lines.pop();
    return lines.join("\n");
  }

  /** Polls the screen until `predicate` holds; fails with the screen at the deadline. */
  async waitFor(what: string, predicate: (screen: string) => boolean, timeoutMs = 90_000): Promise<string> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const screen = await this.screen();
      if (predicate(screen)) return screen;
      if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}; the screen:\n${screen}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}
