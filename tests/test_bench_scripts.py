"""The H200 bench scripts' option parsing and plumbing (CPU)."""

import dataclasses
from pathlib import Path

import bench_fwd  # scripts/, on pytest's pythonpath
import pytest
from torch.nn.functional import scaled_dot_product_attention as SDPA  # the real one, which a test replaces

from flashmask3 import bench, bench_peers


def test_kernel_overrides_are_typed_like_the_config_fields():
    assert bench_fwd.kernel_overrides(["lse_ahead=true", "num_stages=3", "persistent=0"]) == {
        "lse_ahead": True,
        "num_stages": 3,
        "persistent": False,
    }
    assert bench_fwd.kernel_overrides([]) == {}


@pytest.mark.parametrize(
    "pair, message",
    [
        ("persistent=ture", "persistent must be true or false, got 'ture'"),
        ("num_stages=x", "num_stages must be an integer"),
    ],
)
def test_kernel_overrides_refuse_a_value_of_the_wrong_type(pair, message):
    with pytest.raises(SystemExit, match=message):
        bench_fwd.kernel_overrides([pair])


def test_ablation_variants_join_config_changes_with_plus():
    assert bench_fwd.variant_overrides("tile_m=128+num_stages=3+lse_ahead=1") == {
        "tile_m": 128,
        "num_stages": 3,
        "lse_ahead": True,
    }
    with pytest.raises(SystemExit, match="unknown config field 'stages'"):
        bench_fwd.variant_overrides("persistent=true+stages=3")


class FakeMask:
    """What the ablation loop reads of a mask: its density and its variant (causal, width 1, not
    segmented)."""

    causal = True
    segmented = False

    def __init__(self, density: float):
        import torch

        self.startend_row_indices = torch.zeros(1, 1, 8, 1, dtype=torch.int32)
        self.density = lambda: density


def called(mask, causal: bool, q, k):
    """The mask a faked kernel call stands for: `mask`, or with `causal` (and no mask) the causal one
    alone."""
    from conftest import plain_causal_mask

    return plain_causal_mask(1, q.shape[1], k.shape[1], 1, q.device) if causal else mask


def test_the_full_and_causal_families_are_timed_as_users_call_them():
    """Unmasked and causal attention are called without a mask (as FA4's and SDPA's are), so the
    benchmarks call ours with none for "full", none and causal=True for "causal", and with the
    built mask otherwise."""
    from flashmask3.bench import called_mask

    built = object()
    assert called_mask("full", built) == (None, False)
    assert called_mask("causal", built) == (None, True)
    assert all(called_mask(name, built) == (built, False) for name in ("causal_document", "prefix_lm_causal"))


def test_the_full_rows_of_an_ablation_run_without_a_mask(monkeypatch):
    """`ablate --masks full`: ours runs without a mask in the chosen configuration and each variant's;
    FLOPs still count the built mask's density."""
    import torch
    from flashmask3.optimized import fwd_config

    seen = []

    def fake_forward(q, k, v, mask, softmax_scale, config, causal=False):
        seen.append((mask, config))
        return torch.zeros(2), None

    monkeypatch.setattr(bench_fwd, "cute_forward", fake_forward)
    monkeypatch.setattr(bench_fwd, "random_inputs", lambda *a, **k: (1, 2, 3, 4))
    monkeypatch.setattr(bench_fwd.masks, "build", lambda *a, **k: FakeMask(1.0))

    def fake_times(fn, inputs, warmup, repeats):  # every configuration 2 ms
        [fn(*x) for x in inputs]
        return [2.0] * repeats

    monkeypatch.setattr(bench, "gpu_times_ms", fake_times)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    (row,) = bench_fwd.run_ablation([8192], 128, ["full"], ["num_stages=3"])
    assert {mask for mask, _ in seen} == {None}
    chosen = fwd_config(128, False, 2, plain=True)
    assert {config for _, config in seen} == {chosen, dataclasses.replace(chosen, num_stages=3)}
    assert row["default_tflops"] == pytest.approx(4 * 16 * 32 * 8192**2 * 128 / 2e-3 / 1e12)


def test_ablation_times_each_variant_in_its_configuration(monkeypatch):
    """The plumbing of `ablate` (the kernel itself needs the H200): each variant runs the chosen
    configuration with its changes, the configurations take turns round by round, and a row holds
    each one's median time, TFLOP/s and largest difference from the chosen configuration's."""
    import torch
    from flashmask3.optimized import fwd_config

    seen = []

    def fake_forward(q, k, v, mask, softmax_scale, config, causal=False):
        seen.append(config)
        return torch.full((2,), float(config.num_stages)), None

    monkeypatch.setattr(bench_fwd, "cute_forward", fake_forward)
    monkeypatch.setattr(bench_fwd, "random_inputs", lambda *a, **k: (1, 2, 3, 4))
    monkeypatch.setattr(bench_fwd.masks, "build", lambda *a, **k: FakeMask(0.5))
    timed = []

    def fake_times(fn, inputs, warmup, repeats):  # 3 stages take 3 ms, the rest 2
        [fn(*x) for x in inputs]
        timed.append(seen[-1].num_stages)
        return [float(seen[-1].num_stages)] * repeats

    monkeypatch.setattr(bench, "gpu_times_ms", fake_times)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    rows = bench_fwd.run_ablation([8192], 128, ["causal"], ["num_stages=3", "persistent=false"])
    (row,) = rows
    assert all(row[f"{c}_host_us"] > 0 for c in ("default", "num_stages=3", "persistent=false"))
    assert row["num_stages=3_max_diff"] == 1.0 and row["persistent=false_max_diff"] == 0.0
    assert row["default_ms"] == row["persistent=false_ms"] == 2.0 and row["num_stages=3_ms"] == 3.0
    assert timed == [2, 3, 2] * 6  # a warm-up, then 5 rounds in which the three take turns (odd ones reversed)
    assert row["default_tflops"] == pytest.approx(4 * 16 * 32 * 8192**2 * 128 * 0.5 / 2e-3 / 1e12)
    chosen = fwd_config(128, True, 1, plain=True)  # the causal mask alone: a plain call
    assert set(seen) == {
        chosen,
        dataclasses.replace(chosen, num_stages=3),
        dataclasses.replace(chosen, persistent=False),
    }
    assert "persistent=false" in bench_fwd.ablation_table(rows, ["num_stages=3", "persistent=false"])
    row.update({"default_sm_mhz": 1500.0, "persistent=false_sm_mhz": 1410.0})  # as NVML read them
    line = bench_fwd.ablation_table(rows, ["num_stages=3", "persistent=false"]).splitlines()[1].split()
    default, stages, persistent = (row[f"{c}_tflops"] for c in ("default", "num_stages=3", "persistent=false"))
    assert line[2:] == [f"{default:.0f}@1500", f"{stages:.0f}", "d=1.0e+00", f"{persistent:.0f}@1410", "d=0.0e+00"]


def test_backward_ablation_takes_the_largest_difference_over_all_gradients(monkeypatch):
    """`bench_bwd.py ablate` passes its fwd+bwd step (3.5 forwards of FLOPs) to the same loop."""
    import torch

    def step(mask, head_dim, overrides, causal=False):  # dK differs by num_stages - 2 (1 with 3 stages), dQ never
        return lambda q, k, v, dout: (torch.zeros(2), torch.full((2,), overrides.get("num_stages", 2) - 2.0))

    monkeypatch.setattr(bench_fwd, "random_inputs", lambda *a, **k: (1, 2, 3, 4))
    monkeypatch.setattr(bench_fwd.masks, "build", lambda *a, **k: FakeMask(1.0))
    monkeypatch.setattr(bench, "gpu_times_ms", lambda fn, inputs, warmup, repeats: [fn(*x) for x in inputs] and [4.0])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    (row,) = bench_fwd.run_ablation([8192], 128, ["full"], ["num_stages=3"], step, 3.5)
    assert row["num_stages=3_max_diff"] == 1.0
    assert row["default_tflops"] == pytest.approx(3.5 * 4 * 16 * 32 * 8192**2 * 128 / 4e-3 / 1e12)


