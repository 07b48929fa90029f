// Validate a raw UI-message SSE body (stdin) with the Vercel AI SDK's own parsers.
//
//   node check_stream.mjs <ai6|ai7> < stream.txt
//
// Prints one JSON line and exits 0 (ok) or 1 (not ok).
//
// Where the SDK functions come from (checked against dist/index.d.ts and at runtime):
//   ai@6 and ai@7 both export parseJsonEventStream, uiMessageChunkSchema and
//   readUIMessageStream from the `ai` package itself, so all three are imported from
//   the aliased package (`ai6` / `ai7`). parseJsonEventStream is a re-export of the
//   @ai-sdk/provider-utils copy that this `ai` version depends on (4.x for ai@6,
//   5.x for ai@7, nested under node_modules/ai7/node_modules).
//   For the [DONE] check we also need the raw SSE events: EventSourceParserStream is
//   loaded from `eventsource-parser/stream`, resolved from that same provider-utils
//   copy, i.e. the exact SSE parser parseJsonEventStream uses.
//
// [DONE]: parseJsonEventStream itself drops every event whose data is "[DONE]", and
// DefaultChatTransport.processResponseStream just calls parseJsonEventStream and throws
// on the first unsuccessful result. So the bytes are fed to the SDK unchanged; we only
// check separately that [DONE] occurs exactly once, as the last event.

import { createRequire } from 'node:module';
import { Readable } from 'node:stream';

const FORBIDDEN_TYPES = new Set([
  'reset-step', 'custom', 'steering-message', 'reasoning-file', 'tool-approval-response',
]);

const alias = process.argv[2];
let version = null;

function done(result) {
  process.stdout.write(JSON.stringify({ ok: result.error == null, version, ...result }) + '\n');
  process.exitCode = result.error == null ? 0 : 1;
}

class CheckError extends Error {}
const fail = (msg) => { throw new CheckError(msg); };
const show = (v) => JSON.stringify(v);

async function collect(stream) {
  const out = [];
  for await (const item of stream) out.push(item);
  return out;
}

function findNull(value, path = '$') {
  if (value === null) return path;
  if (typeof value !== 'object') return null;
  for (const [k, v] of Object.entries(value)) {
    const hit = findNull(v, Array.isArray(value) ? `${path}[${k}]` : `${path}.${k}`);
    if (hit) return hit;
  }
  return null;
}

// Contract checks on the parsed chunk sequence (beyond the SDK's schema).
function checkContract(chunks) {
  const types = chunks.map((c) => c.type);
  if (types[0] !== 'start') fail(`first chunk must be "start", got ${show(types[0])}`);
  if (types.filter((t) => t === 'start').length !== 1) fail('"start" must occur exactly once');

  const terminals = types.filter((t) => t === 'finish' || t === 'abort').length;
  const last = chunks.at(-1);
  if (terminals !== 1 || (last.type !== 'finish' && last.type !== 'abort')) {
    fail(`stream must end with exactly one terminal chunk (finish or abort); types: ${show(types)}`);
  }
  chunks.forEach((c, i) => {
    if (c.type !== 'error') return;
    if (i !== chunks.length - 2 || last.type !== 'finish') {
      fail(`"error" is only allowed directly before the final "finish" (chunk #${i + 1})`);
    }
    if (last.finishReason != null && last.finishReason !== 'error') {
      fail(`"finish" after "error" must have finishReason "error", got ${show(last.finishReason)}`);
    }
  });

  const partIds = new Set(); // text + reasoning part ids
  const open = new Set();
  const tools = new Map(); // toolCallId -> { start, input, output } counts
  const tool = (id) => tools.get(id) ?? tools.set(id, { start: 0, input: 0, output: 0 }).get(id);
  chunks.forEach((c, i) => {
    const where = `chunk #${i + 1} ${show(c)}`;
    if (FORBIDDEN_TYPES.has(c.type)) fail(`forbidden chunk type: ${where}`);
    if (c.finishReason === 'interrupted') fail(`forbidden finishReason "interrupted": ${where}`);
    switch (c.type) {
      case 'text-start':
      case 'reasoning-start':
        if (partIds.has(c.id)) fail(`part id reused: ${where}`);
        partIds.add(c.id);
        open.add(c.id);
        break;
      case 'text-end':
      case 'reasoning-end':
        if (!open.delete(c.id)) fail(`end of a part that is not open: ${where}`);
        break;
      case 'tool-input-start':
        if (tools.has(c.toolCallId)) fail(`toolCallId reused: ${where}`);
        tool(c.toolCallId).start++;
        break;
      case 'tool-input-available':
      case 'tool-input-error': {
        const t = tool(c.toolCallId);
        if (t.input++ > 0 || t.output > 0) fail(`toolCallId reused: ${where}`);
        break;
      }
      case 'tool-output-available':
      case 'tool-output-error':
      case 'tool-output-denied': {
        const t = tools.get(c.toolCallId);
        if (!t || t.input === 0) fail(`tool output before tool input: ${where}`);
        if (t.output > 0) fail(`second final output for the same toolCallId: ${where}`);
        if (!c.preliminary) t.output++;
        break;
      }
    }
  });
  if (last.type === 'finish' && !chunks.some((c) => c.type === 'error') && open.size > 0) {
    fail(`text/reasoning parts never ended: ${show([...open])}`);
  }
  return types;
}

