"""`python -m flashmask3 [overrides]`: run one configured experiment (Hydra, conf/config.yaml).

Default: causal-document mask, 2K tokens, reference backend on the CPU. Prints the mask density,
tile classes, forward / forward+backward time and TFLOP/s on unmasked work, and the max error vs
an fp64 SDPA computation; writes a JSON record under `logging.out_dir`. Sweeps: `-m`, e.g.
`python -m flashmask3 -m mask=causal,document backend=reference,flex seqlen=2048,4096`;
ablations: `+experiment=kernel_ablation` (H200), `+experiment=cp_ablation` (gloo processes).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .experiment import run_experiment


@hydra.main(version_base="1.3", config_path="pkg://flashmask3.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_experiment(cfg)


if __name__ == "__main__":
    main()
