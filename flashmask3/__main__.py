"""`python -m flashmask3 [overrides]`: run one configured experiment (Hydra, conf/config.yaml).

Default: causal-document mask, 2K tokens, reference backend on the CPU. Prints the mask density,
tile classes, forward / forward+backward time and FLOP/s on unmasked work, and the max error vs
an fp64 SDPA computation; writes a JSON record under `logging.out_dir` and prints its path.
Sweeps: `-m`, e.g. `python -m flashmask3 -m mask=causal,document backend=reference,flex
seqlen=2048,4096`; ablations (sweeps: `-m` required): `-m +experiment=kernel_ablation` (H200),
`-m +experiment=cp_ablation` (gloo processes), `-m +experiment=mask_sweep`.

A bad setting (ValueError or RuntimeError from the job) prints one `error: ...` line and the exit
code is 2; in a sweep the other jobs still run. HYDRA_FULL_ERROR=1 raises it with its traceback.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .experiment import run_experiment

_failed_jobs: list[str] = []


@hydra.main(version_base="1.3", config_path="pkg://flashmask3.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if "experiment" in cfg and HydraConfig.get().mode != RunMode.MULTIRUN:
            raise ValueError(
                f"+experiment={cfg.experiment} is a sweep: run it with -m "
                f"(python -m flashmask3 -m +experiment={cfg.experiment})"
            )
        run_experiment(cfg)
    except (ValueError, RuntimeError) as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        _failed_jobs.append(str(error))


if __name__ == "__main__":
    main()
    sys.exit(2 if _failed_jobs else 0)
