"""HTTP route handlers: parse, call a service, return a DTO or a stream."""
