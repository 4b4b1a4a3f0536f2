"""Imported at the start of every `shardgate serve` process the tests start (tests/conftest.py's
`BrokerProcess` puts this directory first on its PYTHONPATH): pandas cannot be imported there.

pandas is a test extra (the archive reader tests read Parquet with it), not a dependency of the
broker, which never uses it. But pyarrow imports pandas whenever it is importable, at its first
`pa.array` or `pa.scalar` (the archiver's warm-up at start): half a second of CPU, about a third
of a broker's start, paid at each of the suite's hundreds of broker starts. Without it the
broker runs as installed without the test extras. The test process itself keeps pandas.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType


class _WithoutPandas(MetaPathFinder):
    """Finds pandas nowhere, as if it were not installed."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "pandas" or fullname.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


sys.meta_path.insert(0, _WithoutPandas())
