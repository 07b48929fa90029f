/** Command-line and environment settings for the client. */

import { parseArgs } from "node:util";

export const DEFAULT_API_URL = "http://127.0.0.1:8000";

export interface Config {
  readonly apiUrl: string;
  readonly token: string | undefined;
  readonly sessionId: string | undefined;
  readonly help: boolean;
}

export const USAGE = `usage: fleet-tui [--api-url URL] [--session ID]

  --api-url URL   the gateway (default: $FLEET_API_URL, else ${DEFAULT_API_URL})
  --session ID    continue a session and load its history (default: a new session)

  FLEET_API_TOKEN is sent as a bearer token when set.`;

/** `--api-url`, else `FLEET_API_URL`, else the default; `FLEET_API_TOKEN` as the bearer token. */
export function loadConfig(argv: readonly string[], env: Readonly<Record<string, string | undefined>>): Config {
  const { values } = parseArgs({
    args: [...argv],
    options: { "api-url": { type: "string" }, session: { type: "string" }, help: { type: "boolean", short: "h" } },
    strict: true,
    allowPositionals: false,
  });
  const raw = values["api-url"] ?? (env["FLEET_API_URL"] || undefined) ?? DEFAULT_API_URL;
  let url: URL;
  try {
    url = new URL(raw);
  } catch {
    throw new Error(`not a URL: ${raw}`);
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") throw new Error(`not an http(s) URL: ${raw}`);
  return {
    apiUrl: url.toString().replace(/\/+$/, ""),
    token: env["FLEET_API_TOKEN"] || undefined,
    sessionId: values.session,
    help: values.help ?? false,
  };
}
