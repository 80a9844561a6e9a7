"""`memgate memory write|search|get|delete`: the memory store the gateway uses, from the
shell: the config's store opened directly, or with --url a running gateway's HTTP memory
API (the same results either way)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson

from gateway.cli.eventloop import run_async
from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE, aiohttp_errors
from gateway.config.resources import default_config
from gateway.config.rules import load_rules
from gateway.errors import CommandError

MEMORY_EPILOG = """\
record fields (POST /v1/memories takes the same JSON):
  every kind     session_id (required), agent_id, tags, memory_id (generated when absent)
  turn           ts (required, ISO 8601 with a timezone) and user_text / assistant_text,
                 or one message as role (user|assistant|system|tool) + text; turn_id
  message        ts, text (required), role, message_id, turn_id
  session        start_ts, end_ts, summary (required), raw_messages_ref
  memory_type    turn | message | session (default: store.write_granularity)

examples:
  memgate memory write '{"memory_type": "turn", "session_id": "s1", "agent_id": "a1",
      "ts": "2026-11-29T10:00:00Z", "role": "user", "text": "budget is 100k"}'
  memgate memory search --session-id s1 --agent-id a1 --query budget
  memgate memory search --url http://127.0.0.1:8080 --cross-session --query budget
  memgate memory delete 5b1f0c...   # one record of this key's tenant

