"""A memory probe for the broker process of a bench (loaded through ``PYTHONPATH`` by
`bench/bench_memory_arenas.py`; it does nothing unless ``BENCH_MEMORY_PROBE_OUT`` is set and the
process runs ``serve``).

Once a second it samples pymalloc (`sys.getallocatedblocks()`, arenas current and high-water
mark from `sys._debugmallocstats()`) and ``RssAnon``. It takes a baseline when the load starts
(the last sample before the broker's open descriptors grow by 20, the first clients): the
anonymous mappings present then. Once the load is over (the block count has fallen back below 30 % of its rise),
every 15 s it writes which live objects sit in mappings made after the baseline: pymalloc
returns a 1 MiB arena only when every block in it is free, so these objects are what keep the
load's arenas. Objects are found through `gc.get_objects()` and their untracked referents
(ints, strings, bytes, ...), each with the attribute or container that holds it.
"""

from __future__ import annotations

import bisect
import collections
import gc
import json
import os
import sys
import tempfile
import threading
import time
from array import array
from typing import Any

OUT = os.environ.get("BENCH_MEMORY_PROBE_OUT")
TRACKED_OWNERS = 100  # tracked objects whose holder is looked up (each costs a full scan)
LOAD_FDS = 20  # more open descriptors than the idle broker's fewest: the load has started
SMALL = 512  # pymalloc's small-block threshold: larger objects come from malloc
STATS = ("arenas allocated current", "arenas highwater mark", "bytes in allocated blocks",
         "bytes in available blocks")


def malloc_stats() -> dict[str, int]:
    """Arena counts and byte totals of `sys._debugmallocstats()` (it writes to fd 2)."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        text = sink.read().decode()
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition("=")
        name = name.strip().lstrip("# ").strip()
        if name in STATS:
            stats[name.replace(" ", "_")] = int(value.strip().replace(",", ""))
        elif "unused pools *" in name:  # "N unused pools * 16384 bytes"
            stats["unused_pool_bytes"] = int(value.strip().replace(",", ""))
    return stats


def anonymous_mappings() -> array:
    """Start and end of every anonymous mapping (not glibc's [heap]), flattened."""
    bounds = array("Q")
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 5:
                low, high = fields[0].split("-")
                bounds.append(int(low, 16))
                bounds.append(int(high, 16))
    return bounds


def rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def name_of(obj: object) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def attribute_holding(owner: object, obj: object) -> str:
    if type(owner) is dict:
        for key, value in owner.items():
            if value is obj:
                return f"[{key!r:.40}]"
            if key is obj:
                return "<key>"
        return "<value>"
    if type(owner) in (list, tuple, set, frozenset, collections.deque):
        return "<item>"
    attributes = getattr(owner, "__dict__", None)
    if isinstance(attributes, dict):
        for key, value in attributes.items():
            if value is obj:
                return "." + key
    for cls in type(owner).__mro__:
        for slot in getattr(cls, "__slots__", ()) or ():
            try:
                if getattr(owner, slot) is obj:
                    return "." + slot
            except AttributeError:
                pass
    return ".?"


def new_regions(baseline: array) -> list[tuple[int, int]]:
    """Anonymous mappings now, minus those of the baseline."""
    now = anonymous_mappings()
    old = [(baseline[i], baseline[i + 1]) for i in range(0, len(baseline), 2)]
    regions: list[tuple[int, int]] = []
    for i in range(0, len(now), 2):
        pieces = [(now[i], now[i + 1])]
        for low, high in old:
            pieces = [part for a, b in pieces for part in
                      ([(a, b)] if high <= a or low >= b else [(a, min(b, low)), (max(a, high), b)])
                      if part[1] > part[0]]
        regions.extend(pieces)
    return sorted(regions)


def pinned_objects(baseline: array) -> dict[str, Any]:
    """The live small objects inside mappings made since the baseline, by kind and holder."""
    regions = new_regions(baseline)
    starts = [low for low, _ in regions]
    kinds: collections.Counter[str] = collections.Counter()
    holders: collections.Counter[str] = collections.Counter()
    pools: set[int] = set()
    tracked: list[object] = []
    seen: set[int] = set()
    objects = gc.get_objects()

    def note(obj: object, owner: object | None) -> None:
        address = id(obj)
        if address in seen:
            return
        seen.add(address)
        index = bisect.bisect_right(starts, address) - 1
        if index < 0 or address >= regions[index][1] or sys.getsizeof(obj) > SMALL:
            return
        kind = name_of(obj)
        kinds[kind] += 1
        pools.add(address >> 14)
        if owner is None and len(tracked) < TRACKED_OWNERS:
            tracked.append(obj)
        elif owner is not None:
            holders[f"{kind} <- {name_of(owner)}{attribute_holding(owner, obj)}"] += 1

    own = {id(seen), id(objects), id(pools), id(kinds), id(holders), id(tracked)}  # the census's own state
    for obj in objects:
        if id(obj) in own:
            continue
        note(obj, None)
        for referent in gc.get_referents(obj):
            if not gc.is_tracked(referent):
                note(referent, obj)
    for obj in tracked:  # who holds the tracked ones (a full scan each: a few only)
        owners = [o for o in gc.get_referrers(obj) if id(o) not in own and o is not tracked
                  and type(o).__name__ != "frame"][:1]
        for owner in owners:
            holders[f"{name_of(obj)} <- {name_of(owner)}{attribute_holding(owner, obj)}"] += 1
    del objects
    tracked.clear()
    return {"new_mapping_kib": sum(high - low for low, high in regions) >> 10,
            "pinned_objects": sum(kinds.values()), "pinned_pools": len(pools),
            "kinds": kinds.most_common(25), "holders": holders.most_common(25)}


def sample(started: float) -> dict[str, Any]:
    return {"t": round(time.monotonic() - started, 1), "blocks": sys.getallocatedblocks(),
            "rss_anon_kib": rss_anon_kib(), **malloc_stats()}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(path: str) -> None:
    started = time.monotonic()
    before: tuple[dict[str, Any], array] | None = None
    fewest_fds = 1 << 30
    baseline_maps = None
    baseline_blocks = peak = 0
    last_census = 0.0
    with open(path, "a") as out:
        def write(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        while True:
            time.sleep(1.0)
            blocks = sys.getallocatedblocks()
            if baseline_maps is None:
                # The load starts when the clients come: the last sample before the broker's
                # open descriptors grow by LOAD_FDS is the baseline.
                fds = open_fds()
                if time.monotonic() - started > 2:
                    fewest_fds = min(fewest_fds, fds)
                if before is not None and fds >= fewest_fds + LOAD_FDS:
                    record, baseline_maps = before
                    baseline_blocks = record["blocks"]
                    write({"event": "baseline", **record})
                else:
                    before = (sample(started), anonymous_mappings())
                continue
            peak = max(peak, blocks)
            if int(time.monotonic() - started) % 5 == 0:
                write(sample(started))
            over = blocks < baseline_blocks + 0.3 * (peak - baseline_blocks)
            if peak > baseline_blocks * 1.05 and over and time.monotonic() - last_census > 15:
                last_census = time.monotonic()
                write({"event": "idle", **sample(started), **pinned_objects(baseline_maps)})


if OUT and "serve" in sys.argv:
    threading.Thread(target=run, args=(OUT,), daemon=True, name="bench-memory-probe").start()
