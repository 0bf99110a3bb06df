"""What a job keeps on the server: the archive of its outputs (its artifact) and the
snapshots of its checkpoint folder."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from gpufleet.domain.checkpoints import MOST_FILES
from gpufleet.wire._base import Attempt, LeaseSecret, RelPath, Sha256, Size, Strict, Wire


class ArtifactFile(Wire):
    path: str
    size: int


class ArtifactOut(Wire):
    """A job attempt's outputs, archived: a blob and what it holds."""

    job_id: str
    attempt: int
    sha256: str
    size: int = Field(description="archive bytes")
    files: list[ArtifactFile] = Field(description="the first files in the archive (at most 1000)")
    file_count: int
    bytes: int = Field(description="unpacked bytes")
    created_at: datetime


class ArtifactAttach(Strict):
    attempt: Attempt
    sha256: Sha256
    secret: LeaseSecret = None


class CheckpointFile(Wire):
    """One file of a checkpoint snapshot: its path in the job's checkpoint folder, and the
    blob holding its bytes."""

    path: RelPath
    sha256: Sha256
    size: Size


class CheckpointIn(Strict):
    """A snapshot of a running job's checkpoint folder, every file of it a blob on the
    server already; ``progress``: how far the job was (its last epoch and step)."""

    attempt: Attempt
    secret: LeaseSecret = None
    files: list[CheckpointFile] = Field(max_length=MOST_FILES)
    progress: dict[
        Annotated[str, Field(pattern="^(epoch|epochs|step|steps)$")],
        Annotated[int, Field(ge=0, le=2**53)],
    ] = Field(default_factory=dict)


class CheckpointOut(Wire):
    """A snapshot of a job's checkpoint folder, complete on the server."""

    id: int
    job_id: str
    attempt: int = Field(description="the attempt that took it")
    created_at: datetime
    files: list[CheckpointFile]
    file_count: int
    bytes: int
    progress: dict[str, int] = Field(
        default_factory=dict, description="how far the job was: its last epoch and step"
    )


class Restored(Wire):
    """The snapshot a worker restored into a job's checkpoint folder before its command
    started: which, how many files and bytes, and how long it took."""

    snapshot: int
    files: int
    bytes: int
    seconds: float = Field(ge=0)
