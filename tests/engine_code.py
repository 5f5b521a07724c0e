"""SGLang's own DFlash parsing code, executed: the functions that turn a drafter's config.json
into each draft layer's attention, taken from SGLang's released wheel on PyPI (downloaded once
with pip into the test cache, only five source files kept, each checked against its pinned
sha256) and run here unchanged.

What runs (sglang 0.5.23; the audit of issue 42 read the same functions at commit 003b23d):
  - python/sglang/srt/models/dflash.py: `_get_dflash_layer_attention_params` (layer type ->
    sliding window size and AttentionType) and `_get_dflash_attention_type`;
  - python/sglang/srt/speculative/dflash_utils.py: `get_dflash_layer_types`,
    `get_dflash_attention_sliding_window_size` (window_left = sliding_window - 1),
    `parse_dflash_draft_config` with its helpers (target_layer_ids, block_size, mask_token_id);
  - python/sglang/srt/layers/radix_attention.py: `AttentionType`;
  - python/sglang/srt/layers/attention/flashattention_backend.py: the statements of
    `FlashAttentionBackend.forward_extend` and `forward_decode` that compute `causal` and
    `window_size` from the layer (its (left, right) window as flash-attn takes it);
  - python/sglang/srt/models/qwen3.py: `Qwen3ForCausalLM.set_dflash_layers_to_capture` (the
    target captures "before layer id + 1").
Only the functions are extracted (with the standard-library imports of their modules): importing
the modules would need CUDA kernels. vLLM's parsing is not run this way (its wheel is 239 MB and
its sdist builds CUDA extensions to make its metadata): tests/dflash_serving.py follows it at a
named commit, quoting the lines (tests/README.md says so).
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SGLANG_VERSION = "0.5.23"
SOURCES = {
    "dflash": "sglang/srt/models/dflash.py",
    "utils": "sglang/srt/speculative/dflash_utils.py",
    "radix": "sglang/srt/layers/radix_attention.py",
    "fa": "sglang/srt/layers/attention/flashattention_backend.py",
    "qwen3": "sglang/srt/models/qwen3.py",
}
# The files as released in 0.5.23 (the same in every platform's wheel): the code these tests run is
# exactly the code that was read, and a changed file is a failure, never a silent new rule.
SHA256 = {
    "dflash": "1c8307ba7f63fd41f53435fbdabdad8c9e9a04847bef4959f1f8fc16ea6db0ae",
    "utils": "72270b7d4e01012e4b0d04b283db0f57120be37ea0c94c820056ad9a5a9a0d5a",
    "radix": "7d04b60884d94c03cd43aeb04af3e9a57b6a068faf7378311d4ecc960260ac69",
    "fa": "a7b8d205742765e12bf0bad48b151007258736e31f6c97a03725cac6ca2c1d17",
    "qwen3": "bc6b5d40731d21d9be6ba287fd9983810ca7998f2ff394a251bc6ee357ad1121",
}
DOWNLOAD_TIMEOUT_S = 900  # a 39 MB wheel; pip's own retries included


class EngineCodeUnavailable(RuntimeError):
    """The engine's release could not be had (the registry unreachable): the caller skips."""


def cache_dir() -> Path:
    root = Path(os.environ.get("LAUNCH_CACHE") or Path.home() / ".cache" / "launch-tests")
    root.mkdir(parents=True, exist_ok=True)
    return root


def sglang_sources(cache: Path | None = None) -> Path:
    """A directory with SOURCES of sglang==SGLANG_VERSION and the wheel's sha256, made once (under a
    lock, so parallel test workers download it once) and reused."""
    dest = (cache or cache_dir()) / f"sglang-{SGLANG_VERSION}-sources"
    if (dest / "wheel.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "wheel.json").is_file():
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                   "-d", tmp, f"sglang=={SGLANG_VERSION}"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise EngineCodeUnavailable(f"pip download sglang=={SGLANG_VERSION} timed out") from None
            wheels = sorted(Path(tmp).glob("sglang-*.whl"))
            if done.returncode or not wheels:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise EngineCodeUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: {last}")
            staged = Path(tmp) / "sources"
            with zipfile.ZipFile(wheels[0]) as whl:
                for rel in SOURCES.values():
                    (staged / rel).parent.mkdir(parents=True, exist_ok=True)
                    (staged / rel).write_bytes(whl.read(rel))
            digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
            (staged / "wheel.json").write_text(json.dumps({"wheel": wheels[0].name, "sha256": digest}))
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(staged, dest)
    return dest


def _stdlib_imports(tree: ast.Module) -> list[ast.stmt]:
    def stdlib(name: str | None) -> bool:
        return bool(name) and name != "__future__" and name.split(".")[0] in sys.stdlib_module_names

    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Import) and all(stdlib(a.name) for a in node.names):
            keep.append(node)
        elif isinstance(node, ast.ImportFrom) and not node.level and stdlib(node.module):
            keep.append(node)
    return keep


def _segment(lines: list[str], node: ast.stmt) -> str:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return textwrap.dedent("".join(lines[first - 1:node.end_lineno]))


