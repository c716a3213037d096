"""The namespaces' labels kept beside the SSD tier, so that a restarted server still says
which model each namespace on its SSD came from (`umbp ls`) before any engine of that
model reconnects: after a bad deploy, the operator sees which objects are the old
weights'.

One small JSON file, `<ssd-dir>/namespaces.json` (0600, written whole to a temporary
file and renamed over the old one, so a crash leaves the old or the new, never half).
A file that cannot be read is logged and ignored: labels are a convenience, the objects
are the SSD tier's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Final

from umbp.runtime.private_files import UnsafePath, open_private_file
from umbp.runtime.server.namespaces import Registration

__all__ = ["LABEL_FILE_NAME", "LabelFile"]

logger = logging.getLogger("umbp.serve")

LABEL_FILE_NAME: Final = "namespaces.json"


class LabelFile:
    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / LABEL_FILE_NAME
        self._lock = threading.Lock()

    def load(self) -> dict[str, Registration]:
        if not self.path.exists():
            return {}
        try:
            fd = open_private_file(self.path, os.O_RDONLY, "namespace label file")
            with os.fdopen(fd, "rb") as file:
                rows = json.loads(file.read())
            return {str(name): Registration(str(row["label"]), float(row["registered_unix"]))
                    for name, row in rows.items()}
        except (OSError, UnsafePath, ValueError, TypeError, KeyError, AttributeError) as error:
            logger.warning("umbp serve: namespace labels in %s not read: %s", self.path, error)
            return {}

    def save(self, registrations: dict[str, Registration]) -> None:
        rows = {name: {"label": entry.label, "registered_unix": entry.registered_unix}
                for name, entry in registrations.items()}
        temporary = self.path.with_name(self.path.name + ".tmp")
        with self._lock:
            try:
                fd = open_private_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                       "namespace label file")
                with os.fdopen(fd, "w") as file:
                    json.dump(rows, file)
                os.replace(temporary, self.path)
            except (OSError, UnsafePath) as error:
                logger.warning("umbp serve: namespace labels not saved in %s: %s",
                               self.path, error)
