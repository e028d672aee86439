"""Import stubs that let SGLang's host pools and cache controller load on a CPU machine.

torchvision: SGLang imports it unconditionally through its model configs, and the only wheel
here is a CUDA build; nothing these tests run calls it, so every `torchvision.*` is a module
whose attributes are further stubs. Tests only: the package never needs it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _AnyAttr(type):
    """A stub class's own attributes are stubs too (`InterpolationMode.BILINEAR`)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttr(name, (), {"__module__": cls.__module__})


class _Stub(types.ModuleType):
    """A module (and a class, and a decorator) for whatever is asked of it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return _AnyAttr(name, (), {"__module__": self.__name__})
        return _module(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda fn: fn)


def _module(name: str) -> _Stub:
    if name not in sys.modules:
        module = _Stub(name)
        module.__path__, module.__version__ = [], "0.0"
        module.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)
        sys.modules[name] = module
    return sys.modules[name]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    roots = ("torchvision",)

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] in cls.roots:
            return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        return _module(spec.name)

    @staticmethod
    def exec_module(module):
        pass


def install() -> None:
    """Stub what is absent; a real install of a stubbed package wins."""
    for root in _Finder.roots:
        if importlib.util.find_spec(root) is None and _Finder not in sys.meta_path:
            sys.meta_path.append(_Finder)
