/** What each slash command does against the gateway; answers are notices in the chat. */

import type { App } from "./app.js";
import { COMMAND_HELP, type Command } from "./commands.js";
import { downloadArtifact } from "./download.js";
import { ApiError } from "./errors.js";
import { formatBytes } from "./render.js";

type Handled = Exclude<Command["kind"], "prompt" | "exit" | "cancel">;
const MAX_SKILLS = 4;
const FILE_PAGE_CHARS = 20_000;

export async function runCommand(app: App, command: Extract<Command, { kind: Handled }>): Promise<void> {
  switch (command.kind) {
    case "help":
      return app.notice("commands", [...COMMAND_HELP.map(([c, d]) => `${c.padEnd(28)} ${d}`), "", "keys: Enter send · Esc or ctrl+c cancel the running Turn · ctrl+c again (or when idle) quit · ctrl+o expand/fold long output"]);
    case "invalid":
      return app.notice(command.message, [], "error");
    case "new":
      return app.newSession();
    case "sessions": {
      const page = await app.api.listSessions(command.search);
      app.lastListedSessions = page.items.map((s) => s.id);
      const rows = page.items.map((s) => `${s.id}  ${s.status.padEnd(8)} ${s.title ?? "(untitled)"}`);
      return app.notice(`${page.total} session(s)${command.search ? ` matching "${command.search}"` : ""}`, rows.length ? rows : ["none"]);
    }
    case "resume": {
      let known = app.lastListedSessions;
      if (!known.some((id) => id.startsWith(command.sessionId))) known = (await app.api.listSessions(undefined, 100)).items.map((s) => s.id);
      return app.openSession(resolveId(command.sessionId, known, "session"));
    }
    case "delete": {
      let known = app.lastListedSessions;
      const sessions = app.sessionId ? [app.sessionId, ...known] : known;
      if (!sessions.some((id) => id.startsWith(command.sessionId))) known = (await app.api.listSessions(undefined, 100)).items.map((s) => s.id);
      const id = resolveId(command.sessionId, [...new Set([...sessions, ...known])], "session");
      await app.api.deleteSession(id);
      app.lastListedSessions = app.lastListedSessions.filter((listed) => listed !== id);
      if (id === app.sessionId) await app.newSession();
      return app.notice(`deleted session ${id}`, ["its Turns, Runs, files and artifacts are gone"], "success");
    }
    case "approval": {
      const session = await app.api.setApproval(requireSession(app), command.mode);
      const said = { never: "cells run without asking", always: "every cell waits for your approval", on_risk: "cells that look risky wait for your approval" };
      return app.notice(`approval: ${command.mode}`, [`${said[command.mode]} (session ${session.id})`], "success");
    }
    case "approve":
    case "deny":
      return app.decide(command.kind, command.note);
    case "rename": {
      const session = await app.api.renameSession(requireSession(app), command.title);
      app.sessionTitle = session.title;
      return app.notice(`renamed to "${session.title ?? ""}"`, [], "success");
    }
    case "task": {
      const task = await app.api.getTask(requireSession(app));
      const rows = task.progress.map((p) => `#${p.sequence} ${p.status}: ${p.request} → ${p.outcome}`);
      return app.notice(`task (checkpoint ${task.checkpoint_version})`, [`goal: ${task.goal ?? "(none yet)"}`, ...rows]);
    }
    case "skills": {
      const { items } = await app.api.listSkills(command.query);
      return app.notice(`${items.length} skill(s)`, items.map((s) => `${s.id} (${s.name} ${s.version}): ${s.description}`));
    }
    case "skill":
      return selectSkill(app, command.name);
    case "skill-clear":
      app.skills.length = 0;
      return app.notice("skill selection cleared", [], "success");
    case "attach": {
      const info = await app.api.uploadAttachment(command.path);
      app.pendingAttachments = [...app.pendingAttachments, info];
      return app.notice(`attached ${info.filename} (${formatBytes(info.byte_size)}) for the next Turn`, [`id ${info.id}`], "success");
    }
    case "attach-list":
      return app.notice(`${app.pendingAttachments.length} attachment(s) for the next Turn`, app.pendingAttachments.map((a) => `${a.id}  ${a.filename} (${formatBytes(a.byte_size)})`));
    case "attach-clear":
      app.pendingAttachments = [];
      return app.notice("pending attachments cleared", [], "success");
    case "files": {
      const list = await app.api.listFiles(requireSession(app), command.path);
      const rows = list.items.map((e) => (e.type === "directory" ? `${e.path}/` : `${e.path}  ${formatBytes(e.byte_size ?? 0)}`));
      return app.notice(`workspace ${list.path || "/"}`, [...(rows.length ? rows : ["(empty)"]), ...(list.truncated ? ["(truncated)"] : [])]);
    }
    case "file": {
      const page = await app.api.fileContent(requireSession(app), command.path, FILE_PAGE_CHARS);
      const more = page.next_cursor ? [`(first ${FILE_PAGE_CHARS} characters of ${formatBytes(page.byte_size)})`] : [];
      return app.notice(`${page.path}`, [...page.content.replace(/\n$/, "").split("\n"), ...more]);
    }
    case "artifacts": {
      const rows = app.artifacts().map((a) => `${a.artifactId}  ${a.name}  ${formatBytes(a.byteSize)}  ${a.mediaType}`);
      return app.notice(`${rows.length} artifact(s) in this session's Turns`, rows.length ? [...rows, "download one with /artifact <id> <local-path>"] : []);
    }
    case "artifact": {
      const id = resolveId(command.id, app.artifacts().map((a) => a.artifactId), "artifact");
      const saved = await downloadArtifact(app.api, id, command.localPath);
      return app.notice(`saved ${saved.path}`, [`${formatBytes(saved.bytes)}, sha256 ${saved.sha256} (matches the ETag)`], "success");
    }
  }
}

async function selectSkill(app: App, name: string): Promise<void> {
  if (app.skills.length >= MAX_SKILLS) return app.notice(`at most ${MAX_SKILLS} skills per Turn; /skill clear first`, [], "error");
  let card;
  try {
    card = await app.api.getSkill(name);
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 404 || error.code !== "not_found") throw error;
    const { items } = await app.api.listSkills(name);
    card = items.find((s) => s.name.toLowerCase() === name.toLowerCase()) ?? (items.length === 1 ? items[0] : undefined);
    if (!card) return app.notice(`no skill "${name}"`, items.length ? ["did you mean:", ...items.map((s) => `${s.id} (${s.name})`)] : [], "error");
  }
  if (app.skills.some((s) => s.id === card.id)) return app.notice(`${card.name} is already selected`);
  app.skills.push({ id: card.id, expected_version: card.version, name: card.name });
  return app.notice(`skill ${card.name} ${card.version} selected for the next Turns`, [], "success");
}

function requireSession(app: App): string {
  if (!app.sessionId) throw new Error("no session yet: /new or /resume <id>");
  return app.sessionId;
}

/** A full id, or a prefix of exactly one id the client has seen. */
export function resolveId(given: string, known: readonly string[], what: string): string {
  if (known.includes(given)) return given;
  const matches = known.filter((id) => id.startsWith(given));
  if (matches.length === 1 && matches[0]) return matches[0];
  if (matches.length > 1) throw new Error(`"${given}" matches ${matches.length} ${what}s; give more of the id`);
  return given;
}
