"""Files and folders a killed write left behind (SIGKILL runs no cleanup), removed by the next write of the same
thing: best effort, named in a warning, never failing that write (a leftover it may not remove, another user's
in a shared folder, costs disk, not the write)."""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Iterable


def remove_leftovers(folder: str, names: Iterable[str], subject: str, why: str) -> None:
    """Remove each of `names` in `folder`, warning "<subject>: removed <name>, <why>" (or "could not remove")."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass
        done = "could not remove" if os.path.lexists(path) else "removed"
        warnings.warn(f"{subject}: {done} {name}, {why}")
