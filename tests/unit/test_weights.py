"""The weights' part of a namespace (umbp.runtime.weights), on real files: it changes
when the weights' bytes change and only then (not with mtimes, paths or hosts)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from umbp.runtime.weights import (
    CHUNK_BYTES,
    MAX_TENSORS,
    TENSOR_BYTES,
    WeightsUnknown,
    files_digest,
    hub_commit,
    sample_offsets,
    weights_identity,
)

MIB = 1 << 20


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file of uint8 tensors (the format's header, then the data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(tensors.values()))


def tensor_bytes(seed: int, size: int) -> bytes:
    return (bytes([seed % 251 + 1]) * size)[:size]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model folder: config, two shards of 40 tensors each, a README."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64, "rope_theta": 1e4}))
    (folder / "README.md").write_text("a model")
    for shard in range(2):
        write_safetensors(folder / f"model-0000{shard}.safetensors",
                          {f"layer.{i}": tensor_bytes(shard * 100 + i, 64 << 10)
                           for i in range(40)})
    return folder


def rewrite_tensor(path: Path, name: str, data: bytes) -> None:
    """Change one tensor in place, keeping the file's size and header."""
    raw = path.read_bytes()
    header_bytes = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8 : 8 + header_bytes])[name]["data_offsets"]
    base = 8 + header_bytes
    assert len(data) == end - start
    path.write_bytes(raw[: base + start] + data + raw[base + end :])


def test_the_same_files_give_the_same_digest_after_a_copy_and_new_mtimes(
    model: Path, tmp_path: Path
) -> None:
    digest, cost = files_digest(model)
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(model, copy)
    for path in copy.iterdir():
        os.utime(path, (1_000_000_000, 1_000_000_000))
    assert files_digest(copy)[0] == digest
    assert digest.startswith("files:") and len(digest) == len("files:") + 32
    # It sampled, not read everything: 2 shards of 2.5 MiB, a config.
    assert cost.files == 3 and cost.bytes_read < 2 * 2.5 * MIB


def test_new_weights_in_place_give_a_new_digest_even_one_tensor_of_eighty(model: Path) -> None:
    before = files_digest(model)[0]
    # A LoRA merged into one tensor only: same size, same header, same config.
    rewrite_tensor(model / "model-00001.safetensors", "layer.17", tensor_bytes(7, 64 << 10))
    assert files_digest(model)[0] != before


def test_a_config_edited_in_place_gives_a_new_digest(model: Path) -> None:
    before = files_digest(model)[0]
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "rope_theta": 5e5}))
    assert files_digest(model)[0] != before


def test_files_that_are_not_weights_or_config_do_not_count(model: Path) -> None:
    before = files_digest(model)[0]
    (model / "README.md").write_text("rewritten")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.safetensors").write_bytes(b"ignored")
    assert files_digest(model)[0] == before


def test_a_renamed_or_added_shard_gives_a_new_digest(model: Path) -> None:
    before = files_digest(model)[0]
    (model / "model-00001.safetensors").rename(model / "model-00002.safetensors")
    renamed = files_digest(model)[0]
    assert renamed != before
    (model / "extra.bin").write_bytes(b"\0" * 100)
    assert files_digest(model)[0] not in (before, renamed)


def test_a_change_between_the_chunks_of_a_file_that_is_not_safetensors_is_not_seen(
    tmp_path: Path,
) -> None:
    """What a sample cannot see (docs/configuration.md says so): a plain weight file
    changed only between its sampled chunks."""
    folder = tmp_path / "pt"
    folder.mkdir()
    data = bytearray(16 * CHUNK_BYTES * 4)
    (folder / "model.bin").write_bytes(data)
    before = files_digest(folder)[0]
    offsets = sample_offsets(len(data))
    gap = offsets[1] - CHUNK_BYTES // 2 if offsets[1] > CHUNK_BYTES else None
    assert gap is not None and not any(o <= gap < o + CHUNK_BYTES for o in offsets)
    data[gap] = 1
    (folder / "model.bin").write_bytes(data)
    assert files_digest(folder)[0] == before
    data[offsets[3]] = 1
    (folder / "model.bin").write_bytes(data)
    assert files_digest(folder)[0] != before


def test_a_file_with_more_tensors_than_sampled_still_samples_them_evenly(tmp_path: Path) -> None:
    folder = tmp_path / "moe"
    folder.mkdir()
    count = 3 * MAX_TENSORS
    write_safetensors(folder / "experts.safetensors",
                      {f"expert.{i}": tensor_bytes(i, TENSOR_BYTES) for i in range(count)})
    _, cost = files_digest(folder)
    # 16 chunks, the header, MAX_TENSORS tensors.
    assert cost.reads == len(sample_offsets(count * TENSOR_BYTES)) + 1 + MAX_TENSORS


@given(st.integers(0, 1 << 40), st.integers(1, 64), st.integers(1, 1 << 20))
def test_sample_offsets_are_sorted_distinct_and_inside_the_file(
    size: int, chunks: int, chunk_bytes: int
) -> None:
    offsets = sample_offsets(size, chunks, chunk_bytes)
    assert list(offsets) == sorted(set(offsets)) and 1 <= len(offsets) <= chunks
    assert offsets[0] == 0
    if size > chunk_bytes and chunks > 1:
        assert offsets[-1] == size - chunk_bytes
    assert all(0 <= offset and offset + min(chunk_bytes, size) <= max(size, 1) for offset in offsets)


def test_local_weights_hub_revisions_and_what_cannot_be_identified(
    model: Path, tmp_path: Path
) -> None:
    assert weights_identity(str(model), None, "auto", None) == files_digest(model)[0]
    single = model / "model-00000.safetensors"
    assert weights_identity(str(single), None, "auto", None).startswith("files:")
    dummy = weights_identity(str(model), None, "dummy", None)
    assert dummy.startswith("dummy:files:"), "dummy weights follow the config alone"
    (model / "model-00000.safetensors").write_bytes(b"changed")
    assert weights_identity(str(model), None, "dummy", None) == dummy
    # A hub model pinned to a commit is identified by it, even out of the cache.
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert weights_identity("org/name", commit, "auto", str(tmp_path / "empty-cache")) == (
        f"hub:org/name@{commit}")
    with pytest.raises(WeightsUnknown, match="Set an explicit 'namespace'"):
        weights_identity("org/name", "main", "auto", str(tmp_path / "empty-cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsUnknown, match="holds no weight files"):
        files_digest(empty)


def test_a_hub_model_in_the_local_cache_is_identified_by_its_resolved_commit(
    tmp_path: Path,
) -> None:
    """The hub cache's layout (refs/<revision> -> commit, snapshots/<commit>/...), as
    huggingface_hub writes it: ``main`` resolves to the commit it names now."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    first, second = "a" * 40, "b" * 40
    for commit in (first, second):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    assert hub_commit("org/name", None, str(cache)) == first
    assert weights_identity("org/name", None, "auto", str(cache)) == f"hub:org/name@{first}"
    (repo / "refs" / "main").write_text(second)  # main moved to new weights
    assert weights_identity("org/name", "main", "auto", str(cache)) == f"hub:org/name@{second}"
