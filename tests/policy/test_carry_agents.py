"""The carry-over reads agents' tool calls: paths touched and written, the working
directory, the last task's conclusion; within bounds, whatever a call holds."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.config.carry import load_carry_patterns
from gateway.config.carry_calls import SHIPPED_CALLS
from gateway.config.rules import load_rules
from gateway.config.schema import ALL_FIELDS, CarryRules
from gateway.errors import RulesError
from gateway.policy.carry import Fold, Message, ToolCall, build_snapshot, render_note
from gateway.policy.carry.calls import CALL_CHARS, call_facts, json_strings
from tests.conftest import SECRET, GatewayFactory, Upstream

ROOT = Path(__file__).resolve().parents[2]
RULES = load_rules(ROOT / "rules" / "gateway.yaml", {})
PATTERNS = RULES.memory.carry_patterns
assert PATTERNS is not None
ALL = CarryRules(keep_fields=ALL_FIELDS, log_skipped=False)


def call(name: str, args: Any) -> ToolCall:
    return ToolCall(name, orjson.dumps(args).decode())


def facts(name: str, args: Any) -> tuple[Any, ...]:
    assert PATTERNS is not None
    return tuple(call_facts(PATTERNS, call(name, args)))


@pytest.mark.parametrize(("name", "args", "want"), [
    # Claude Code: file tools name their file; Write/Edit write it, their contents unread
    ("Read", {"file_path": "/repo/src/app.py", "offset": 1, "limit": 80},
     ((("path", "/repo/src/app.py"),), (), None, None)),
    ("Edit", {"file_path": "/repo/src/app.py", "old_string": "open('/etc/passwd')",
              "new_string": "x"}, ((), (("path", "/repo/src/app.py"),), None, None)),
    ("Write", {"file_path": "report.csv", "content": "see /data/other.csv"},
     ((), (("file", "report.csv"),), None, None)),
    ("Glob", {"pattern": "src/**/*.py", "path": "/repo"}, ((("path", "/repo"),), (), None, None)),
    ("Grep", {"pattern": "/api/v1", "path": "src", "glob": "*.py"},
     ((("path", "src"),), (), None, None)),
    # Bash: paths by the ref patterns and as relative paths; cd; a redirect writes
    ("Bash", {"command": "cd /repo && cat src/x.py notes.md > out/all.txt 2>/dev/null",
              "description": "Concatenate"},
     ((("path", "src/x.py"), ("file", "notes.md")), (("path", "out/all.txt"),), None, "/repo")),
    # Codex: shell with a workdir; apply_patch (in a heredoc, or the custom tool's input)
    ("shell", {"command": ["bash", "-lc", "sed -n 1,40p tests/test_a.py"], "workdir": "/w"},
     ((("path", "tests/test_a.py"),), (), "/w", None)),
    ("shell", {"command": ["bash", "-lc", "apply_patch <<'EOF'\n*** Begin Patch\n"
                           "*** Update File: src/a.py\n@@\n-if a > b:\n+open('/etc/x')\n"
                           "*** Add File: docs/b.md\n+hi\n*** End Patch\nEOF"]},
     ((), (("path", "src/a.py"), ("path", "docs/b.md")), None, None)),
    ("apply_patch", "*** Begin Patch\n*** Update File: a/b.py\n*** Move to: a/c.py\n"
                    "*** End Patch", ((), (("path", "a/b.py"), ("path", "a/c.py")), None, None)),
    ("local_shell", {"type": "exec", "command": ["cat", "README.md"],
                     "working_directory": "/w"}, ((("file", "README.md"),), (), "/w", None)),
])
def test_what_a_call_names_writes_and_where_it_runs(name: str, args: Any,
                                                    want: tuple[Any, ...]) -> None:
    """Claude Code's and Codex's tool shapes: path arguments taken whole (written when the
    tool writes), file contents and search patterns unread, command text read with the
    ref patterns, relative paths, `cd` and redirects, a patch's file headers (its body
    not read for paths), a working-directory argument."""
    assert facts(name, args) == want


def test_a_head_cut_inside_a_string_gives_its_whole_lines() -> None:
    """The head of a long argument text may end inside a string: its words up to the
    last space or line break are read, the word cut short is not (no half path)."""
    head = '{"file_path":"/a/b.py","command":"cat x/one.py\\ncat x/tw'
    assert json_strings(head, frozenset()) == [("file_path", "/a/b.py"),
                                               ("command", "cat x/one.py\ncat")]
    assert json_strings('{"command":"cat_x/tw', frozenset()) == []
    assert json_strings('{"a":[{"b":"1"},"2"],"c":{"d":["3"]}}', frozenset({"d"})) == [
        ("b", "1"), ("a", "2")]
    assert json_strings("not json at all", frozenset()) == [(None, "not json at all")]


def test_a_huge_call_costs_a_bounded_read() -> None:
    """A 1 MB command: only its first CALL_CHARS characters are read (a path past them is
    not seen), in about the time those characters take."""
    assert PATTERNS is not None
    big = "cat early/a.py " + "x " * 500_000 + " late/b.py"
    start = time.perf_counter()
    f = call_facts(PATTERNS, call("Bash", {"command": big + " more/c.py"}))
    elapsed = time.perf_counter() - start
    assert f.refs == (("path", "early/a.py"),)
    assert elapsed < 0.5
    assert len(call("Bash", {"command": big}).arguments[:CALL_CHARS]) == CALL_CHARS


def _turn(fold: Fold, turn: int, *msgs: Message) -> None:
    for m in msgs:
        fold.add(m)


def test_the_conclusion_is_the_closing_text_of_the_last_task_that_made_calls() -> None:
    """A text followed by a call of its turn is no conclusion; the last text of a finished
    turn that made calls is; a chat turn after it does not replace it; the current
    turn's text is not one yet."""
    fold = Fold(PATTERNS)
    fold.add(Message(1, "user", "Fix the bug"))
    fold.add(Message(1, "assistant", "Let me look.", (call("Read", {"file_path": "/r/a.py"}),)))
    fold.add(Message(1, "tool", "def f(): ..."))
    assert "conclusion" not in fold.snapshot(ALL, 2).fields
    fold.add(Message(1, "assistant", "## Done\n\n**Fixed the off-by-one in /r/a.py.** Tests "
                                     "pass."))
    assert "conclusion" not in fold.snapshot(ALL, 1).fields  # the current turn's
    assert fold.snapshot(ALL, 2).fields["conclusion"] == "Fixed the off-by-one in /r/a.py."
    fold.add(Message(2, "user", "What is a closure?"))
    fold.add(Message(2, "assistant", "A function with its environment."))
    fold.add(Message(3, "user", "thanks"))
    assert fold.snapshot(ALL, 3).fields["conclusion"] == "Fixed the off-by-one in /r/a.py."


