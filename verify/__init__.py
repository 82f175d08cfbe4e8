"""Numerical-equivalence checks of any backend against the reference (used by tests and GPU scripts)."""

from .compare import FLOOR, TENSORS, Report, compare, random_inputs, random_sinks, rel_l2
from .suite import run_suite

__all__ = ["FLOOR", "TENSORS", "Report", "compare", "random_inputs", "random_sinks", "rel_l2", "run_suite"]
