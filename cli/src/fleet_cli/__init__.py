"""The fleet CLI."""
