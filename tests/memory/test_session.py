"""Who is calling, as a property over header combinations: no usable credential means no
tenant, and two different credentials never share one."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.config.schema import TenantRules
from gateway.memory.session import client_refusal, tenant_of

# in the order the gateway looks at them; the last one is configured
CREDENTIAL_HEADERS = ("Authorization", "x-api-key", "api-key", "X-Client-Key")
RULES = (TenantRules(credential_headers=("X-Client-Key",)),
         TenantRules(credential_headers=("X-Client-Key",), anonymous="lab-shared"))
# what a client whose key variable is unset sends, the stand-ins local model servers
# document (every such client sends them), and a scheme alone
NOT_KEYS = {"undefined", "null", "none", "nil", "bearer", "empty", "dummy", "placeholder",
            "not-needed", "not_needed", "no-key", "nokey", "sk-no-key-required", "ollama",
            "lm-studio", "lmstudio", "sk-xxx", "sk-dummy", "sk-placeholder", "fake",
            "fake-key", "sk-fake"}

keys = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
               max_size=12).filter(lambda k: k.lower() not in NOT_KEYS)
space = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def usable(draw: Any) -> tuple[str, str]:
    """(header value, the key it carries)."""
    key = draw(keys)
    scheme = draw(st.sampled_from(["", "Bearer ", "bearer ", "BEARER  ", "Bearer\t"]))
    return draw(space) + scheme + key + draw(space), key


unusable = st.sampled_from([
    "", " ", "\t ", "Bearer", "Bearer ", "bearer  ", "Bearer undefined", "None", "null",
    "Bearer a b", "Basic dXNlcjpwdw==", "Bearer \udcff\udcfe", "k\udce9y", "\x7f", "k\x01y",
    "ключ", "Bearer sk-é", "sk-\u2028x", "Bearer EMPTY", "sk-no-key-required", "ollama",
    "Bearer lm-studio", "DUMMY",
]).map(lambda v: (v, None))


@st.composite
def headers(draw: Any) -> tuple[CIMultiDict[str], str | None]:
    """Some credential headers (names in any case), usable or not, plus one that never
    carries a credential; and the key the gateway must take (first usable one)."""
    h: CIMultiDict[str] = CIMultiDict()
    expected = None
    for name in CREDENTIAL_HEADERS:
        if draw(st.booleans()):
            value, key = draw(usable() | unusable)
            h[draw(st.sampled_from([name, name.lower(), name.upper()]))] = value
            expected = expected if expected is not None else key
    if draw(st.booleans()):
        h["X-Other-Key"] = draw(keys)
    return h, expected


@given(one=headers(), other=headers(), rules=st.sampled_from(RULES))
def test_no_usable_credential_is_no_tenant_and_keys_never_share_one(
    one: tuple[CIMultiDict[str], str | None], other: tuple[CIMultiDict[str], str | None],
    rules: TenantRules,
) -> None:
    """tenant is None (or the configured anonymous one) exactly when no header holds a
    usable key; the same key gives the same tenant, different keys different ones."""
    (h1, k1), (h2, k2) = one, other
    t1, t2 = tenant_of(h1, rules), tenant_of(h2, rules)
    for t, k in ((t1, k1), (t2, k2)):
        if k is None:
            assert t == rules.anonymous
        else:
            assert t is not None and t.startswith("t-") and t != rules.anonymous
    if k1 is not None and k2 is not None:
        assert (t1 == t2) == (k1 == k2)


@given(h=headers(), allowed=st.lists(keys, max_size=3))
def test_only_allowlisted_keys_may_use_an_injected_key(
    h: tuple[CIMultiDict[str], str | None], allowed: list[str]
) -> None:
    """client_refusal lets a caller through exactly when its key's sha256 is listed."""
    headers_, key = h
    rules = TenantRules(credential_headers=("X-Client-Key",), client_keys_sha256=frozenset(
        hashlib.sha256(k.encode()).hexdigest() for k in allowed) | {"0" * 64})
    assert (client_refusal(headers_, rules) is None) == (key is not None and key in allowed)


def test_tenants_config_is_validated_and_described() -> None:
    """tenants: bad header names, a name a key could hash to, and malformed hashes (in the
    file or the environment) are refused with the key; check-config prints the section."""
    import pytest
    import yaml

    from gateway.config.effective import effective_config
    from gateway.config.env_overrides import apply_env
    from gateway.config.rules import build_rules
    from gateway.errors import RulesError

    good = "a" * 64
    for bad, key in (({"credential_headers": ["X Key"]}, "tenants.credential_headers"),
                     ({"anonymous": "t-0123456789abcdef"}, "tenants.anonymous"),
                     ({"anonymous": ""}, "tenants.anonymous"),
                     ({"client_keys_sha256": ["sk-live-the-key-itself"]},
                      "tenants.client_keys_sha256"),
                     ({"allow_any_client": "yes"}, "tenants.allow_any_client"),
                     ({"credential_header": ["X-Key"]}, "tenants.credential_header")):
        with pytest.raises(RulesError) as exc:
            build_rules({"tenants": bad})
        assert exc.value.key == key
        assert "sk-live" not in str(exc.value)
    rules = build_rules({"tenants": {"client_keys_sha256": [good.upper()],
                                     "credential_headers": ["X-Client-Key"]}})
    with pytest.raises(RulesError) as exc:
        apply_env(rules, {"MEMGATE_CLIENT_KEYS_SHA256": "not-a-hash"})
    assert exc.value.key == "MEMGATE_CLIENT_KEYS_SHA256"
    assert "not-a-hash" not in str(exc.value)  # likely a key pasted in place of its hash
    merged = apply_env(rules, {"MEMGATE_CLIENT_KEYS_SHA256": "b" * 64})
    assert merged.tenants.client_keys_sha256 == {good, "b" * 64}
    shown = yaml.safe_load(yaml.safe_dump(effective_config(merged)))["tenants"]
    assert shown == {"credential_headers": ["X-Client-Key"], "anonymous": None,
                     "client_keys_sha256": [good, "b" * 64], "allow_any_client": False}


@pytest.mark.slow
def test_hash_key_prints_what_the_allowlist_compares() -> None:
    """memgate hash-key reads the key from stdin (a bare key or `Bearer <key>`) and prints
    the digest the allowlist admits; no usable key is exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def run(stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", "hash-key"], input=stdin,
                              capture_output=True, text=True, cwd=root, check=False, timeout=60)

    out = run("sk-client-123\n")
    assert out.returncode == 0
    digest = out.stdout.strip()
    assert digest == hashlib.sha256(b"sk-client-123").hexdigest()
    assert run("Bearer sk-client-123").stdout.strip() == digest
    rules = TenantRules(client_keys_sha256=frozenset({digest}))
    assert client_refusal({"api-key": "sk-client-123"}, rules) is None
    bad = run("Bearer \n")
    assert bad.returncode == 2 and "no usable key" in bad.stderr and bad.stdout == ""