def _fake_peers(monkeypatch, module, calls: list, density: float) -> list:
    """Every kernel of a bench replaced by one that logs its name and returns q + k + v (CPU), with
    the five ways a peer ends: timed (flex), not taking the mask (fa4 and cuDNN take only the full
    one), failing to build (FA4 sparse: no wheel), failing on its first call (Flex FLASH), failing
    while timed (cuDNN: out of memory on its fifth call, the first timed one after its check and
    three warm-ups). Returns the list that collects the bench's input tensors."""
    import torch

    def kernel(name):
        def run(q, k, v, *rest, **kwargs):
            calls.append(name)
            return q + k + v

        return run

    def no_wheel(case):
        raise ModuleNotFoundError("No module named 'flash_attn'")

    def compile_error(q, k, v):
        raise RuntimeError("CuteDSL template failed")

    def cudnn(case):
        if case.mask_name != "full":
            return None

        def run(q, k, v):
            if calls.count("cudnn") == 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
            return kernel("cudnn")(q, k, v)

        return run

    created = []

    class FakeMask:
        def density(self):
            return density

    for inputs_of in {module, bench_fwd}:  # bench_bwd draws its inputs through bench_fwd.bench_inputs
        monkeypatch.setattr(
            inputs_of,
            "random_inputs",
            lambda *a, **k: created.extend(torch.zeros(2) for _ in range(4)) or tuple(created[-4:]),
        )
    monkeypatch.setattr(bench_fwd.masks, "build", lambda name, *a, **k: FakeMask())
    monkeypatch.setattr(
        bench_peers,
        "PEERS",
        {
            "flex": lambda case: kernel("flex"),
            "flex_flash": lambda case: compile_error,
            "fa4": lambda case: kernel("fa4") if case.mask_name == "full" else None,
            "fa4_sparse": no_wheel,
            "cudnn": cudnn,
        },
    )
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        bench,
        "gpu_times_ms",
        lambda fn, inputs, warmup, repeats: (
            [fn(*x) for x in inputs] and [{"cute": 1.0, "flex": 2.0}.get(calls[-1], 0.5)] * repeats * len(inputs)
        ),
    )
    return created


PEER_ERRORS = {
    "flex_flash_error": "RuntimeError: CuteDSL template failed",
    "fa4_sparse_error": "ModuleNotFoundError: No module named 'flash_attn'",
    "cudnn_error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 GiB",
}


def test_forward_bench_times_cute_and_each_peer_in_turns(monkeypatch):
    """`bench_fwd.py bench` (CPU plumbing): per mask cute and each peer that takes the mask, checked
    against our output once, then timed in turns; TFLOP/s from each one's median; a peer that fails
    (at its build, its first call or while timed) leaves its error in the row and the rest go on."""
    calls = []
    _fake_peers(monkeypatch, bench_fwd, calls, density=0.5)
    monkeypatch.setattr(
        bench_fwd,
        "cute_forward",
        lambda q, k, v, mask, scale, causal=False: (calls.append("cute") or bench_fwd.torch.zeros(2), None),
    )
    full, document = bench_fwd.run_bench([8192], 128, ["full", "document"])
    assert {k for k in full if k.endswith("_ms")} == {"cute_ms", "flex_ms", "fa4_ms"}
    assert {k for k in document if k.endswith("_ms")} == {"cute_ms", "flex_ms"}
    assert {k: full[k] for k in PEER_ERRORS} == PEER_ERRORS
    assert "cudnn_error" not in document and "fa4_error" not in document  # cuDNN: not for documents
    assert full["flex_ms"] == 2.0 and full["cute_tflops"] == pytest.approx(2 * full["flex_tflops"])
    assert full["flex_max_diff"] == full["fa4_max_diff"] == 0.0
    assert calls[:4] == ["cute", "flex", "fa4", "cudnn"]  # our output, then each peer's first call
    assert calls[4:16:3] == ["cute", "flex", "fa4", "cudnn"]  # warm-ups (3 input sets) in turn
    assert calls.count("cudnn") == 4  # out of the turns after its error
    table = bench_fwd.bench_table([full, document], tuple(bench_peers.PEERS)).splitlines()
    assert table[0].split() == [
        "mask",
        "S",
        "dens",
        "cute",
        "flex",
        "flex_flash",
        "fa4",
        "fa4_sparse",
        "cudnn",
        "x",
        "best",
        "/clock",
    ]
    assert table[2].split()[3:] == [
        f"{document['cute_tflops']:.0f}",
        f"{document['flex_tflops']:.0f}",
        "err",
        "-",
        "err",
        "-",
        "2.00",
        "nan",  # no clocks read
    ]
    full.update({"cute_sm_mhz": 1500.0, "flex_sm_mhz": 1500.0, "fa4_sm_mhz": 1350.0})  # as NVML read them
    cells = bench_fwd.bench_table([full], tuple(bench_peers.PEERS)).splitlines()[1].split()
    cute, flex, fa4 = (full[f"{c}_tflops"] for c in ("cute", "flex", "fa4"))
    assert cells[3:5] == [f"{cute:.0f}@1500", f"{flex:.0f}@1500"] and cells[6] == f"{fa4:.0f}@1350"
    assert cells[-2:] == [f"{cute / fa4:.2f}", f"{cute / 1500 / (fa4 / 1350):.2f}"]  # fa4 the fastest, per clock too


def test_backward_bench_times_fwd_and_bwd_of_cute_and_each_peer(monkeypatch):
    """`bench_bwd.py bench` (CPU plumbing): forward and backward of each, in turns, 3.5x the FLOPs;
    each peer's output and gradients compared with ours; failing peers leave their errors."""
    import bench_bwd

    calls = []
    inputs = _fake_peers(monkeypatch, bench_bwd, calls, density=1.0)
    monkeypatch.setattr(bench_bwd.fm, "attention", lambda q, k, v, mask, **kw: calls.append("cute") or q + k + v)
    (row,) = bench_bwd.run_bench([8192], 128, ["full"], deterministic=False)
    assert {k for k in row if k.endswith("_ms")} == {"cute_ms", "flex_ms", "fa4_ms"}
    assert {k: row[k] for k in PEER_ERRORS} == PEER_ERRORS
    assert {k: row[k] for k in row if k.startswith("fa4_max_diff")} == {
        "fa4_max_diff": 0.0,
        "fa4_max_diff_dq": 0.0,
        "fa4_max_diff_dk": 0.0,
        "fa4_max_diff_dv": 0.0,
    }
    assert row["cute_ms"] == 1.0 and row["fa4_ms"] == 0.5
    assert row["cute_tflops"] == pytest.approx(3.5 * 4 * 16 * 32 * 8192**2 * 128 / 1e-3 / 1e12)
    # the gradients are returned, never accumulated into the inputs' .grad (an extra pass per call)
    assert len(inputs) == 8 and all(t.grad is None for t in inputs)
    # MLA's head dims: recorded, and the FLOPs over the mean head dim (bench_fwd's convention)
    (mla,) = bench_bwd.run_bench([8192], 192, ["full"], deterministic=False, heads=16, head_dim_v=128)
    assert (mla["head_dim"], mla["head_dim_v"]) == (192, 128)
    assert mla["cute_tflops"] == pytest.approx(3.5 * 4 * 16 * 16 * 8192**2 * 160 / 1e-3 / 1e12)


