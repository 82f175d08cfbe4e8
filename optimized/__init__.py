"""CuTe DSL kernels for Hopper (sm_90a): the mask-aware forward and backward."""

from .config import BwdConfig, FwdConfig, bwd_config, fwd_config
from .interface import compile_check, compile_only, compile_seconds, cute_attention, unsupported_reason

__all__ = [
    "cute_attention",
    "unsupported_reason",
    "compile_check",
    "compile_only",
    "compile_seconds",
    "FwdConfig",
    "BwdConfig",
    "fwd_config",
    "bwd_config",
]
