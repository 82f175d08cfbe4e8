"""The kernels' configurations and their choosers (no DSL needed)."""

import dataclasses

import pytest
from flashmask3.optimized import BwdConfig, FwdConfig, bwd_config, fwd_config
from flashmask3.optimized.config import apply_overrides, config_fields


def test_the_forward_takes_192_row_query_tiles_at_head_dim_64_only():
    chosen = FwdConfig(
        tile_m=128,
        tile_n=128,
        num_stages=2,
        q_buffers=2,
        persistent=True,
        uniform_tiles=True,
        longest_tiles_first_waves=128,
        late_k_release=True,
        fmax_row_max=False,
        lazy_rescale=False,
        diagonal_tiles=False,
        off_diagonal_tiles=False,
        one_interval_tiles=False,
        segment_tiles=False,
        o_from_registers=False,
        turn_barriers=True,
        counted_keys=False,
    )
    for causal, width in ((True, 1), (True, 2), (False, 2), (False, 4)):
        diagonal, off_diagonal = causal and width == 1, causal and width == 2
        assert fwd_config(64, causal, width) == dataclasses.replace(chosen, tile_m=192, late_k_release=False)
        assert fwd_config(128, causal, width) == dataclasses.replace(
            chosen,
            fmax_row_max=not causal,
            lazy_rescale=not causal and width == 2,
            diagonal_tiles=diagonal,
            off_diagonal_tiles=off_diagonal,
            one_interval_tiles=not causal and width == 4,
        )
    assert (fwd_config(64, True, 1).num_consumer_wgs, fwd_config(128, True, 1).num_consumer_wgs) == (3, 2)


def test_segmented_masks_take_segment_tiles_where_the_tiles_have_128_rows():
    for causal, width in ((True, 1), (True, 2), (False, 2), (False, 4)):
        for head_dim in (128, 192, 256):
            plain = fwd_config(head_dim, causal, width)
            segmented = fwd_config(head_dim, causal, width, segmented=True)
            assert segmented == dataclasses.replace(plain, segment_tiles=True)
        assert fwd_config(64, causal, width, segmented=True) == fwd_config(64, causal, width)  # 192-row tiles


def test_head_dim_192_takes_one_q_buffer_and_longest_first_only_on_short_lists():
    """MLA's q/k 192: two Q buffers do not fit beside two K/V stages; its larger K/V tiles make the
    index order's L2 reuse win from fewer work tiles per SM than at 128."""
    for causal, width in ((True, 1), (False, 2)):
        config = fwd_config(192, causal, width)
        assert (config.tile_m, config.q_buffers, config.late_k_release, config.fmax_row_max) == (128, 1, True, False)
        assert not config.lazy_rescale
        assert config.longest_tiles_first_waves == 64 < fwd_config(128, causal, width).longest_tiles_first_waves


def test_only_head_dim_192_drops_the_turn_barriers():
    """At 192/128 the warpgroups issue their GEMMs as their data arrive (FA4's choice above 128);
    128 and 256 keep the turns (at 256 dropping them lost on share-question)."""
    variants = [(False, 2), (True, 1), (True, 2), (False, 4)]
    for head_dim in (64, 128, 192, 256):
        assert {fwd_config(head_dim, c, w).turn_barriers for c, w in variants} == {head_dim != 192}


def test_head_dim_256_takes_64_key_tiles_and_one_q_buffer():
    """Gemma's head dim 256: O's 128 registers per thread leave room for a 64-key tile's scores, and
    one Q buffer beside two K/V stages fits in shared memory; the other head dims keep 128 keys."""
    for causal, width in ((True, 1), (False, 4)):
        config = fwd_config(256, causal, width)
        assert (config.tile_m, config.tile_n, config.q_buffers, config.num_stages) == (128, 64, 1, 2)
        assert config.longest_tiles_first_waves == 64 and config.lazy_rescale
        assert {fwd_config(d, causal, width).tile_n for d in (64, 128, 192)} == {128}


