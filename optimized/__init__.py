"""CuTe DSL kernels for Hopper (sm_90a): the mask-aware forward and backward."""

from .interface import KernelOptions, compile_check, compile_seconds, cute_attention, kernel_options, unsupported_reason

__all__ = [
    "cute_attention",
    "unsupported_reason",
    "compile_check",
    "compile_seconds",
    "KernelOptions",
    "kernel_options",
]
