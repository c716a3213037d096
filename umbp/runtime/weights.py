"""Which weights a model's KV was computed with: the part of a namespace only I/O can
tell (core.identity's ``NamespaceInputs.weights``).

Keys are fingerprints of everything that shapes the stored bytes. The model's path
alone is not enough: an operator who puts a fine-tuned checkpoint at the same path
(same config, new weights) would otherwise restore the old weights' KV into the new
model. So the namespace also covers the weights actually loaded:

* a local directory (or a single weight file): a digest of its weight files'
  contents, sampled (:func:`files_digest`): per file its relative path, its size and
  ``SAMPLE_CHUNKS`` chunks of ``CHUNK_BYTES`` at evenly spaced offsets (the first and
  the last included); for a safetensors file also its header (every tensor's name,
  dtype, shape and place) and the first ``TENSOR_BYTES`` of each tensor (of
  ``MAX_TENSORS`` evenly spaced ones when a file has more), so that a checkpoint where
  only some tensors changed (a LoRA merged into q and v only) is caught however few
  they are; plus every config file read whole. Never mtimes or absolute paths: the
  same files give the same digest on every host and after a copy, so a pool shared by
  several hosts is not split. What a sample cannot see (a change confined to bytes
  between the chunks of a tensor) is documented in docs/configuration.md;
* a hub model: the commit its revision resolved to in the local hub cache (the
  snapshot vLLM or SGLang loaded), so ``main`` moving to new weights is a new
  namespace;
* vLLM's ``dummy`` load format: ``dummy`` and the config's digest (the weights are
  generated from the config with a fixed seed).

Anything else (weights streamed from object storage, a hub model not in the local
cache) raises :class:`WeightsUnknown`, whose message says to set an explicit
``namespace``: serving KV the running weights did not compute is the one failure
umbp must not have, so it refuses to guess.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import xxhash

__all__ = [
    "CHUNK_BYTES",
    "CONFIG_FILES",
    "MAX_TENSORS",
    "SAMPLE_CHUNKS",
    "TENSOR_BYTES",
    "WEIGHT_SUFFIXES",
    "DigestCost",
    "WeightsUnknown",
    "files_digest",
    "hub_commit",
    "sample_offsets",
    "weight_files",
    "weights_identity",
]

SAMPLE_CHUNKS: Final = 16
"""Chunks read from each weight file (evenly spaced, first and last included)."""
CHUNK_BYTES: Final = 64 << 10
"""Bytes of each chunk: a 140 GB checkpoint of 30 files costs 480 reads, 30 MiB."""
WEIGHT_SUFFIXES: Final = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors", ".ckpt", ".npy", ".npz",
    ".msgpack", ".h5",
)
"""Files whose bytes are weights, in any format vLLM or SGLang loads."""
CONFIG_FILES: Final = ("config.json", "params.json")
"""Top-level files that shape what the weights compute (rope scaling, norms...), read
whole: a config edited in place is a new namespace too."""
TENSOR_BYTES: Final = 4 << 10
"""Bytes read from the start of each sampled safetensors tensor."""
MAX_TENSORS: Final = 256
"""Tensors sampled per safetensors file at most (a MoE file holds thousands)."""
_MAX_CONFIG_BYTES: Final = 16 << 20
_MAX_HEADER_BYTES: Final = 100 << 20  # safetensors' own limit
_COMMIT: Final = re.compile(r"[0-9a-f]{40}")


class WeightsUnknown(ValueError):
    """umbp cannot tell which weights are loaded; the message says what to do."""


@dataclass(frozen=True, slots=True)
class DigestCost:
    """What one digest read: files sampled, chunks read, bytes read."""

    files: int
    reads: int
    bytes_read: int


def sample_offsets(size: int, chunks: int = SAMPLE_CHUNKS,
                   chunk_bytes: int = CHUNK_BYTES) -> tuple[int, ...]:
    """Where the chunks of a file of ``size`` bytes start: ``chunks`` evenly spaced
    offsets from 0 to ``size - chunk_bytes`` (one offset, 0, when the file is no larger
    than a chunk: it is read whole). Sorted, distinct, each chunk inside the file."""
    if size <= chunk_bytes or chunks <= 1:
        return (0,)
    last = size - chunk_bytes
    return tuple(sorted({last * index // (chunks - 1) for index in range(chunks)}))


def weight_files(root: Path) -> tuple[Path, ...]:
    """The weight files under ``root`` (itself, when it is a file), sorted by their path
    relative to ``root``. Directories whose name starts with a dot (``.cache``, ``.git``)
    are skipped; symbolic links are followed (a hub snapshot is links into blobs)."""
    if root.is_file():
        return (root,)
    found = [path for path in _walk(root) if path.name.endswith(WEIGHT_SUFFIXES)]
    return tuple(sorted(found, key=lambda path: path.relative_to(root).as_posix()))


def _walk(root: Path) -> Iterator[Path]:
    for entry in os.scandir(root):  # weight_files sorts what this finds
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from _walk(Path(entry.path))
        elif entry.is_file():
            yield Path(entry.path)


def files_digest(root: Path, *, weights: bool = True) -> tuple[str, DigestCost]:
    """``files:<32 hex digits>``, the digest of ``root``'s weight files (a sample of
    each; none when ``weights`` is False) and config files (whole), and what computing
    it read. Raises :class:`WeightsUnknown` when ``root`` holds none of them."""
    digest = xxhash.xxh3_128()
    reads = read = 0
    files = weight_files(root) if weights else ()
    configs = () if root.is_file() else tuple(
        root / name for name in CONFIG_FILES if (root / name).is_file()
    )
    if not files and not configs:
        raise WeightsUnknown(f"{root} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}) "
                             f"and no {' or '.join(CONFIG_FILES)}")
    with contextlib.ExitStack() as opened:
        fds = [opened.enter_context(_read_only(path)) for path in files]
        for path, fd, size, pieces in _planned_reads(files, fds):
            relative = path.name if path == root else path.relative_to(root).as_posix()
            digest.update(f"file\0{relative}\0{size}\0".encode())
            for offset, length in pieces:
                chunk = os.pread(fd, length, offset)
                digest.update(chunk)
                reads += 1
                read += len(chunk)
    for path in configs:
        with _read_only(path) as fd:
            size = os.fstat(fd).st_size
            if size > _MAX_CONFIG_BYTES:
                raise WeightsUnknown(f"{path} has {size} bytes, more than a config file "
                                     f"may ({_MAX_CONFIG_BYTES})")
            content = os.pread(fd, size, 0)
        digest.update(f"config\0{path.name}\0{size}\0".encode())
        digest.update(content)
        reads += 1
        read += len(content)
    return f"files:{digest.hexdigest()}", DigestCost(len(files) + len(configs), reads, read)


def _planned_reads(
    files: tuple[Path, ...], fds: list[int]
) -> list[tuple[Path, int, int, list[tuple[int, int]]]]:
    """Each file's pieces, every one announced to the kernel first (``WILLNEED``), so
    that their reads from a cold disk overlap instead of waiting one by one: the
    files' starts (safetensors headers) in one round, then every piece."""
    for fd in fds:
        _will_need(fd, 0, CHUNK_BYTES)
    planned = []
    for path, fd in zip(files, fds):
        size = os.fstat(fd).st_size
        pieces = [(offset, min(CHUNK_BYTES, size - offset))
                  for offset in sample_offsets(size, SAMPLE_CHUNKS, CHUNK_BYTES)]
        if path.name.endswith(".safetensors"):
            pieces += safetensors_pieces(fd, size)
        for offset, length in pieces:
            _will_need(fd, offset, length)
        planned.append((path, fd, size, pieces))
    return planned