def test_peers_option_restricts_the_peers_and_names_the_accepted_ones(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    bench_fwd.add_peers_argument(parser)
    assert parser.parse_args([]).peers == tuple(bench_peers.PEERS)
    assert parser.parse_args(["--peers", "fa4,cudnn"]).peers == ("fa4", "cudnn")
    with pytest.raises(SystemExit):
        parser.parse_args(["--peers", "fa4,flash"])
    assert "unknown peer 'flash' in peers='fa4,flash'; accepted: flex, flex_flash, fa4" in capsys.readouterr().err


def test_fwd_bwd_returns_the_gradients():
    import bench_bwd

    q, k, v = (bench_fwd.torch.tensor([1.0, 2.0], requires_grad=True) for _ in range(3))
    dq, dk, dv = bench_bwd.fwd_bwd(lambda q, k, v: q * k + v)(q, k, v, bench_fwd.torch.tensor([1.0, 3.0]))
    assert dq.tolist() == [1.0, 6.0] and dk.tolist() == [1.0, 6.0] and dv.tolist() == [1.0, 3.0]
    assert q.grad is None


def test_unknown_config_field_names_the_accepted_ones():
    with pytest.raises(
        SystemExit, match="unknown config field 'skip_tiles'; fields: tile_m, tile_n, num_stages, q_buffers, persistent"
    ):
        bench_fwd.kernel_overrides(["skip_tiles=0"])


def test_backward_ablation_step_runs_both_configurations_with_the_changes(monkeypatch):
    """`bench_bwd.backward_step`: the forward and the backward each in the chosen configuration with
    the variant's changes that are its fields; with `deterministic`, that mode's configuration and
    kernel."""
    import bench_bwd
    from flashmask3.optimized import bwd_config, fwd_config

    seen = []
    monkeypatch.setattr(bench_bwd, "cute_forward", lambda *args, config, causal: seen.append(config) or ("out", "lse"))
    monkeypatch.setattr(
        bench_bwd, "cute_backward", lambda *args, config, causal: seen.append((args[-1], config)) or ("dq", "dk", "dv")
    )
    step = bench_bwd.backward_step(FakeMask(1.0), 64, {"persistent": False, "lse_ahead": False})
    assert step(1, 2, 3, 4) == ("dq", "dk", "dv")
    assert seen == [
        dataclasses.replace(fwd_config(64, True, 1), persistent=False),
        (False, dataclasses.replace(bwd_config(64, True, 1), lse_ahead=False)),
    ]
    seen.clear()
    bench_bwd.backward_step(FakeMask(1.0), 64, {}, deterministic=True)(1, 2, 3, 4)
    assert seen[1] == (True, bwd_config(64, True, 1, deterministic=True))


def test_record_is_saved_under_out(tmp_path, monkeypatch):
    import argparse
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_fwd.torch.cuda, "get_device_name", lambda: "test GPU")
    parser = argparse.ArgumentParser()
    parser.add_argument("what")
    bench_fwd.add_common_arguments(parser)
    result, save = bench_fwd.new_record(parser.parse_args(["bench"]), "fwd")
    assert result["gpu"] == "test GPU" and result["command"]
    save({**result, "bench": [{"mask": "full"}]})
    (path,) = tmp_path.glob("fwd_bench_*.json")
    assert json.loads(path.read_text())["bench"] == [{"mask": "full"}]


def test_record_defaults_to_runs_never_the_committed_results(tmp_path, monkeypatch):
    """Without $OUT a record lands under runs/: bench/results/ changes only by a deliberate copy."""
    import argparse

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_fwd.torch.cuda, "get_device_name", lambda: "test GPU")
    parser = argparse.ArgumentParser()
    parser.add_argument("what")
    bench_fwd.add_common_arguments(parser)
    result, save = bench_fwd.new_record(parser.parse_args(["check"]), "bwd")
    save(result)
    assert [p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.json")] == ["runs"]


def test_result_json_rounds_floats_and_puts_each_row_on_one_line():
    import json

    record = {
        "commit": "abc",
        "gpu": "H200",
        "bench": [{"mask": "full", "ms": 39.284849, "n": 3}, {"mask": "causal", "ms": 0.000123456}],
    }
    text = bench.result_json(record)
    assert json.loads(text) == {
        "commit": "abc",
        "gpu": "H200",
        "bench": [{"mask": "full", "ms": 39.28, "n": 3}, {"mask": "causal", "ms": 0.0001235}],
    }
    assert '  {"mask": "full", "ms": 39.28, "n": 3},' in text.splitlines()


def test_gpu_times_bracket_each_call_and_sync_once(monkeypatch):
    """`gpu_times_ms` (needs CUDA for real): events around every call in order, warm-up untimed,
    one synchronize at the end (no per-call sync that would count the host's launch work)."""
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("record")

        def elapsed_time(self, stop):
            return float(stop.at - self.at)

    monkeypatch.setattr(bench.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: log.append("sync"))
    times = bench.gpu_times_ms(lambda x: log.append(f"call {x}"), [(1,), (2,)], warmup=1, repeats=2)
    assert times == [2.0] * 4
    assert log[:2] == ["call 1", "call 2"] and log.count("sync") == 1 and log[-1] == "sync"
    assert log[2:5] == ["record", "call 1", "record"]


def test_interleaved_timing_takes_turns_so_a_drift_hits_every_contender(monkeypatch):
    """`interleaved_ms`: an untimed warm-up of each, then rounds in which the contenders take turns,
    every other round reversed: on a GPU that gets slower call by call, two equal kernels come out
    equal (timed one after the other, 4 calls each, they would read 2.5 and 6.5 here)."""
    order = []

    def drifting_times(fn, inputs, warmup, repeats):
        fn()
        order.append(fn.__name__)
        return [float(len(order))] * repeats * len(inputs)

    def a():
        pass

    def b():
        pass

    monkeypatch.setattr(bench, "gpu_times_ms", drifting_times)
    times = bench.interleaved_ms({"a": (a, [()]), "b": (b, [()])}, rounds=4, repeats=1)
    assert order == ["a", "b"] + ["a", "b", "b", "a"] * 2
    assert times == {"a": 6.5, "b": 6.5}  # medians of [3, 6, 7, 10] and [4, 5, 8, 9]


def test_interleaved_timing_records_the_clock_each_contender_ran_at(monkeypatch):
    """With `clocks`: the SM clock and power NVML reads while each contender's timed rounds run,
    as medians per contender (the warm-up unsampled); none where NVML cannot be read, nor for a
    contender timed for less than `clock_min_ms` in all (NVML then reads the idle card)."""
    import time

    import torch

    reading = {"mhz": 0}

    def times(fn, inputs, warmup, repeats):
        reading["mhz"] = fn()
        time.sleep(0.03 if repeats else 0)
        return [60.0] * repeats

    monkeypatch.setattr(bench, "gpu_times_ms", times)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: reading["mhz"])
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: reading["mhz"] * 300)  # milliwatts
    contenders = {"a": (lambda: 1980, [()]), "b": (lambda: 1755, [()])}
    clocks = {}
    assert bench.interleaved_ms(contenders, rounds=2, repeats=1, clocks=clocks) == {"a": 60.0, "b": 60.0}
    assert clocks == {"a": {"sm_mhz": 1980.0, "power_w": 594.0}, "b": {"sm_mhz": 1755.0, "power_w": 526.5}}
    clocks = {}
    bench.interleaved_ms(contenders, rounds=2, repeats=1, clocks=clocks, clock_min_ms=121.0)
    assert clocks == {}

    def no_nvml():
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    clocks = {}
    bench.interleaved_ms(contenders, rounds=2, repeats=1, clocks=clocks)
    assert clocks == {}


