"""Moving KV bytes between tiers: layouts, the pinned host pool, copy handlers, the worker.

The worker side makes no policy decisions: it executes ``TransferSpec``s
(block ids in, job results out) handed over by the scheduler side.
"""

from kvoffload.transfer.copy_plan import STRATEGIES, GroupPairs, RowPairs, copy_rows
from kvoffload.transfer.cuda_streams import CudaStreamTransferHandler
from kvoffload.transfer.gpu_cpu import CpuGpuTransferHandler, GpuCpuJobPlanner
from kvoffload.transfer.handler import ThreadPoolTransferHandler, TransferHandler
from kvoffload.transfer.host_memory import host_buffer
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.layout import (
    LAYOUT_KINDS,
    SUPPORTED_DTYPES,
    KVGeometry,
    KVLayout,
    parse_dtype,
)
from kvoffload.transfer.sizing import (
    compute_block_size_factor,
    cpu_slot_bytes,
    format_bytes,
    num_cpu_blocks,
    parse_bytes,
)
from kvoffload.transfer.spec import TransferResult, TransferSpec, as_transfer_spec
from kvoffload.transfer.worker import OffloadingWorker, make_cpu_gpu_handler

__all__ = [
    "LAYOUT_KINDS",
    "STRATEGIES",
    "SUPPORTED_DTYPES",
    "CpuGpuTransferHandler",
    "CudaStreamTransferHandler",
    "GpuCpuJobPlanner",
    "GroupPairs",
    "HostPool",
    "KVGeometry",
    "KVLayout",
    "OffloadingWorker",
    "RowPairs",
    "ThreadPoolTransferHandler",
    "TransferHandler",
    "TransferResult",
    "TransferSpec",
    "as_transfer_spec",
    "compute_block_size_factor",
    "copy_rows",
    "cpu_slot_bytes",
    "format_bytes",
    "host_buffer",
    "make_cpu_gpu_handler",
    "num_cpu_blocks",
    "parse_bytes",
    "parse_dtype",
]
