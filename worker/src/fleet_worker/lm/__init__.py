"""LM construction: the scripted LM's script reader and the provider LM settings."""
