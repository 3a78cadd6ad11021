"""An import-only stand-in for ``sgl_kernel`` on machines without CUDA.

PyPI's ``sglang-kernel`` wheel is CUDA-only (importing it fails with ``libcuda.so.1: cannot open shared object
file``) and there is no CPU build. SGLang 0.5.23's CPU path imports names from it at module level but, in every run
measured, calls none of them. ``turnstream engine`` puts this folder first on the engine process's PYTHONPATH when
there is no GPU; nothing else sees it. Every name (and every submodule, e.g. ``sgl_kernel.kvcacheio``) imports,
and *calling* any of them raises, so a future SGLang that does call into the kernel library fails loudly, naming
the function, instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+turnstream.cpu.standin"


class StandInCalled(RuntimeError):
    """SGLang called a CUDA kernel that the CPU stand-in cannot run."""


class _Missing:
    """Any attribute of the stand-in: a further stand-in; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInCalled(
            f"SGLang called {self._name}, a CUDA kernel; turnstream's CPU stand-in for sgl_kernel cannot run it"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.<sub>`` module as a stand-in."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StandInModule
