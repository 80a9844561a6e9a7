"""Azure OpenAI routes through the gateway, driven by the real `AzureOpenAI` client (and
the plain `OpenAI` client on Azure's v1 API): measured, evicted, routed by config."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import CHAT_REPLY, GatewayFactory, Upstream, responses_object, sse_chunks

EVICT = {"enable_eviction": True,
         "budget": {"max_tokens": 600, "max_chars": None, "max_messages": None,
                    "max_turns": None}}


@pytest.fixture
async def azure(aiohttp_server: Any) -> Upstream:
    """A stand-in for https://<resource>.openai.azure.com: records every request and
    answers chat completions (plain or streamed) and responses."""
    rec = Upstream(server=None)  # type: ignore[arg-type]

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec.received.append({"method": request.method, "path": request.path_qs, "raw": raw,
                             "headers": request.headers.copy()})
        body = orjson.loads(raw)
        if request.path.endswith("/responses"):
            return web.json_response(responses_object("hi from azure"),
                                     dumps=lambda o: orjson.dumps(o).decode())
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in sse_chunks(["hi", " from", " azure"]):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        return web.json_response(CHAT_REPLY, dumps=lambda o: orjson.dumps(o).decode())

    app = web.Application(client_max_size=1 << 26)
    app.router.add_route("*", "/{tail:.*}", answer)
    rec.server = await aiohttp_server(app)
    return rec


def routes(azure: Upstream, default: Upstream) -> list[dict[str, Any]]:
    """The config's upstreams: Azure paths to the Azure resource, the rest to OpenAI."""
    return [{"name": "azure", "base_url": azure.url, "paths": ["/openai/*"]},
            {"name": "openai", "base_url": default.url, "paths": ["/*"]}]


def history(turns: int = 15) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t} " + "words " * 40},
                 {"role": "assistant", "content": f"answer {t}"}]
    msgs.append({"role": "user", "content": "And now?"})
    return msgs


async def test_azure_client_chat_is_measured_and_evicted(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream
) -> None:
    """AzureOpenAI chat.completions: /openai/deployments/{name}/chat/completions is measured
    and evicted like /v1/chat/completions, sent to the upstream the config names with its
    path, api-version query and api-key header as the client sent them."""
    gw = await gateway(memory=EVICT, upstreams=routes(azure, upstream))
    msgs = history()
    client = openai.AsyncAzureOpenAI(azure_endpoint=gw.url, api_key="x",
                                     api_version="2024-10-21", max_retries=0)
    async with client:
        resp = await client.chat.completions.create(model="prod-4o", messages=msgs)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == "hello from upstream"
    assert upstream.received == []  # nothing went to the default upstream
    got = azure.received[-1]
    assert got["path"] == "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21"
    assert got["headers"]["api-key"] == "x"
    sent = orjson.loads(got["raw"])["messages"]
    assert sent[0] == msgs[0] and sent[-1] == msgs[-1] and len(sent) < len(msgs)
    ev = (await gw.wait_mem(1))[-1]
    assert ev["model"] == "prod-4o" and ev["hist_msgs"] == str(len(msgs))
    assert ev["mode"] == "on" and int(ev["dropped"]) == len(msgs) - len(sent) > 0
    assert "api" not in ev  # the chat completions wire, like /v1/chat/completions