def test_interleaved_timing_drops_a_contender_that_raises_and_keeps_its_error(monkeypatch):
    """With `errors`, a contender raising in its second round leaves the turns with its error and
    the others are timed to the end; without `errors` the exception propagates."""
    order = []

    def times(fn, inputs, warmup, repeats):
        fn()
        order.append(fn.__name__)
        return [1.0] * repeats

    def a():
        pass

    def b():
        if order.count("b") == 2:
            raise MemoryError("out of memory\n  while timing")

    monkeypatch.setattr(bench, "gpu_times_ms", times)
    errors = {}
    assert bench.interleaved_ms({"a": (a, [()]), "b": (b, [()])}, rounds=4, repeats=1, errors=errors) == {"a": 1.0}
    assert errors == {"b": "MemoryError: out of memory while timing"}
    assert order == ["a", "b", "a", "b", "a", "a", "a"]  # b raised in round 2
    order.clear()
    with pytest.raises(MemoryError):
        bench.interleaved_ms({"a": (a, [()]), "b": (b, [()])}, rounds=4, repeats=1)


def test_device_steps_runs_each_step_under_its_limit_and_logs_it(tmp_path):
    """`tools/device_steps.sh` (the H200 call's wrapper): a log per step under $OUT, and a line per
    step with its exit status; a step past its limit is stopped (status 124) and the next one runs."""
    import subprocess

    steps = tmp_path / "steps.txt"
    steps.write_text("step 5 hello echo hi\nstep 1 slow sleep 10\nstep 5 after echo still\n")
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parents[1] / "tools" / "device_steps.sh"
    result = subprocess.run(
        ["bash", str(script), str(steps)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "COMMIT": "abc1234", "OUT": str(out)},
        timeout=60,
    )
    status = (out / "steps.txt").read_text().splitlines()
    assert [line.split()[1:3] for line in status] == [["hello", "rc=0"], ["slow", "rc=124"], ["after", "rc=0"]]
    assert (out / "hello.log").read_text() == "hi\n" and (out / "after.log").read_text() == "still\n"
    assert result.stdout.rstrip().endswith(status[-1])


