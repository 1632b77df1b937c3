"""A toy worker for the tiered manager's tests: executes specs on dicts, with faults.

A block's *content* is the key it should hold; a corrupted or half-written
place holds ``GARBAGE``. The stores behave like the real ones: the disk
returns a slot's bytes only for the key recorded at that slot (and drops an
entry whose bytes do not verify), the remote returns what was set under a
key. A load that delivers anything but each key's own content to the GPU is
corruption, which the tests assert never happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.offload import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec, OffloadKey
from kvoffload.tiers.lower_tier import (
    DiskLoadStoreSpec,
    RemoteLoadStoreSpec,
    TierCopy,
    TieredLoadStoreSpec,
)

GARBAGE = b"<garbage>"


class CopyFailed(Exception):
    pass


@dataclass
class World:
    cpu: dict[int, bytes] = field(default_factory=dict)
    gpu: dict[int, bytes] = field(default_factory=dict)
    disk: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # slot -> (key, content)
    remote: dict[bytes, bytes] = field(default_factory=dict)
    remote_up: bool = True
    #: Media pairs ("CPU", "DISK") whose next copy fails; consumed one per copy.
    fail_next: list[tuple[str, str]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    # -- remote as the managers see it --------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not self.remote_up:
            return [False] * len(keys)
        return [bytes(k) in self.remote for k in keys]

    def available(self) -> bool:
        return self.remote_up

    # -- bytes --------------------------------------------------------------

    def read(self, spec: LoadStoreSpec) -> list[bytes | None]:
        if isinstance(spec, CPULoadStoreSpec):
            return [self.cpu.get(int(s), GARBAGE) for s in spec.block_ids]
        if isinstance(spec, GPULoadStoreSpec):
            return [self.gpu.get(int(b), GARBAGE) for b in spec.block_ids]
        if isinstance(spec, DiskLoadStoreSpec):
            out: list[bytes | None] = []
            for s, k in zip(spec.block_ids.tolist(), spec.keys):
                entry = self.disk.get(s)
                if entry is None or entry[0] != k:
                    out.append(None)
                elif entry[1] != k:  # fails its checksum: the store drops it
                    del self.disk[s]
                    out.append(None)
                else:
                    out.append(entry[1])
            return out
        if isinstance(spec, RemoteLoadStoreSpec):
            if not self.remote_up:
                return [None] * len(spec.keys)
            return [self.remote.get(bytes(k)) for k in spec.keys]
        raise TypeError(spec)

    def write(self, spec: LoadStoreSpec, data: list[bytes | None]) -> None:
        if isinstance(spec, CPULoadStoreSpec):
            for s, d in zip(spec.block_ids.tolist(), data):
                self.cpu[s] = GARBAGE if d is None else d
        elif isinstance(spec, GPULoadStoreSpec):
            for b, d in zip(spec.block_ids.tolist(), data):
                self.gpu[b] = GARBAGE if d is None else d
        elif isinstance(spec, DiskLoadStoreSpec):
            for s, k, d in zip(spec.block_ids.tolist(), spec.keys, data):
                if d is None:
                    self.disk.pop(s, None)
                else:
                    self.disk[s] = (k, d)
        elif isinstance(spec, RemoteLoadStoreSpec):
            if self.remote_up:
                for k, d in zip(spec.keys, data):
                    if d is not None:
                        self.remote[bytes(k)] = d
        else:
            raise TypeError(spec)

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """One copy; False when a block could not be read or the copy was made to fail."""
        pair = (src.medium(), dst.medium())
        data = self.read(src)
        if pair in self.fail_next:
            self.fail_next.remove(pair)
            self.write(dst, [None] * len(data))  # half-written garbage
            self.log.append(f"fail {pair}")
            return False
        if isinstance(dst, RemoteLoadStoreSpec) and not self.remote_up:
            return False
        self.write(dst, data)
        return all(d is not None for d in data)

    def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Execute one job the way the worker does; returns its success."""
        tiered = src if isinstance(src, TieredLoadStoreSpec) else dst
        if not isinstance(tiered, TieredLoadStoreSpec):
            return self.copy(src, dst)
        if tiered.error:
            return False
        for step in tiered.before:
            if not self._step(step):
                return False
        ok = self.copy(tiered.cpu, dst) if tiered is src else self.copy(src, tiered.cpu)
        if not ok:
            return False
        for step in tiered.after:
            self._step(step)
        return True

    def _step(self, step: TierCopy) -> bool:
        ok = self.copy(step.src, step.dst)
        return ok or not step.required


def keyset(keys: Sequence[OffloadKey]) -> list[bytes]:
    return [bytes(k) for k in keys]
