/** The gateway's HTTP routes (docs/api.md), over `fetch`, with bearer auth and error envelopes. */

import { openAsBlob } from "node:fs";
import { stat } from "node:fs/promises";
import { basename, resolve } from "node:path";
import { ApiError, NetworkError, RouteMissingError } from "./errors.js";

export interface Session {
  readonly id: string;
  readonly title: string | null;
  readonly status: string;
  readonly created_at?: string;
  readonly updated_at?: string;
}

export interface SkillCard {
  readonly id: string;
  readonly name: string;
  readonly version: string;
  readonly description: string;
}

export interface SkillSelection {
  readonly id: string;
  readonly expected_version: string;
}

export interface TurnBody {
  readonly text: string;
  readonly attachment_ids: readonly string[];
  readonly skill_selections: readonly SkillSelection[];
  /** With a Turn running in the session: `enqueue` waits behind it on the server, `interrupt`
   * cancels it (and any waiting) and runs this one; the default rejects it (409). */
  readonly multitask?: "enqueue" | "interrupt";
}

export interface AttachmentInfo {
  readonly id: string;
  readonly filename: string;
  readonly byte_size: number;
}

export interface FileEntry {
  readonly name: string;
  readonly path: string;
  readonly type: "file" | "directory";
  readonly byte_size?: number;
}

export interface FileList {
  readonly path: string;
  readonly items: readonly FileEntry[];
  readonly truncated: boolean;
}

export interface FileContent {
  readonly path: string;
  readonly content: string;
  readonly next_cursor: string | null;
  readonly byte_size: number;
}

export interface Task {
  readonly checkpoint_version: number;
  readonly goal?: string;
  readonly progress: readonly { sequence: number; status: string; request: string; outcome: string }[];
}

export interface HistoryPage {
  readonly items: readonly { id: string; role: string; parts: unknown[]; metadata?: unknown }[];
  readonly next_after_sequence: number | null;
}

export type FetchLike = (input: string, init?: RequestInit) => Promise<Response>;

export class FleetApi {
  constructor(
    readonly baseUrl: string,
    private readonly token: string | undefined,
    private readonly fetcher: FetchLike = fetch,
  ) {}

