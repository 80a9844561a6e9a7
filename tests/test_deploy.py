"""deploy/: the files a reviewer reads, checked statically (no Docker engine here).

Schema validators from the package index (`kubernetes-validate --strict` for the
manifests, check-jsonschema's vendored compose-spec for the compose file), `promtool` for
the Prometheus config and the exposition (skipped when it is not installed), and the
properties a reviewer looks for, read from the parsed files: loopback ports, pinned
images, probes, preStop, a PodDisruptionBudget, limits, a non-root read-only container,
a build context that keeps to what the Dockerfile copies."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.config.effective import effective_config
from gateway.config.rules import build_rules
from tests.conftest import ROOT, GatewayFactory

DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = DEPLOY / "docker-compose.yml"
DRAIN_S = 30.0  # memgate serve --drain-s default
# a version tag down to the patch release (7.4.2, v3.5.0, 3.11.15-slim-bookworm; PostgreSQL
# numbers its patch releases major.minor: 16.8) or a digest
_PATCH_TAG = re.compile(r"^v?\d+\.\d+\.\d+([-.][\w.-]+)?$")
_PG_TAG = re.compile(r"^\d+\.\d+([-.][\w.-]+)?$")


def pinned(image: str) -> bool:
    if re.search(r"@sha256:[0-9a-f]{64}$", image):
        return True
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return False  # no tag at all (a registry port is not one)
    return bool((_PG_TAG if name.endswith("postgres") else _PATCH_TAG).match(tag))


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def tool(module: str) -> str:
    """A validator installed with the dev extra, run as a module of this interpreter."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed: pip install -e '.[dev]'")
    return module


def k8s_docs() -> list[dict[str, Any]]:
    return [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def kind(docs: list[dict[str, Any]], k: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == k]


def deploy_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "config" / "gateway.yaml").read_text())
    return data


# --------------------------------------------------------------------------- validators


def test_k8s_manifests_pass_kubernetes_validate_strict(tmp_path: Path) -> None:
    """Every manifest passes --strict (unknown fields refused) for the newest schema and
    for 1.29 (an old cluster still in use); a misspelt field is caught, so the check is
    not vacuous."""
    mod = tool("kubernetes_validate")
    assert K8S
    for version in ("1.37.0", "1.29.0"):
        res = run(sys.executable, "-m", mod, "--strict", "-k", version, *map(str, K8S))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "PodDisruptionBudget".lower() in res.stdout.lower()
    typo = tmp_path / "typo.yaml"
    typo.write_text(K8S[0].read_text().replace("imagePullPolicy:", "imagePullPolcy:"))
    res = run(sys.executable, "-m", mod, "--strict", str(typo))
    assert res.returncode != 0 and "imagePullPolcy" in res.stdout + res.stderr


def test_compose_file_passes_the_compose_spec_schema(tmp_path: Path) -> None:
    """The compose file against the compose-spec JSON schema (vendored by check-jsonschema,
    no network); a copy with a misspelt service key, checked in the same run, is caught."""
    mod = tool("check_jsonschema")
    typo = tmp_path / "typo-compose.yml"
    typo.write_text(COMPOSE.read_text().replace("read_only:", "readonly:"))
    res = run(sys.executable, "-m", mod, "--builtin-schema", "vendor.compose-spec",
              str(COMPOSE), str(typo))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "typo-compose.yml" in out and "readonly" in out, out
    assert str(COMPOSE) not in out, out  # only the planted typo is reported


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return found


