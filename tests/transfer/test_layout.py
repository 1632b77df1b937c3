"""KVGeometry validation and KVLayout shapes, views, planes and groups."""

from __future__ import annotations

import pytest
import torch

from kvoffload.transfer.layout import LAYOUT_KINDS, SUPPORTED_DTYPES, KVGeometry, KVLayout

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_size=4, block_size=5, dtype=torch.float16)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_size", "block_size"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_geometry_rejects_non_positive_ints_naming_the_field(field: str, bad: object) -> None:
    kwargs = dict(num_layers=1, num_kv_heads=1, head_size=1, block_size=1, dtype=torch.float32)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=f"KVGeometry.{field}"):
        KVGeometry(**kwargs)  # type: ignore[arg-type]


def test_geometry_dtype_names_and_unsupported() -> None:
    assert KVGeometry(1, 1, 1, 1, "bf16").dtype is torch.bfloat16  # type: ignore[arg-type]
    assert KVGeometry(1, 1, 1, 1, "torch.float32").dtype is torch.float32  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"KVGeometry.dtype.*not supported"):
        KVGeometry(1, 1, 1, 1, torch.complex64)
    with pytest.raises(ValueError, match=r"KVGeometry.dtype.*unknown"):
        KVGeometry(1, 1, 1, 1, "float13")  # type: ignore[arg-type]


def test_bytes_per_block() -> None:
    assert GEOM.element_size == 2
    assert GEOM.bytes_per_block == 3 * 2 * 5 * 2 * 4 * 2
    for kind in LAYOUT_KINDS:
        assert KVLayout(GEOM, kind).bytes_per_block == GEOM.bytes_per_block


def test_unknown_kind_lists_known() -> None:
    with pytest.raises(ValueError, match="layer_first, kv_split, cross_layer"):
        KVLayout(GEOM, "blocks_last")


@pytest.mark.parametrize(
    ("kind", "shapes"),
    [
        ("layer_first", [(2, 7, 5, 2, 4)] * 3),
        ("kv_split", [(7, 2, 5, 2, 4)] * 3),
        ("cross_layer", [(7, 3, 2, 5, 2, 4)]),
    ],
)
def test_allocate_shapes(kind: str, shapes: list[tuple[int, ...]]) -> None:
    layout = KVLayout(GEOM, kind)
    tensors = layout.allocate(7)
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.dtype == torch.float16 and not t.any() for t in tensors)
    assert layout.num_blocks_of(tensors) == 7
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert total == 7 * layout.bytes_per_block


def test_allocate_rejects_bad_counts_and_pinning_without_cuda() -> None:
    layout = KVLayout(GEOM)
    with pytest.raises(ValueError, match="num_blocks"):
        layout.allocate(0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory"):
            layout.allocate(2, pin_memory=True)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_layer_kv_views_write_through_to_the_right_place(kind: str) -> None:
    layout = KVLayout(GEOM, kind)
    tensors = layout.allocate(4)
    for layer in range(GEOM.num_layers):
        k, v = layout.layer_kv(tensors, layer)
        assert k.shape == v.shape == (4, 5, 2, 4)
        k[2, 1, 0, 3] = 100 + layer
        v[3, 4, 1, 0] = 200 + layer
    for layer in range(GEOM.num_layers):
        if kind == "layer_first":
            k_val = tensors[layer][0, 2, 1, 0, 3]
            v_val = tensors[layer][1, 3, 4, 1, 0]
        elif kind == "kv_split":
            k_val = tensors[layer][2, 0, 1, 0, 3]
            v_val = tensors[layer][3, 1, 4, 1, 0]
        else:
            k_val = tensors[0][2, layer, 0, 1, 0, 3]
            v_val = tensors[0][3, layer, 1, 4, 1, 0]
        assert k_val == 100 + layer and v_val == 200 + layer
    with pytest.raises(IndexError):
        layout.layer_kv(tensors, GEOM.num_layers)


@pytest.mark.parametrize(
    ("kind", "planes"), [("layer_first", 6), ("kv_split", 3), ("cross_layer", 1)]
)
def test_block_planes_cover_each_block_exactly(kind: str, planes: int) -> None:
    layout = KVLayout(GEOM, kind)
    tensors = layout.allocate(4)
    got = layout.block_planes(tensors)
    assert len(got) == layout.num_planes == planes
    assert all(p.shape == (4, layout.plane_row_bytes) and p.dtype == torch.uint8 for p in got)
    # Writing block 1's rows in every plane touches exactly block 1's K and V in every layer.
    for p in got:
        p[1] = 0xFF
    for layer in range(GEOM.num_layers):
        k, v = layout.layer_kv(tensors, layer)
        for cache in (k, v):
            blocks_set = [bool((cache[b].view(torch.int16) == -1).all()) for b in range(4)]
            assert blocks_set == [False, True, False, False]


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_block_groups_fuse_one_region_and_not_separate_tensors(kind: str) -> None:
    layout = KVLayout(GEOM, kind)
    region_tensors = layout.allocate(4)
    groups = layout.block_groups(region_tensors)
    assert len(groups) == 1 and groups[0].shape[0] == layout.num_planes
    separate = [t.clone() for t in region_tensors]
    split = layout.block_groups(separate)
    assert len(split) == (1 if kind == "cross_layer" else layout.num_planes)
    # The fused view and the per-plane views name the same bytes.
    planes = layout.block_planes(region_tensors)
    width = layout.view_width(region_tensors)
    for p, plane in enumerate(planes):
        assert torch.equal(groups[0][p].view(torch.uint8), plane)
        plane[3, :width] = p + 1
        assert groups[0][p, 3].view(torch.uint8)[:width].eq(p + 1).all()


def test_view_width_follows_row_size() -> None:
    odd = KVLayout(KVGeometry(1, 1, 3, 1, torch.uint8), "cross_layer")  # 6-byte rows
    assert odd.view_width(odd.allocate(2)) == 2
    wide = KVLayout(GEOM, "cross_layer")
    assert wide.view_width(wide.allocate(2)) == 8
    with pytest.raises(ValueError, match="width"):
        odd.block_groups(odd.allocate(2), width=4)


def test_num_blocks_of_names_the_mismatch() -> None:
    layout = KVLayout(GEOM, "layer_first")
    tensors = layout.allocate(3)
    with pytest.raises(ValueError, match="3 KV tensor"):
        layout.num_blocks_of(tensors[:2])
    bad_shape = [*tensors[:2], torch.zeros(2, 3, 5, 2, 5, dtype=torch.float16)]
    with pytest.raises(ValueError, match="KV tensor 2 has shape"):
        layout.num_blocks_of(bad_shape)
    bad_dtype = [*tensors[:2], tensors[2].float()]
    with pytest.raises(ValueError, match="dtype"):
        layout.num_blocks_of(bad_dtype)
    strided = [t.transpose(3, 4).contiguous().transpose(3, 4) for t in tensors]
    with pytest.raises(ValueError, match="contiguous"):
        layout.num_blocks_of(strided)


def test_supported_dtypes_include_fp8_when_torch_has_it() -> None:
    assert torch.bfloat16 in SUPPORTED_DTYPES and torch.float16 in SUPPORTED_DTYPES
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.float8_e4m3fn in SUPPORTED_DTYPES
