"""Name tables for ``kvoffload._lazy.lazy_exports`` that a plain dict cannot spell.

- ``PolicyNames``: the package's fixed names, plus every ``KVOffload<Name>Policy``
  (one class per kvoffload policy, registered ones included, so the set is open);
- ``EveryName``: every public name of one module, for an old module path that
  stays importable after its module moved.

Dunder names are never forwarded: Python's import machinery asks a module for
``__path__`` and friends, and those must stay the module's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class PolicyNames(Mapping[str, str]):
    """``names`` as given, and any ``KVOffload*Policy`` name from ``policy_module``."""

    def __init__(self, names: Mapping[str, str], policy_module: str) -> None:
        self._names = dict(names)
        self._policy_module = policy_module

    def __getitem__(self, name: str) -> str:
        module = self._names.get(name)
        if module is not None:
            return module
        if name.startswith("KVOffload") and name.endswith("Policy"):
            return self._policy_module
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class EveryName(Mapping[str, str]):
    """Every non-dunder name resolves to ``module`` (an old path's re-export of its new one)."""

    def __init__(self, module: str) -> None:
        self._module = module

    def __getitem__(self, name: str) -> str:
        if name.startswith("__") and name.endswith("__"):
            raise KeyError(name)
        return self._module

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0