def test_working_directory_follows_workdir_arguments_and_cd() -> None:
    """A workdir argument sets it; an absolute cd moves it; a relative cd moves from it;
    a call with a workdir argument is not moved by the cd inside its command."""
    fold = Fold(PATTERNS)
    steps = [({"command": "ls", "workdir": "/w"}, "/w"),
             ({"command": "cd sub && ls"}, "/w/sub"),
             ({"command": "cd ../other"}, "/w/other"),
             ({"command": "cd /abs/x"}, "/abs/x"),
             ({"command": "cd tmp && ls", "workdir": "/repo"}, "/repo")]
    for turn, (args, want) in enumerate(steps, start=1):
        fold.add(Message(turn, "assistant", "", (call("shell", args),)))
        assert fold.snapshot(ALL, turn).fields["workdir"] == want


def test_a_chat_without_tool_calls_gets_no_agent_fields() -> None:
    """The seed's sample A: nothing of the agent fields appears without tool calls."""
    assert PATTERNS is not None
    msgs = [Message(1, "user", "把 /data/orders 里上周的订单按状态汇总，结果写到 report_0421.csv"),
            Message(1, "assistant", "确认按状态分组输出 CSV，是否排除已取消订单？"),
            Message(2, "user", "不排除，就按刚才那个路径跑")]
    f = build_snapshot(msgs, PATTERNS, ALL).fields
    assert not {"workdir", "conclusion", "files_written", "files_touched"} & set(f)


