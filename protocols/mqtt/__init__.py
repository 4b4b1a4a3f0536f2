"""Shardgate protocols.mqtt package. Its codec modules may run compiled by mypyc when the build
matches the sources (see `shardgate.core.native`)."""

import os

from ...core.native import use_compiled_if_current

use_compiled_if_current("shardgate.protocols.mqtt.codec_native", os.path.dirname(__file__))
