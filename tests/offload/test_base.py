"""Offload keys, load/store specs and the manager's data types."""

import dataclasses

import numpy as np
import pytest

from kvoffload.offload import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    make_offload_key,
    offload_key_block_hash,
    offload_key_group_idx,
)


def test_key_is_hash_plus_big_endian_group() -> None:
    h = bytes(range(32))
    key = make_offload_key(h, 258)
    assert isinstance(key, bytes)
    assert key == h + b"\x00\x00\x01\x02"
    assert offload_key_block_hash(key) == h
    assert offload_key_group_idx(key) == 258
    assert make_offload_key(h) == h + bytes(4)


def test_keys_of_groups_differ() -> None:
    h = b"\x01" * 8
    assert make_offload_key(h, 0) != make_offload_key(h, 1)


@pytest.mark.parametrize("group", [-1, 1 << 32])
def test_bad_group(group: int) -> None:
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"x" * 8, group)


def test_short_key_rejected() -> None:
    with pytest.raises(ValueError):
        offload_key_block_hash(b"abc")
    with pytest.raises(ValueError):
        offload_key_group_idx(b"")


def test_specs_hold_int64_block_ids() -> None:
    spec = CPULoadStoreSpec([3, 1, 2])
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.ndim == 1
    assert spec.block_ids.tolist() == [3, 1, 2]
    assert len(spec) == 3
    assert CPULoadStoreSpec.medium() == "CPU" and spec.medium() == "CPU"
    assert GPULoadStoreSpec.medium() == "GPU"
    assert isinstance(spec, BlockIDsLoadStoreSpec) and isinstance(spec, LoadStoreSpec)
    assert CPULoadStoreSpec(np.array([1, 2], dtype=np.int32)).block_ids.dtype == np.int64
    assert len(CPULoadStoreSpec([])) == 0


def test_spec_equality_is_by_medium_and_ids() -> None:
    assert CPULoadStoreSpec([1, 2]) == CPULoadStoreSpec(np.array([1, 2]))
    assert CPULoadStoreSpec([1, 2]) != CPULoadStoreSpec([2, 1])
    assert CPULoadStoreSpec([1, 2]) != GPULoadStoreSpec([1, 2])


def test_spec_must_be_1d() -> None:
    with pytest.raises(ValueError, match="1-D"):
        CPULoadStoreSpec(np.zeros((2, 2), dtype=np.int64))


def test_load_store_spec_is_abstract() -> None:
    with pytest.raises(TypeError):
        LoadStoreSpec()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        OffloadingManager()  # type: ignore[abstract]


def test_event_has_no_block_size() -> None:
    names = [f.name for f in dataclasses.fields(OffloadingEvent)]
    assert names == ["keys", "medium", "removed"]
    ev = OffloadingEvent([make_offload_key(b"a" * 8)], "CPU", removed=False)
    assert ev.medium == "CPU" and not ev.removed


def test_prepare_store_output_fields() -> None:
    names = [f.name for f in dataclasses.fields(PrepareStoreOutput)]
    assert names[:3] == ["keys_to_store", "store_spec", "evicted_keys"]
    out = PrepareStoreOutput([], CPULoadStoreSpec([]), [])
    assert out.evicted_spec is None
