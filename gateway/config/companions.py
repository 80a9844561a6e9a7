"""The files a config names beside itself, and the model map read from one of them.

`tokens.models_file` (the model map) and `memory.carry.rules_file` (the carry patterns,
read by `gateway.config.carry`) are found the same way: as named (relative to the
config's folder), else beside the config, else shipped with memgate; a refusal while
loading one names the config key that chose it. The model map says, per model glob,
which tokenizer encoding counts its tokens and how large its context window is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config.reader import Reader, read_yaml
from gateway.config.resources import shipped_file
from gateway.config.schema import ModelInfo
from gateway.config.validate import check_int, check_str
from gateway.errors import RulesError

MODEL_SECTIONS: dict[str, frozenset[str]] = {  # the models file (tokens.models_file)
    "": frozenset({"models", "default"}),
    "models[]": frozenset({"match", "encoding", "context_window"}),
    "default": frozenset({"encoding", "context_window"}),
}


def companion_path(r: Reader, data: dict[str, Any], prefix: str, name: str, default: str,
                   base_dir: Path) -> Path:
    """A file the config names (relative to the config's folder). Not named: the one of
    that name beside the config, else the one shipped with memgate, so a config copied
    to another folder keeps working; named but absent: refused with the key and path."""
    given: str | None = r.get(data, prefix, name, check_str(), None)
    if given is not None:
        path = (base_dir / given).resolve()
        if not path.is_file():
            hint = "" if Path(given).is_absolute() else (
                f"a relative {name} is read from the config's folder; ")
            raise r.fail(f"{prefix}.{name}", f"{path} does not exist ({hint}leave the key "
                         "out for the file shipped with memgate)")
        return path
    beside = base_dir / default
    if beside.is_file():
        return beside.resolve()
    shipped = shipped_file("rules", default)
    if shipped is None:
        raise r.fail(f"{prefix}.{name}", f"no {default} beside the config ({beside}) and "
                     "none shipped with this install: set the key")
    return shipped


def load_companion(r: Reader, key: str, path: Path, load: Callable[[Path], Any]) -> Any:
    """load(path), its errors naming the config key that chose the file."""
    try:
        return load(path)
    except RulesError as exc:
        if exc.key in ("<file>", "<document>"):  # the file itself, not a key inside it
            raise r.fail(key, f"{path}: {exc.reason}") from None
        raise


def _parse_models(r: Reader, data: Any) -> tuple[tuple[ModelInfo, ...], str, int]:
    t = r.section(data, "")
    infos: list[ModelInfo] = []
    items = t.get("models") or []
    if not isinstance(items, list):
        raise r.fail("models", "must be a list")
    for i, item in enumerate(items):
        key = f"models[{i}]"
        mi = r.section(item, key)
        if "match" not in mi or "encoding" not in mi:
            raise r.fail(key, "needs match and encoding")
        infos.append(
            ModelInfo(
                match=r.get(mi, key, "match", check_str(), ""),
                encoding=r.get(mi, key, "encoding", check_str(), ""),
                context_window=r.get(mi, key, "context_window", check_int(1), 8192),
            )
        )
    dflt = r.section(t.get("default"), "default")
    return (
        tuple(infos),
        r.get(dflt, "default", "encoding", check_str(), "cl100k_base"),
        r.get(dflt, "default", "context_window", check_int(1), 8192),
    )


def load_model_map(r: Reader, tokens: dict[str, Any], base_dir: Path
                   ) -> tuple[Path, tuple[ModelInfo, ...], str, int]:
    """The model map `tokens` (the config's `tokens:` mapping) chooses: its path, its
    entries, and the default encoding and context window of a model no entry matches."""
    path = companion_path(r, tokens, "tokens", "models_file", "models.yaml", base_dir)
    data, lines = load_companion(r, "tokens.models_file", path, read_yaml)
    models, default_encoding, default_window = _parse_models(
        Reader(str(path), lines, MODEL_SECTIONS), data
    )
    return path, models, default_encoding, default_window
