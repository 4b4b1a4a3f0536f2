"""pyarrow without pandas in the broker process: `shardgate serve` runs as if pandas were not
installed (`hide_pandas`, called once at start, before pyarrow is first used).

pyarrow imports pandas whenever it is importable, from two places, neither of which the
archive can step around for good:
- its pandas shim (Cython), the first time any value is converted (`pa.array`, `pa.scalar`,
  a Python scalar handed to a compute function), to ask whether the value is a pandas object;
  it tries once, quietly, and remembers the answer;
- its C++ type inference (`InferArrowType`, whenever a conversion is given no type:
  `pa.scalar(3)`, `pa.array(["a"])`), which imports pandas for its null sentinels and, when
  that fails, tries again at the next inference.
The archive's modules build such constants when they are imported and its warm-up builds a
table at start: pandas' import was about a third of a broker's start CPU, and pandas stayed in
memory for nothing. The broker never hands pyarrow a pandas object and never uses pandas,
which is no dependency of it; but a user may have it installed (it is one of the test extras).

A process that reads the archive into pandas (a user's program, Spark) must not call this.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType


class _PandasNotFound(MetaPathFinder):
    """Finds pandas nowhere, as if it were not installed."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "pandas" or fullname.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def hide_pandas() -> bool:
    """From now on pandas cannot be imported in this process (see the module docstring). True
    when it is hidden; False where it was imported already (nothing changes then)."""
    if "pandas" in sys.modules:
        return False
    if not any(isinstance(finder, _PandasNotFound) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PandasNotFound())
    return True


__all__ = ["hide_pandas"]
