/** The client's named errors; imports nothing from the package. */

/** The gateway answered with an error envelope `{code, message}`. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly method: string,
    readonly path: string,
  ) {
    super(message);
    this.name = "ApiError";
  }
}

/** The gateway has no such route (404 for an unknown path, 405 for a method it lacks). */
export class RouteMissingError extends ApiError {
  constructor(status: number, method: string, path: string) {
    super(status, status === 405 ? "method_not_allowed" : "not_found", `this gateway has no route ${method} ${path} (HTTP ${status}); it may not have landed yet`, method, path);
    this.name = "RouteMissingError";
  }
}

/** The request never got an HTTP answer (refused, reset, timed out). */
export class NetworkError extends Error {
  constructor(message: string, override readonly cause?: unknown) {
    super(message);
    this.name = "NetworkError";
  }
}

/** A downloaded artifact did not match its `Content-Length` or sha256 `ETag`. */
export class VerificationError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "VerificationError";
  }
}

/** A short, human line for any error. */
export function describeError(error: unknown): string {
  if (error instanceof RouteMissingError) return error.message;
  if (error instanceof ApiError) return `${error.code} (HTTP ${error.status}): ${error.message}`;
  if (error instanceof Error) return error.message;
  return String(error);
}