# --------------------------------------------------------------------------- property

_PATHS = ["/w/a.py", "/w/data/b.csv", "src/c.py", "docs/d.md", "e.json", "lib/f.ts"]
_DIRS = ["/w", "/srv/app"]


@st.composite
def _agent_call(draw: st.DrawFn) -> tuple[ToolCall, list[str]]:
    """A call in one of Claude Code's or Codex's shapes, and the paths it names."""
    paths = draw(st.lists(st.sampled_from(_PATHS), min_size=1, max_size=3, unique=True))
    shape = draw(st.sampled_from(["Read", "Write", "Bash", "shell", "patch", "heredoc"]))
    if shape in ("Read", "Write"):
        return call(shape, {"file_path": paths[0], "content": "x" * draw(
            st.integers(0, 3 * CALL_CHARS))}), paths[:1]
    if shape == "Bash":
        return call("Bash", {"command": "cat " + " ".join(paths)}), paths
    if shape == "shell":
        return call("shell", {"command": ["bash", "-lc", "wc -l " + " ".join(paths)],
                              "workdir": draw(st.sampled_from(_DIRS))}), paths
    patch = "*** Begin Patch\n" + "".join(f"*** Update File: {p}\n@@\n-a\n+b\n" for p in paths)
    if shape == "patch":
        return ToolCall("apply_patch", orjson.dumps(patch + "*** End Patch").decode()), paths
    return call("shell", {"command": ["bash", "-lc", f"apply_patch <<'EOF'\n{patch}EOF"]}), paths


@given(turns=st.lists(st.tuples(st.lists(_agent_call(), max_size=4), st.booleans()),
                      min_size=1, max_size=6),
       ttl=st.integers(0, 3), later=st.integers(0, 2), max_chars=st.integers(100, 2000))
@example(turns=[([(ToolCall("shell", orjson.dumps({"command": [
    "bash", "-lc", "apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: src/c.py\nEOF"]})
    .decode()), ["src/c.py"])], True)], ttl=0, later=0, max_chars=100)
def test_every_fresh_path_a_call_named_is_carried_and_the_note_stays_bounded(
        turns: list[tuple[list[tuple[ToolCall, list[str]]], bool]], ttl: int, later: int,
        max_chars: int) -> None:
    """Agent turns (a request, calls of every shape, maybe a closing text): every path a
    call named in the last ref_ttl_turns turns is carried (written or touched), each in
    the note when it has room; the note never exceeds max_note_chars. (Checked against a
    planted bug: a patch's file headers read only before its heredoc started.)"""
    assert PATTERNS is not None
    rules = CarryRules(keep_fields=ALL_FIELDS, ref_ttl_turns=ttl, log_skipped=False)
    fold = Fold(PATTERNS)
    named: dict[str, int] = {}
    for turn, (calls, closes) in enumerate(turns, start=1):
        fold.add(Message(turn, "user", f"task {turn}"))
        for c, paths in calls:
            fold.add(Message(turn, "assistant", "", (c,)))
            fold.add(Message(turn, "tool", "ok"))
            named.update(dict.fromkeys(paths, turn))
        if closes:
            fold.add(Message(turn, "assistant", f"Finished task {turn}."))
        fold.prune(rules, turn)
        fold = fold.copy()
    now = len(turns) + later
    f = fold.snapshot(rules, now).fields
    carried = {*f.get("files_written", ()), *f.get("files_touched", ())}
    fresh = {p for p, t in named.items() if t >= now - ttl}
    assert fresh <= carried
    note = render_note(fold.snapshot(rules, now), PATTERNS.note, max_chars)
    assert note is None or len(note) <= max_chars
    whole = render_note(fold.snapshot(rules, now), PATTERNS.note, 100_000) or ""
    assert all(re.search(rf"^- file (?:written|touched): {re.escape(p)}$", whole, re.M)
               for p in fresh)


# --------------------------------------------------------------------------- the rules

def test_shipped_tool_calls_section_is_the_built_in_default() -> None:
    """rules/carry.yaml spells out `tool_calls` as memgate's defaults (a carry.yaml
    without the section reads calls the same)."""
    assert PATTERNS is not None and PATTERNS.calls == SHIPPED_CALLS


