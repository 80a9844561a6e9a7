"""session.id_from: the loader takes an order of sources and refuses, with the key and
the reason, one the gateway could not follow; session.header still loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.effective import effective_config
from gateway.config.rules import build_rules, load_rules
from gateway.config.schema import SESSION_ID_FROM
from gateway.errors import RulesError

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_order_is_the_default_and_is_printed() -> None:
    """rules/gateway.yaml writes the default order; check-config prints it."""
    rules = load_rules(ROOT / "rules" / "gateway.yaml", {})
    assert rules.session_id_from == SESSION_ID_FROM == build_rules({}).session_id_from
    shown = yaml.safe_load(yaml.safe_dump(effective_config(rules)))["session"]
    assert shown["id_from"] == list(SESSION_ID_FROM) and "header" not in shown


def test_an_order_of_ones_own() -> None:
    """Any header, the named sources in any order, the fingerprint last."""
    order = ["header:X-Team-Session", "prompt_cache_key", "user", "fingerprint"]
    assert build_rules({"session": {"id_from": order}}).session_id_from == tuple(order)
    assert build_rules({"session": {"id_from": ["fingerprint"]}}).session_id_from == (
        "fingerprint",)


@pytest.mark.parametrize(("id_from", "reason"), [
    ("fingerprint", "must be a list of sources ending with fingerprint"),
    ([], "must end with fingerprint"),
    (["header:X-Session-Id"], "must end with fingerprint"),
    (["fingerprint", "user"], "fingerprint must be the last entry: 'user' after it"),
    (["user", "session", "fingerprint"], "entry 1: unknown source 'session'; the sources "
                                         "are header:<Name>, metadata.session_id"),
    (["metadata.user_id", "fingerprint"], "entry 0: unknown source 'metadata.user_id'"),
    (["header:", "fingerprint"], "entry 0 ('header:'): a header source is header:<Name>"),
    (["header:X Session", "fingerprint"], "entry 0 ('header:X Session'): a header source"),
    (["body:user", "fingerprint"], "entry 0 ('body:user'): a header source is header:<Name>"),
    (["header:X-A", "header:x-a", "fingerprint"], "entry 1: 'header:x-a' is listed twice"),
    (["user", "user", "fingerprint"], "entry 1: 'user' is listed twice"),
    ([1, "fingerprint"], "must be a list of sources ending with fingerprint"),
])
def test_a_bad_order_is_refused_with_the_key_and_why(id_from: Any, reason: str) -> None:
    """Not a list, an unknown source (the account part of metadata.user_id is none), a
    malformed header, a duplicate (header names ignore case) or no fingerprint last."""
    with pytest.raises(RulesError) as exc:
        build_rules({"session": {"id_from": id_from}})
    assert exc.value.key == "session.id_from"
    assert reason in exc.value.reason


def test_session_header_is_the_older_spelling_of_the_first_source(tmp_path: Path) -> None:
    """A config written before id_from loads unchanged; with id_from beside it, or a bad
    header name, it is refused on its own key, with the file's line."""
    rules = build_rules({"session": {"header": "X-Conversation"}})
    assert rules.session_id_from == ("header:X-Conversation", *SESSION_ID_FROM[1:])
    for bad, reason in (({"header": "X-A", "id_from": ["fingerprint"]},
                         "session.id_from is given too"),
                        ({"header": "X A"}, "is not an HTTP header name"),
                        ({"header": ["X-A", "X-B"]}, "must be one HTTP header name")):
        with pytest.raises(RulesError) as exc:
            build_rules({"session": bad})
        assert exc.value.key == "session.header" and reason in exc.value.reason
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("session:\n  max_tracked: 10\n  id_from: [user, nope, fingerprint]\n")
    with pytest.raises(RulesError) as err:
        load_rules(cfg, {})
    assert err.value.key == "session.id_from" and err.value.line == 3


@pytest.mark.parametrize(("session", "tenants", "key"), [
    ({"id_from": ["header:Authorization", "fingerprint"]}, {}, "session.id_from"),
    ({"id_from": ["header:x-api-key", "fingerprint"]}, {}, "session.id_from"),
    ({"id_from": ["header:Cookie", "fingerprint"]}, {}, "session.id_from"),
    ({"header": "api-key"}, {}, "session.header"),
    ({"id_from": ["header:X-Client-Key", "fingerprint"]},
     {"credential_headers": ["x-client-key"]}, "session.id_from"),
    ({"header": "X-Client-Key"}, {"credential_headers": ["X-Client-Key"]}, "session.header"),
])
def test_no_source_reads_a_callers_key(session: dict[str, Any], tenants: dict[str, Any],
                                       key: str) -> None:
    """A session id is written on every [mem] line: a header that carries the caller's
    key (the built-in ones, a cookie, or one tenants.credential_headers names) is refused."""
    with pytest.raises(RulesError) as exc:
        build_rules({"session": session, "tenants": tenants})
    assert exc.value.key == key
    assert "caller's key" in exc.value.reason and "[mem] line" in exc.value.reason
