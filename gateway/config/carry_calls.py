"""rules/carry.yaml `tool_calls`: how an agent's tool calls fill the carry note.

Which argument names hold a path (read whole, no pattern) or the working directory,
which hold file contents (never read), which tools write the files their path arguments
name, and the patterns read in the text of other arguments: paths relative to the
working directory, a `cd`, a redirect, a patch's file headers, where a command's
inline file content starts. A key the file leaves out takes the shipped value, so a
carry.yaml written before this section reads agents' calls as the shipped one does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from gateway.errors import RulesError

FLAGS = re.IGNORECASE | re.MULTILINE


@dataclass(frozen=True, slots=True)
class CallRules:
    path_args: frozenset[str]  # an argument of this name holds a path
    workdir_args: frozenset[str]  # ... the working directory
    skip_args: frozenset[str]  # ... file contents or search patterns: not read
    write_tools: frozenset[str]  # tools whose path arguments name files they write
    command_paths: re.Pattern[str]  # paths in command text besides the ref patterns'
    cd: re.Pattern[str]  # a group: where a command moves
    redirects: re.Pattern[str]  # a group: a file a command writes
    patch_files: re.Pattern[str]  # a group: a file a patch writes (read in its body too)
    body_start: re.Pattern[str]  # where a command's inline file content starts
    not_paths: re.Pattern[str]  # values never taken as paths (/dev/null)


_NAMES = ("path_args", "workdir_args", "skip_args", "write_tools")
_GROUPED = ("cd", "redirects", "patch_files")  # what a group of theirs captures is the path

SHIPPED: dict[str, Any] = {
    "path_args": ["file_path", "path", "notebook_path", "filepath", "filename",
                  "target_file", "dir_path"],
    "workdir_args": ["workdir", "cwd", "working_directory"],
    "skip_args": ["content", "old_string", "new_string", "new_source", "edits", "diff",
                  "pattern", "glob"],
    "write_tools": ["Write", "Edit", "MultiEdit", "NotebookEdit", "apply_patch",
                    "write_file", "edit_file", "create_file"],
    "command_paths": r"(?<![\w.:/~$-])(?:[\w.-]+/)+[\w-]*\.[a-z]\w*\b",
    "cd": r"""(?:^|[;&|(])\s*cd\s+["']?([^\s;&|()"']+)""",
    "redirects": (r"""(?<![<>&\d])>{1,2}\s*(?!&)([^\s;&|<>()'"]+)"""
                  r"""|\btee\s+(?:-a\s+)?([^\s;&|<>()'"]+)"""),
    "patch_files": r"^\*\*\* (?:Add File|Update File|Move to): *(\S.*?)\s*$",
    "body_start": r"""<<-?\s*(["']?)\w+\1|^\*\*\* Begin Patch""",
    "not_paths": r"^(?:/dev/|/proc/)",
}


def load_call_rules(file: str, data: Any) -> CallRules:
    """The `tool_calls` section (None: the shipped values), key by key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesError(file, None, "tool_calls", "must be a mapping")
    known = {f.name for f in fields(CallRules)}
    unknown = set(data) - known
    if unknown:
        raise RulesError(file, None, f"tool_calls.{sorted(unknown)[0]}", "unknown key")
    given = {**SHIPPED, **data}
    out: dict[str, Any] = {}
    for name in _NAMES:
        v = given[name]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise RulesError(file, None, f"tool_calls.{name}", "must be a list of names")
        out[name] = frozenset(v)
    for name in known - set(_NAMES):
        key = f"tool_calls.{name}"
        p = given[name]
        if not isinstance(p, str) or not p:
            raise RulesError(file, None, key, "must be a non-empty regular expression")
        try:
            out[name] = re.compile(p, FLAGS)
        except re.error as exc:
            raise RulesError(file, None, key, f"invalid regular expression: {exc}") from None
        if name in _GROUPED and out[name].groups < 1:
            raise RulesError(file, None, key, "needs a group: what it captures is the path")
    return CallRules(**out)


SHIPPED_CALLS = load_call_rules("<shipped>", None)