def _will_need(fd: int, offset: int, length: int) -> None:
    if length > 0 and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def safetensors_pieces(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of a safetensors file's header and of the first
    ``TENSOR_BYTES`` of each tensor it describes (``MAX_TENSORS`` evenly spaced ones at
    most), in file order; none when the file is not safetensors after all (its evenly
    spaced chunks still cover it)."""
    if size < 8:
        return []
    header_bytes = int.from_bytes(os.pread(fd, 8, 0), "little")
    if not 0 < header_bytes <= min(_MAX_HEADER_BYTES, size - 8):
        return []
    try:
        header = json.loads(os.pread(fd, header_bytes, 8))
        starts = sorted(
            int(entry["data_offsets"][0]) for name, entry in header.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return []
    if len(starts) > MAX_TENSORS:
        starts = [starts[index * len(starts) // MAX_TENSORS] for index in range(MAX_TENSORS)]
    base = 8 + header_bytes
    tensors = [(base + start, min(TENSOR_BYTES, size - base - start))
               for start in starts if 0 <= start < size - base]
    return [(8, header_bytes), *tensors]


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[int]:
    """A read-only descriptor of the regular file at ``path`` (links followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WeightsUnknown(f"{path} is not a regular file")
        yield fd
    finally:
        os.close(fd)


def hub_commit(repo_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The commit ``revision`` (``main`` when None) of hub model ``repo_id`` resolves to
    in the local hub cache (``cache_dir``, else the default one), or None when the
    cache does not hold it. Never asks the network."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        folder = snapshot_download(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                                   local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not in the cache"
        return None
    commit = Path(folder).name
    return commit if _COMMIT.fullmatch(commit) else None


def weights_identity(model: str, revision: str | None, load_format: str,
                     download_dir: str | None) -> str:
    """The ``weights`` text of a namespace: see the module docstring. Raises
    :class:`WeightsUnknown` with what to do when the weights cannot be identified."""
    path = Path(model)
    if load_format == "dummy":
        if path.is_dir() and any((path / name).is_file() for name in CONFIG_FILES):
            return "dummy:" + files_digest(path, weights=False)[0]
        return "dummy"
    if path.exists():
        return files_digest(path)[0]
    commit = hub_commit(model, revision, download_dir)
    if commit is not None:
        return f"hub:{model}@{commit}"
    if revision is not None and _COMMIT.fullmatch(revision):
        return f"hub:{model}@{revision}"
    raise WeightsUnknown(
        f"umbp cannot tell which weights model {model!r} (revision {revision!r}, load "
        f"format {load_format!r}) loads: it is neither a local path nor a hub model in the "
        "local hub cache. Set an explicit 'namespace' (vLLM's kv_connector_extra_config, "
        "SGLang's --hicache-storage-backend-extra-config) that you change whenever the "
        "weights change (see docs/configuration.md)"
    )
