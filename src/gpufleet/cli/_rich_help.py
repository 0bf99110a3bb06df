"""Typer draws help and usage errors with ``typer.rich_utils``, which imports rich's
``Markdown`` and ``Traceback`` at its top: a third of ``gpufleet --help``'s start
(markdown-it, pygments, attrs) for two classes it reaches only in Markdown help mode and
in pretty tracebacks, neither of which the CLI uses. While that module loads, the two
names are stand-ins that import the real class when first used; after it, ``rich.markdown``
and ``rich.traceback`` import as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from typing import Any

TARGET = "typer.rich_utils"
#: module -> the class typer.rich_utils takes from it
DEFERRED = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}


def _stand_in(module: str, name: str) -> type:
    """A class named like ``module.name`` whose construction, and ``from_exception``,
    import the real class and hand over to it."""

    def real() -> Any:
        return getattr(importlib.import_module(module), name)

    class StandIn:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return real()(*args, **kwargs)

        @classmethod
        def from_exception(cls, *args: Any, **kwargs: Any) -> Any:
            return real().from_exception(*args, **kwargs)

    StandIn.__name__ = StandIn.__qualname__ = name
    StandIn.__module__ = module
    return StandIn


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        placed = {}
        for name, cls in DEFERRED.items():
            if name not in sys.modules:
                stub = types.ModuleType(name)
                setattr(stub, cls, _stand_in(name, cls))
                placed[name] = stub
        sys.modules.update(placed)
        try:
            self.real.exec_module(module)
        finally:
            for name, stub in placed.items():
                if sys.modules.get(name) is stub:
                    del sys.modules[name]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        uninstall()  # once: the real finders find it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_finder = _Finder()


def install() -> None:
    """Defer the two classes the next time ``typer.rich_utils`` is imported (nothing if
    it already is)."""
    if TARGET not in sys.modules and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
