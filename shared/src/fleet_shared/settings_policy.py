"""What a request may change in the policy file: the rules the schema declares beside each key.

The settings API edits the file every process starts from, so a request must never be able to
make the host run or read something of its choosing. `fleet_shared.config_file` marks each key
that chooses a host path, an executable, an identity, an exposure or what is deleted as
file-only, and gives each key that names an environment variable the names a request may use.
This module resolves a dotted key through the schema and refuses what those marks forbid; a key
the schema does not know is refused too, before any file is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from fleet_shared.config_file import FILE_ONLY, FileHeader, Profile
from fleet_shared.errors import InvalidSettingChange

FILE_ONLY_KEY = next(iter(FILE_ONLY))


@dataclass(frozen=True)
class KeyRule:
    """What the schema says of one key: the table it is, or the value it holds."""

    file_only: bool = False
    is_table: bool = False
    holds_file_only: bool = False  # a table with a file-only key somewhere inside


def check_change(key: str, value: object) -> None:
    """InvalidSettingChange unless a request may set (or, with None, remove) `key` to `value`."""
    rule = rule_for(key)
    if rule.file_only or key.rsplit(".", 1)[-1].endswith("_env"):
        raise InvalidSettingChange(
            f"{key}: only the file on disk can change it, never a request (it chooses a host path, "
            "an executable, an identity, a variable, the model or profile, what is exposed or deleted)"
        )
    if rule.is_table:
        if value is not None:
            raise InvalidSettingChange(f"{key}: is a table; set the keys inside it")
        if rule.holds_file_only:
            raise InvalidSettingChange(
                f"{key}: holds keys only the file on disk can change; remove the keys inside it instead"
            )


def rule_for(key: str) -> KeyRule:
    """The rule of a dotted key (`config.<key>` or `profiles.<name>.<path>`)."""
    parts = key.split(".")
    if parts[0] == "config" and len(parts) == 2:
        return resolve(parts[1:], msgspec.inspect.type_info(FileHeader), key)
    if parts[0] == "profiles" and len(parts) == 2:
        return KeyRule(is_table=True, holds_file_only=True)  # a whole profile
    if parts[0] == "profiles" and len(parts) > 2:
        return resolve(parts[2:], profile_type(), key)
    raise InvalidSettingChange(f"{key}: not a setting (dotted bare keys under `config.` or `profiles.`)")


@cache
def profile_type() -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(Profile)


def resolve(parts: list[str], node: msgspec.inspect.Type, key: str) -> KeyRule:
    """Walk `parts` down from `node`; a file-only table makes everything inside it file-only."""
    file_only = False
    walked = key.split(".")[: -len(parts)]
    for part in parts:
        node, extra = unwrap(node)
        file_only = file_only or bool(extra.get(FILE_ONLY_KEY))
        if not isinstance(node, msgspec.inspect.StructType):
            raise InvalidSettingChange(f"{'.'.join(walked)}: is a value, not a table")
        field = next((f for f in node.fields if f.encode_name == part), None)
        if field is None:
            raise InvalidSettingChange(f"{key}: unknown key")
        node = field.type
        walked.append(part)
    node, extra = unwrap(node)
    file_only = file_only or bool(extra.get(FILE_ONLY_KEY))
    if isinstance(node, msgspec.inspect.StructType):
        return KeyRule(file_only=file_only, is_table=True, holds_file_only=holds_file_only(node))
    return KeyRule(file_only=file_only)


def unwrap(node: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, dict[str, Any]]:
    """The type under its metadata and any `| None`, with the metadata's extra."""
    extra: dict[str, Any] = {}
    while True:
        if isinstance(node, msgspec.inspect.Metadata):
            extra = {**extra, **(node.extra or {})}
            node = node.type
        elif isinstance(node, msgspec.inspect.UnionType):
            rest = [t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(rest) != 1:
                return node, extra
            node = rest[0]
        else:
            return node, extra


def holds_file_only(node: msgspec.inspect.StructType) -> bool:
    for field in node.fields:
        inner, extra = unwrap(field.type)
        if extra.get(FILE_ONLY_KEY) or field.encode_name.endswith("_env"):
            return True
        if isinstance(inner, msgspec.inspect.StructType) and holds_file_only(inner):
            return True
    return False
