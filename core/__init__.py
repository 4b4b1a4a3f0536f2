"""Shardgate core package. Its topic names, filters and trie may run compiled by mypyc when
the build matches the sources (see `native.py`)."""

import os

from .native import use_compiled_if_current

use_compiled_if_current("shardgate.core.topics_native", os.path.dirname(__file__))
