"""Finding a verifier from the string a config names it by.

Four kinds of reference, tried in this order:

1. a registered name (``psnr``, ``math_answer``; see ``VERIFIERS``);
2. a ``path/to/file.py:function`` (the file is imported once per process);
3. a ``module.sub:function`` importable from ``sys.path``;
4. an entry point in the group ``mmrl.verifiers`` of any installed package, by name.

:func:`portable_ref` turns a reference into one that a fresh worker process can
resolve on its own (a worker cannot see verifiers registered at run time).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from mmrl.errors import VerifierError
from mmrl.verifiers import builtins  # noqa: F401  (registers the built-in verifiers)
from mmrl.verifiers.base import VERIFIERS, VerifierFn

ENTRY_POINT_GROUP = "mmrl.verifiers"
# Modules made from path plugins: synthetic module name -> source file.
_PATH_MODULES: dict[str, Path] = {}


def resolve(ref: str) -> VerifierFn:
    """The verifier callable that ``ref`` names; errors list what was available."""
    if ref in VERIFIERS:
        return VERIFIERS[ref]
    if ":" in ref:
        target, _, attr = ref.rpartition(":")
        if not target or not attr:
            raise VerifierError(
                f"verifier reference {ref!r} must look like 'module:function' or 'file.py:function'"
            )
        module = _load_path(target) if _is_path(target) else _import(target, ref)
        return _get_callable(module, attr, ref)
    eps = _entry_points()
    if ref in eps:
        fn = eps[ref].load()
        if not callable(fn):
            raise VerifierError(
                f"entry point {ref!r} ({eps[ref].value}) in group {ENTRY_POINT_GROUP!r} is not "
                "callable"
            )
        return fn
    raise VerifierError(
        f"unknown verifier {ref!r}: not registered ({sorted(VERIFIERS)}), not an entry point in "
        f"group {ENTRY_POINT_GROUP!r} ({sorted(eps)}), and not 'module:function' or "
        "'file.py:function'"
    )


def get_verifier(name: str) -> VerifierFn:
    """The verifier registered, installed as an entry point, or importable under ``name``."""
    return resolve(name)


def default_name(ref: str) -> str:
    """The metric name of a verifier: the registered/entry-point name, or the function's name."""
    return ref.rpartition(":")[2].rpartition(".")[2] if ":" in ref else ref


def portable_ref(ref: str, fn: Any) -> str:
    """A reference to ``fn`` that a new process can resolve without the caller's registry.

    Registered names become ``module:qualname`` (or ``file.py:qualname`` for a function
    from a path plugin); entry points become their ``module:attr`` value; paths become
    absolute. Raises ValueError for a function defined in ``__main__`` or a local scope.
    """
    if ":" in ref:
        target, _, attr = ref.rpartition(":")
        return f"{Path(target).resolve()}:{attr}" if _is_path(target) else ref
    if ref not in VERIFIERS:
        return _entry_points()[ref].value
    fn = getattr(fn, "func", fn)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in _PATH_MODULES:
        return f"{_PATH_MODULES[module]}:{qualname}"
    if not module or module == "__main__" or "<locals>" in qualname:
        raise VerifierError(
            f"verifier {ref!r} ({module}.{qualname}) cannot run in a worker process: define it at "
            "the top level of an importable module or a .py file, or use mode 'batch'"
        )
    return f"{module}:{qualname}"


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


@cache
def _load_path_cached(path: Path) -> Any:
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    name = f"mmrl_verifier_plugin_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import verifier plugin file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    _PATH_MODULES[name] = path
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name], _PATH_MODULES[name]
        raise
    return module


def _load_path(target: str) -> Any:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise VerifierError(f"verifier plugin file {target!r} does not exist (resolved to {path})")
    return _load_path_cached(path)


def _import(module_name: str, ref: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise VerifierError(
            f"verifier {ref!r}: cannot import module {module_name!r} ({err}); is its package "
            "installed, or its folder on sys.path / PYTHONPATH?"
        ) from err


def _get_callable(module: Any, attr: str, ref: str) -> VerifierFn:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise VerifierError(
                f"verifier {ref!r}: {getattr(module, '__name__', module)} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise VerifierError(f"verifier {ref!r} names a {type(obj).__name__}, expected a function")
    return obj


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> dict[str, str]:
    """Every verifier name a config can use without a path: registered and installed ones."""
    names = {name: "registered" for name in VERIFIERS}
    names.update(
        {
            name: f"entry point {ep.value}"
            for name, ep in _entry_points().items()
            if name not in names
        }
    )
    return dict(sorted(names.items()))
