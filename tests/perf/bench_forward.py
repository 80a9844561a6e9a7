"""Building the forwarded body from the client's bytes vs re-serialising it (not a test).

    python -m tests.perf.bench_forward [--repeat 200]

For the sample payloads and a ~700 KB history, each spelled three ways (compact as
the openai/anthropic SDKs and orjson write it; Python's json.dumps default with
", " / ": " and \\u escapes; indented), it times `Wire.build_body` with a plan that
keeps the first item and the last two thirds, against the orjson.dumps of the
same plan's payload that build_body used to be. Both run in turns; the minimum of
the repeats is printed (the steadiest figure on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from gateway.measure.conversation import META_KEY
from gateway.wire import sniff
from gateway.wire.base import Wire
from tests.perf.bench_plan import history

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ("anthropic_long_tools", "chat_long_tools", "responses_long_tools",
           "chat_zh_pinned", "chat_short")


def reserialised(wire: Wire, payload: dict[str, Any], kept: list[int]) -> bytes:
    """What build_body did before: the plan applied to the parse, written by orjson."""
    items = payload[wire.items_key]
    out = []
    for i in kept:
        m = items[i]
        if isinstance(m, dict) and META_KEY in m:
            m = {k: v for k, v in m.items() if k != META_KEY}
        out.append(m)
    return orjson.dumps({**payload, wire.items_key: out})


def fastest(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    return min(ta) * 1e6, min(tb) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    bodies = {n: json.loads((ROOT / "samples" / f"{n}.json").read_text()) for n in SAMPLES}
    bodies["history_3000"] = {"model": "gpt-4o-mini", "messages": history(3000)}
    print(f"{'payload':22} {'spelling':8} {'bytes':>8} {'dumps us':>9} {'bytes us':>9} "
          f"{'ratio':>6}")
    for name, body in bodies.items():
        wire = sniff(body, name)
        n = len(body[wire.items_key])
        kept = [0, *range(n // 3, n)]
        for spelling, raw in (
            ("compact", json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()),
            ("python", json.dumps(body).encode()),
            ("indent", json.dumps(body, indent=1).encode()),
        ):
            payload = orjson.loads(raw)
            meta = META_KEY.encode() in raw
            built = wire.build_body(raw, payload, kept, metadata=meta)
            assert built is not None
            assert orjson.loads(built) == orjson.loads(reserialised(wire, payload, kept))
            repeat = max(5, args.repeat * 40_000 // max(len(raw), 40_000))
            old, new = fastest(partial(reserialised, wire, payload, kept),
                               partial(wire.build_body, raw, payload, kept, metadata=meta),
                               repeat)
            print(f"{name:22} {spelling:8} {len(raw):8} {old:9.0f} {new:9.0f} "
                  f"{new / old:6.1f}")


if __name__ == "__main__":
    main()
