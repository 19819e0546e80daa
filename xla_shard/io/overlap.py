"""Where a command may write: never over what it reads, nor over the run or the directory the user stands in.

A command that replaces a directory (`ckpt export --overwrite`, the final FULL_STATE_DICT export) deletes it
first, so a destination that is, or lies above, the checkpoint being read, the run's `checkpoint.dir` or
`output_dir`, the model directory it reads, or the working directory would delete them. Those are refused
before anything is opened, on any filesystem fsspec reaches: local paths are compared after resolving links
and `..`, object-store URLs by protocol and path (`gs://b/run` lies above `gs://b/run/ckpt/step-00000002`).
A destination inside something that is only read (a checkpoint, a model directory) is refused too: writing
there changes what the next reader finds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from xla_shard.errors import UserError


@dataclass(frozen=True)
class Location:
    """A URL reduced to what identifies it: its filesystem's protocol and an absolute, normalised path."""

    protocol: str
    path: str

    def holds(self, other: Location) -> bool:
        """Whether `other` is this location or lies below it."""
        if self.protocol != other.protocol:
            return False
        base = self.path.rstrip("/")
        return other.path == self.path or other.path.startswith(base + "/") or base == ""


def locate(url: str) -> Location:
    from fsspec.core import split_protocol

    protocol, path = split_protocol(url)
    if protocol in (None, "file", "local"):
        return Location("file", os.path.realpath(os.path.expanduser(path or ".")))
    protocol = {"gcs": "gs"}.get(protocol, protocol)
    return Location(protocol, "/" + "/".join(p for p in path.split("/") if p not in ("", ".")))


@dataclass
class Protected:
    """Something a write must not land on: what it is (for the message), its URL, and whether writing inside
    it is refused too (what the command reads) or allowed (a run's output_dir, the working directory)."""

    what: str
    url: str | None
    inside_too: bool = False


def refuse_overlap(flag: str, destination: str, protected: list[Protected]) -> None:
    """Raise a one-line UserError naming `flag` if `destination` is, contains or (for read sources) lies
    inside anything in `protected`."""
    if not destination.strip():
        raise UserError(f"{flag}: an empty destination (it would be the working directory); name a directory")
    target = locate(destination)
    for item in [*protected, Protected("the working directory", os.getcwd())]:
        if not item.url:
            continue
        guarded = locate(item.url)
        if target.holds(guarded):
            relation = "is" if target == guarded else "contains"
            raise UserError(f"{flag} {destination} {relation} {item.what} ({item.url}); writing there would "
                            "replace it: choose a directory outside it")
        if item.inside_too and guarded.holds(target):
            raise UserError(f"{flag} {destination} lies inside {item.what} ({item.url}), which this command reads; "
                            "choose a directory outside it")