async def test_azure_stream_and_shadow_bytes_unchanged(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream
) -> None:
    """Eviction off (shadow): the deployment route is measured (would_drop) and the
    client's bytes reach Azure unchanged; a streamed answer is relayed whole."""
    gw = await gateway(memory={**EVICT, "enable_eviction": False},
                       upstreams=routes(azure, upstream))
    raw = orjson.dumps({"model": "prod-4o", "messages": history()}, option=orjson.OPT_INDENT_2)
    url = f"{gw.url}/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21"
    async with aiohttp.ClientSession() as s, s.post(
            url, data=raw, headers={"api-key": "x", "Content-Type": "application/json"}) as r:
        assert r.status == 200
    assert azure.received[-1]["raw"] == raw
    ev = (await gw.wait_mem(1))[-1]
    assert ev["mode"] == "shadow" and int(ev["would_drop"]) > 0
    client = openai.AsyncAzureOpenAI(azure_endpoint=gw.url, api_key="x",
                                     api_version="2024-10-21", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(model="prod-4o", messages=history(),  # type: ignore[arg-type]
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "hi from azure"
    ev = (await gw.wait_mem(2))[-1]
    assert ev["status"] == "200" and "stream" not in ev


async def test_deployment_name_is_the_model_without_one_in_the_body(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream
) -> None:
    """A body without `model` is budgeted and counted for the deployment's name (which
    also picks the upstream when the config routes by model)."""
    ups = [{"name": "azure-4o", "base_url": azure.url, "paths": ["/openai/*"],
            "models": ["gpt-4o*"]},
           {"name": "openai", "base_url": upstream.url, "paths": ["/*"]}]
    gw = await gateway(memory=EVICT, upstreams=ups)
    body = orjson.dumps({"messages": history()})
    url = f"{gw.url}/openai/deployments/gpt-4o-eu/chat/completions?api-version=2024-10-21"
    async with aiohttp.ClientSession() as s, s.post(url, data=body,
                                                    headers={"api-key": "x"}) as r:
        assert r.status == 200
    assert len(azure.received) == 1 and upstream.received == []
    ev = (await gw.wait_mem(1))[-1]
    assert ev["model"] == "gpt-4o-eu" and int(ev["dropped"]) > 0


@pytest.mark.parametrize("v1", [True, False])
async def test_azure_responses_routes(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream, v1: bool
) -> None:
    """Responses on Azure: /openai/v1/responses (the v1 API, plain OpenAI client) and
    /openai/responses?api-version=... (AzureOpenAI client) are measured and evicted."""
    gw = await gateway(memory=EVICT, upstreams=routes(azure, upstream))
    items: list[dict[str, Any]] = [
        {"role": m["role"], "content": m["content"]} for m in history() if m["role"] != "system"]
    client: openai.AsyncOpenAI
    if v1:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/openai/v1/", api_key="x", max_retries=0)
        want = "/openai/v1/responses"
    else:
        client = openai.AsyncAzureOpenAI(azure_endpoint=gw.url, api_key="x",
                                         api_version="2025-03-01-preview", max_retries=0)
        want = "/openai/responses?api-version=2025-03-01-preview"
    async with client:
        resp = await client.responses.create(model="prod-4o", input=items)  # type: ignore[arg-type]
    assert resp.output_text == "hi from azure"
    assert azure.received[-1]["path"] == want
    sent = orjson.loads(azure.received[-1]["raw"])["input"]
    assert sent[-1] == items[-1] and len(sent) < len(items)
    ev = (await gw.wait_mem(1))[-1]
    assert ev["api"] == "openai_responses" and int(ev["dropped"]) == len(items) - len(sent)


async def test_azure_v1_chat_completions(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream
) -> None:
    """Azure's v1 API chat completions (/openai/v1/chat/completions, no api-version) is
    measured and evicted."""
    gw = await gateway(memory=EVICT, upstreams=routes(azure, upstream))
    msgs = history()
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/openai/v1/", api_key="x",
                                  max_retries=0) as client:
        await client.chat.completions.create(model="prod-4o", messages=msgs)  # type: ignore[arg-type]
    assert azure.received[-1]["path"] == "/openai/v1/chat/completions"
    sent = orjson.loads(azure.received[-1]["raw"])["messages"]
    assert len(sent) < len(msgs)
    ev = (await gw.wait_mem(1))[-1]
    assert int(ev["dropped"]) == len(msgs) - len(sent)


async def test_gateway_key_injected_as_api_key(
    gateway: GatewayFactory, upstream: Upstream, azure: Upstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """api_key_header: api-key injects the gateway's Azure key in Azure's header, in place
    of the key the client sent (in api-key or Authorization)."""
    monkeypatch.setenv("MEMGATE_TEST_AZURE_KEY", "azure-secret")
    ups = routes(azure, upstream)
    ups[0].update(api_key_env="MEMGATE_TEST_AZURE_KEY", api_key_header="api-key")
    allowed = hashlib.sha256(b"client-key").hexdigest()  # an injected key serves listed clients
    gw = await gateway(upstreams=ups, tenants={"client_keys_sha256": [allowed]})
    client = openai.AsyncAzureOpenAI(azure_endpoint=gw.url, api_key="client-key",
                                     api_version="2024-10-21", max_retries=0,
                                     default_headers={"Authorization": "Bearer client-key"})
    async with client:
        await client.chat.completions.create(model="prod-4o", messages=history(1))  # type: ignore[arg-type]
    headers = azure.received[-1]["headers"]
    assert headers.getall("api-key") == ["azure-secret"] and "Authorization" not in headers
