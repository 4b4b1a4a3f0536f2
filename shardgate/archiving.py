"""Starting the archiver of a broker (`[archive]`): its settings from the configuration, what it
asks the broker (the reliable streams, their registered schemas, whether this node leads a
shard in a cluster, continuing a shard log after what the archive holds) and the archive
reader that replays from it. Called once by the composition root (`app.py`) at start.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .config import ConfigError
from .storage.interfaces import StorageError

if TYPE_CHECKING:
    from .app import Shardgate

# The composition root's logger, as before this module was split from it.
log = logging.getLogger("shardgate.app")


async def start_archiver(app: Shardgate) -> None:
    archive = app.config.archive
    if not archive.enabled:
        return
    from .storage.archive import ArchiveConfigError, Archiver, ArchiveReader, ArchiveSettings

    url = archive.url or f"file://{(app.config.data_dir / 'archive').resolve()}"
    settings = ArchiveSettings(
        target_rows=archive.target_rows, target_bytes=archive.target_bytes,
        max_delay_s=archive.max_delay_s, compaction=archive.compaction,
        file_target_bytes=archive.file_target_bytes, compact_after_s=archive.compact_after_s,
        keep_typed_payload=archive.keep_typed_payload,
        endpoint_url=archive.endpoint_url, region=archive.region,
        access_key_id=archive.access_key_id, secret_access_key=archive.secret_access_key,
        # leave part of the shutdown budget to the journal and the metadata store
        stop_timeout_s=max(1.0, app.config.shutdown_timeout_s * 0.6),
    )
    broker = app.broker
    assert broker is not None

    def reliable_streams() -> list[tuple[str, int, str]]:
        return [
            (stream.name, len(stream.shards), stream.config.schema.value)
            for stream in broker.streams.values() if stream.reliable
        ]

    def registered_schema(name: str) -> tuple[str, Any, int] | None:
        latest = broker.schemas.latest(name)
        return None if latest is None else (latest.type.value, latest.parsed, latest.version)

    def continue_log(name: str, index: int, offset: int) -> bool:
        """A shard log that holds no record continues at `offset`, its broker shard too."""
        stream = broker.streams.get(name)
        if stream is None or not 0 <= index < len(stream.shards):
            return False
        shard = stream.shards[index]
        start_at = getattr(shard.log, "start_at", None)
        if start_at is None or shard.log is None or shard.next_offset != shard.log.next_offset:
            return False
        try:
            shard.next_offset = start_at(offset)
        except StorageError as exc:
            log.error("%s/%d: the archive holds offsets up to %d, the journal fewer, and it "
                      "cannot continue after them: %s", name, index, offset - 1, exc)
            return False
        return True

    leads = None
    if app.cluster is not None:  # only a shard's leader archives it
        from .cluster.state_log import INTERNAL_STREAM

        view, node_id = app.cluster.view, app.cluster.node_id

        def leads(name: str, index: int) -> bool:
            if name == INTERNAL_STREAM:
                return False  # the broker's own replicated state, not messages to keep
            assignment = view.leader(name, index)
            return assignment is not None and assignment.leader == node_id

    assert app.journal is not None  # the archive reads the journal's reliable streams
    try:
        journal = app.journal

        def archived_log(stream: str, shard: int) -> Any:
            # a replicated shard: its leader archives what is below the high watermark
            cluster = app.cluster
            if cluster is not None and cluster.replicas is not None:
                return cluster.replicas.archived_log(stream, shard)
            return journal.open_shard(stream, shard)

        app.archiver = Archiver(app.journal, url, reliable_streams, settings,
                                 registered_schema=registered_schema, leads=leads,
                                 continue_log=continue_log,
                                 shard_log=archived_log if app.cluster is not None else None)
        await app.archiver.start()
        if app.cluster is not None:  # a shard this node starts to lead: at once
            app.cluster.view.on_change(app.archiver.wake)
    except ArchiveConfigError as exc:
        raise ConfigError(f"archive: {exc}") from exc
    app.archive_reader = ArchiveReader(url, settings)
    broker.archive_source.install(app.archive_reader)
    log.info("archiving reliable streams to %s", url)
