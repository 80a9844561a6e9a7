"""Hot reload: watch the config files, rebuild Rules, swap one reference.

Polling `stat()` (following symlinks) catches in-place writes, atomic renames
and Kubernetes ConfigMap `..data` symlink swaps alike, with no extra
dependency; a change is loaded once it has held for a poll (a file being written is
not read halfway). SIGHUP forces a reload. Files are read and validated on a worker
thread (within config_yaml's bounds): a hostile file costs that thread a few
milliseconds, never the event loop. A file that fails to load, for whatever reason,
is logged once (file, line, key, reason), the last good Rules keeps serving and the
watcher keeps watching.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.config.rules import load_rules
from gateway.config.schema import Rules
from gateway.errors import RulesError

Signature = tuple[Any, ...]


def _signature(paths: list[Path]) -> Signature:
    sig: list[Any] = []
    for p in paths:
        try:
            st = os.stat(p)
            sig.append((os.path.realpath(p), st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size))
        except OSError as exc:
            sig.append((str(p), type(exc).__name__))
    return tuple(sig)


class Reloader:
    """Owns the current Rules of a running gateway."""

    def __init__(
        self,
        config: Path | None,
        env: Mapping[str, str],
        rules: Rules,
        on_swap: Callable[[Rules, Rules], None],
        log: Any,
        interval_s: float = 0.5,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.rules = rules
        self.on_swap = on_swap
        self.log = log
        self.interval_s = interval_s
        self.on_result = on_result or (lambda _result: None)
        self._files = self._files_of(rules)
        self._sig = _signature(self._files)
        self._settling: Signature | None = None  # a change seen, not yet steady for a poll
        self.ok = 0
        self.failed = 0
        self._failing = False
        self.last: tuple[float, str, str | None] | None = None  # /readyz: when, ok|failed, why
        self.last_file: str | None = None  # the file the last reload read (or failed on)
        self.last_trigger: str | None = None  # watch | sighup
        self._lock = asyncio.Lock()  # a SIGHUP during a watch reload waits for it
        self._pending: set[asyncio.Task[bool]] = set()

    def _files_of(self, rules: Rules) -> list[Path]:
        if self.config is None:
            return []
        return [self.config, *(Path(p) for p in (rules.models_path, rules.carry_path) if p)]

    async def reload(self, reason: str) -> bool:
        """Try to load the config now; swap on success. Returns True if swapped."""
        if self.config is None:
            return False
        async with self._lock:
            self._sig = _signature(self._files)
            loop = asyncio.get_running_loop()
            try:
                new = await loop.run_in_executor(None, load_rules, self.config, self.env)
            except Exception as exc:  # noqa: BLE001 - no file may stop the watcher
                err = exc if isinstance(exc, RulesError) else RulesError(
                    str(self.config), None, "<file>", f"{type(exc).__name__}: {exc}"[:300])
                self._refused(reason, err)
                return False
            return self._swap(reason, new)

    def _refused(self, reason: str, exc: RulesError) -> None:
        self.last = (time.time(), "failed", str(exc))
        self.last_file, self.last_trigger = exc.file, reason
        self.failed += 1
        self._failing = True
        self.on_result("failed")
        self.log.error(
            "config_reload", result="failed", trigger=reason, file=exc.file,
            line=exc.line, key=exc.key, reason=exc.reason,
        )

    def _swap(self, reason: str, new: Rules) -> bool:
        self.last = (time.time(), "ok", None)
        self.last_file, self.last_trigger = new.source, reason
        old = self.rules
        self._files = self._files_of(new)
        self._sig = _signature(self._files)
        recovered, self._failing = self._failing, False
        if new == old:
            if recovered:  # back to the config that was serving all along
                self.log.info("config_reload", result="ok", trigger=reason, file=new.source,
                              mode=new.memory.mode, changed=False)
            return False
        self.rules = new
        self.ok += 1
        self.on_result("ok")
        self.on_swap(old, new)
        self.log.info(
            "config_reload", result="ok", trigger=reason, file=new.source,
            mode=new.memory.mode, changed=True,
        )
        return True

    async def check(self) -> bool:
        """Reload if any watched file changed since the last look."""
        if self.config is None:
            return False
        sig = _signature(self._files)
        if sig == self._sig:
            self._settling = None
            return False
        if sig != self._settling:
            # changed since the last look: loaded once it stays so for a poll, so a file
            # caught halfway written (parsing, its later sections still missing) is not
            # applied with those sections at their defaults
            self._settling = sig
            return False
        self._settling = None
        return await self.reload("watch")

    def hup(self) -> None:
        """SIGHUP: reload now (the task is kept until done, so it is not collected)."""
        task = asyncio.ensure_future(self.reload("sighup"))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()
