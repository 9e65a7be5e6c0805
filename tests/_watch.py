"""A rank ended by zeroshard's peer watch ([Note: asking the peers] in peer_watch.py): it
prints its peer's error and exits, so a test reads what it printed, not what it raised."""

from __future__ import annotations

import os
import time
from pathlib import Path


def print_to_file(root: str, rank: int) -> None:
    """Send this (fresh) rank's stderr to ``root``, and note when its wait begins."""
    with open(os.path.join(root, f"rank{rank}.start"), "w") as f:
        f.write(repr(time.time()))
    err = os.open(os.path.join(root, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT)
    os.dup2(err, 2)
    os.close(err)


def ended_by_watch(root: str | Path, rank: int) -> tuple[float, str]:
    """(seconds from the wait's start to the watch's last words, the error it printed)
    of a rank its watch ended."""
    root = Path(root)
    printed = (root / f"rank{rank}.err").read_text()
    assert printed.startswith(f"zeroshard: rank {rank}: "), printed
    assert "a peer reported a divergence" in printed and "exit code 1" in printed, printed
    seconds = (root / f"rank{rank}.err").stat().st_mtime - float(
        (root / f"rank{rank}.start").read_text())
    return seconds, printed.removeprefix(f"zeroshard: rank {rank}: ")
