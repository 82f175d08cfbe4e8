"""One configured experiment: build the mask and inputs, time a backend, check it, record it.

backend=cute calls the kernels (`optimized.interface.forward` / `backward`) in the configurations
`cfg.kernel` names: the ones chosen for the head dim and mask (`fwd_config` / `bwd_config`) with the
variant's `changes` (kernel ablations); other backends go through `attention`.
`RefuseSweepWithoutItsGpu` (a Hydra callback, conf/config.yaml) stops a sweep whose every job needs
the GPU the machine lacks before any job starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .api import attention
from .bench import attention_flops, git_commit, time_fn
from .reference import masks
from .verify.compare import random_inputs
from .verify.suite import DTYPES


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


class NoGpuError(RuntimeError):
    """The configuration runs on CUDA, and torch sees no CUDA GPU."""


def check_device(cfg: DictConfig, *, whole_sweep: bool = False) -> None:
    """Raise NoGpuError when `cfg` runs on CUDA and torch sees no GPU; `whole_sweep`: the message
    speaks for every job of a sweep, none of them launched."""
    if torch.device(cfg.device).type != "cuda" or torch.cuda.is_available():
        return
    no_gpu = f"torch {torch.__version__} sees no CUDA GPU"
    if not whole_sweep:
        raise NoGpuError(
            f"device={cfg.device}, but {no_gpu}: on the CPU use backend=reference, sdpa or flex with device=cpu "
            "(backend=cute and backend=flex_cuda set device=cuda)"
        )
    needs = 'a Hopper GPU (sm_90) and the gpu extra (pip install -e ".[experiments,gpu]")'
    raise NoGpuError(
        f"every job of this sweep runs with backend={cfg.backend} device={cfg.device}, but {no_gpu}, so none was "
        f"launched: run it on a machine with {needs if cfg.backend == 'cute' else 'a CUDA GPU'}"
    )


class RefuseSweepWithoutItsGpu(Callback):
    """Hydra callback: a sweep that runs every job on CUDA stops before its first job on a machine
    without a GPU, with one `error:` line and exit code 2 (Hydra's launcher would run every job, each
    failing alike). A sweep over backend or device is left to its jobs: some may run on the CPU."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        swept = {o.key_or_group for o in overrides if o.is_sweep_override()}
        swept |= set(config.hydra.sweeper.get("params") or {})  # an experiment's own sweep
        if swept & {"backend", "device"}:
            return
        try:
            check_device(config, whole_sweep=True)
        except NoGpuError as error:
            # Hydra turns a callback's exception into a warning and launches the sweep anyway: exit.
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from error


