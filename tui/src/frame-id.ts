/** Frame ids of the Turn stream (`s.k` for content, `s.k.n` for control frames) and their order. */

export interface FrameId {
  readonly raw: string;
  readonly parts: readonly number[];
  /** `s.k`: a chunk of a Runtime Event; the same in every stream of a Run. */
  readonly isContent: boolean;
}

const FRAME_ID = /^\d+(\.\d+){0,2}$/;

/** Parses a frame id; `undefined` for a missing or malformed one. */
export function parseFrameId(raw: string | undefined): FrameId | undefined {
  if (raw === undefined || !FRAME_ID.test(raw)) return undefined;
  const parts = raw.split(".").map(Number);
  return { raw, parts, isContent: parts.length === 2 };
}

/** Numeric order on (s, k, n); a missing component sorts first (`9` < `9.0` < `9.0.1`). */
export function compareFrameIds(a: FrameId, b: FrameId): number {
  const length = Math.max(a.parts.length, b.parts.length);
  for (let i = 0; i < length; i++) {
    const x = a.parts[i] ?? -1;
    const y = b.parts[i] ?? -1;
    if (x !== y) return x < y ? -1 : 1;
  }
  return 0;
}
