from kvoffload.offload import OffloadKey, make_offload_key


def key(i: int, group: int = 0) -> OffloadKey:
    """A distinct test key per ``i``."""
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]