def run_experiment(cfg: DictConfig) -> dict:
    """Run the experiment `cfg` describes, print a summary and return (and write) its record."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    check_device(cfg)
    if cfg.cp.scheme != "none":
        return _run_cp_experiment(cfg)
    dtype, device = DTYPES[cfg.dtype], cfg.device
    if not isinstance(cfg.mask.get("params"), DictConfig):
        got = cfg.mask.get("params")
        raise ValueError(f"mask.params takes the mask's parameters by name (e.g. mask.params.num_docs=4), got {got!r}")
    params = OmegaConf.to_container(cfg.mask.params)
    mask = masks.build(cfg.mask.name, cfg.seqlen, cfg.batch, cfg.heads, cfg.seed, device, **params)
    classes = mask.block_classes(128, 128)
    density = mask.density()
    q, k, v, dout = random_inputs(
        cfg.batch, cfg.seqlen, cfg.seqlen, cfg.heads, cfg.kv_heads, cfg.head_dim, dtype, device, cfg.seed
    )
    backward = bool(cfg.bench.backward)
    if backward and cfg.backend == "flex" and device == "cpu":
        print("note: FlexAttention has no CPU backward; timing the forward only")
        backward = False
    q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
    deterministic = bool(cfg.bench.deterministic)
    kernel = None
    if cfg.backend == "cute":
        fwd, fwd_bwd, kernel = _cute_calls(cfg, q, k, v, dout, mask)
    else:

        def fwd():
            with torch.no_grad():
                return attention(q, k, v, mask, backend=cfg.backend)

        def fwd_bwd():
            out = attention(q, k, v, mask, backend=cfg.backend, deterministic=deterministic)
            return torch.autograd.grad(out, (q, k, v), dout)

    flops = attention_flops(cfg.batch, cfg.heads, cfg.seqlen, cfg.seqlen, cfg.head_dim, density)
    record = _time_and_check(cfg, fwd, fwd_bwd, flops, backward, device, q, k, v, dout, mask)
    if kernel is not None:
        record["kernel"] = kernel
    record["density"] = density
    record["tiles_128"] = {"skip": classes.skip, "partial": classes.partial, "unmasked": classes.unmasked}
    _print_summary(record)
    _write(record, cfg)
    return record


def _cute_calls(cfg: DictConfig, q, k, v, dout, mask) -> tuple[Callable, Callable, dict]:
    """(fwd, fwd_bwd, what they run): the cute kernels in the configurations chosen for the head dim
    and mask, with `cfg.kernel.changes` applied; fwd returns out, fwd_bwd (dq, dk, dv)."""
    from .optimized import interface

    fwd_cfg, bwd_cfg = interface.mask_configs(cfg.head_dim, mask, OmegaConf.to_container(cfg.kernel.changes))
    scale = cfg.head_dim**-0.5
    deterministic = bool(cfg.bench.deterministic)

    def fwd():
        return interface.forward(q, k, v, mask, scale, config=fwd_cfg)[0]

    def fwd_bwd():
        out, lse = interface.forward(q, k, v, mask, scale, config=fwd_cfg)
        return interface.backward(dout, q, k, v, out, lse, mask, scale, deterministic, config=bwd_cfg)

    kernel = {"name": cfg.kernel.name, "fwd": dataclasses.asdict(fwd_cfg), "bwd": dataclasses.asdict(bwd_cfg)}
    return fwd, fwd_bwd, kernel


def _time_and_check(cfg, fwd, fwd_bwd, flops, backward, device, q, k, v, dout, mask) -> dict:
    t_fwd = time_fn(fwd, cfg.bench.warmup, cfg.bench.repeats, device)
    record = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "commit": git_commit(),
        "environment": environment(device),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fwd_ms": t_fwd * 1e3,
        "fwd_tflops": flops / t_fwd / 1e12,
    }
    if backward:
        t_fb = time_fn(fwd_bwd, cfg.bench.warmup, cfg.bench.repeats, device)
        record |= {"fwd_bwd_ms": t_fb * 1e3, "fwd_bwd_tflops": 3.5 * flops / t_fb / 1e12}
    if cfg.batch * cfg.heads * cfg.seqlen**2 <= cfg.check.max_elements:
        record["max_abs_err_vs_" + cfg.check.against] = _max_error(q, k, v, dout, mask, cfg, fwd, fwd_bwd, backward)
    return record


def _run_cp_experiment(cfg: DictConfig) -> dict:
    from .cp_experiment import run_cp

    if cfg.device != "cpu":
        raise ValueError("the CP experiment spawns gloo processes on the CPU: use device=cpu")
    record = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "commit": git_commit(),
        "environment": environment("cpu"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    } | run_cp(cfg)
    c = record["cp"]
    print(
        f"CP {c['scheme']} on {c['world_size']} gloo ranks, {c['assignment']} assignment, mask={cfg.mask.name} "
        f"seqlen={cfg.seqlen}: imbalance {record['imbalance']:.3f}"
    )
    for rank, r in enumerate(record["per_rank"]):
        print(
            f"  rank {rank}: fwd {r['fwd_s'] * 1e3:.1f} ms, fwd+bwd {r['total_s'] * 1e3:.1f} ms, "
            f"sent {r['bytes_sent'] / 2**20:.2f} MiB"
        )
    errs = record["max_abs_err_vs_single_device"]
    print("max abs error vs single device: " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    _write(record, cfg)
    return record


def _max_error(q, k, v, dout, mask, cfg, fwd, fwd_bwd, backward: bool) -> dict:
    """Max abs difference of out (`fwd()`) and, with `backward`, the gradients (`fwd_bwd()`) from the
    `check.against` backend run in fp64."""
    ref_inputs = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
    ref = attention(*ref_inputs, mask, backend=cfg.check.against)
    errors = {"out": float((fwd().double() - ref).abs().max().detach())}
    if backward:
        got_g = fwd_bwd()
        ref_g = torch.autograd.grad(ref, ref_inputs, dout.double())
        for name, a, b in zip(("dq", "dk", "dv"), got_g, ref_g):
            errors[name] = float((a.double() - b).abs().max())
    return errors


def _print_summary(rec: dict) -> None:
    c = rec["config"]
    print(
        f"mask={c['mask']['name']} seqlen={c['seqlen']} B={c['batch']} H={c['heads']}/{c['kv_heads']} "
        f"D={c['head_dim']} {c['dtype']} backend={c['backend']} device={c['device']}"
    )
    if "kernel" in rec:
        kernel = rec["kernel"]
        print(
            f"kernel={kernel['name']}: "
            + "; ".join(f"{d} " + " ".join(f"{k}={v}" for k, v in kernel[d].items()) for d in ("fwd", "bwd"))
        )
    t = rec["tiles_128"]
    print(
        f"density {rec['density']:.4f}  tiles 128x128: skip {t['skip']} partial {t['partial']} unmasked {t['unmasked']}"
    )
    line = f"fwd {rec['fwd_ms']:.2f} ms ({_rate(rec['fwd_tflops'])})"
    if "fwd_bwd_ms" in rec:
        line += f"  fwd+bwd {rec['fwd_bwd_ms']:.2f} ms ({_rate(rec['fwd_bwd_tflops'])})"
    print(line)
    for key, errs in rec.items():
        if key.startswith("max_abs_err_vs_"):
            print(f"max abs error vs {key[15:]} (fp64): " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()))


def _rate(tflops: float) -> str:
    """TFLOP/s as GPUs reach them; GFLOP/s below 1 TFLOP/s (CPU runs), where 3 decimals show 0."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"