def test_key_tiles_up_to_256_wide_are_a_configuration_choice():
    """FA3's 176-key tiles (one Q buffer beside their K/V stages) and others up to 256 are accepted
    as ablations; the chosen tiles stay at 128 keys (64 at head dim 256), with a mask or without."""
    wide = dataclasses.replace(fwd_config(128, False, 2), tile_n=176, q_buffers=1, o_from_registers=True)
    assert (wide.tile_n, wide.q_buffers) == (176, 1)
    assert dataclasses.replace(wide, tile_n=256).tile_n == 256
    from flashmask3.optimized.interface import mask_fwd_config

    assert mask_fwd_config(128, None).tile_n == fwd_config(128, False, 2).tile_n == 128


def test_the_causal_masks_diagonal_choices_follow_their_bounds_at_128_row_tiles():
    """Diagonal-only tiles on the one-bound causal masks, off-diagonal tiles on the two-bound ones,
    at head dims 128 and 192 (128-row tiles); neither at head dim 64 nor without the causal part."""
    for head_dim in (128, 192):
        choices = {(c, w): fwd_config(head_dim, c, w) for c, w in ((True, 1), (True, 2), (False, 2), (False, 4))}
        assert {k: (v.diagonal_tiles, v.off_diagonal_tiles) for k, v in choices.items()} == {
            (True, 1): (True, False),
            (True, 2): (False, True),
            (False, 2): (False, False),
            (False, 4): (False, False),
        }
    assert not any(fwd_config(64, True, w).diagonal_tiles or fwd_config(64, True, w).off_diagonal_tiles for w in (1, 2))


def test_the_backward_reads_the_lse_ahead_except_at_mask_width_4_and_in_128_row_steps():
    variants = ((True, 1), (True, 2), (False, 2))
    assert [bwd_config(128, c, w).lse_ahead for c, w in variants] == [True] * 3
    assert [bwd_config(64, c, w).lse_ahead for c, w in variants] == [False] * 3
    assert [bwd_config(64, c, w, deterministic=True).lse_ahead for c, w in variants] == [True] * 3
    for head_dim in (64, 128):
        assert bwd_config(head_dim, False, 4) == BwdConfig(
            key_tile=128,
            query_tile=64,
            keys_on_rows=True,
            q_stages=3,
            do_stages=0,
            lse_ahead=False,
            longest_ctas_first_waves=16,
            longest_ctas_first_buckets=8,
            diagonal_steps=False,
            segment_steps=False,
            dq_writer=True,
            short_grid_q_stages=0,
            split_ctas_max_parts=0,
            split_ctas_slack_pct=2,
            counted_steps=False,
        )
    splits = {(c, w): bwd_config(128, c, w).split_ctas_max_parts for c, w in ((True, 1), (True, 2), (False, 2))}
    assert splits == {(True, 1): 4, (True, 2): 4, (False, 2): 0}
    assert bwd_config(128, True, 1, deterministic=True).split_ctas_max_parts == 0  # it does not split
    variants = ((True, 1), (True, 2), (False, 2), (False, 4))
    assert [bwd_config(192, c, w).split_ctas_max_parts for c, w in variants] == [4, 4, 4, 0]
    assert bwd_config(192, True, 1, deterministic=True).split_ctas_max_parts == 0
    assert {bwd_config(d, c, w).split_ctas_max_parts for d in (64, 256) for c, w in variants} == {0}


def test_the_backward_turns_to_queries_on_rows_above_head_dim_128():
    """FA4's SM90 shapes at 192 (v 128) and 256: 96 and 48 keys per CTA, two Q stages, two and one
    dO stages, so the fp32 dQ staging fits beside them; 128 keys on rows below."""
    for causal, width in ((True, 1), (False, 4)):
        shapes = {d: bwd_config(d, causal, width) for d in (64, 128, 192, 256)}
        assert {d: (c.key_tile, c.keys_on_rows, c.do_stages) for d, c in shapes.items()} == {
            64: (128, True, 0),
            128: (128, True, 0),
            192: (96, False, 0),
            256: (48, False, 1),
        }
        assert [shapes[d].q_stages for d in (128, 192, 256)] == [3, 2, 2]
        assert shapes[256].diagonal_steps == causal