@pytest.mark.parametrize(("section", "key", "reason"), [
    ({"nope": 1}, "tool_calls.nope", "unknown key"),
    ({"path_args": "file_path"}, "tool_calls.path_args", "must be a list of names"),
    ({"cd": "cd +\\S+"}, "tool_calls.cd", "needs a group"),
    ({"redirects": "(["}, "tool_calls.redirects", "invalid regular expression"),
    ([1], "tool_calls", "must be a mapping"),
])
def test_a_bad_tool_calls_section_is_refused(tmp_path: Path, section: Any, key: str,
                                             reason: str) -> None:
    """A bad `tool_calls` never takes effect: refused naming the key and the reason."""
    data = yaml.safe_load((ROOT / "rules" / "carry.yaml").read_text())
    data["tool_calls"] = section
    f = tmp_path / "carry.yaml"
    f.write_text(yaml.safe_dump(data, allow_unicode=True))
    with pytest.raises(RulesError) as exc:
        load_carry_patterns(f)
    assert exc.value.key == key and reason in exc.value.reason


def test_a_carry_yaml_without_the_section_gets_the_defaults(tmp_path: Path) -> None:
    """A carry.yaml written before `tool_calls` existed still reads agents' calls."""
    data = yaml.safe_load((ROOT / "rules" / "carry.yaml").read_text())
    del data["tool_calls"]
    f = tmp_path / "carry.yaml"
    f.write_text(yaml.safe_dump(data, allow_unicode=True))
    assert load_carry_patterns(f).calls == SHIPPED_CALLS


# --------------------------------------------------------------------------- through HTTP

async def test_a_dropped_task_s_written_file_reaches_the_upstream_in_the_note(
        gateway: GatewayFactory, upstream: Upstream) -> None:
    """Claude Code's tool loop through the gateway with the Anthropic SDK, eviction on:
    the first task reads, writes /repo/notes/summary.md and answers; once the second
    task's requests drop it, the body the upstream gets carries a note naming the file
    it wrote, the working directory and what it concluded (the session resumed from its
    checkpoints, request after request)."""
    gw = await gateway(memory={
        "enable_eviction": True,
        "budget": {"max_tokens": 400, "max_chars": None, "max_messages": None,
                   "max_turns": None},
        "carry": {"rules_file": str(ROOT / "rules" / "carry.yaml"), "log_skipped": False}})
    rows = "\n".join(f"{k},order-{k},open" for k in range(150))
    loop: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "Summarize the open orders into notes/summary.md"}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                            "input": {"file_path": "/repo/data/orders.csv"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                       "content": rows}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "Write",
                                            "input": {"file_path": "/repo/notes/summary.md",
                                                      "content": "# Orders\n" + rows}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                       "content": "File created successfully"}]}],
        [{"role": "assistant", "content": "Wrote 150 open orders to notes/summary.md."},
         {"role": "user", "content": "Now add a totals line at the end"}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "Bash",
                                            "input": {"command": "cd /repo && tail -3 x.md"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3",
                                       "content": "149,order-149,open"}]}],
    ]
    history: list[dict[str, Any]] = []
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        for step in loop:
            history += step
            await c.messages.create(model="claude-sonnet-4-5", max_tokens=256,
                                    system="You are a coding agent.", messages=history,
                                    extra_headers={"X-Session-Id": "s-agent"})
    events = await gw.wait_mem(len(loop))
    for n in (3, 4):  # the second task's requests
        sent = orjson.loads(upstream.received[n]["raw"])
        texts = [str(m["content"]) for m in sent["messages"]]
        assert not any("toolu_2" in t for t in texts), "the Write was dropped"
        note = next(t for t in texts if "[memgate memory]" in t)
        assert "- file written: /repo/notes/summary.md" in note
        assert "- last task concluded: Wrote 150 open orders to notes/summary.md." in note
        assert events[n]["note"] == "1" and int(events[n]["dropped"]) > 0
    assert "- working directory: /repo" in str(orjson.loads(upstream.received[4]["raw"]))
    assert SECRET not in gw.log.getvalue()
