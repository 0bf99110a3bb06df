"""Build and unpack gpufleet's package and artifact archives, safely.

A gpufleet archive is a PAX tar stream in one zstd frame (level 3, single-threaded). Entries
are sorted by path, directories come before their contents, and owners, times and permission
bits are normalized, so the same content always gives the same bytes and the same SHA-256.

Reading never trusts the archive. :func:`scan` and :func:`extract` put every member through
one set of rules (``_Checker``) and refuse with :class:`UnsafeArchive` anything that could
write outside the target, create a device, or expand past :class:`Limits`. :func:`extract`
unpacks into a hidden directory next to the target and renames it into place only once the
whole archive passed, so a refused or damaged archive leaves nothing behind.
"""

from gpufleet.archive._files import copy_hashing, merge_into
from gpufleet.archive._fingerprint import Remembered, fingerprint, remembered_digest
from gpufleet.archive._pack import pack_outputs, pack_path, tree_digest
from gpufleet.archive._rules import DEFAULT_EXCLUDES, IGNORE_FILE, SUFFIX, Entry, Limits, Packed
from gpufleet.archive._unpack import extract, scan

__all__ = [
    "DEFAULT_EXCLUDES",
    "IGNORE_FILE",
    "SUFFIX",
    "Entry",
    "Limits",
    "Packed",
    "Remembered",
    "copy_hashing",
    "extract",
    "fingerprint",
    "merge_into",
    "pack_outputs",
    "pack_path",
    "remembered_digest",
    "scan",
    "tree_digest",
]