def test_prometheus_config_passes_promtool() -> None:
    res = run(promtool(), "check", "config", str(DEPLOY / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


async def test_metrics_exposition_passes_promtool(gateway: GatewayFactory) -> None:
    """What /metrics serves, read over HTTP, passes `promtool check metrics` (names,
    types, HELP, counter suffixes)."""
    binary = promtool()
    gw = await gateway()
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        text = await r.read()
    res = subprocess.run([binary, "check", "metrics"], input=text, capture_output=True,
                         timeout=60, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr).decode()


# --------------------------------------------------------------------------- compose


def test_pinned_tells_floating_tags_from_pinned_ones() -> None:
    for ok in ("redis:7.4.2-alpine", "prom/prometheus:v3.5.0", "postgres:16.8-alpine",
               "python:3.11.15-slim-bookworm", "memgate:0.1.0", "localhost:5000/memgate:1.2.3",
               "python@sha256:" + "a" * 64):
        assert pinned(ok), ok
    for floating in ("redis:7-alpine", "prom/prometheus:latest", "postgres:16-alpine",
                     "python:3.11-slim", "memgate", "localhost:5000/memgate", "redis:7.4"):
        assert not pinned(floating), floating


def test_compose_binds_loopback_and_pins_images() -> None:
    """Every published port is on 127.0.0.1, every image a pinned tag, the gateways run
    read-only without capabilities, stop within a grace period longer than the drain,
    and Prometheus scrapes the admin port the config names."""
    # as compose reads it with nothing set in the environment: ${VAR:-default} -> default
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", COMPOSE.read_text())
    compose = yaml.safe_load(text)
    services = compose["services"]
    published = 0
    for name, svc in services.items():
        for port in svc.get("ports", []):
            published += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
            else:
                assert str(port).startswith("127.0.0.1:"), (name, port)
        assert pinned(svc["image"]), (name, svc["image"])
    assert published >= 3
    gateways = {n: s for n, s in services.items() if "build" in s}
    assert len(gateways) == 2
    for name, svc in gateways.items():
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert float(svc["stop_grace_period"].rstrip("s")) > DRAIN_S, name
        assert any(v.endswith(":/app/var") for v in svc["volumes"]), name
        assert svc["environment"]["MEMGATE_CONFIG"] == "/config/gateway.yaml"
    admin = deploy_config()["listen"]["admin_port"]
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert sorted(targets) == sorted(f"{n}:{admin}" for n in gateways)


# --------------------------------------------------------------------------- kubernetes


def test_k8s_deployment_drains_probes_and_limits() -> None:
    """imagePullPolicy and a pinned image; preStop sleeps so endpoints drain before
    SIGTERM, and the grace period outlasts the sleep plus memgate's drain; readiness on
    /readyz and liveness on /healthz of the main port; requests and limits; a non-root,
    read-only container without privileges; the admin port in the pod, not the Service."""
    docs = k8s_docs()
    (deploy,) = kind(docs, "Deployment")
    spec = deploy["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["imagePullPolicy"] in ("IfNotPresent", "Always")
    assert pinned(c["image"]) and not c["image"].endswith(":latest")
    pre = c["lifecycle"]["preStop"]
    pause = float(pre["sleep"]["seconds"]) if "sleep" in pre else float(
        pre["exec"]["command"][-1])
    assert pause >= 3
    args = c["args"]
    drain = float(args[args.index("--drain-s") + 1]) if "--drain-s" in args else DRAIN_S
    assert spec["terminationGracePeriodSeconds"] > pause + drain
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    cfg = deploy_config()["listen"]
    assert ports == {"http": cfg["port"], "admin": cfg["admin_port"]}
    assert args[:1] == ["serve"] and args[args.index("--port") + 1] == str(cfg["port"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for key in ("cpu", "memory"):
        assert c["resources"]["requests"][key] and c["resources"]["limits"][key]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert {"/app/var", "/tmp"} <= writable
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(cfg["admin_port"])
    (svc,) = kind(docs, "Service")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]


def test_k8s_pdb_covers_the_deployment() -> None:
    """A PodDisruptionBudget selects the Deployment's pods and leaves a drain possible
    (it allows fewer than all replicas)."""
    docs = k8s_docs()
    (deploy,) = kind(docs, "Deployment")
    (pdb,) = kind(docs, "PodDisruptionBudget")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    wanted = pdb["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= labels.items()
    replicas = deploy["spec"]["replicas"]
    assert 0 < pdb["spec"]["minAvailable"] < replicas


# --------------------------------------------------------------------------- image


INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM",
                "HEALTHCHECK", "LABEL", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER",
                "VOLUME", "WORKDIR"}


def dockerfile() -> list[Any]:
    """The Dockerfile as BuildKit's own parser reads it (the `dockerfile` package wraps
    the Go parser Docker uses): (cmd, flags, value, json) per instruction."""
    if importlib.util.find_spec("dockerfile") is None:
        pytest.skip("dockerfile (BuildKit's parser) not installed: pip install -e '.[dev]'")
    import dockerfile as parser

    return list(parser.parse_file(str(DEPLOY / "Dockerfile")))


def test_dockerfile_pins_its_base_runs_as_non_root_and_ships_samples() -> None:
    """It parses, with known instructions only; every FROM resolves to a pinned tag; the
    final stage runs as a numeric non-root user from /app with rules/ and samples/
    (`memgate demo` looks in ./samples), the config at MEMGATE_CONFIG and a healthcheck on
    the main port; ENTRYPOINT and CMD in exec form (SIGTERM reaches memgate, which
    drains, not a shell) with `memgate` as the entrypoint so `docker run IMAGE demo`
    works."""
    steps = dockerfile()
    assert {c.cmd for c in steps} <= INSTRUCTIONS
    args = dict(v.split("=", 1) for c in steps if c.cmd == "ARG" for v in c.value if "=" in v)
    bases = [c.value[0] for c in steps if c.cmd == "FROM"]
    assert len(bases) == 2
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert pinned(image), image
    final = steps[max(i for i, c in enumerate(steps) if c.cmd == "FROM"):]
    user = [c.value[0] for c in final if c.cmd == "USER"][-1]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
    copies = [c.value for c in final if c.cmd == "COPY" and not c.flags]
    assert ("rules", "/app/rules") in copies and ("samples", "/app/samples") in copies
    assert [c.value for c in final if c.cmd == "WORKDIR"][-1] == ("/app",)
    env = dict(zip(*[iter(v for c in final if c.cmd == "ENV" for v in c.value)] * 2))
    assert env["MEMGATE_CONFIG"] == "/app/rules/gateway.yaml"
    port = deploy_config()["listen"]["port"]
    (health,) = [c for c in final if c.cmd == "HEALTHCHECK"]
    assert health.json and f"127.0.0.1:{port}/healthz" in " ".join(health.value)
    (entry,) = [c for c in final if c.cmd == "ENTRYPOINT"]
    (cmd,) = [c for c in final if c.cmd == "CMD"]
    assert entry.json and entry.value == ("memgate",)
    assert cmd.json and cmd.value[0] == "serve" and str(port) in cmd.value


def ignored(rules: list[str], path: str) -> bool:
    """Docker's .dockerignore semantics: the last matching pattern wins, `!` re-includes,
    `**` spans directories, and a pattern that matches a directory matches what is in it."""
    verdict = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for raw in rules:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        rx = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        rx = rx.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            verdict = not negate
    return verdict


def test_dockerignore_keeps_the_context_to_what_is_copied() -> None:
    """The build context has what the Dockerfile copies and nothing a checkout grows:
    .venv, var/, captures, .git, .env, tests, byte code."""
    rules = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    sources = [src for c in dockerfile() if c.cmd == "COPY" and not c.flags
               for src in c.value[:-1]]
    needed = {"pyproject.toml", "README.md", "gateway/__init__.py", "gateway/wire/base.py",
              "rules/gateway.yaml", "rules/models.yaml", "samples/chat_short.json"}
    assert set(sources) == {"pyproject.toml", "README.md", "gateway", "rules", "samples"}
    for path in sorted(needed):
        assert not ignored(rules, path), path
    for path in (".venv/bin/python", "var/capture/x.json", "var/memory.db", "captures/a.json",
                 ".git/HEAD", ".env", "tests/test_proxy.py", "deploy/docker-compose.yml",
                 "gateway/__pycache__/app.cpython-311.pyc", "rules/__pycache__/x.pyc",
                 "memgate.egg-info/PKG-INFO", ".hypothesis/examples/x", "shared/data/x"):
        assert ignored(rules, path), path


def test_dockerignore_matcher_follows_docker() -> None:
    """The matcher the test above relies on, on Docker's documented examples."""
    assert ignored(["*/temp*"], "somedir/temporary.txt")
    assert not ignored(["*/temp*"], "temp")
    assert ignored(["**/*.go"], "a/b/c.go") and ignored(["**/*.go"], "c.go")
    assert not ignored(["*.md", "!README.md"], "README.md")
    assert ignored(["*", "!gateway/", "**/__pycache__"], "gateway/__pycache__/x.pyc")
    assert ignored(["temp?"], "temp1") and not ignored(["temp?"], "temp12")


# --------------------------------------------------------------------------- config


def effective(path: Path) -> dict[str, Any]:
    text = path.read_text().replace("/app/rules/", f"{ROOT}/rules/")
    rules = build_rules(yaml.safe_load(text), str(path), base_dir=path.parent)
    out = effective_config(rules)
    for volatile in ("source", "models_path", "carry_path"):
        out.pop(volatile, None)
    return out


def leaf_diff(a: Any, b: Any, prefix: str = "") -> set[str]:
    """The dotted keys where two effective configs differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k for key in a.keys() | b.keys()
                for k in leaf_diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)}
    return set() if a == b else {prefix}


def test_deploy_config_is_the_shipped_one_scaled_out() -> None:
    """deploy/config/gateway.yaml is rules/gateway.yaml with the scale-out changes only
    (Redis state, PostgreSQL store, listeners on all interfaces, the admin port): a value
    changed in the shipped config and not here fails this test."""
    shipped, deployed = effective(ROOT / "rules" / "gateway.yaml"), effective(
        DEPLOY / "config" / "gateway.yaml")
    # dotted keys, whether the effective config spells listen.host or listen_host
    diff = {re.sub(r"^listen_", "listen.", k) for k in leaf_diff(shipped, deployed)}
    scale_out = {"store.backend", "state.backend", "listen.host", "listen.admin_host",
                 "listen.admin_port"}
    assert diff == scale_out, ("deploy/config/gateway.yaml drifted from rules/gateway.yaml: "
                               f"{sorted(diff ^ scale_out)}")
    raw = deploy_config()
    assert (raw["store"]["backend"], raw["state"]["backend"]) == ("postgres", "redis")
    assert raw["listen"] == {"host": "0.0.0.0", "port": 8080, "admin_port": 9091,
                             "admin_host": "0.0.0.0"}


async def deploy_gateway(aiohttp_server: Any, tmp_path: Path, env: dict[str, str]) -> str:
    """The deploy config (its /app/rules paths pointed at this checkout) served."""
    import io

    from gateway.config.rules import load_rules
    from gateway.observe import logging as mglog
    from gateway.proxy.app import create_app

    cfg = tmp_path / "gateway.yaml"
    cfg.write_text((DEPLOY / "config" / "gateway.yaml").read_text().replace(
        "/app/rules/", f"{ROOT}/rules/"))
    mglog.configure("json", "info", stream=io.StringIO())
    app = create_app(load_rules(cfg, env), cfg, env, watch_interval_s=60)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def readyz(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/readyz") as r:
        return r.status, await r.json()


async def test_readyz_of_the_deploy_config_reflects_redis_and_postgres(
    aiohttp_server: Any, tmp_path: Path, upstream: Any
) -> None:
    """The Kubernetes readiness probe's answer under the deploy config: with Redis and
    PostgreSQL unreachable it says `degraded` and which backend is down and why (and stays
    200: forwarding works, and a shared outage must not empty the Service); with both up,
    `ready`, the store opened by the probe itself."""
    from tests.conftest import PG_DSN, pg_schema

    dead = {"MEMGATE_UPSTREAM": upstream.url, "MEMGATE_ANTHROPIC_UPSTREAM": upstream.url,
            "MEMGATE_REDIS_URL": "redis://127.0.0.1:1/0",
            "MEMGATE_STORE_DSN": "postgresql://memgate:pw@127.0.0.1:1/memgate"}
    code, body = await readyz(await deploy_gateway(aiohttp_server, tmp_path, dead))
    assert code == 200 and body["status"] == "degraded"
    state, store = body["backends"]["state"], body["backends"]["store"]
    assert (state["backend"], state["status"]) == ("redis", "down")
    assert (store["backend"], store["status"], store["opened"]) == ("postgres", "down", False)
    assert store["last_error"] and "pw" not in str(body)

    async with pg_schema() as (schema, _):
        live = {**dead, "MEMGATE_REDIS_URL": "redis://127.0.0.1:6379/0",
                "MEMGATE_STORE_DSN": f"{PG_DSN}?options=-csearch_path%3D{schema}"}
        (tmp_path / "live").mkdir()
        url = await deploy_gateway(aiohttp_server, tmp_path / "live", live)
        code, body = await readyz(url)
        assert code == 200 and body["status"] == "ready", body
        assert body["backends"]["store"]["opened"] is True
        assert body["backends"]["state"]["status"] == "ok"
