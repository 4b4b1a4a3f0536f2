"""Compiled builds of pure-Python modules, used only when they match the sources present.

`pip install` compiles a few hot groups of modules with mypyc (see `setup.py`, which reads
`COMPILED_GROUPS` from this file): each group becomes one shared library plus one extension
module per source module, installed beside the `.py` files, and Python imports an extension
before a source of the same name. A package's `__init__` calls `use_compiled_if_current` for
its group: the compiled modules are kept only if every one of them imports and was compiled
from the source now beside it (the hash compiled into it as `COMPILED_FROM`). Otherwise (a
source edited after the build, a build for another interpreter, or `SHARDGATE_PURE=1` in the
environment) the whole group is loaded from its sources, so stale compiled code never runs and
the pure Python is always a working fallback. A group goes one way or the other as a whole,
since its compiled modules call each other directly.

This module runs standalone too (setup.py executes it before the package exists): no imports
from the package.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Any

log = logging.getLogger(__name__)

#: Set to "1" to run the Python sources even where compiled builds are installed, and to skip
#: compiling at `pip install` time.
PURE_ENV = "SHARDGATE_PURE"

#: group (shared library) name -> (package, modules compiled, in import order, modules only
#: read by the type checker while compiling). The order matters: a module is loaded after
#: those it imports.
COMPILED_GROUPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "shardgate.protocols.mqtt.codec_native": (
        "shardgate.protocols.mqtt",
        ("wire", "properties", "decoders", "parser", "encoders"),
        ("packets", "errors"),
    ),
    "shardgate.core.topics_native": ("shardgate.core", ("topics", "trie"), ("errors",)),
    "shardgate.storage.journal.framing_native": ("shardgate.storage.journal", ("framing",), ()),
    "shardgate.storage.archive.footer_native": ("shardgate.storage.archive", ("footer",), ()),
}

#: Hand-written C extension modules (hot loops that mypyc cannot make fast enough: per-byte
#: parsing that releases the GIL), module name -> its C source in the repository. `setup.py`
#: builds each one (optional, like the groups above) with the SHA-256 of its source compiled in
#: as `SOURCE_HASH`; `load_c_extension` uses a build only when that matches the source present.
#: Every one has a pure-Python equivalent that runs when it is not built.
C_EXTENSIONS: dict[str, str] = {
    "shardgate.storage.journal.scan_native": "storage/journal/scan_native.c",
    "shardgate.storage.archive.records_native": "storage/archive/records_native.c",
    "shardgate.storage.archive.typed_native": "storage/archive/typed_native.c",
}

# group -> whether its compiled build is in use (filled as packages are imported).
_in_use: dict[str, bool] = {}


def compiled_in_use() -> dict[str, bool]:
    """For each group imported so far, whether its compiled build runs (False: pure Python)."""
    return dict(_in_use)


def load_c_extension(name: str, directory: str) -> Any:
    """The C extension module `name` (a key of C_EXTENSIONS) built from the source now in
    `directory` (its package's folder), or None: not built, built from another version of its
    source (an edited `.c` after `pip install -e .`), or `SHARDGATE_PURE=1`. A wheel ships no
    C source: its build is then trusted. The result is recorded for `compiled_in_use`."""
    module = None
    reason = None
    if os.environ.get(PURE_ENV) == "1":
        reason = f"{PURE_ENV}=1"
    else:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            reason = f"not built ({exc})"
        else:
            source = os.path.join(directory, os.path.basename(C_EXTENSIONS[name]))
            if os.path.exists(source) and getattr(module, "SOURCE_HASH", None) != source_hash(
                source
            ):
                module, reason = None, f"{os.path.basename(source)} changed since it was built"
    _in_use[name] = module is not None
    if reason is not None and os.environ.get(PURE_ENV) != "1" and "not built" not in reason:
        log.warning("%s: running the Python equivalent (%s); `pip install -e .` rebuilds it",
                    name, reason)
    return module


def is_compiled(module: object) -> bool:
    """Whether `module` was loaded from an extension module rather than Python source."""
    path = getattr(module, "__file__", None) or ""
    return path.endswith(tuple(EXTENSION_SUFFIXES))


def source_hash(path: str) -> str:
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def use_compiled_if_current(group: str, directory: str) -> bool:
    """Import the modules of `group` (a key of COMPILED_GROUPS) from `directory`, their
    package's folder: compiled if a current build is there, else from their sources. Returns
    whether the compiled build is used."""
    package, modules, _ = COMPILED_GROUPS[group]
    built = any(
        os.path.exists(os.path.join(directory, name + suffix))
        for name in modules for suffix in EXTENSION_SUFFIXES
    )
    if not built:  # a pure install: plain imports find the sources
        _in_use[group] = False
        return False
    reason = _why_not_compiled(package, directory, modules)
    if reason is None:
        _in_use[group] = True
        return True
    _load_sources(package, directory, modules)
    _in_use[group] = False
    if os.environ.get(PURE_ENV) != "1":
        log.warning(
            "%s: running the Python sources (%s); `pip install -e .` rebuilds it", group, reason
        )
    return False


def _why_not_compiled(package: str, directory: str, modules: Sequence[str]) -> str | None:
    if os.environ.get(PURE_ENV) == "1":
        return f"{PURE_ENV}=1"
    try:
        for name in modules:
            module = importlib.import_module(f"{package}.{name}")
            if not is_compiled(module):
                return f"{name} has no compiled build"
            if getattr(module, "COMPILED_FROM", None) != source_hash(
                os.path.join(directory, name + ".py")
            ):
                return f"{name}.py changed since it was compiled"
    except ImportError as exc:
        return f"the compiled build does not load: {exc}"
    return None


def _load_sources(package: str, directory: str, modules: Sequence[str]) -> None:
    """Replace the group's modules by ones executed from their `.py` files. In order, each
    registered before the next runs, so their imports of each other find the sources too."""
    for name in modules:
        sys.modules.pop(f"{package}.{name}", None)
    parent = sys.modules[package]
    for name in modules:
        qualified = f"{package}.{name}"
        spec = importlib.util.spec_from_file_location(
            qualified, os.path.join(directory, name + ".py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(qualified, None)
            raise
        setattr(parent, name, module)