def _top_level(path: Path, names: set[str]) -> str:
    """The module's standard-library imports and its top-level definitions (def, class, NAME = ...)
    named in `names`, as source text; every name must be there."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    parts = [_segment(lines, n) for n in _stdlib_imports(tree)]
    found = set()
    for node in tree.body:
        name = getattr(node, "name", None)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if name in names:
            parts.append(_segment(lines, node))
            found.add(name)
    missing = names - found
    if missing:
        raise LookupError(f"{path}: no top-level {', '.join(sorted(missing))} (SGLang moved its code?)")
    return "\n".join(parts)


def _method(path: Path, cls: str, method: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    raise LookupError(f"{path}: no {cls}.{method}")


def _assignments(path: Path, cls: str, method: str, targets: tuple[str, ...]) -> str:
    """The first run of statements of cls.method that assign `targets` (an `if` that assigns one
    counts), in source order, as source text."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    fn = _method(path, cls, method)

    def assigns(node: ast.stmt) -> set[str]:
        return {t.id for sub in ast.walk(node) if isinstance(sub, ast.Assign)
                for t in sub.targets if isinstance(t, ast.Name)}

    picked: list[ast.stmt] = []
    for node in fn.body:  # the first run of statements that assigns them all
        if assigns(node) & set(targets):
            picked.append(node)
        elif picked and {t for n in picked for t in assigns(n)} >= set(targets):
            break
    if {t for n in picked for t in assigns(n)} < set(targets):
        raise LookupError(f"{path}: {cls}.{method} no longer assigns {targets}")
    return "".join(_segment(lines, n) for n in picked)


class SGLangCode:
    """SGLang's functions, executed on the config object it would get (transformers' AutoConfig)."""

    def __init__(self, sources: Path) -> None:
        self.sources = sources
        self.wheel = json.loads((sources / "wheel.json").read_text())
        path = {k: sources / rel for k, rel in SOURCES.items()}
        for key, file in path.items():
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            if digest != SHA256[key]:
                raise RuntimeError(f"{SOURCES[key]} of sglang=={SGLANG_VERSION} ({self.wheel['wheel']}) has sha256 "
                                   f"{digest}, not the {SHA256[key]} these tests were written against")
        # a real module: dataclasses look their class's module up in sys.modules
        module = types.ModuleType(f"_sglang_{SGLANG_VERSION.replace('.', '_')}_dflash")
        sys.modules[module.__name__] = module
        ns: dict[str, Any] = module.__dict__
        code = "\n\n".join([
            "from __future__ import annotations",
            _top_level(path["radix"], {"AttentionType"}),
            _top_level(path["utils"], {"DEFAULT_DFLASH_MASK_TOKEN", "logger", "build_target_layer_ids",
                                       "get_dflash_layer_types", "get_dflash_attention_sliding_window_size",
                                       "_cfg_get", "_get_text_config", "_get_dflash_config",
                                       "is_nemotron_35_draft_config", "_parse_optional_int", "DFlashDraftConfig",
                                       "parse_dflash_draft_config"}),
            _top_level(path["dflash"], {"_get_dflash_attention_type", "_get_dflash_layer_attention_params"}),
        ])
        exec(compile(code, "<sglang dflash parsing>", "exec"), ns)  # noqa: S102 - the engine's own code
        self.ns = ns
        self.AttentionType = ns["AttentionType"]
        self._fa = {m: compile(_assignments(path["fa"], "FlashAttentionBackend", m,
                                            ("is_swa_layer", "causal", "window_size")), f"<sglang fa {m}>", "exec")
                    for m in ("forward_extend", "forward_decode")}
        capture = ast.Module(body=[_method(path["qwen3"], "Qwen3ForCausalLM", "set_dflash_layers_to_capture")],
                             type_ignores=[])
        cap_ns: dict[str, Any] = {}
        exec(compile(ast.unparse(capture), "<sglang qwen3 capture>", "exec"), cap_ns)  # noqa: S102
        self._capture = cap_ns["set_dflash_layers_to_capture"]

    def layer_attention(self, config: Any, i: int) -> tuple[int, Any]:
        """(sliding_window_size as SGLang stores it: window_left, or -1; AttentionType) of draft layer i."""
        return self.ns["_get_dflash_layer_attention_params"](config, i)

    def flash_window(self, sliding_window_size: int, attn_type: Any, mode: str = "forward_extend"
                     ) -> tuple[bool, tuple[int, int]]:
        """(causal, window_size) as SGLang's FlashAttention backend computes them for the layer."""
        layer = SimpleNamespace(sliding_window_size=sliding_window_size, attn_type=attn_type, is_cross_attention=False)
        ns = {"layer": layer, "AttentionType": self.AttentionType}
        exec(self._fa[mode], ns)  # noqa: S102
        return bool(ns["causal"]), tuple(ns["window_size"])

    def draft_config(self, config: Any) -> Any:
        return self.ns["parse_dflash_draft_config"](draft_hf_config=config)

    def target_capture(self, target_layer_ids: list[int]) -> list[int]:
        """Where the target captures: Qwen3ForCausalLM.set_dflash_layers_to_capture on a stand-in
        model (the last pipeline rank), its `model.layers_to_capture` ("before layer i")."""
        me = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
        self._capture(me, list(target_layer_ids))
        return list(me.model.layers_to_capture)
