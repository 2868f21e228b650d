"""Read what an offline W&B run recorded (run-<id>.wandb): the run record (id, group, name, job type, entity), the
artifacts it logged and its config updates. The file is W&B's leveldb-style log of protobuf records: a 7-byte header,
then 32 KiB blocks of chunks (checksum 4, length 2, type 1: full / first / middle / last)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768
HEADER = 7


@dataclass
class OfflineRun:
    run_id: str = ""
    group: str = ""
    name: str = ""
    job_type: str = ""
    entity: str = ""
    resumed: bool = False
    artifacts: list[dict] = field(default_factory=list)  # {"name", "type", "digest", "metadata", "refs"}
    config: dict = field(default_factory=dict)


def _records(data: bytes) -> list[bytes]:
    out, buf, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return out


def read_run(run_dir: Path) -> OfflineRun:
    """run_dir: a wandb/offline-run-* directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    (path,) = run_dir.glob("run-*.wandb")
    for raw in _records(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.group, run.name, run.job_type, run.entity = r.run_id, r.run_group, r.display_name, r.job_type, r.entity
            run.resumed = run.resumed or r.resumed
            for item in r.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "artifact":
            a = rec.artifact
            run.artifacts.append({"name": a.name, "type": a.type, "digest": a.digest,
                                  "metadata": json.loads(a.metadata) if a.metadata else {},
                                  "refs": [e.ref for e in a.manifest.contents if e.ref]})
        elif kind == "config":
            for item in rec.config.update:
                run.config[item.key] = json.loads(item.value_json)
    return run


def offline_runs(directory: Path) -> list[OfflineRun]:
    """Every offline run under directory/wandb, oldest first."""
    return [read_run(d) for d in sorted((Path(directory) / "wandb").glob("offline-run-*"))]
