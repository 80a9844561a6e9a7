"""The carry note: a snapshot's fields (and recalled records) as lines within a bound."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.policy.carry.snapshot import Snapshot

DEFAULT_NOTE = ("[memgate memory] Earlier turns of this conversation were trimmed. "
                "Still in force:\n{lines}")


_LEFT_OUT = "- ({n} more left out: max_note_chars)"


def render_note(
    snap: Snapshot | None, template: str, max_chars: int, recalled: list[str] | None = None,
    retrieve: str | None = None,
) -> str | None:
    """The compact note injected before the current turn, or None when there is nothing.

    Within `max_chars` lines go whole, never cut: the task's own fields first (an agent's
    working directory and its last task's conclusion among them), then the confirmed
    constraints newest first (an older one is the likelier to be superseded), then the
    files tool calls wrote and touched (in the order last named: those of the dropped
    turns before the current turn's, which the model still reads), then refs, tool
    results and unchosen candidates; what does not fit is left out, and a last line says
    how many lines were. `retrieve`: the line naming the dropped turns' retrieval
    handle, first of all."""
    f = snap.fields if snap is not None else {}
    fixed = [retrieve] if retrieve else []
    if "task_state" in f:
        fixed.append(f"- task state: {f['task_state']}")
    if "output_file" in f:
        fixed.append(f"- output file: {f['output_file']}")
    for phrase, value in (f.get("resolved_refs") or {}).items():
        fixed.append(f"- \"{phrase}\" = {value}")
    if "workdir" in f:
        fixed.append(f"- working directory: {f['workdir']}")
    if "conclusion" in f:
        fixed.append(f"- last task concluded: {f['conclusion']}")
    confirmed = [f"- confirmed: {c}" for c in f.get("confirmed_constraints") or []]
    files = [f"- file written: {v}" for v in f.get("files_written") or []]
    files += [f"- file touched: {v}" for v in f.get("files_touched") or []]
    rest = [f"- {rtype}: {', '.join(values)}" for rtype, values in (f.get("refs") or {}).items()]
    rest += [f"- tool result: {t}" for t in f.get("tool_results") or []]
    if f.get("dropped_candidates"):
        rest.append(f"- not chosen: {', '.join(f['dropped_candidates'])}")
    # a record's lines joined into one: a recalled text never makes a line of the note's
    # own ("- task state: closed" inside an archived reply stays inside its line)
    recalled_lines = [f"- recalled: {' / '.join(r.splitlines())}" for r in recalled or []]
    every = [*fixed, *confirmed, *files, *rest]
    if not every:
        bare = template.replace("{lines}", "").rstrip()
        lines = _within(recalled_lines, max_chars - len(bare))
        return "\n".join([bare, *lines]) if lines else None
    room = max_chars - len(template.replace("{lines}", ""))
    if sum(len(x) + 1 for x in every) > room:
        room -= len(_LEFT_OUT.format(n=len(every))) + 1  # the line that says so

    def take(candidates: Iterable[str]) -> list[str]:
        nonlocal room
        out = []
        for line in candidates:
            if len(line) + 1 <= room:
                out.append(line)
                room -= len(line) + 1
        return out

    kept = take(fixed)
    kept += reversed(take(reversed(confirmed)))  # the newest first, shown in their order
    kept += take(files)
    kept += take(rest)
    if len(kept) < len(every):
        kept.append(_LEFT_OUT.format(n=len(every) - len(kept)))
    head = template.replace("{lines}", "\n".join(kept))
    if len(head) > max_chars:  # not even the line saying what was left out fits
        return None
    lines = _within(recalled_lines, max_chars - len(head))
    return "\n".join([head, *lines]) if lines else head


def _within(lines: list[str], room: int) -> list[str]:
    """The recalled lines that fit `room` characters (each with its newline), the first
    that does not cut to the room with "…" when at least 40 characters are left: the
    note, recalled text included, stays within max_note_chars."""
    out = []
    for line in lines:
        if len(line) + 1 <= room:
            out.append(line)
            room -= len(line) + 1
            continue
        if room - 1 >= 40:
            out.append(line[: room - 2] + "…")
        break
    return out
