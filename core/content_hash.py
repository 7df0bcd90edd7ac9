"""Content hashes of input files, for staleness: has anything a record was measured on changed since?"""

from __future__ import annotations

import hashlib
from pathlib import Path

FULL_HASH_LIMIT = 1 << 30  # files below this are hashed whole
SAMPLED_BLOCKS = 256
BLOCK = 64 << 10


def update_with_file(h, path: Path) -> None:
    """Feed one file into hash h. Below 1 GiB: every byte, streamed. From 1 GiB on (weight shards of large
    models, where reading every byte on each run would cost minutes): size, the first and last MiB, 256 blocks
    spread over the file, and the inode change time. An edit that keeps the size and misses every sampled block
    still moves the change time, which restoring the modification time (touch -d, os.utime) cannot set back."""
    path = Path(path)
    st = path.stat()
    h.update(f"{path.name}:{st.st_size}".encode())
    with path.open("rb") as f:
        if st.st_size < FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return
        h.update(f.read(1 << 20))
        step = st.st_size // SAMPLED_BLOCKS
        for k in range(SAMPLED_BLOCKS):
            f.seek(k * step)
            h.update(f.read(BLOCK))
        f.seek(st.st_size - (1 << 20))
        h.update(f.read())
        h.update(f"ctime={st.st_ctime_ns}:ino={st.st_ino}".encode())


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    update_with_file(h, path)
    return h.hexdigest()[:16]


def files_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        update_with_file(h, p)
    return h.hexdigest()[:16]
