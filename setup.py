"""Build hook: compile the hot modules with mypyc, or install pure Python when that fails.

Everything else about the package is in `pyproject.toml`; this file only adds extension modules.
The modules in `COMPILED_GROUPS` (core/native.py) are typed Python that mypyc turns into C
extension modules, installed beside their `.py` sources (an editable install builds them in place). Python imports
an extension before a source of the same name, and `shardgate.core.native` checks at import that
each compiled group was built from the sources present (a source hash is compiled in), falling
back to the sources otherwise, so an edited `.py` is never shadowed by a stale build.
The hand-written C modules of `C_EXTENSIONS` (same file) are built beside their sources too,
each with its source's hash compiled in and checked the same way at import.

An editable install whose compiled modules are already current beside the sources does not
compile them again. The build is skipped, and the package is pure Python, when `SHARDGATE_PURE=1` is set, on an
interpreter other than CPython, or when mypyc or a C compiler is missing or fails: the
extensions are optional.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import platform
import runpy
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# Where the sources are copied under their installed names (`shardgate/...`), since the
# repository maps folders onto packages (`core/` is `shardgate.core`) and mypyc names a
# module by its path.
STAGING = Path("build") / "mypyc-src"


def compiled_groups() -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """`COMPILED_GROUPS` of core/native.py (read from the file: the package is not built yet)."""
    return runpy.run_path(str(ROOT / "core" / "native.py"))["COMPILED_GROUPS"]


def c_extensions() -> dict[str, str]:
    """`C_EXTENSIONS` of core/native.py: module name -> C source."""
    return runpy.run_path(str(ROOT / "core" / "native.py"))["C_EXTENSIONS"]


def source_folder(package: str) -> Path:
    """The repository folder of an installed package name (see package-dir in pyproject)."""
    return ROOT.joinpath(*package.split(".")[1:])


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stage(package: str, modules: tuple[str, ...], readonly: tuple[str, ...]) -> list[str]:
    """Copy the group's sources under `STAGING`; each compiled copy ends with the hash of its
    source. Returns the staged paths to compile."""
    target = STAGING.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    parts = package.split(".")
    for depth in range(1, len(parts) + 1):  # empty packages: nothing else is read
        init = STAGING.joinpath(*parts[:depth]) / "__init__.py"
        if not init.exists():
            init.write_text("")
    compiled = []
    for name in modules + readonly:
        source = source_folder(package) / f"{name}.py"
        text = source.read_text(encoding="utf-8")
        if name in modules:
            text += f'\n\nCOMPILED_FROM = "{source_hash(source)}"\n'
            compiled.append(str(target / f"{name}.py"))
        staged = target / f"{name}.py"
        if not staged.exists() or staged.read_text(encoding="utf-8") != text:
            staged.write_text(text, encoding="utf-8")  # unchanged files keep their time
    return compiled


def _built_in_place(group: str, package: str, modules: tuple[str, ...]) -> bool:
    """Whether an earlier editable install left a build of `group` beside its sources that
    was compiled from them (each source's hash is in the group's library): nothing to redo."""
    folder = source_folder(package)
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    library = next(
        (folder / f"{group.rsplit('.', 1)[1]}__mypyc{suffix}" for suffix in suffixes
         if (folder / f"{group.rsplit('.', 1)[1]}__mypyc{suffix}").exists()), None,
    )
    if library is None or not all(
        any((folder / f"{name}{suffix}").exists() for suffix in suffixes) for name in modules
    ):
        return False
    content = library.read_bytes()
    return all(
        source_hash(folder / f"{name}.py").encode() in content for name in modules
    )


METADATA_COMMANDS = {"egg_info", "dist_info"}
"""What pip's build hooks run before the build itself (the requirements, the metadata): they
never build an extension, so the modules are not analysed for them (each mypyc analysis takes
most of a minute)."""


def only_metadata(arguments: list[str]) -> bool:
    return bool(METADATA_COMMANDS.intersection(arguments)) and not any(
        command in arguments for command in ("build", "build_ext", "bdist_wheel",
                                             "editable_wheel", "install", "develop"))


def compiled_extensions() -> list:
    if os.environ.get("SHARDGATE_PURE") == "1" or platform.python_implementation() != "CPython":
        return []
    if only_metadata(sys.argv[1:]):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("shardgate: mypyc is not available; its modules stay pure Python", file=sys.stderr)
        return plain_c_extensions()
    extensions = []
    editable = "editable_wheel" in sys.argv
    for group, (package, modules, readonly) in compiled_groups().items():
        if editable and _built_in_place(group, package, modules):
            print(f"shardgate: {group} is already built from these sources", file=sys.stderr)
            continue
        try:
            compiled = _stage(package, modules, readonly)
            paths = compiled + [
                str(STAGING.joinpath(*package.split(".")) / f"{name}.py") for name in readonly
            ]
            built = mypycify(
                paths, only_compile_paths=compiled, group_name=group,
                target_dir=str(Path("build") / "mypyc" / group), opt_level="3", debug_level="0",
            )
        except (Exception, SystemExit) as exc:  # mypyc exits on a type error
            print(f"shardgate: {group} stays pure Python ({exc})", file=sys.stderr)
            continue
        for extension in built:
            extension.optional = True  # no compiler, or it failed: the sources are used
        extensions.extend(built)
    return extensions + plain_c_extensions()


def plain_c_extensions() -> list:
    """The hand-written C modules, each with its source's hash compiled in (`SOURCE_HASH`,
    which `core.native.load_c_extension` checks); optional: a failed build leaves the Python
    equivalent in use."""
    from setuptools import Extension

    built = []
    for name, source in c_extensions().items():
        path = ROOT / source
        if not path.exists():
            continue
        built.append(Extension(
            name, [source], optional=True,
            define_macros=[("SOURCE_HASH", f'"{source_hash(path)}"')],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
        ))
    return built


if __name__ == "__main__":
    os.chdir(ROOT)
    setup(ext_modules=compiled_extensions())
