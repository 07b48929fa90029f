/** The slash commands: a pure parser from an input line to a `Command`, and their help text. */

export type Command =
  | { readonly kind: "prompt"; readonly text: string }
  | { readonly kind: "help" }
  | { readonly kind: "new" }
  | { readonly kind: "sessions"; readonly search?: string }
  | { readonly kind: "resume"; readonly sessionId: string }
  | { readonly kind: "rename"; readonly title: string }
  | { readonly kind: "delete"; readonly sessionId: string }
  | { readonly kind: "task" }
  | { readonly kind: "cancel" }
  | { readonly kind: "interrupt"; readonly text: string }
  | { readonly kind: "queue"; readonly text: string }
  | { readonly kind: "approve"; readonly note: string }
  | { readonly kind: "deny"; readonly note: string }
  | { readonly kind: "approval"; readonly mode: "never" | "always" | "on_risk" }
  | { readonly kind: "exit" }
  | { readonly kind: "skills"; readonly query?: string }
  | { readonly kind: "skill"; readonly name: string }
  | { readonly kind: "skill-clear" }
  | { readonly kind: "attach"; readonly path: string }
  | { readonly kind: "attach-list" }
  | { readonly kind: "attach-clear" }
  | { readonly kind: "files"; readonly path: string }
  | { readonly kind: "file"; readonly path: string }
  | { readonly kind: "artifacts" }
  | { readonly kind: "artifact"; readonly id: string; readonly localPath: string }
  | { readonly kind: "invalid"; readonly message: string };

export const COMMAND_HELP: readonly (readonly [string, string])[] = [
  ["/help", "this list"],
  ["/new", "start a new session"],
  ["/sessions [search]", "list sessions, newest first"],
  ["/resume <id>", "continue a session and load its history"],
  ["/rename <title>", "rename this session"],
  ["/delete <id>", "delete a session and all it holds (8+ characters of its id confirm it)"],
  ["/task", "this session's goal and progress checkpoint"],
  ["/cancel", "cancel the running Turn (also Esc, or Ctrl+C)"],
  ["/queue [text]", "send this once the running Turn has ended (it waits on the server); no text: the prompt just refused"],
  ["/interrupt [text]", "cancel the running Turn (and any queued) and send this instead; no text: the prompt just refused"],
  ["/approval never|always|on_risk", "whether this session's cells wait for your approval before they run"],
  ["/approve [note] · /deny [note]", "decide on the cell waiting for approval (also y or n on an empty line)"],
  ["/skills [query]", "list skill cards"],
  ["/skill <name|clear>", "select a skill for the next Turns, or clear the selection"],
  ["/attach <path>|list|clear", "upload a file for the next Turn; list or clear pending ones"],
  ["/files [path]", "list this session's workspace files"],
  ["/file <path>", "show a workspace file"],
  ["/artifacts", "artifacts this session's Turns produced"],
  ["/artifact <id> <local-path>", "download an artifact (Content-Length and sha256 checked)"],
  ["/exit", "quit (also Ctrl+C when no Turn runs or twice, Ctrl+D on an empty line)"],
];

/** `//text` sends `/text` as a prompt; any other line starting with `/` is a command. */
export function parseCommand(line: string): Command {
  const text = line.trim();
  if (text.startsWith("//")) return { kind: "prompt", text: text.slice(1) };
  if (!text.startsWith("/")) return { kind: "prompt", text };
  const match = /^\/(\S+)\s*([\s\S]*)$/.exec(text);
  const name = (match?.[1] ?? "").toLowerCase();
  const rest = (match?.[2] ?? "").trim();
  const none = (command: Command): Command => (rest ? invalid(`/${name} takes no argument`) : command);
  switch (name) {
    case "help":
    case "?":
      return { kind: "help" };
    case "new":
      return none({ kind: "new" });
    case "sessions":
      return rest ? { kind: "sessions", search: rest } : { kind: "sessions" };
    case "resume":
      return rest && !/\s/.test(rest) ? { kind: "resume", sessionId: rest } : invalid("usage: /resume <session id>");
    case "rename":
      return rest ? { kind: "rename", title: rest } : invalid("usage: /rename <title>");
    case "delete":
      // The id is the confirmation: at least its first 8 characters, never a stray key or two.
      return rest.length >= 8 && !/\s/.test(rest) ? { kind: "delete", sessionId: rest } : invalid("usage: /delete <session id> (its first 8 characters or more confirm it; /sessions lists them)");
    case "task":
      return none({ kind: "task" });
    case "cancel":
      return none({ kind: "cancel" });
    case "interrupt": // no text: the prompt typed while a Turn ran (App keeps it)
      return { kind: "interrupt", text: rest };
    case "queue":
      return { kind: "queue", text: rest };
    case "approve":
    case "deny":
      return { kind: name, note: rest };
    case "approval":
      return rest === "never" || rest === "always" || rest === "on_risk" ? { kind: "approval", mode: rest } : invalid("usage: /approval never|always|on_risk");
    case "exit":
    case "quit":
      return none({ kind: "exit" });
    case "skills":
      return rest ? { kind: "skills", query: rest } : { kind: "skills" };
    case "skill":
      if (!rest) return invalid("usage: /skill <name|clear>");
      return rest === "clear" ? { kind: "skill-clear" } : { kind: "skill", name: rest };
    case "attach":
      if (!rest) return invalid("usage: /attach <path>|list|clear");
      if (rest === "list") return { kind: "attach-list" };
      if (rest === "clear") return { kind: "attach-clear" };
      return { kind: "attach", path: unquote(rest) };
    case "files":
      return { kind: "files", path: unquote(rest) };
    case "file":
      return rest ? { kind: "file", path: unquote(rest) } : invalid("usage: /file <path>");
    case "artifacts":
      return none({ kind: "artifacts" });
    case "artifact": {
      const args = splitArgs(rest);
      const [id, localPath] = args;
      return args.length === 2 && id && localPath ? { kind: "artifact", id, localPath } : invalid("usage: /artifact <id> <local-path>");
    }
    default:
      return invalid(`unknown command /${name}; /help lists them (start with // to send a line beginning with /)`);
  }
}

function invalid(message: string): Command {
  return { kind: "invalid", message };
}

/** Splits on spaces; "double" or 'single' quotes keep spaces inside one argument. */
export function splitArgs(text: string): string[] {
  const args: string[] = [];
  const pattern = /"([^"]*)"|'([^']*)'|(\S+)/g;
  for (let m = pattern.exec(text); m; m = pattern.exec(text)) args.push(m[1] ?? m[2] ?? m[3] ?? "");
  return args;
}

function unquote(text: string): string {
  const m = /^(["'])(.*)\1$/.exec(text);
  return m ? (m[2] ?? "") : text;
}

/** The commands as the editor's `/` menu lists them: name, what it takes, what it does. */
export function slashCommands(): { name: string; description: string; argumentHint?: string }[] {
  return COMMAND_HELP.map(([usage, description]) => {
    const [name = "", ...rest] = usage.slice(1).split(" ");
    return rest.length ? { name, description, argumentHint: rest.join(" ") } : { name, description };
  });
}