def test_device_steps_bundles_the_runs_files_into_one_archive(tmp_path):
    """With BUNDLE=1 the wrapper leaves one runs.tgz under $OUT holding every log and the step
    lines, after printing them as without it."""
    import subprocess
    import tarfile

    steps = tmp_path / "steps.txt"
    steps.write_text("step 5 hello echo hi\nstep 5 after echo still\n")
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parents[1] / "tools" / "device_steps.sh"
    env = {"PATH": "/usr/bin:/bin", "COMMIT": "abc1234", "OUT": str(out), "BUNDLE": "1"}
    result = subprocess.run(["bash", str(script), str(steps)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert sorted(p.name for p in out.iterdir()) == ["runs.tgz"]
    with tarfile.open(out / "runs.tgz") as bundle:
        names = sorted(name.removeprefix("./") for name in bundle.getnames() if name != ".")
        assert names == ["after.log", "hello.log", "steps.txt"]
        assert bundle.extractfile("./hello.log").read() == b"hi\n"
    assert "== after rc=0" in result.stdout


def test_ncu_source_summary_finds_the_hot_loop_and_its_stalls():
    """A small `--page source --csv` dump: program output before the header, a producer loop, the
    hot consumer loop closed by a predicated backward branch, and an unconditional out-of-line
    retry jump spanning both (not a loop of its own)."""
    import ncu_source_summary

    header = [
        "Address",
        "Source",
        "Warp Stall Sampling (All Samples)",
        "Instructions Executed",
        "stall_barrier",
        "stall_wait",
        "stall_barrier (Not Issued)",
    ]
    body = [  # address, source, samples, barrier, wait
        ("0x1000", "MOV R1, c[0x0][0x28]", 1, 0, 1),
        ("0x1010", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 10, 0, 10),
        ("0x1020", "@!P0 BRA 0x1010", 5, 0, 5),
        ("0x1030", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 30, 0, 30),
        ("0x1040", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 40, 0),
        ("0x1050", "MUFU.EX2 R3, R4", 20, 0, 20),
        ("0x1060", "@P1 BRA 0x1030", 2, 0, 2),
        ("0x1070", "EXIT", 0, 0, 0),
        ("0x1080", "BRA 0x1000", 0, 0, 0),
    ]
    lines = ["==PROF== Connected to process 1", '{"mask": "full"}', ",".join(f'"{h}"' for h in header)]
    lines += [",".join(f'"{v}"' for v in (a, s, n, 1, b, w, 0)) for a, s, n, b, w in body]
    instructions = ncu_source_summary.read_instructions(lines)
    assert ncu_source_summary.hottest_loop(instructions) == (0x30, 0x60)
    summary = ncu_source_summary.summarize(instructions, top=2).splitlines()
    assert summary[0] == "samples: 108 in all, 92 (85%) in the hottest loop (SASS +0x30..+0x60)"
    assert summary[1] == "loop stall reasons: wait 56.5%, barrier 43.5%"
    assert summary[2] == "loop samples by opcode: WARPGROUP 43.5%, HGMMA 32.6%, MUFU 21.7%, BRA 2.2%"
    assert summary[4].split() == ["43.5%", "barrier", "WARPGROUP.DEPBAR.LE", "gsb0,", "0x0"]
    with pytest.raises(ValueError, match="not an ncu"):
        ncu_source_summary.read_instructions(["no header here"])


def test_ncu_source_summary_attributes_the_loop_to_source_lines():
    """`--lines`: nvdisasm -g of a compile with line info, whose parameter loads differ from the
    profiled kernel's (an extra instruction, other registers), still aligns with the profile."""
    import ncu_source_summary

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_wait"]
    body = [
        ("0x100", "ULDC.64 UR8, c[0x0][0x518]", 1, 0, 1),
        ("0x110", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 30, 0, 30),
        ("0x120", "MUFU.EX2 R3, R4", 50, 0, 50),
        ("0x130", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 20, 20, 0),
        ("0x140", "@P1 BRA 0x110", 0, 0, 0),
        ("0x150", "EXIT", 3, 3, 0),
    ]
    lines = [",".join(f'"{h}"' for h in header)] + [",".join(f'"{v}"' for v in row) for row in body]
    instructions = ncu_source_summary.read_instructions(lines)
    sass = """
        //## File "/repo/optimized/flash_fwd_sm90.py", line 12
        /*0000*/                   ULDC UR8, c[0x0][0x514] ;
        /*0010*/                   ULDC UR9, c[0x0][0x518] ;
        //## File "/repo/optimized/flash_fwd_sm90.py", line 84
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R40, gdesc[UR12], R40 ;
        //## File "/repo/optimized/softmax.py", line 26
        /*0030*/                   MUFU.EX2 R7, R9 ;
        //## File "/repo/optimized/flash_fwd_sm90.py", line 439
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/              @P0  BRA 0x20 ;
        //## File "/repo/optimized/flash_fwd_sm90.py", line 560
        /*0060*/                   EXIT ;
    """.splitlines()
    listing = ncu_source_summary.read_line_info(sass)
    assert listing[2] == ("HGMMA.64x128x16.F32.BF16 R40, gdesc[UR12], R40", "flash_fwd_sm90.py:84")
    report = ncu_source_summary.loop_lines(instructions, listing).splitlines()
    assert report[0].startswith("loop samples per source line (0% unaligned")
    assert [line.split()[:2] for line in report[1:]] == [
        ["50.0%", "softmax.py:26"],
        ["30.0%", "flash_fwd_sm90.py:84"],
        ["20.0%", "flash_fwd_sm90.py:439"],
    ]
    assert report[1].endswith("(wait 100%)") and report[3].endswith("(barrier 100%)")
    outside = ncu_source_summary.loop_lines(instructions, listing, outside=True).splitlines()
    # Outside the loop: the EXIT (3 of all 104 samples); the ULDC.64 has no counterpart in the listing.
    assert outside[0].startswith("samples outside the loop per source line (25% unaligned")
    assert outside[1:] == ["    2.9% flash_fwd_sm90.py:560        (barrier 100%)"]


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R2 ;
        /*0030*/              @!P0 BRA `(.L_x_9) ;
        /*0040*/                   FSEL R3, R3, -INF , P1 ;
.L_x_2:
        /*0050*/                   MUFU.EX2 R4, R4 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
.L_x_9:
        /*0090*/                   NANOSLEEP.SYNCS 0x989680 ;
        /*00a0*/                   BRA `(.L_x_1) ;
"""


def test_sass_path_splits_blocks_at_branches_and_finds_the_loop():
    """`sass_path.py`: blocks start at labels and after branches (so a path can skip what a branch
    jumps over); the hot loop closes with a predicated backward branch (the unconditional one comes
    back from an out-of-line retry); a path's opcodes are summed and compared with another's."""
    import sass_path

    blocks = sass_path.read_blocks(SASS.splitlines())
    assert [(name, len(body)) for name, body in blocks] == [
        ("start", 1),
        ("L_x_1", 3),
        ("L_x_1+3", 1),
        ("L_x_2", 3),
        ("L_x_2+3", 1),
        ("L_x_9", 2),
    ]
    assert [name for name, _ in sass_path.hot_loop(blocks)] == ["L_x_1", "L_x_1+3", "L_x_2"]
    unmasked = sass_path.path_opcodes(blocks, ["L_x_1", "L_x_2"])
    assert unmasked == {"HGMMA": 1, "SYNCS": 1, "BRA": 2, "MUFU": 2}
    masked = sass_path.path_opcodes(blocks, ["L_x_1", "L_x_1+3", "L_x_2"])
    assert sass_path.compare(masked, unmasked).splitlines()[1:] == [
        "(all)             7        6     +1",
        "FSEL              1        0     +1",
    ]
    with pytest.raises(ValueError, match="no such block: L_x_7"):
        sass_path.path_opcodes(blocks, ["L_x_7"])
    assert sass_path.loop_summary(sass_path.hot_loop(blocks)) == "hot loop: 7 instructions, 1 HGMMA, 0 WARPGROUP.ARRIVE"
    serialized = [
        (
            "L_x_1",
            ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32 R24, R8, gdesc[UR4], R24", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 2,
        )
    ]
    assert sass_path.loop_summary(serialized).endswith("(an arrive per HGMMA: the WGMMAs are serialized)")


def test_overheads_fit_and_backward_of_a_kept_graph():
    """`overheads.py`: the per-wave fit recovers fixed + per-tile cost from exact data, and the
    backward it times (autograd on a kept forward graph) gives the same gradients on every call."""
    import overheads
    import torch

    from flashmask3 import attention

    ctas = 32768
    rows = [{"seqlen": s, "ctas": ctas, "t_ms": (5.0 + 1.8 * s / 128) * ctas / 132 / 1e3} for s in (1024, 4096, 16384)]
    fit = overheads.per_wave_fit(rows, "t_ms")
    assert fit["fixed_us"] == pytest.approx(5.0) and fit["per_tile_us"] == pytest.approx(1.8)

    q, k, v = (torch.randn(1, 37, 2, 16, dtype=torch.float64) for _ in range(3))
    graph = overheads.kept_graph(lambda q, k, v: attention(q, k, v, backend="reference"), q, k, v)
    first, second = overheads.backward_of_kept_graph(*graph), overheads.backward_of_kept_graph(*graph)
    _, qg, kg, vg, dout = graph
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qg, kg) / 4, -1)  # scale 1/sqrt(16)
    expected = torch.autograd.grad(torch.einsum("bhqk,bkhd->bqhd", probs, vg), (qg, kg, vg), dout)
    for a, b, e in zip(first, second, expected):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


# -- GQA: --heads, --kv-heads, --batch through our call and every peer's (CPU stand-ins) ------------

GQA = {"batch": 2, "seqlen": 256, "heads": 4, "kv_heads": 2, "head_dim": 16}
GQA_MASKS = ("full", "causal_document", "random_eviction")  # dense / varlen / one mask per query head


def shape_parser():
    import argparse

    parser = argparse.ArgumentParser()
    bench_fwd.add_common_arguments(parser)
    return parser


def parsed_shape(argv):
    parser = shape_parser()
    args = parser.parse_args(argv)
    bench_fwd.check_common_arguments(parser, args)
    return args.heads, args.kv_heads, args.batch


def test_shape_options_default_to_hidden_4096_and_128k_tokens_per_run():
    assert parsed_shape([]) == (32, 32, None) and parsed_shape(["--head-dim", "64"]) == (64, 64, None)
    assert parsed_shape(["--heads", "16", "--kv-heads", "4", "--batch", "1"]) == (16, 4, 1)
    assert parsed_shape(["--kv-heads", "8"]) == (32, 8, None)
    assert [bench_fwd.run_batch(s) for s in (1024, 8192, 32768, 131072, 262144)] == [128, 16, 4, 1, 1]
    assert bench_fwd.run_batch(32768, 1) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--heads", "16", "--kv-heads", "5"],
            "--kv-heads 5 must divide the query heads (16); accepted: 1, 2, 4, 8, 16",
        ),
        (["--kv-heads", "3"], "--kv-heads 3 must divide the query heads (32); accepted: 1, 2, 4, 8, 16, 32"),
        (["--kv-heads", "64"], "--kv-heads 64 must divide the query heads (32); accepted: 1, 2, 4, 8, 16, 32"),
        (["--batch", "0"], "argument --batch: must be a positive int, got '0'"),
        (["--heads", "x"], "argument --heads: must be a positive int, got 'x'"),
    ],
)
def test_shape_options_name_the_argument_and_the_accepted_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        parsed_shape(argv)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def gqa_sdpa(q, k, v, causal: bool, scale: float):
    """Attention over [..., S, H, D] (fewer K/V heads allowed), torch's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return SDPA(
            q.transpose(-3, -2),
            k.transpose(-3, -2),
            v.transpose(-3, -2),
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        ).transpose(-3, -2)


def gqa_peers(monkeypatch) -> dict[str, list]:
    """The peers' libraries replaced by CPU stand-ins that log what they are given: FA4's
    `flash_attn.cute` (dense and varlen attention by torch's math kernel, the mask_mod call's output
    a dense attention: its shapes only count), Flex eager (not compiled), torch SDPA under the cuDNN
    backend by torch's math kernel, cuDNN frontend's flex_attention (`StandInFlexAttention`) and
    FlashMask V3 (the reference on its mask). Returns the log, per peer the calls' arguments."""
    import sys
    import types

    import torch
    from flashmask3.reference import ColumnMask, reference_attention
    from test_bench_peers_cudnn_flex import install_stand_in
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    log: dict[str, list] = {name: [] for name in ("fa4", "fa4_varlen", "fa4_sparse", "flex", "cudnn", "flashmask_v3")}

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, mask_mod=None, **kwargs):
        log["fa4_sparse" if mask_mod is not None else "fa4"].append({"q": q, "k": k, "v": v, **kwargs})
        return gqa_sdpa(q, k, v, causal, softmax_scale), None

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, learnable_sink
    ):
        log["fa4_varlen"].append({"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens_q, "longest": max_seqlen_q})
        assert cu_seqlens_k is cu_seqlens_q and max_seqlen_k == max_seqlen_q and learnable_sink is None
        bounds = cu_seqlens_q.tolist()
        parts = [gqa_sdpa(*(x[a:b] for x in (q, k, v)), causal, softmax_scale) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts), None

    class BlockSparseTensorsTorch:
        def __init__(self, *lists, block_size):
            self.lists, self.block_size = lists, block_size

    fa4 = types.ModuleType("flash_attn.cute")
    fa4.flash_attn_func, fa4.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    fa4.block_sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    fa4.block_sparsity.BlockSparseTensorsTorch = BlockSparseTensorsTorch
    package = types.ModuleType("flash_attn")
    package.cute = fa4
    for name, module in (
        ("flash_attn", package),
        ("flash_attn.cute", fa4),
        ("flash_attn.cute.block_sparsity", fa4.block_sparsity),
    ):
        monkeypatch.setitem(sys.modules, name, module)

    def flex(q, k, v, **kwargs):
        log["flex"].append({"q": q, "k": k, "v": v, **kwargs})
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
            return flex_attention(q, k, v, **kwargs)
        # Flex has no backward on the CPU: its BlockMask's mask_mod evaluated densely, torch's math kernel.
        attend = create_mask(kwargs["block_mask"].mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], "cpu")
        with sdpa_kernel(SDPBackend.MATH):
            return SDPA(q, k, v, attn_mask=attend, scale=kwargs["scale"], enable_gqa=kwargs["enable_gqa"])

    monkeypatch.setattr(bench_peers, "_compiled_flex", lambda: flex)

    def sdpa(q, k, v, **kwargs):
        log["cudnn"].append({"q": q, "k": k, "v": v, **kwargs})
        with sdpa_kernel(SDPBackend.MATH):  # the peer's cuDNN backend, by torch's math kernel
            return SDPA(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    log["cudnn_flex"] = install_stand_in(monkeypatch).plans

    def flashmask_attention(query, key, value, startend_row_indices, *, causal, softmax_scale):
        log["flashmask_v3"].append({"q": query, "k": key, "v": value, "bounds": startend_row_indices})
        mask = ColumnMask(startend_row_indices, causal, query.shape[1])
        return reference_attention(query, key, value, mask, softmax_scale)[0]

    interface = types.ModuleType("interface_torch")
    interface.flashmask_attention = flashmask_attention
    monkeypatch.setitem(sys.modules, "interface_torch", interface)
    monkeypatch.delenv(bench_peers.FLASHMASK_V3_PATH_VARIABLE, raising=False)
    return log


def gqa_bench_on_cpu(monkeypatch, module) -> list:
    """`module`'s inputs and masks made on the CPU, fp32 (the bench asks for bf16 on CUDA), each
    input set's shape logged; every contender timed at 1 ms. Returns the log of input shapes."""
    import torch

    from flashmask3 import verify

    built, shapes = bench_fwd.masks.build, []

    def inputs(b, sq, sk, hq, hkv, d, dtype, device, seed, head_dim_v=None):
        shapes.append((b, sq, sk, hq, hkv, d))
        return verify.random_inputs(b, sq, sk, hq, hkv, d, torch.float32, "cpu", seed=seed, head_dim_v=head_dim_v)

    for inputs_of in {module, bench_fwd}:  # bench_bwd draws its inputs through bench_fwd.bench_inputs
        monkeypatch.setattr(inputs_of, "random_inputs", inputs)
    monkeypatch.setattr(bench_fwd.masks, "build", lambda *args, device, **kwargs: built(*args, device="cpu", **kwargs))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        bench, "gpu_times_ms", lambda fn, inputs, warmup, repeats: [fn(*x) for x in inputs] and [1.0] * len(inputs)
    )
    return shapes


def assert_gqa_reached_every_peer(log: dict, rows: list[dict]) -> None:
    """Every peer got q with the query heads and k, v with the K/V heads, as they are (no repeat), on
    each mask it takes; the per-head lists and masks it got have one head or one per query head."""
    b, s, hq, hkv, d = (GQA[key] for key in ("batch", "seqlen", "heads", "kv_heads", "head_dim"))
    assert [row["mask"] for row in rows] == list(GQA_MASKS)
    for row in rows:
        assert {key: row[key] for key in ("batch", "seqlen", "heads", "kv_heads", "head_dim")} == GQA
        assert not [key for key in row if key.endswith("_error")], row
    # Which peer ran which mask (each peer's first call is its check, on the first input set).
    assert len(log["flex"]) >= 2 * len(GQA_MASKS) and len(log["fa4_sparse"]) >= len(GQA_MASKS)
    assert len(log["fa4"]) >= 1 and len(log["fa4_varlen"]) >= 1 and len(log["cudnn"]) >= 1
    assert len(log["cudnn_flex"]) >= len(GQA_MASKS) and len(log["flashmask_v3"]) >= len(GQA_MASKS)
    for peer in ("fa4", "fa4_sparse", "flashmask_v3"):  # [B, S, H, D]
        for call in log[peer]:
            assert call["q"].shape == (b, s, hq, d) and call["k"].shape == call["v"].shape == (b, s, hkv, d), peer
    for call in log["fa4_varlen"]:  # the batch's sequences packed: [B * S, H, D]
        assert call["q"].shape == (b * s, hq, d) and call["k"].shape == call["v"].shape == (b * s, hkv, d)
        assert int(call["cu_seqlens"][-1]) == b * s
    for peer in ("flex", "cudnn"):  # [B, H, S, D], with enable_gqa
        for call in log[peer]:
            assert call["q"].shape == (b, hq, s, d) and call["k"].shape == call["v"].shape == (b, hkv, s, d), peer
            assert call["enable_gqa"] is True, peer
    assert {call["kernel_options"]["BACKEND"] for call in log["flex"]} == {"TRITON", "FLASH"}
    assert {call["block_mask"].kv_num_blocks.shape[1] for call in log["flex"]} == {1, hq}  # random_eviction: Hq
    for call in log["fa4_sparse"]:  # FA4 expects [B, Hq, Tm(, Tn)], a 1 broadcast, both directions
        for lists in (call["block_sparse_tensors"].lists, call["block_sparse_tensors_bwd"].lists):
            for counts in lists[::2]:
                assert counts.shape[0] in (1, b) and counts.shape[1:] in ((1, s // 128), (hq, s // 128))
    assert {call["block_sparse_tensors"].lists[0].shape[1] for call in log["fa4_sparse"]} == {1, hq}
    for plan in log["cudnn_flex"]:
        q_shape, k_shape, v_shape = plan.geometry
        assert q_shape == (b, s, hq, d) and k_shape == v_shape == (b, s, hkv, d)
        assert plan.attend.shape[1] in (1, hq)
    assert {call["bounds"].shape[1] for call in log["flashmask_v3"]} == {1, hq}


def test_forward_bench_takes_gqa_to_our_kernel_and_every_peer(monkeypatch):
    """`bench_fwd.py bench --heads 4 --kv-heads 2 --batch 2`: our kernel and each peer get q with 4
    heads and k, v with 2 (FA4's varlen path packed, Flex and SDPA with enable_gqa), run the same
    attention as ours (the stand-ins that compute it: within fp32 rounding), and TFLOP/s count the
    query heads."""
    from flashmask3.reference import reference_attention

    log = gqa_peers(monkeypatch)
    inputs = gqa_bench_on_cpu(monkeypatch, bench_fwd)
    ours = []

    def cute_forward(q, k, v, mask, softmax_scale, causal=False):
        ours.append((q.shape, k.shape, v.shape, None if mask is None else mask.heads))
        return reference_attention(q, k, v, called(mask, causal, q, k), softmax_scale)

    monkeypatch.setattr(bench_fwd, "cute_forward", cute_forward)
    rows = bench_fwd.run_bench(
        [GQA["seqlen"]],
        GQA["head_dim"],
        list(GQA_MASKS),
        heads=4,
        kv_heads=2,
        batch=2,
        peer_names=tuple(bench_peers.PEERS),
    )
    assert set(inputs) == {(2, 256, 256, 4, 2, 16)}
    assert {shapes[:3] for shapes in ours} == {((2, 256, 4, 16), (2, 256, 2, 16), (2, 256, 2, 16))}
    assert {shapes[3] for shapes in ours} == {None, 1, 4}  # full: no mask; random_eviction: one per query head
    assert_gqa_reached_every_peer(log, rows)
    computed = {"flex", "flex_flash", "cudnn", "cudnn_flex", "flashmask_v3"}
    for row in rows:
        ran = {key[: -len("_max_diff")] for key in row if key.endswith("_max_diff")}
        assert computed - {"cudnn"} <= ran and ("cudnn" in ran) == (row["mask"] == "full")
        assert ("fa4" in ran) == (row["mask"] != "random_eviction") and "fa4_sparse" in ran
        assert all(row[f"{peer}_max_diff"] < 1e-5 for peer in (ran & computed) | (ran & {"fa4"})), row
        flops = 4 * 2 * 4 * 256 * 256 * 16 * row["density"]  # query heads
        assert row["cute_tflops"] == pytest.approx(flops / 1e-3 / 1e12)


def test_backward_bench_takes_gqa_to_our_attention_and_every_peer(monkeypatch, cute_on_cpu):
    """`bench_bwd.py bench` with GQA: our attention (the CPU stand-in of the cute ops) and each
    peer, forward and backward, get the K/V heads as they are; each peer's dK and dV have our
    shape (their differences from ours are in the row) and 3.5x the forward's FLOPs count the
    query heads."""
    import bench_bwd

    log = gqa_peers(monkeypatch)
    inputs = gqa_bench_on_cpu(monkeypatch, bench_bwd)
    attention, ours = bench_bwd.fm.attention, []

    def recorded(q, k, v, mask, **kwargs):
        ours.append((q.shape, k.shape, v.shape, None if mask is None else mask.heads, kwargs["backend"]))
        return attention(q, k, v, mask, **kwargs)

    monkeypatch.setattr(bench_bwd.fm, "attention", recorded)
    rows = bench_bwd.run_bench([GQA["seqlen"]], GQA["head_dim"], list(GQA_MASKS), False, heads=4, kv_heads=2, batch=2)
    assert set(inputs) == {(2, 256, 256, 4, 2, 16)}
    assert {shapes[:3] for shapes in ours} == {((2, 256, 4, 16), (2, 256, 2, 16), (2, 256, 2, 16))}
    assert {shapes[3] for shapes in ours} == {None, 1, 4} and {shapes[4] for shapes in ours} == {"cute"}
    assert_gqa_reached_every_peer(log, rows)
    computed = {"flex", "flex_flash", "fa4", "cudnn", "cudnn_flex", "flashmask_v3"}  # not fa4_sparse's stand-in
    for row in rows:
        ran = {key[: -len("_max_diff_dk")] for key in row if key.endswith("_max_diff_dk")}
        assert (
            ran
            == {"flex", "flex_flash", "fa4_sparse", "cudnn_flex", "flashmask_v3"}
            | {
                "full": {"fa4", "cudnn"},
                "causal_document": {"fa4"},
                "random_eviction": set(),
            }[row["mask"]]
        )
        for peer in ran & computed:
            assert max(row[f"{peer}_max_diff{grad}"] for grad in ("", "_dq", "_dk", "_dv")) < 1e-4, (peer, row)
        flops = 3.5 * 4 * 2 * 4 * 256 * 256 * 16 * row["density"]
        assert row["cute_tflops"] == pytest.approx(flops / 1e-3 / 1e12)


def test_ablation_takes_the_shape_options(monkeypatch):
    seen = []

    def inputs(*args, **kwargs):
        seen.append(args[:6])
        return (1, 2, 3, 4)

    monkeypatch.setattr(bench_fwd, "random_inputs", inputs)
    monkeypatch.setattr(bench_fwd.masks, "build", lambda *a, **k: seen.append(k["heads"]) or FakeMask(0.5))
    monkeypatch.setattr(bench, "gpu_times_ms", lambda fn, inputs, warmup, repeats: [fn(*x) for x in inputs] and [2.0])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    step = lambda mask, head_dim, overrides, causal: lambda q, k, v, dout: (bench_fwd.torch.zeros(1),)  # noqa: E731
    (row,) = bench_fwd.run_ablation([32768], 128, ["full"], [], step, heads=16, kv_heads=4, batch=1)
    assert seen == [(1, 32768, 32768, 16, 4, 128)] * 2 + [16]
    assert {key: row[key] for key in ("batch", "heads", "kv_heads")} == {"batch": 1, "heads": 16, "kv_heads": 4}
    assert row["default_tflops"] == pytest.approx(4 * 1 * 16 * 32768**2 * 128 * 0.5 / 2e-3 / 1e12)


def test_forward_bench_and_ablation_take_a_value_head_dim(monkeypatch):
    """`--head-dim 192 --head-dim-v 128`: v has 128 columns, the row records it, and TFLOP/s count
    QK^T over 192 and PV over 128 (the mean head dim in 4 B H Sq Sk D)."""
    from flashmask3.reference import reference_attention

    gqa_bench_on_cpu(monkeypatch, bench_fwd)
    shapes = []

    def cute_forward(q, k, v, mask, softmax_scale, config=None, causal=False):
        shapes.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return reference_attention(q, k, v, called(mask, causal, q, k), softmax_scale)

    monkeypatch.setattr(bench_fwd, "cute_forward", cute_forward)
    (row,) = bench_fwd.run_bench([256], 192, ["causal"], peer_names=(), heads=2, batch=1, head_dim_v=128)
    (ablated,) = bench_fwd.run_ablation([256], 192, ["causal"], [], heads=2, batch=1, head_dim_v=128)
    assert set(shapes) == {(192, 192, 128)}
    assert row["head_dim_v"] == ablated["head_dim_v"] == 128
    flops = 4 * 1 * 2 * 256**2 * 160 * row["density"]
    assert row["cute_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert ablated["default_tflops"] == pytest.approx(flops / 1e-3 / 1e12)


def test_the_forward_bench_with_sinks_gives_them_to_cute_and_the_fa4_peers_only(monkeypatch):
    """`bench --sinks`: one set of per-head sink logits for ours and for the peers that take them
    (FA4's learnable_sink); the other peers sit the row out; the row says it ran with sinks."""
    import torch
    from flashmask3.reference import reference_attention

    gqa_bench_on_cpu(monkeypatch, bench_fwd)
    monkeypatch.setattr(bench_fwd, "random_sinks", lambda heads, seqlen, device: torch.arange(heads) / 4.0)
    ours, peers = [], {}

    def cute_forward(q, k, v, mask, softmax_scale, causal=False, sinks=None):
        ours.append(sinks)
        return reference_attention(q, k, v, called(mask, causal, q, k), softmax_scale, sinks=sinks)

    def peer(name):
        def build(case):
            peers[name] = case.sinks
            return lambda q, k, v: cute_forward(q, k, v, case.mask, case.softmax_scale, sinks=case.sinks)[0]

        return build

    monkeypatch.setattr(bench_fwd, "cute_forward", cute_forward)
    monkeypatch.setattr(bench_peers, "PEERS", {name: peer(name) for name in ("fa4", "fa4_sparse", "flex_flash")})
    (row,) = bench_fwd.run_bench(
        [256], 64, ["causal"], peer_names=("fa4", "fa4_sparse", "flex_flash"), heads=4, batch=1, sinks=True
    )
    assert row["sinks"] is True and {k for k in row if k.endswith("_ms")} == {"cute_ms", "fa4_ms", "fa4_sparse_ms"}
    assert set(peers) == {"fa4", "fa4_sparse"} and all(torch.equal(s, torch.arange(4) / 4.0) for s in peers.values())
    assert ours and all(torch.equal(s, torch.arange(4) / 4.0) for s in ours)
    assert row["fa4_max_diff"] == row["fa4_sparse_max_diff"] == 0.0
    assert row["flex_flash_skipped"] == "takes no attention sinks"


def test_overheads_takes_the_shape_options(monkeypatch, tmp_path):
    """`overheads.py --heads 16 --kv-heads 4 --batch 1`: the inputs have that shape, and the CTAs of
    the fit are our kernels': the forward's per query head and query tile, walking S / 128 key
    tiles; the backward's per K/V head and key tile, walking the query tiles of 4 heads."""
    import json
    import sys

    import overheads
    import torch

    from flashmask3 import attention

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_fwd.torch.cuda, "get_device_name", lambda: "test GPU")
    monkeypatch.setattr(overheads, "fa4_fn", lambda causal: None)
    seen = []

    def inputs(b, sq, sk, hq, hkv, d, dtype, device, seed):
        seen.append((b, sq, hq, hkv, d))
        return tuple(torch.randn(b, sq, h, d) for h in (hq, hkv, hkv, hq))

    monkeypatch.setattr(overheads, "random_inputs", inputs)
    monkeypatch.setattr(overheads, "cute_forward", lambda q, k, v, mask, scale, config: (q.clone(), None))
    monkeypatch.setattr(overheads, "attention", lambda q, k, v, backend: attention(q, k, v, backend="reference"))
    times = iter(range(1, 100))
    monkeypatch.setattr(overheads, "interleaved_ms", lambda contenders: {"cute": float(next(times))})
    shape = ["--heads", "16", "--kv-heads", "4", "--batch", "1", "--head-dim", "16", "--seqlens", "256,512"]
    for backward in (False, True):
        monkeypatch.setattr(sys, "argv", ["overheads.py", *shape, *(["--backward"] if backward else [])])
        overheads.main()
    assert seen == [(1, 256, 16, 4, 16), (1, 256, 16, 4, 16), (1, 512, 16, 4, 16), (1, 512, 16, 4, 16)] * 2
    forward, backward = (
        json.loads(path.read_text()) for path in sorted(tmp_path.glob("*_overheads_*.json"), reverse=True)
    )
    tile_m = forward["fwd_config"]["tile_m"]
    assert [(r["ctas"], r["tiles_per_cta"]) for r in forward["rows"]] == [
        (16 * -(-256 // tile_m), 2),
        (16 * -(-512 // tile_m), 4),
    ]
    assert [(r["ctas"], r["tiles_per_cta"]) for r in backward["rows"]] == [(4 * 2, 8), (4 * 4, 16)]
    assert {(r["batch"], r["heads"], r["kv_heads"]) for r in forward["rows"] + backward["rows"]} == {(1, 16, 4)}


def test_cp_calibrate_fits_the_backward_call_at_its_kernel_rate(tmp_path, monkeypatch):
    """Rank times made by the pinned-slope model, forward and backward: the fits recover both
    fixed and per-chunk costs, and the rows carry the backward's measured imbalance."""
    import json
    import sys

    import cp_calibrate
    import numpy as np
    from flashmask3.distributed.cost_model import Hardware

    forward, backward = (1.5e-3, 4e-6), (2.5e-3, 9e-6)  # (fixed, per needed chunk) seconds
    tile_flops = 32 * 4 * 128**3
    rate = {
        "rank_ms": (forward, tile_flops / (Hardware().tflops * 1e12)),
        "rank_bwd_ms": (backward, 2.5 * tile_flops / (Hardware().bwd_tflops * 1e12)),
    }
    rows = []
    for mask, assignment in (("causal_document", "balanced"), ("causal", "zigzag"), ("share_question", "zigzag")):
        row = {"mask": mask, "ranks": 4, "assignment": assignment}
        features = cp_calibrate.rank_features(row, 1024, 256)
        for key, ((fixed, per_chunk), per_load) in rate.items():
            seconds = fixed + per_load * features[:, 0] + per_chunk * features[:, 1]
            row[key] = (seconds * 1e3).tolist()
        rows.append(row)
    source = tmp_path / "rank_times.json"
    source.write_text(json.dumps({"commit": "abc", "rows": rows}))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", ["cp_calibrate.py", str(source), "--tokens-per-rank", "1024", "--chunk", "256"])
    cp_calibrate.main()
    result = json.loads((tmp_path / "out" / "cp_calibration.json").read_text())
    for name, (fixed, per_chunk) in (("kernel_rate_slope", forward), ("backward_kernel_rate_slope", backward)):
        coef = result["fits"][name]["coef"]
        assert (coef["fixed_s"], coef["per_needed_chunk_s"]) == (
            pytest.approx(fixed, rel=1e-3),
            pytest.approx(per_chunk, rel=1e-3),
        )
    for row, measured in zip(result["rows"], rows):
        times = np.array(measured["rank_bwd_ms"])
        assert row["measured_bwd"] == pytest.approx(times.max() / times.mean(), rel=1e-3)  # JSON rounds
        assert row["fitted_bwd_model"] == pytest.approx(row["measured_bwd"], rel=1e-3)


def test_cp_calibrate_never_fits_a_chunk_that_saves_time():
    """Rank times that fall with the needed chunks (the pinned slope too slow for the kernel): the
    per-chunk term is 0 and the fixed cost the mean of the rest, not a negative chunk cost."""
    import cp_calibrate
    import numpy as np

    load, needed = np.array([10.0, 20.0, 30.0, 40.0]), np.array([2.0, 5.0, 3.0, 8.0])
    design = np.c_[np.ones(4), load, needed]
    y = 1e-3 + 2e-6 * load - 1e-5 * needed
    coef = cp_calibrate.pinned_slope_fit(design, y, 2e-6)["coef"]
    assert coef["per_needed_chunk_s"] == 0.0
    assert coef["fixed_s"] == pytest.approx(1e-3 - 1e-5 * needed.mean())
    assert coef["per_load_s"] == 2e-6


def test_check_runs_every_case_at_the_head_dim_pair_it_is_given(monkeypatch):
    """`check --head-dim 192 --head-dim-v 128`: every case (12 masks x 3, Sq != Sk, no mask) at that
    pair, each row saved as it is checked; without the options, the cases at 128 and 64."""
    import argparse

    cases, saved = [], []

    def case(name, mask, b, sq, sk, hq, hkv, d, dtype, seed, dv=None):
        cases.append((d, dv))
        return {"mask": name}

    monkeypatch.setattr(bench_fwd.masks, "build", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench_fwd, "ColumnMask", lambda *args: None)
    monkeypatch.setattr(bench_fwd.torch, "full", lambda *args, **kwargs: None)
    pair = bench_fwd.check_head_dims(argparse.Namespace(head_dim=192, head_dim_v=128))
    rows = bench_fwd.run_check(case, head_dims=pair, save=lambda rows: saved.append(len(rows)))
    assert pair == (192, 128) and set(cases) == {(192, 128)} and len(rows) == 3 * len(bench_fwd.masks.MASK_NAMES) + 4
    assert saved[0] == 1 and saved[-1] == len(rows)
    cases.clear()
    default = bench_fwd.check_head_dims(argparse.Namespace(head_dim=128, head_dim_v=None))
    bench_fwd.run_check(case, head_dims=default)
    assert default is None and set(cases) == {(128, None), (64, None)}


def test_the_clock_trace_takes_the_medians_inside_windows_and_outside_others():
    """`ClockTrace.within`: the readings inside any of the windows (merged where they overlap) and
    inside none of the excluded ones; None where no reading is left."""
    from flashmask3.bench import ClockTrace

    trace = ClockTrace()
    trace.samples = [(t / 10, 1000.0 + t, 500.0 + 2 * t) for t in range(10)]  # at 0.0, 0.1, ..., 0.9
    assert trace.within([(0.0, 0.25), (0.2, 0.45)]) == {"sm_mhz": 1002.0, "power_w": 504.0, "readings": 5}
    assert trace.within([(0.0, 0.95)], [(0.25, 0.75)]) == {"sm_mhz": 1002.0, "power_w": 504.0, "readings": 5}
    assert trace.within([(2.0, 3.0)]) is None