  /** Any request: a network failure is a `NetworkError`, an error status an `ApiError`. */
  async request(method: string, path: string, init: { body?: string | FormData; json?: unknown; headers?: Record<string, string>; signal?: AbortSignal } = {}): Promise<Response> {
    const headers: Record<string, string> = { accept: "application/json", ...init.headers };
    if (this.token) headers["authorization"] = `Bearer ${this.token}`;
    let body = init.body;
    if (init.json !== undefined) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(init.json);
    }
    let response: Response;
    try {
      response = await this.fetcher(this.baseUrl + path, { method, headers, ...(body !== undefined ? { body } : {}), ...(init.signal ? { signal: init.signal } : {}) });
    } catch (error) {
      if (init.signal?.aborted) throw error;
      throw new NetworkError(`cannot reach ${this.baseUrl}: ${causeOf(error)}`, error);
    }
    if (!response.ok && response.status !== 304) throw await toApiError(response, method, path);
    return response;
  }

  async json<T>(method: string, path: string, json?: unknown): Promise<T> {
    const response = await this.request(method, path, json === undefined ? {} : { json });
    return (await response.json()) as T;
  }

  createSession(title?: string): Promise<Session> {
    return this.json("POST", "/api/sessions", title ? { title } : {});
  }

  getSession(id: string): Promise<Session> {
    return this.json("GET", `/api/sessions/${enc(id)}`);
  }

  listSessions(search?: string, limit = 20): Promise<{ items: Session[]; total: number }> {
    return this.json("GET", `/api/sessions?${query({ limit, search })}`);
  }

  renameSession(id: string, title: string): Promise<Session> {
    return this.json("PATCH", `/api/sessions/${enc(id)}`, { title });
  }

  /** Deletes the session and everything of it (the gateway answers 204). */
  async deleteSession(id: string): Promise<void> {
    await this.request("DELETE", `/api/sessions/${enc(id)}`);
  }

  historyPage(id: string, afterSequence: number, limit = 200): Promise<HistoryPage> {
    return this.json("GET", `/api/sessions/${enc(id)}/turns?${query({ limit, after_sequence: afterSequence })}`);
  }

  getTask(id: string): Promise<Task> {
    return this.json("GET", `/api/sessions/${enc(id)}/task`);
  }

  /** Opens a Turn's stream; the caller owns retries (see `turn-runner.ts`). */
  postTurn(sessionId: string, body: TurnBody, idempotencyKey: string, signal?: AbortSignal): Promise<Response> {
    return this.request("POST", `/api/sessions/${enc(sessionId)}/turns`, {
      json: body,
      headers: { "idempotency-key": idempotencyKey, accept: "text/event-stream" },
      ...(signal ? { signal } : {}),
    });
  }

  /** Resumes a Run's stream after a frame id; `null` when the gateway does not know the Run (204). */
  async resumeStream(runId: string, lastEventId: string | undefined, signal?: AbortSignal): Promise<Response | null> {
    const headers: Record<string, string> = { accept: "text/event-stream" };
    if (lastEventId) headers["last-event-id"] = lastEventId;
    const response = await this.request("GET", `/api/runs/${enc(runId)}/stream`, { headers, ...(signal ? { signal } : {}) });
    return response.status === 204 ? null : response;
  }

  /** Decides on a cell waiting for approval (409 once decided or timed out). */
  decideApproval(runId: string, approvalId: string, decision: "approve" | "deny", note?: string): Promise<{ decision: string }> {
    return this.json("POST", `/api/runs/${enc(runId)}/approvals/${enc(approvalId)}`, note ? { decision, note } : { decision });
  }

  /** The session's approval mode: whether its Turns' cells wait for a person before they run. */
  setApproval(sessionId: string, approval: "never" | "always" | "on_risk"): Promise<Session> {
    return this.json("PATCH", `/api/sessions/${enc(sessionId)}`, { approval });
  }

  cancelRun(runId: string): Promise<{ run_id: string; state: string }> {
    return this.json("PUT", `/api/runs/${enc(runId)}/cancellation`);
  }

  listSkills(q?: string): Promise<{ items: SkillCard[] }> {
    return this.json("GET", `/api/skills${q ? `?${query({ q })}` : ""}`);
  }

  getSkill(id: string): Promise<SkillCard> {
    return this.json("GET", `/api/skills/${enc(id)}`);
  }

  async uploadAttachment(path: string): Promise<AttachmentInfo> {
    const form = new FormData();
    form.append("attachment", await openFile(path), basename(path));
    // The gateway takes an upload only with a header no plain web form can send.
    const response = await this.request("POST", "/api/attachments", { body: form, headers: { "x-requested-with": "fleet-tui" } });
    return (await response.json()) as AttachmentInfo;
  }

  listFiles(sessionId: string, path: string): Promise<FileList> {
    return this.json("GET", `/api/files?${query({ session_id: sessionId, path })}`);
  }

  fileContent(sessionId: string, path: string, maxChars: number, cursor?: string): Promise<FileContent> {
    return this.json("GET", `/api/files/content?${query({ session_id: sessionId, path, max_chars: maxChars, cursor })}`);
  }

  artifactContent(id: string, signal?: AbortSignal): Promise<Response> {
    return this.request("GET", `/api/artifacts/${enc(id)}/content`, { headers: { accept: "*/*" }, ...(signal ? { signal } : {}) });
  }
}

async function toApiError(response: Response, method: string, path: string): Promise<ApiError> {
  let envelope: { code?: unknown; message?: unknown } = {};
  try {
    envelope = (await response.json()) as typeof envelope;
  } catch {
    // not JSON: keep the status alone
  }
  const code = typeof envelope.code === "string" ? envelope.code : `http_${response.status}`;
  const message = typeof envelope.message === "string" ? envelope.message : response.statusText;
  const route = path.split("?")[0] ?? path;
  // An unmatched route is the framework's bare "Not Found"; a missing resource names itself.
  if (response.status === 405 || (response.status === 404 && message === "Not Found")) return new RouteMissingError(response.status, method, route);
  return new ApiError(response.status, code, message, method, route);
}

function enc(segment: string): string {
  return encodeURIComponent(segment);
}

function query(params: Record<string, string | number | undefined>): string {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) if (value !== undefined && value !== "") search.set(key, String(value));
  return search.toString();
}

function causeOf(error: unknown): string {
  const cause = (error as { cause?: { code?: string; message?: string } }).cause;
  return cause?.code ?? cause?.message ?? (error instanceof Error ? error.message : String(error));
}

/** The file as a blob, or an error that names the file and, for a relative path, the folder. */
async function openFile(path: string): Promise<Blob> {
  const where = resolve(path) === path ? "" : ` (a relative path starts at ${process.cwd()})`;
  let info;
  try {
    info = await stat(path);
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    throw new Error(code === "ENOENT" ? `no such file: ${path}${where}` : `cannot read ${path}${where}: ${code ?? String(error)}`);
  }
  if (!info.isFile()) throw new Error(`not a file: ${path}${where}`);
  return openAsBlob(path);
}