Without --url the store of the config is opened directly; with --url the gateway's HTTP
memory API is asked. Search results are the same either way: every record field plus
score, the share (0..1) of the query's distinct terms the record contains (1 = all of
them; no query: 0), best first, ties in BM25 order (SQLite) / ts_rank (PostgreSQL).
The tenant is the hash of --api-key / $OPENAI_API_KEY: another key's records are never
seen, changed or deleted."""


def _search_body(args: argparse.Namespace, default_top_k: int) -> dict[str, Any]:
    """The POST /v1/memories/search body the search flags describe."""
    try:
        flt: dict[str, Any] = orjson.loads(args.filter) if args.filter else {}
    except orjson.JSONDecodeError as exc:
        raise CommandError(f"--filter: not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(flt, dict):
        raise CommandError("--filter: must be a JSON object", EXIT_USAGE)
    for key in ("agent_id", "session_id", "time_from", "time_to", "memory_type"):
        if getattr(args, key, None) is not None:
            flt[key] = getattr(args, key)
    if args.tag:
        flt["tags"] = args.tag
    body: dict[str, Any] = {"filter": flt, "query": args.query or "",
                            "top_k": args.top_k or default_top_k}
    if args.cross_session:
        body["scope"] = "cross_session"
    return body


def _memory_body(args: argparse.Namespace) -> Any:
    if args.memory_command == "write":
        try:
            return orjson.loads(sys.stdin.buffer.read() if args.json == "-" else args.json)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"the record is not JSON: {exc}", EXIT_USAGE) from None
    return None


async def _memory_http(args: argparse.Namespace, key: str, default_top_k: int) -> Any:
    """The output of one call to a running gateway's memory API (an error answer raises
    CommandError)."""
    import aiohttp
    from yarl import URL

    base = args.url.rstrip("/") + "/v1/memories"
    cmd = args.memory_command
    if cmd == "write":
        method, url, body = "POST", base, _memory_body(args)
    elif cmd == "search":
        method, url, body = "POST", base + "/search", _search_body(args, default_top_k)
    else:
        method, url, body = ("GET" if cmd == "get" else "DELETE",
                             str(URL(base) / args.memory_id), None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.request(
            method, url, headers=headers, data=None if body is None else orjson.dumps(body),
    ) as r:
        raw = await r.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = {"error": {"message": raw[:200].decode("utf-8", "replace")}}
        if r.status >= 400:
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            # no such memory or a gateway that cannot serve: the command failed (1); a
            # request it refuses (a record, a filter, a key): the user's to fix (2)
            failed = r.status == 404 or r.status >= 500
            raise CommandError(f"the gateway answered {r.status}: {msg}",
                               EXIT_FAILED if failed else EXIT_USAGE)
    return data["results"] if cmd == "search" else data


def cmd_memory(args: argparse.Namespace) -> int:
    """memgate memory write|search|get|delete: the store the gateway uses, from the shell
    (or, with --url, a running gateway's HTTP memory API)."""
    from gateway.memory.session import tenant_of
    from gateway.memory.store import StoreError, build_filter, build_record, make_store

    for common in ("config", "api_key", "url"):  # given before or after the subcommand
        setattr(args, common, getattr(args, common, None))
    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    key = args.api_key or env.get("OPENAI_API_KEY", "")
    tenant = tenant_of({"Authorization": f"Bearer {key}"}, rules.tenants)
    if tenant is None and not args.url:
        raise CommandError("whose records? give --api-key or $OPENAI_API_KEY "
                           "(or map keyless callers with tenants.anonymous)", EXIT_USAGE)

    async def run() -> int:
        out: Any
        if args.url:
            out = await _memory_http(args, key, rules.store.search_top_k)
            print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
            return 0
        assert tenant is not None
        store = make_store(rules.store, env)
        await store.open()
        try:
            cmd = args.memory_command
            if cmd == "write":
                rec = build_record(_memory_body(args), tenant, rules.store)
                await store.write([rec], exists_ok=False)  # an id held already: exit 2
                out = {"memory_id": rec.memory_id, "truncated": rec.truncated}
            elif cmd == "search":
                body = _search_body(args, rules.store.search_top_k)
                results = await store.search(build_filter(body, tenant, rules.store))
                out = [r.public(score) for r, score in results]
            elif cmd == "delete":
                if not await store.delete(tenant, args.memory_id):
                    raise CommandError(f"no memory {args.memory_id!r} for this key",
                                       EXIT_FAILED)
                out = {"deleted": True}
            else:
                got = await store.get(tenant, args.memory_id)
                if got is None:
                    raise CommandError(f"no memory {args.memory_id!r} for this key",
                                       EXIT_FAILED)
                out = got.public()
        finally:
            await store.close()
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0

    try:
        return run_async(run)
    except StoreError as exc:  # a store that cannot serve failed the command; else the input
        raise CommandError(exc.message, EXIT_FAILED if exc.status >= 500 else EXIT_USAGE,
                           ) from None
    except ValueError as exc:  # an invalid --url
        raise CommandError(str(exc), EXIT_USAGE) from None
    except (OSError, aiohttp_errors()) as exc:
        if not args.url:
            raise  # a file of the config's store: main names it
        raise CommandError(f"cannot reach {args.url}: {exc}", EXIT_FAILED) from None


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memory` and its subcommands; the common flags work before and after the subcommand
    (a flag given after it wins)."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument("--config", help="YAML config whose store to open (no --url)")
    common.add_argument("--api-key", help="whose records (default $OPENAI_API_KEY)")
    common.add_argument("--url", help="a running gateway's base URL: use its HTTP memory API "
                                      "instead of opening the store")
    fmt = argparse.RawDescriptionHelpFormatter
    mem = sub.add_parser("memory", help="write / search / get / delete memory records",
                         parents=[common], epilog=MEMORY_EPILOG, formatter_class=fmt)
    # no set_defaults for the common flags: it would change the actions the subcommands
    # share, and a default set after the subcommand would undo a flag given before it
    mem.set_defaults(func=cmd_memory)
    msub = mem.add_subparsers(dest="memory_command", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = msub.add_parser(
            name, help=text, description=text, parents=[common], epilog=MEMORY_EPILOG,
            formatter_class=fmt)
        return parser

    mw = add("write", "write one record (JSON as for POST /v1/memories)")
    mw.add_argument("json", help="the record as JSON, or - for stdin (fields: see below)")
    ms = add("search", "search (as POST /v1/memories/search)")
    ms.add_argument("--filter", default=None, help='JSON, e.g. {"session_id": "s1"}; the '
                                                   "flags below are merged into it")
    ms.add_argument("--session-id", dest="session_id", default=None,
                    help="required unless --cross-session")
    ms.add_argument("--agent-id", dest="agent_id", default=None,
                    help="only records of this agent")
    ms.add_argument("--time-from", dest="time_from", default=None,
                    help="ISO 8601 with a timezone, e.g. 2026-11-29T00:00:00Z")
    ms.add_argument("--time-to", dest="time_to", default=None,
                    help="up to this time (ISO 8601; store.time_boundary says if included)")
    ms.add_argument("--tag", action="append", default=None,
                    help="a record must carry one of the --tag values (repeatable)")
    ms.add_argument("--memory-type", dest="memory_type", default=None,
                    choices=["turn", "message", "session"], help="only records of this kind")
    ms.add_argument("--query", default=None, help="full-text query (ranks the results)")
    ms.add_argument("--top-k", type=int, default=None, help="1..100 (store.search_top_k)")
    ms.add_argument("--cross-session", action="store_true",
                    help="search every session of this key's tenant")
    mg = add("get", "one record by memory_id")
    mg.add_argument("memory_id", help="the id write printed")
    md = add("delete", "delete one record by memory_id (this key's tenant only)")
    md.add_argument("memory_id", help="the id write printed (only your own records)")

