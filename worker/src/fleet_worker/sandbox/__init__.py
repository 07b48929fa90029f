"""The local code sandbox: a persistent Python REPL jailed with bubblewrap."""
