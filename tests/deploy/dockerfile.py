"""The Dockerfile and .dockerignore, read as data: stages, their instructions, COPY sources, the
`uv sync` commands, and the build context's allowlist. The deploy tests check the image's shape
with it, and test_packaging replays the build's copies and installs from it (no container
engine here), so both read the same commands instead of repeating them."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest, continuation lines joined
    line: int  # 1-based line of the keyword


@dataclass
class Stage:
    name: str
    base: str  # an image reference, or the name of an earlier stage
    parent: Stage | None  # the earlier stage it builds on, if any
    own: list[Instruction] = field(default_factory=list)

    def chain(self) -> list[Stage]:
        """This stage and the stages it builds on, the first base first."""
        return [*(self.parent.chain() if self.parent else []), self]

    def instructions(self, keyword: str | None = None) -> list[Instruction]:
        """Every instruction in effect for this stage (its parents' first)."""
        found = [ins for stage in self.chain() for ins in stage.own]
        return [ins for ins in found if keyword is None or ins.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.instructions(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for ins in self.instructions("ENV"):
            for item in shlex.split(ins.args):
                key, _, value = item.partition("=")
                values[key] = value
        return values


@dataclass(frozen=True)
class Copy:
    sources: list[str]
    dest: str
    from_stage: str | None  # --from=...; None copies from the build context
    workdir: str  # the WORKDIR in effect, for a relative dest


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, instruction text) with `\\` continuations joined and comments dropped."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # a comment (also inside a continuation) or a blank line between instructions
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        yield start, " ".join(part for part in pending if part)
        pending = []
    if pending:
        yield start, " ".join(pending)


def parse_dockerfile(text: str | None = None) -> dict[str, Stage]:
    """The stages by name, in file order."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for number, line in logical_lines(DOCKERFILE.read_text() if text is None else text):
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), number)
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            words = [word for word in words if not word.startswith("--platform")]
            base = words[0]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage-{len(stages)}"
            current = Stage(name=name, base=base, parent=stages.get(base))
            stages[name] = current
        elif current is None:
            raise ValueError(f"line {number}: {keyword} before the first FROM")
        else:
            current.own.append(instruction)
    return stages


def exec_form(args: str) -> list[str]:
    """CMD/ENTRYPOINT/HEALTHCHECK CMD arguments in JSON (exec) form; shell form is refused."""
    parsed = json.loads(args)
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise ValueError(f"not an exec-form array: {args}")
    return parsed


def split_flags(args: str) -> tuple[dict[str, list[str]], str]:
    """Leading `--name=value` flags of COPY/RUN/HEALTHCHECK (a name may repeat), and the rest."""
    flags: dict[str, list[str]] = {}
    rest = args
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        flags.setdefault(name, []).append(value)
        rest = rest.strip()
    return flags, rest


def copies(stage: Stage) -> list[Copy]:
    """The COPY instructions of this stage and its parents, with the WORKDIR each ran in."""
    found: list[Copy] = []
    workdir = "/"
    for ins in stage.instructions():
        if ins.keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / ins.args)
        elif ins.keyword in ("COPY", "ADD"):
            flags, rest = split_flags(ins.args)
            words = exec_form(rest) if rest.startswith("[") else shlex.split(rest)
            source_stage = flags["from"][0] if "from" in flags else None
            found.append(Copy(words[:-1], words[-1], source_stage, workdir))
    return found


def uv_syncs(stage: Stage) -> list[list[str]]:
    """Every `uv sync` argv run in this stage's own RUN instructions."""
    commands: list[list[str]] = []
    for ins in stage.own:
        if ins.keyword != "RUN":
            continue
        _, script = split_flags(ins.args)
        for command in script.split("&&"):
            argv = shlex.split(command)
            if argv[:2] == ["uv", "sync"]:
                commands.append(argv)
    return commands


def install_command(side: str, stages: dict[str, Stage] | None = None) -> list[str]:
    """The `uv sync` that installs a side's venv (the full one, not the dependencies-only layer)."""
    stages = parse_dockerfile() if stages is None else stages
    matches = [
        argv
        for stage in stages.values()
        for argv in uv_syncs(stage)
        if side in extras_of(argv) and "--no-install-workspace" not in argv
    ]
    if len(matches) != 1:
        raise ValueError(f"expected one `uv sync` installing the {side} side, found {matches}")
    return matches[0]


def extras_of(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--extra"]


def venv_stage(target: Stage, stages: dict[str, Stage]) -> Stage:
    """The build stage whose /app/.venv a runtime target copies."""
    sources = [c.from_stage for c in copies(target) if c.from_stage and "/app/.venv" in c.sources]
    if len(sources) != 1 or sources[0] not in stages:
        raise ValueError(f"{target.name}: expected one COPY of /app/.venv from a stage, found {sources}")
    return stages[sources[0]]


# --- .dockerignore ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnorePattern:
    regex: re.Pattern[str]
    include: bool  # a `!` exception re-includes what matches


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's matching (Go's filepath.Match plus `**`): `*` and `?` stay within one path part."""
    pattern = str(PurePosixPath("/" + pattern)).lstrip("/")  # cleaned like filepath.Clean
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def read_dockerignore(text: str | None = None) -> list[IgnorePattern]:
    patterns = []
    for raw in (DOCKERIGNORE.read_text() if text is None else text).splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        patterns.append(IgnorePattern(pattern_regex(line.lstrip("!").strip()), include))
    return patterns


def in_context(path: str, patterns: list[IgnorePattern]) -> bool:
    """Whether the build context holds `path` (relative to the repo): the last pattern matching
    it or one of its parent directories decides, as in Docker."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        if any(pattern.regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not pattern.include
    return not excluded


# --- replaying COPY without an engine -------------------------------------------------------------


def place(root: Path, dest: str, workdir: str) -> Path:
    """Where `dest` lands in a filesystem rooted at `root` (relative dests start at WORKDIR)."""
    absolute = PurePosixPath(workdir) / dest
    return root / str(absolute).lstrip("/")


def replay_context_copies(stage: Stage, root: Path, patterns: list[IgnorePattern]) -> None:
    """Do the build-context COPYs of `stage` (and its parents) into `root`, skipping what
    .dockerignore leaves out of the context, with Docker's rules: a directory's contents go into
    the destination, a file goes into it when it ends in `/`."""
    for copy in copies(stage):
        if copy.from_stage is not None:
            continue
        target = place(root, copy.dest, copy.workdir)
        into_dir = copy.dest.endswith("/") or len(copy.sources) > 1
        for source in copy.sources:
            path = REPO / source
            if path.is_dir():
                copy_tree(path, target, source.rstrip("/"), patterns)
            elif in_context(source, patterns):
                destination = target / path.name if into_dir else target
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, destination)


def copy_tree(directory: Path, target: Path, relative: str, patterns: list[IgnorePattern]) -> None:
    for path in sorted(directory.rglob("*")):
        inside = path.relative_to(directory)
        if path.is_file() and in_context(f"{relative}/{inside.as_posix()}", patterns):
            destination = target / inside
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