def _write(record: dict, cfg: DictConfig) -> None:
    out_dir = Path(cfg.logging.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = record["config"]
    name = f"{c['mask']['name']}_{c['backend']}_{c['seqlen']}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json"
    path = out_dir / name
    path.write_text(json.dumps(record, indent=1))
    record["path"] = str(path)
    print(f"record: {path}")
    wandb_cfg = cfg.logging.wandb
    if wandb_cfg.enabled:
        _log_wandb(record, wandb_cfg, out_dir)


def _log_wandb(record: dict, wandb_cfg: DictConfig, out_dir: Path) -> None:
    import wandb

    if wandb_cfg.mode not in ("offline", "disabled", "online"):
        raise ValueError(f"logging.wandb.mode must be offline, online or disabled, got {wandb_cfg.mode!r}")
    c = record["config"]
    run = wandb.init(
        project=wandb_cfg.project,
        mode=wandb_cfg.mode,
        dir=str(out_dir),
        config=c,
        name=f"{c['mask']['name']}-{c['backend']}-{c['seqlen']}",
        reinit="finish_previous",
    )
    metrics = {k: v for k, v in record.items() if isinstance(v, (int, float))}
    for key, errs in record.items():
        if key.startswith("max_abs_err_vs_"):
            metrics |= {f"err/{n}": e for n, e in errs.items()}
    run.log(metrics | {"summary": wandb.Table(columns=list(metrics), data=[list(metrics.values())])})
    run.summary.update(metrics)
    run.finish()
