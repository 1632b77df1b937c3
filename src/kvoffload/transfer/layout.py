"""KV cache geometry and the physical layouts of the engine's KV tensors.

Three layouts are supported (``num_blocks`` is always the block dimension the
block ids index):

``layer_first``
    one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_size]``
    (K/V first). A block of one layer is two contiguous chunks (its K and its V).
``kv_split``
    one tensor per layer, ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.
    A block of one layer is one contiguous chunk (K then V).
``cross_layer``
    a single tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]``.
    A whole block, all layers, is one contiguous chunk.

Copies see a layout as a list of *block planes* (``block_planes``): 2-D byte
views ``[num_blocks, row_bytes]`` whose rows are contiguous, one row per block.
Copying block ``s`` of one set of tensors to block ``d`` of another set with the
same layout kind is copying row ``s`` to row ``d`` of every plane pair, which is
what makes batched gather/scatter possible. Planes are viewed as ``uint8`` so
that copies are bit-exact for every dtype (fp8 included) and need no
dtype-specific kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

_INT_BY_WIDTH: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}

LayoutKind = Literal["layer_first", "kv_split", "cross_layer"]
LAYOUT_KINDS: tuple[str, ...] = ("layer_first", "kv_split", "cross_layer")


def _supported_dtypes() -> tuple[torch.dtype, ...]:
    names = (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "int8",
        "uint8",
    )
    # fp8 types exist only in newer torch builds; take what this one has.
    return tuple(
        getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)
    )


SUPPORTED_DTYPES: tuple[torch.dtype, ...] = _supported_dtypes()

_DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A supported ``torch.dtype`` from a dtype or its name ("float16", "bf16", "fp8", ...)."""
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        name = str(value).strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        dtype = getattr(torch, name, None)  # type: ignore[assignment]
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value!r}")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported for KV caches; supported: {names}")
    return dtype


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache, independent of how it is laid out.

    All sizes are positive ints; ``dtype`` is one of ``SUPPORTED_DTYPES``
    (a dtype name such as "bfloat16" is accepted and normalised).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        try:
            dtype = parse_dtype(self.dtype)
        except ValueError as exc:
            raise ValueError(f"KVGeometry.dtype: {exc}") from None
        object.__setattr__(self, "dtype", dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, all layers."""
        return self.block_size * self.bytes_per_token

    @property
    def chunk_shape(self) -> tuple[int, int, int]:
        """``[block_size, num_kv_heads, head_size]``: the K (or V) of one block in one layer."""
        return (self.block_size, self.num_kv_heads, self.head_size)


class KVLayout:
    """How a geometry's KV cache is laid out in tensors; see the module docstring.

    A layout is immutable and holds no tensors: methods take the tensor list
    (``allocate``'s result or the engine's own tensors) as an argument.
    """

    __slots__ = ("geometry", "kind")

    def __init__(self, geometry: KVGeometry, kind: str = "layer_first") -> None:
        if not isinstance(geometry, KVGeometry):
            raise TypeError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        if kind not in LAYOUT_KINDS:
            raise ValueError(f"unknown KV layout {kind!r}; known: {', '.join(LAYOUT_KINDS)}")
        self.geometry = geometry
        self.kind: str = kind

    def __repr__(self) -> str:
        return f"KVLayout({self.geometry!r}, kind={self.kind!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVLayout):
            return NotImplemented
        return self.geometry == other.geometry and self.kind == other.kind

    def __hash__(self) -> int:
        return hash((self.geometry, self.kind))

    # -- sizes and shapes -----------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.geometry.bytes_per_block

    @property
    def num_tensors(self) -> int:
        return 1 if self.kind == "cross_layer" else self.geometry.num_layers

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of each of the layout's ``num_tensors`` tensors."""
        g = self.geometry
        if self.kind == "layer_first":
            return (2, num_blocks, *g.chunk_shape)
        if self.kind == "kv_split":
            return (num_blocks, 2, *g.chunk_shape)
        return (num_blocks, g.num_layers, 2, *g.chunk_shape)

    def region_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one contiguous region holding all tensors (``split_region``)."""
        shape = self.tensor_shape(num_blocks)
        return shape if self.kind == "cross_layer" else (self.geometry.num_layers, *shape)

    # -- tensors ----------------------------------------------------------------

    def allocate(
        self, num_blocks: int, device: str | torch.device = "cpu", pin_memory: bool = False
    ) -> list[torch.Tensor]:
        """Zeroed KV tensors for ``num_blocks`` blocks, carved from one contiguous region.

        ``pin_memory`` asks for page-locked host memory; it needs a CPU device
        and a CUDA build with a device (``ValueError`` otherwise).
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        device = torch.device(device)
        if pin_memory and (device.type != "cpu" or not torch.cuda.is_available()):
            raise ValueError("pin_memory needs a CPU device and an available CUDA device")
        region = torch.zeros(
            self.region_shape(num_blocks),
            dtype=self.geometry.dtype,
            device=device,
            pin_memory=pin_memory,
        )
        return self.split_region(region)

    def split_region(self, region: torch.Tensor) -> list[torch.Tensor]:
        """The layout's tensors as views of ``region`` (shaped ``region_shape``)."""
        if self.kind == "cross_layer":
            return [region]
        return list(region.unbind(0))

    def num_blocks_of(self, tensors: Sequence[torch.Tensor]) -> int:
        """The block count of ``tensors``, after checking they match this layout.

        Raises ``ValueError`` naming the first mismatch (count, shape, dtype,
        device, or a row that is not contiguous).
        """
        if len(tensors) != self.num_tensors:
            raise ValueError(
                f"{self.kind} layout has {self.num_tensors} KV tensor(s), got {len(tensors)}"
            )
        first = tensors[0]
        block_dim = 1 if self.kind == "layer_first" else 0
        if first.dim() <= block_dim:
            raise ValueError(f"KV tensor 0 has shape {tuple(first.shape)}")
        num_blocks = int(first.shape[block_dim])
        expected = self.tensor_shape(num_blocks)
        for i, t in enumerate(tensors):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"KV tensor {i} has shape {tuple(t.shape)}, {self.kind} layout expects "
                    f"{expected}"
                )
            if t.dtype != self.geometry.dtype:
                raise ValueError(
                    f"KV tensor {i} has dtype {t.dtype}, expected {self.geometry.dtype}"
                )
            if t.device != first.device:
                raise ValueError(f"KV tensor {i} is on {t.device}, tensor 0 on {first.device}")
        for plane in self._planes(tensors):
            if num_blocks and not plane[0].is_contiguous():
                raise ValueError(f"{self.kind} KV tensors must have contiguous blocks")
        return num_blocks

    def layer_kv(
        self, tensors: Sequence[torch.Tensor], layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of ``layer``, views shaped ``[num_blocks, block_size, H, D]``.

        Writes through the views land in ``tensors`` (paged attention uses them).
        """
        if not 0 <= layer < self.geometry.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.geometry.num_layers})")
        if self.kind == "layer_first":
            t = tensors[layer]
            return t[0], t[1]
        if self.kind == "kv_split":
            t = tensors[layer]
            return t[:, 0], t[:, 1]
        t = tensors[0]
        return t[:, layer, 0], t[:, layer, 1]

    def _planes(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.kind == "layer_first":
            return [t[kv] for t in tensors for kv in (0, 1)]
        return list(tensors)

    def block_planes(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Byte views ``[num_blocks, row_bytes]`` of ``tensors``, one row per block.

        ``layer_first`` gives ``2 * num_layers`` planes (K and V of each layer),
        ``kv_split`` one per layer and ``cross_layer`` exactly one. Row ``b`` of
        every plane together is block ``b``; rows are contiguous.
        """
        self.num_blocks_of(tensors)
        out = []
        for plane in self._planes(tensors):
            rows = plane.reshape(plane.shape[0], -1)  # a view: rows are contiguous
            out.append(rows.view(torch.uint8))
        return out

    def block_groups(
        self, tensors: Sequence[torch.Tensor], width: int | None = None, fuse: bool = True
    ) -> list[torch.Tensor]:
        """The planes as 3-D integer views ``[planes, num_blocks, row]``; dim 1 is the block.

        Rows are reinterpreted as the widest integer type (up to 8 bytes) that
        the row size and alignment allow, or ``width`` bytes when given (it
        must divide ``view_width``). Copying integers is bit-exact and torch's
        index kernels run per element, so wider elements are several times
        faster than bytes. When ``fuse`` and all planes are equally spaced
        in one storage (tensors carved from one region, as ``allocate`` and
        ``HostPool`` do) the result is a single view spanning every plane, so
        one op moves a block in all layers; otherwise one group per plane.
        """
        planes = self.block_planes(tensors)
        w = self.view_width(tensors) if width is None else width
        if w not in _INT_BY_WIDTH or self.view_width(tensors) % w:
            raise ValueError(f"width {w} is not a usable element width for these tensors")
        views = [p.view(_INT_BY_WIDTH[w]) for p in planes]
        fused = _fuse(views) if fuse else None
        return [fused] if fused is not None else [v.unsqueeze(0) for v in views]

    def view_width(self, tensors: Sequence[torch.Tensor]) -> int:
        """The widest integer element size (1, 2, 4 or 8 bytes) that divides every row
        size, block stride and plane offset of ``tensors``."""
        w = 8
        for p in self.block_planes(tensors):
            byte_quantities = (
                p.shape[1],
                p.stride(0),
                p.storage_offset(),
                p.untyped_storage().data_ptr(),
            )
            while w > 1 and any(q % w for q in byte_quantities):
                w //= 2
        return w

    @property
    def num_planes(self) -> int:
        """How many planes ``block_planes`` gives."""
        return 2 * self.geometry.num_layers if self.kind == "layer_first" else self.num_tensors

    @property
    def plane_row_bytes(self) -> int:
        """Bytes in one row of each ``block_planes`` plane."""
        return self.bytes_per_block // self.num_planes


def _fuse(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[P, num_blocks, row]`` view over equally spaced, same-shaped 2-D planes, or None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0:
        return None
    for i, v in enumerate(views):
        if (
            v.shape != first.shape
            or v.stride() != first.stride()
            or v.device != first.device
            or v.untyped_storage().data_ptr() != storage
            or v.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    return first.as_strided(
        (len(views), *first.shape), (step, *first.stride()), first.storage_offset()
    )
