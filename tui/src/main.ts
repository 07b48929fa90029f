#!/usr/bin/env node
/** Entry point: `node dist/main.js [--api-url URL] [--session ID]`. */

import { FleetApi } from "./api.js";
import { App } from "./app.js";
import { USAGE, loadConfig } from "./config.js";
import { ProcessTerminal } from "./ui.js";

async function main(): Promise<number> {
  let config;
  try {
    config = loadConfig(process.argv.slice(2), process.env);
  } catch (error) {
    process.stderr.write(`${error instanceof Error ? error.message : String(error)}\n${USAGE}\n`);
    return 2;
  }
  if (config.help) {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  const app = new App({ api: new FleetApi(config.apiUrl, config.token), terminal: new ProcessTerminal(), ...(config.sessionId ? { sessionId: config.sessionId } : {}) });
  const code = await app.run();
  const hint = app.exitHint();
  if (hint) process.stdout.write(`${hint}\n`);
  return code;
}

main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(`fleet-tui: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
    process.exit(1);
  },
);
