"""Which upstream a request goes to: by path and model, and by the wire it speaks.

A request always goes to one of the configured upstreams. A request whose wire is known
goes to the first upstream whose paths (and models) serve it and that speaks its wire;
else to the default one if that speaks it; else to the first upstream declaring that
wire. A request whose wire is not known, or whose wire no upstream declares, is routed
by path alone, as before there were wires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.effective import effective_config
from gateway.config.rules import build_rules, load_rules
from gateway.config.schema import Rules, Upstream
from gateway.errors import RulesError

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["/", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/files",
         "/v1/chat/completions", "/v1/responses", "/team-a/v1/messages",
         "/openai/deployments/gpt/chat/completions", "/healthz-like", "/v1/embeddings"]
GLOBS = ["/*", "/v1/*", "/v1/messages*", "/", "/openai/*", "/team-a/*", "/v1/models"]


@st.composite
def upstreams(draw: st.DrawFn) -> tuple[Upstream, ...]:
    names = draw(st.lists(st.sampled_from(["openai", "anthropic", "azure", "litellm", "b"]),
                          min_size=1, max_size=5, unique=True))
    return tuple(Upstream(
        name, f"http://127.0.0.1:{9000 + k}",
        paths=tuple(draw(st.lists(st.sampled_from(GLOBS), min_size=1, max_size=3))),
        models=tuple(draw(st.sampled_from([(), (), ("claude-*",), ("gpt-*",)]))),
        wire=draw(st.sampled_from(["openai", "anthropic", "any"])),
    ) for k, name in enumerate(names))


def by_path(rules: Rules, path: str, model: str | None) -> Upstream:
    """The routing of a request whose wire is not known: the first upstream serving its
    path and model, else the default one."""
    return next((u for u in rules.upstreams if u.serves(path, model)), rules.default_upstream)


@given(ups=upstreams(), path=st.sampled_from(PATHS),
       model=st.sampled_from([None, "claude-sonnet-4-5", "gpt-4o-mini"]),
       wire=st.sampled_from([None, "openai", "anthropic"]))
def test_routing_chooses_among_the_configured_upstreams_by_path_then_wire(
    ups: tuple[Upstream, ...], path: str, model: str | None, wire: str | None,
) -> None:
    rules = Rules(upstreams=ups)
    up = rules.upstream_for(path, model, wire)
    assert any(up is u for u in ups)  # never an address of the request's choosing
    assert rules.upstream_for(path, model, wire) is up  # the memo answers the same
    declared = wire is not None and any(u.wire == wire for u in ups)
    if not declared:
        assert up is by_path(rules, path, model)
        return
    assert up.speaks(wire)  # its key never goes to an upstream of another wire
    fitting = [u for u in ups if u.serves(path, model) and u.speaks(wire)]
    if fitting:
        assert up is fitting[0]
    elif rules.default_upstream.speaks(wire):
        assert up is rules.default_upstream
    else:
        assert up is next(u for u in ups if u.wire == wire)


SHIPPED = load_rules(ROOT / "rules" / "gateway.yaml", {})


@pytest.mark.parametrize(("path", "wire", "name"), [
    ("/v1/messages", "anthropic", "anthropic"),
    ("/v1/models", "anthropic", "anthropic"),  # the Anthropic SDK's models.list()
    ("/v1/models", None, "openai"),  # the OpenAI SDK's
    ("/team-a/v1/messages", "anthropic", "anthropic"),  # a base URL with a prefix
    ("/", None, "anthropic"),  # Claude Code's HEAD /: no header, the shipped path
    ("/", "anthropic", "anthropic"),
    ("/v1/chat/completions", "openai", "openai"),
    ("/v1/responses", "openai", "openai"),
    ("/v1/files", "anthropic", "anthropic"),
    ("/v1/files", None, "openai"),
])
def test_the_shipped_routes(path: str, wire: str | None, name: str) -> None:
    assert SHIPPED.upstream_for(path, None, wire).name == name


def test_the_shipped_list_is_the_default_one() -> None:
    """rules/gateway.yaml's upstreams are those of a config without the key."""
    assert SHIPPED.upstreams == Rules().upstreams
    bare = build_rules({}, base_dir=ROOT / "rules")
    assert bare.upstreams == Rules().upstreams


def _rules(*ups: dict[str, Any]) -> Rules:
    return build_rules({"upstreams": list(ups)}, base_dir=ROOT / "rules")


def test_wire_defaults_by_name_and_is_printed() -> None:
    """Unset, `wire` is the API of the upstream the gateway names (`openai`,
    `anthropic`), else `any`; check-config prints it."""
    rules = _rules({"name": "anthropic", "base_url": "https://a.example"},
                   {"name": "openai", "base_url": "https://o.example"},
                   {"name": "litellm", "base_url": "https://l.example"},
                   {"name": "claude", "base_url": "https://c.example", "wire": "anthropic"})
    assert [u.wire for u in rules.upstreams] == ["anthropic", "openai", "any", "anthropic"]
    assert [u["wire"] for u in effective_config(rules)["upstreams"]] == [
        "anthropic", "openai", "any", "anthropic"]


def test_a_bad_wire_is_refused_with_its_key() -> None:
    with pytest.raises(RulesError) as exc:
        _rules({"name": "openai", "base_url": "https://o.example", "wire": "gemini"})
    assert "upstreams[0].wire" in str(exc.value) and "openai, anthropic, any" in str(exc.value)


def test_an_operator_changes_the_routing_in_the_config() -> None:
    """The operator decides: an upstream named for Anthropic but declared `any` takes
    what its paths claim and nothing more; one that speaks both takes everything."""
    both = _rules({"name": "anthropic", "base_url": "https://a.example",
                   "paths": ["/v1/messages*"]},
                  {"name": "openai", "base_url": "https://l.example", "wire": "any"})
    assert both.upstream_for("/v1/models", None, "anthropic").name == "openai"
    assert both.upstream_for("/v1/messages", None, "anthropic").name == "anthropic"
    only_openai = _rules({"name": "openai", "base_url": "https://o.example"})
    # no upstream speaks Anthropic: as configured, by path
    assert only_openai.upstream_for("/v1/models", None, "anthropic").name == "openai"
