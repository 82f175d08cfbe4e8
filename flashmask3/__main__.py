"""`python -m flashmask3 [overrides]`: run one configured experiment (Hydra, conf/config.yaml).

Default: causal-document mask, 2K tokens, reference backend on the CPU. Prints the mask density,
tile classes, forward / forward+backward time and FLOP/s on unmasked work, and the max error vs
an fp64 SDPA computation; writes a JSON record under `logging.out_dir` and prints its path.
Sweeps: `-m`, e.g. `python -m flashmask3 -m mask=causal,document backend=reference,flex
seqlen=2048,4096`; ablations (sweeps: `-m` required): `-m +experiment=kernel_ablation` (H200),
`-m +experiment=cp_ablation` (gloo processes), `-m +experiment=mask_sweep`.

A bad setting prints one `error: ...` line and the exit code is 2: a ValueError or RuntimeError
from the job (in a sweep the other jobs still run), or Hydra's own errors (an unknown option of a
config group, a key that is not in the config, an override it cannot parse). A sweep whose every
job needs a GPU the machine lacks (`-m +experiment=kernel_ablation` without one) stops before its
first job, with one such line. HYDRA_FULL_ERROR=1 raises the others with their tracebacks.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from .experiment import run_experiment

_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user's: raise, with the traceback
_failed_jobs: list[str] = []


def one_line(error: BaseException) -> str:
    """An error's message on one line. Hydra's and OmegaConf's span several: the accepted options
    one per line (tab-indented, joined here by commas), the config search path and the failing
    key's details (both dropped), the OmegaConf error behind a Hydra one (added in parentheses)."""
    text = str(error).split("\nConfig search path:")[0]
    parts: list[str] = []
    for line in text.splitlines():
        if line.startswith("\t") and parts:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line.strip()
        elif line.strip() and not line.startswith("    "):
            parts.append(line.strip())
    message = " ".join(
        p if p.endswith((".", ":", ";")) or i == len(parts) - 1 else p + ";" for i, p in enumerate(parts)
    )
    if isinstance(error, OverrideParseException):
        message = f"cannot parse the override {error.override!r}: {message}"
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).splitlines():
        message += f" ({str(cause).splitlines()[0]})"
    return message or type(error).__name__


@hydra.main(version_base="1.3", config_path="pkg://flashmask3.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if "experiment" in cfg and HydraConfig.get().mode != RunMode.MULTIRUN:
            raise ValueError(
                f"+experiment={cfg.experiment} is a sweep: run it with -m "
                f"(python -m flashmask3 -m +experiment={cfg.experiment})"
            )
        run_experiment(cfg)
    except (ValueError, RuntimeError, OmegaConfBaseException) as error:
        if _FULL_ERROR:
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        _failed_jobs.append(str(error))


def run() -> int:
    """The entry point: 0, or 2 when a job or Hydra itself failed (one `error:` line each)."""
    if not _FULL_ERROR:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises its errors here, to print on one line
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        if _FULL_ERROR:
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    return 2 if _failed_jobs else 0


if __name__ == "__main__":
    sys.exit(run())
