"""What `fleet up` prints once the stack is ready: the URL, the profile, the LM and how to try
it, set apart from the log lines around it (bold at a terminal, plain in a pipe)."""

from __future__ import annotations

from typing import TextIO

from fleet_shared.config import Settings

BOLD = "\x1b[1m"
DIM = "\x1b[2m"
RESET = "\x1b[0m"
TRY_A_TURN = "Try a Turn"  # a heading of the README


def lm_label(settings: Settings) -> str:
    lm = settings.root_lm
    if lm.scripted:
        script = lm.script_path.name if lm.script_path else "a script"
        return f"{lm.name}  (scripted: replays {script}, not a model)"
    return lm.name


def try_it_hint(url: str) -> str:
    return f"uv run fleet cli --api-url {url}   (or curl: README, '{TRY_A_TURN}', with FLEET={url})"


def startup_banner(url: str, settings: Settings, *, color: bool) -> str:
    bold, dim, reset = (BOLD, DIM, RESET) if color else ("", "", "")
    rows = [
        ("profile", settings.profile_name),
        ("LM", lm_label(settings)),
        ("try it", try_it_hint(url)),
        ("stop", "Ctrl-C"),
    ]
    lines = [f"{bold}fleet is up: {url}{reset}"]
    lines += [f"  {dim}{name:<8}{reset}{value}" for name, value in rows]
    return "\n".join(lines)


def print_banner(url: str, settings: Settings, stream: TextIO) -> None:
    color = stream.isatty()
    print(f"\n{startup_banner(url, settings, color=color)}\n", file=stream, flush=True)
