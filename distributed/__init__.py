"""Context parallelism: chunk plans, zero-communication mask localization, the sparsity-aware
balancer and mask-aware all-gather / ring / all-gather CP attention on torch.distributed, and
threads as ranks (`emulate`) to test it without several GPUs."""

from .balance import balance, chunk_loads, imbalance, lower_bound
from .context_parallel import SCHEMES, ContextParallelAttention, CPConfig, CPStats, cp_attention
from .emulator import Emulation, EmulatorError, emulate
from .localize import chunk_visibility, local_rows_below, localize
from .plan import CPPlan, contiguous_assignment, make_plan, zigzag_assignment

__all__ = [
    "CPPlan",
    "make_plan",
    "contiguous_assignment",
    "zigzag_assignment",
    "localize",
    "chunk_visibility",
    "local_rows_below",
    "balance",
    "chunk_loads",
    "imbalance",
    "lower_bound",
    "CPConfig",
    "CPStats",
    "SCHEMES",
    "cp_attention",
    "ContextParallelAttention",
    "emulate",
    "Emulation",
    "EmulatorError",
]