def test_head_dim_64_steps_over_128_rows_where_that_build_keeps_its_registers():
    """Every variant but four bounds per key takes FA4's 128-row step (two Q/dO stages, the LSE
    after the S GEMM), the causal two-bound one without the dQ writer, whose consumers spill with
    it; four bounds and deterministic mode, whose 128-row builds spill, keep 64 rows and three
    stages."""
    for causal, width in ((False, 2), (True, 1), (True, 2)):
        config = bwd_config(64, causal, width)
        assert (config.query_tile, config.q_stages, config.lse_ahead, config.short_grid_q_stages) == (128, 2, False, 0)
        assert config.dq_writer == (width == 1 or not causal)
        assert bwd_config(64, causal, width, deterministic=True).query_tile == 64
    assert (bwd_config(64, False, 4).query_tile, bwd_config(64, False, 4).q_stages) == (64, 3)
    assert all(bwd_config(d, c, w).query_tile == 64 for d in (128, 192, 256) for c, w in ((False, 2), (True, 1)))


def test_configs_are_frozen_validated_and_hashable():
    config = fwd_config(128, True, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_stages = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_stages must be 2 or 3"):
        dataclasses.replace(config, num_stages=5)
    with pytest.raises(ValueError, match="tile_m must be 128 or 192"):
        dataclasses.replace(config, tile_m=64)
    for tile_n in (8, 72, 272):
        with pytest.raises(ValueError, match=f"tile_n must be a multiple of 16 from 16 to 256, got {tile_n}"):
            dataclasses.replace(config, tile_n=tile_n)
    with pytest.raises(ValueError, match="q_stages must be 2 or 3, got 4"):
        dataclasses.replace(bwd_config(128, False, 2), q_stages=4)
    with pytest.raises(ValueError, match="key_tile must be a multiple of 16 from 16 to 128, got 40"):
        dataclasses.replace(bwd_config(256, False, 2), key_tile=40)
    with pytest.raises(ValueError, match=r"do_stages must be from 0 \(as many as Q's\) to q_stages=2, got 3"):
        dataclasses.replace(bwd_config(192, False, 2), do_stages=3)
    with pytest.raises(ValueError, match="keys_on_rows=True takes key_tile=128 .*got key_tile=64, do_stages=0"):
        dataclasses.replace(bwd_config(128, False, 2), key_tile=64)
    with pytest.raises(ValueError, match="keys_on_rows=True takes .*got key_tile=128, do_stages=2"):
        dataclasses.replace(bwd_config(128, False, 2), do_stages=2)
    assert len({config, dataclasses.replace(config, persistent=False), fwd_config(128, True, 1)}) == 2


def test_overrides_go_to_the_configuration_that_has_the_field():
    """An ablation variant's changes, one set for both directions (the field names are disjoint)."""
    assert config_fields() == {
        "tile_m": int,
        "tile_n": int,
        "num_stages": int,
        "q_buffers": int,
        "persistent": bool,
        "uniform_tiles": bool,
        "longest_tiles_first_waves": int,
        "late_k_release": bool,
        "fmax_row_max": bool,
        "lazy_rescale": bool,
        "diagonal_tiles": bool,
        "off_diagonal_tiles": bool,
        "one_interval_tiles": bool,
        "segment_tiles": bool,
        "o_from_registers": bool,
        "turn_barriers": bool,
        "counted_keys": bool,
        "key_tile": int,
        "query_tile": int,
        "keys_on_rows": bool,
        "q_stages": int,
        "do_stages": int,
        "lse_ahead": bool,
        "longest_ctas_first_waves": int,
        "longest_ctas_first_buckets": int,
        "diagonal_steps": bool,
        "segment_steps": bool,
        "dq_writer": bool,
        "short_grid_q_stages": int,
        "split_ctas_max_parts": int,
        "split_ctas_slack_pct": int,
        "counted_steps": bool,
    }
    changes = {"persistent": False, "lse_ahead": False}
    assert apply_overrides(fwd_config(64, True, 1), changes) == FwdConfig(
        192,
        128,
        2,
        q_buffers=2,
        persistent=False,
        uniform_tiles=True,
        longest_tiles_first_waves=128,
        late_k_release=False,
        fmax_row_max=False,
        lazy_rescale=False,
        diagonal_tiles=False,
        off_diagonal_tiles=False,
        one_interval_tiles=False,
        segment_tiles=False,
        o_from_registers=False,
        turn_barriers=True,
        counted_keys=False,
    )
    assert apply_overrides(bwd_config(64, True, 1), changes) == dataclasses.replace(
        bwd_config(64, True, 1), lse_ahead=False
    )
    assert apply_overrides(fwd_config(64, True, 1), {}) == fwd_config(64, True, 1)
    with pytest.raises(ValueError, match="no kernel config field skip_tiles; the fields: tile_m, tile_n, num_stages"):
        apply_overrides(bwd_config(64, True, 1), {"skip_tiles": False})


def test_late_k_release_is_for_128_row_tiles():
    import dataclasses

    with pytest.raises(ValueError, match="late_k_release needs tile_m=128 .*got tile_m=192"):
        dataclasses.replace(fwd_config(64, True, 1), late_k_release=True)


def test_segment_tiles_are_for_128_row_tiles_and_key_tiles_dividing_them():
    with pytest.raises(ValueError, match="segment_tiles needs tile_m=128 .*got tile_m=192, tile_n=128"):
        dataclasses.replace(fwd_config(64, True, 1), segment_tiles=True)
    with pytest.raises(ValueError, match="a tile_n dividing 128 .*got tile_m=128, tile_n=96"):
        dataclasses.replace(fwd_config(128, True, 1), segment_tiles=True, tile_n=96)
    assert dataclasses.replace(fwd_config(256, True, 1), segment_tiles=True).tile_n == 64
    assert dataclasses.replace(fwd_config(128, True, 1), segment_tiles=True).segment_tiles


def test_o_from_registers_is_for_one_q_buffer():
    with pytest.raises(ValueError, match="o_from_registers needs q_buffers=1 .*got q_buffers=2, tile_m=128"):
        dataclasses.replace(fwd_config(128, True, 1), o_from_registers=True)
    with pytest.raises(ValueError, match="and tile_m=128, got q_buffers=1, tile_m=192"):
        dataclasses.replace(fwd_config(64, True, 1), q_buffers=1, o_from_registers=True)
    assert dataclasses.replace(fwd_config(256, True, 1), o_from_registers=True).o_from_registers


def test_segment_steps_are_for_128_key_tiles():
    with pytest.raises(ValueError, match="segment_steps needs key_tile=128 .*got key_tile=48"):
        dataclasses.replace(bwd_config(256, True, 1), segment_steps=True)
    assert dataclasses.replace(bwd_config(128, True, 1), segment_steps=True).segment_steps


def test_short_grids_take_two_query_stages_on_the_one_bound_causal_masks_at_head_dim_128():
    """With the dQ writer, the CTAs-longest-first grids of the causal one-bound masks at head dim
    128 run two Q/dO stages; every other variant and head dim, and every long grid, its q_stages."""
    for head_dim in (64, 128, 192, 256):
        for causal, width in ((True, 1), (True, 2), (False, 2), (False, 4)):
            config = bwd_config(head_dim, causal, width)
            two = head_dim == 128 and causal and width == 1
            assert config.for_short_grid().q_stages == (2 if two else config.q_stages)
            assert config.for_short_grid() == dataclasses.replace(config, q_stages=config.for_short_grid().q_stages)
    assert bwd_config(128, True, 1).q_stages == 3
    three = apply_overrides(bwd_config(128, True, 1), {"q_stages": 3})  # an explicit count holds everywhere
    assert three.for_short_grid().q_stages == 3
    assert apply_overrides(bwd_config(128, True, 1), {"short_grid_q_stages": 3}).for_short_grid().q_stages == 3
    with pytest.raises(ValueError, match="short_grid_q_stages must be 0 \\(as q_stages\\), 2 or 3, got 1"):
        dataclasses.replace(bwd_config(128, True, 1), short_grid_q_stages=1)


def test_the_chosen_forward_for_a_mask_follows_its_variant_and_segmented_hint():
    """`mask_fwd_config`: `fwd_config` of the mask's variant and hint; no mask is a plain call,
    non-causal, width 2, or with `causal` the causal mask alone, width 1."""
    from flashmask3.optimized.interface import mask_fwd_config
    from flashmask3.reference import ColumnMask, masks

    documents = masks.build("causal_document", 1024, seed=3)
    assert documents.segmented and mask_fwd_config(128, documents) == fwd_config(128, True, 1, segmented=True)
    assert mask_fwd_config(128, documents).segment_tiles
    plain = ColumnMask(documents.startend_row_indices, True, 1024)
    assert mask_fwd_config(128, plain) == fwd_config(128, True, 1) and not mask_fwd_config(128, plain).segment_tiles
    assert mask_fwd_config(64, None) == fwd_config(64, False, 2, plain=True)
    assert mask_fwd_config(128, None, causal=True) == fwd_config(128, True, 1, plain=True)


def test_a_masks_configs_take_the_overrides_in_both_directions():
    """`mask_configs`: the mask's forward and backward choices, each with the overrides that name its
    fields; an explicit q_stages holds in short grids too."""
    from flashmask3.optimized.interface import mask_configs, mask_fwd_config
    from flashmask3.reference import masks

    documents = masks.build("causal_document", 1024, seed=3)
    assert mask_configs(128, documents) == (mask_fwd_config(128, documents), bwd_config(128, True, 1))
    fwd, bwd = mask_configs(128, documents, {"persistent": False, "q_stages": 2})
    assert fwd == dataclasses.replace(mask_fwd_config(128, documents), persistent=False)
    assert bwd == dataclasses.replace(bwd_config(128, True, 1), q_stages=2, short_grid_q_stages=0)
    assert mask_configs(64, None) == (fwd_config(64, False, 2, plain=True), bwd_config(64, False, 2, plain=True))
    plain_causal = (fwd_config(128, True, 1, plain=True), bwd_config(128, True, 1, plain=True))
    assert mask_configs(128, None, causal=True) == plain_causal
    assert mask_configs(64, None, deterministic=True)[1] == bwd_config(64, False, 2, deterministic=True, plain=True)
    # Plain calls count their query steps; a mask's steps are listed.
    assert mask_configs(128, None, causal=True)[1].counted_steps
    assert not mask_configs(128, documents)[1].counted_steps


def test_128_row_steps_are_for_keys_on_rows_with_two_stages():
    """`query_tile=128`: the step FA4 takes at head dim 64, with keys on rows, two Q/dO stages, the
    LSE after the S GEMM and the sequence's tiles; anything else is refused by name."""
    rows_128 = dataclasses.replace(
        bwd_config(64, True, 1), query_tile=128, q_stages=2, lse_ahead=False, short_grid_q_stages=0
    )
    assert rows_128.for_short_grid().query_tile == 128
    with pytest.raises(ValueError, match="query_tile must be 64 or 128, got 96"):
        dataclasses.replace(bwd_config(64, True, 1), query_tile=96)
    for change in ({"lse_ahead": True}, {"q_stages": 3}, {"short_grid_q_stages": 3}):
        with pytest.raises(ValueError, match=r"query_tile=128 takes keys_on_rows=True, lse_ahead=False"):
            dataclasses.replace(rows_128, **change)
    with pytest.raises(ValueError, match="query_tile=128 takes"):
        dataclasses.replace(bwd_config(256, True, 1), query_tile=128, lse_ahead=False)


def test_inputs_go_to_the_kernels_in_place_only_where_tma_can_read_them():
    """transformers' q, k, v ([B, S, H, D] views of [B, H, S, D]) are passed as they are; a unit
    stride missing in the last dim, or a stride that is not a multiple of 16 bytes, takes a copy."""
    import torch
    from flashmask3.optimized.interface import tma_operand

    heads_major = torch.randn(2, 4, 100, 128).bfloat16().transpose(1, 2)
    assert tma_operand(heads_major) is heads_major
    for unreadable in (
        torch.randn(2, 100, 4, 130).bfloat16()[..., :128],  # rows of 260 bytes
        torch.randn(2, 100, 4, 256).bfloat16()[..., ::2],  # stride 2 in the last dim
        torch.randn(1, 100, 4, 128).bfloat16().expand(2, 100, 4, 128),  # stride 0 over the batch
    ):
        copy = tma_operand(unreadable)
        assert copy.is_contiguous() and torch.equal(copy, unreadable)