async function main() {
  if (alias !== 'ai6' && alias !== 'ai7') fail('usage: node check_stream.mjs <ai6|ai7> < stream.txt');
  const pkgJsonUrl = import.meta.resolve(`${alias}/package.json`);
  const requireFromAi = createRequire(pkgJsonUrl);
  version = requireFromAi('./package.json').version;

  const { parseJsonEventStream, uiMessageChunkSchema, readUIMessageStream } = await import(alias);
  const requireFromUtils = createRequire(requireFromAi.resolve('@ai-sdk/provider-utils/package.json'));
  const { EventSourceParserStream } = requireFromUtils('eventsource-parser/stream');

  const stdin = Readable.toWeb(process.stdin); // ReadableStream<Uint8Array>
  const [forSdk, forFrames] = stdin.tee();
  const [results, events] = await Promise.all([
    collect(parseJsonEventStream({ stream: forSdk, schema: uiMessageChunkSchema })),
    collect(forFrames.pipeThrough(new TextDecoderStream()).pipeThrough(new EventSourceParserStream())),
  ]);

  // [DONE] must be the last SSE event, exactly once.
  const doneAt = events.flatMap((e, i) => (e.data === '[DONE]' ? [i] : []));
  if (doneAt.length !== 1 || doneAt[0] !== events.length - 1) {
    fail(`"data: [DONE]" must occur exactly once, as the last event (found at event indexes ${show(doneAt)} of ${events.length})`);
  }
  const frames = events.slice(0, -1); // 1:1 with the parse results
  if (frames.length !== results.length) fail(`internal: ${frames.length} frames vs ${results.length} parse results`);
  if (results.length === 0) fail('no chunks before [DONE]');

  results.forEach((r, i) => {
    const where = `frame #${i + 1} (id: ${frames[i].id ?? '-'}) data: ${frames[i].data}`;
    if (!r.success) fail(`SDK rejected ${where}\n${r.error?.message ?? r.error}`);
    const nullAt = findNull(r.rawValue);
    if (nullAt) fail(`null value at ${nullAt} in ${where}`);
  });
  const chunks = results.map((r) => r.value);
  const chunkTypes = checkContract(chunks);

  // Rebuild the UIMessage like the SDK client does. In-band "error" chunks are reported
  // through onError as plain Errors; anything else (e.g. UIMessageStreamError) is a failure.
  const expectedErrors = chunks.filter((c) => c.type === 'error').map((c) => c.errorText);
  const unexpected = [];
  let message;
  for await (const snapshot of readUIMessageStream({
    stream: ReadableStream.from(chunks),
    onError: (e) => {
      if (e?.constructor === Error && e.message === expectedErrors[0]) expectedErrors.shift();
      else unexpected.push(e);
    },
  })) {
    message = snapshot;
  }
  if (unexpected.length) fail(`readUIMessageStream error: ${unexpected.map((e) => e?.message ?? String(e)).join('; ')}`);
  if (expectedErrors.length) fail(`"error" chunks not reported by readUIMessageStream: ${show(expectedErrors)}`);
  if (!message) fail('readUIMessageStream produced no message (a "start" with a messageId makes one)');

  done({ message, chunkTypes });
}

main().catch((e) => done({ error: e instanceof CheckError ? e.message : `unexpected: ${e?.stack ?? e}` }));
