"""`with store:` for every store: leaving the block closes it."""

from __future__ import annotations

from typing import Self


class ClosesOnExit:
    """Mixin: the context manager of a class whose `close` is idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
