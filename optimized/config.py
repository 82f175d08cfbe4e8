"""The cute kernels' tuning choices as frozen configurations, and the host functions that pick them.

`fwd_config` / `bwd_config` choose, per head dim and mask variant (causal, width), the configuration
measured best on the H200 (as FA4's `FwdConfig` and `_tile_size_fwd_sm90` do); bf16 and fp16 share
every choice. A kernel is compiled per configuration (the compile cache keys on it), so an ablation
runs another one next to the chosen one:

    config = dataclasses.replace(fwd_config(128, True, 1), persistent=False)
    interface.forward(q, k, v, mask, scale, config=config)

The two classes share no field name, so `apply_overrides` can route one set of `field=value`
changes (an ablation variant) to both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

FORWARD_HEAD_DIMS = ((64, 64), (128, 128), (128, 64), (192, 128), (256, 256))
"""The (q/k head dim, v head dim) pairs the public entry runs on the forward kernel: the ones checked
against the reference on the H200 (the kernel builds a few more)."""
BACKWARD_HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
"""The (q/k head dim, v head dim) pairs the backward kernel builds, all checked on the H200."""


@dataclass(frozen=True)
class FwdConfig:
    """The forward's choices (flash_fwd_sm90.py)."""

    # Query rows per work tile, 64 per consumer warpgroup: 128 (two warpgroups in ping-pong) or, at
    # head dim 64 only, 192 (three in round-robin turns; at 128 their registers would not fit).
    tile_m: int
    # Keys per key tile, a multiple of 16 up to 256: 128, or 64 at head dim 256, where a 128-key
    # tile's scores would not fit in registers beside O's 128 values per thread (at head dim 128,
    # from 160 keys only with one Q buffer, and the causal builds spill above 144; at 256, 80 keys
    # fit in smem with one bound per key only: wider tiles are an ablation). The host's key-block
    # min/max and the tile lists follow it.
    tile_n: int
    # K/V pipeline depth: 2 or 3 (each stage is a K and a V buffer in smem; three fit at head dim
    # 64 only: at 128 they would take 260 KB beside two Q buffers, the compile refuses them).
    num_stages: int
    # Q buffers in smem, each holding a work tile's Q and then its O for the store: 2 (the next
    # tile's Q lands while this one's O is stored) or 1 (the next Q waits for the store to have
    # read it, or with `o_from_registers` for the last S GEMM), where two do not fit beside the K/V
    # stages (head dims 192 and 256).
    q_buffers: int
    # One CTA per SM, each drawing work tiles until none are left (off: one CTA per work tile; the
    # same kernel, only the grid differs).
    persistent: bool
    # PARTIAL key tiles whose keys all share one set of bounds (a document's interior, a question's
    # answers) masked from one key's bounds, per row, instead of every key's.
    uniform_tiles: bool
    # Work tiles drawn in order of their key-tile steps, most first (through a host permutation),
    # so the last ones drawn are short, when there are at most this many per SM (0: never). With
    # more, the tail is a small share and the draw order's L2 reuse (consecutive work tiles read
    # one head's K/V) is worth more.
    longest_tiles_first_waves: int
    # In the key-tile loop, the K stage released after the mask of S_j, not as soon as S_j lands:
    # with the release (an mbarrier arrive) ahead of the PARTIAL branch, ptxas puts the wait for
    # the warpgroup's own PV GEMM above the whole softmax; after the mask, below most of it. For
    # 128-row tiles only (at 192 rows ptxas does not move the wait and spills).
    late_k_release: bool
    # Row maxima of the scores by `fmax` in four chains (one FMNMX per value) instead of a MAX
    # reduction, which lowers to NaN-propagating compares and selects on the softmax's critical path
    # (the same numbers bit for bit: the scores are never NaN).
    fmax_row_max: bool
    # O rescaled only when a key tile raises a row's max by more than 2^8 (`softmax.py`): until
    # then the probabilities are taken against the old max, and a turn whose warp has no such row
    # skips the rescale's multiplies, which wait for the warpgroup's own PV GEMM.
    lazy_rescale: bool
    # Causal masks: a key tile that no key's bounds reach (only the diagonal cuts it) is listed as
    # such and masked by the causal comparison alone, without its bounds' cp.async, wait and barrier.
    diagonal_tiles: bool
    # Causal masks: a PARTIAL key tile the causal diagonal does not cut is listed as such and masked
    # by its keys' bounds alone, without the per-element causal comparison.
    off_diagonal_tiles: bool
    # Non-causal masks: a PARTIAL key tile that only one of the two intervals reaches (a band's
    # edge, the global keys' tile of a global window) is listed as such and masked by that
    # interval's bounds alone, half the compares per element.
    one_interval_tiles: bool
    # Masks over Sq = Sk whose rows split into independent segments (packed documents): query and
    # key tiles aligned to the segments instead of the sequence, through a virtual sequence that
    # pads each segment to whole tiles (segments.py); the tiles straddling two documents, and their
    # masked steps, are gone. 128-row query tiles and key tiles dividing 128 only (the plan's
    # granule: a key tile must not span two).
    segment_tiles: bool
    # With one Q buffer and 128-row tiles: O stored from registers (quads swap column pairs, 8-byte
    # stores) instead of staged in the Q buffer for a TMA store, and the buffer freed once every
    # consumer warpgroup's last S GEMM has read it, so the next work tile's Q loads under the last
    # PV and the epilogue, not after.
    o_from_registers: bool
    # The consumer warpgroups take turns on the tensor cores (ping-pong: one's QK and PV GEMMs
    # issued while the other runs its softmax), by a named barrier per turn. Off, they issue as
    # their data arrive, as FA3 and FA4 run above head dim 128; each refill of a warpgroup's
    # prefetched bounds then waits for the warpgroup at a barrier of its own instead.
    turn_barriers: bool
    # Calls without a mask, or with the causal one alone, over keys that fill whole tiles: each
    # work tile's key tiles counted in registers by the producer and the consumers, as FA4 walks
    # them, instead of read from the mask warp's list (which then holds the work tiles only); only
    # the causal diagonal cuts a tile, masked by the comparison. The plan keeps the list for every
    # other call.
    counted_keys: bool

    def __post_init__(self) -> None:
        if self.tile_m not in (128, 192):
            raise ValueError(f"tile_m must be 128 or 192, got {self.tile_m}")
        if self.tile_n % 16 != 0 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 from 16 to 256, got {self.tile_n}")
        if self.num_stages not in (2, 3):
            raise ValueError(f"num_stages must be 2 or 3, got {self.num_stages}")
        if self.q_buffers not in (1, 2):
            raise ValueError(f"q_buffers must be 1 or 2, got {self.q_buffers}")
        if self.longest_tiles_first_waves < 0:
            raise ValueError(f"longest_tiles_first_waves must be >= 0, got {self.longest_tiles_first_waves}")
        if self.segment_tiles and (self.tile_m != 128 or 128 % self.tile_n):
            raise ValueError(
                "segment_tiles needs tile_m=128 and a tile_n dividing 128 (a tile within one 128-row granule), "
                f"got tile_m={self.tile_m}, tile_n={self.tile_n}"
            )
        if self.late_k_release and self.tile_m != 128:
            raise ValueError(f"late_k_release needs tile_m=128 (at more rows ptxas spills), got tile_m={self.tile_m}")
        if self.o_from_registers and (self.q_buffers != 1 or self.tile_m != 128):
            raise ValueError(
                "o_from_registers needs q_buffers=1 (with two, Q already loads early) and tile_m=128, "
                f"got q_buffers={self.q_buffers}, tile_m={self.tile_m}"
            )

    @property
    def num_consumer_wgs(self) -> int:
        """Consumer warpgroups, 64 query rows each."""
        return self.tile_m // 64


@dataclass(frozen=True)
class BwdConfig:
    """The backward's choices (flash_bwd_sm90.py)."""

    # Keys per CTA (the key tile): 128 with keys on rows, else a multiple of 16 up to 128 (48 at
    # head dim 256, 96 at 192, FA4's SM90 shapes: what fits beside the fp32 dQ staging in smem).
    key_tile: int
    # Query rows per step: 64, or 128 with keys on rows at head dim 64 (FA4's SM90 shape there:
    # half the steps, and their barriers, list reads and dQ adds, per key tile; the dQ GEMM splits
    # the rows between the warpgroups; two Q/dO stages fit in smem, the LSE is read after the S
    # GEMM, whose 32 values per thread ahead of it spill).
    query_tile: int
    # The step's orientation. On rows: the scores transposed (S^T = K Q^T), 64 keys per consumer
    # warpgroup, P^T and dS^T kept in registers as the A operands of dV and dK. Off (head dims
    # above 128, whose dK and dV accumulators would not fit in registers that way): S = Q K^T with
    # the warpgroups splitting the keys, P and dS through smem, dV^T = dO^T P and dK^T = Q^T dS.
    keys_on_rows: bool
    # Q (with its LSE) pipeline depth: 2 or 3 query tiles in smem, so the producer loads further
    # ahead of the step that needs them.
    q_stages: int
    # dO (with Delta) pipeline depth, up to q_stages: 0 for as many as Q's (one at head dim 256,
    # where a second dO stage does not fit).
    do_stages: int
    # The thread's LSE values into registers before the S GEMM is issued, not read from smem after
    # it (the loads then queue behind the GEMMs' operand reads); 16 more live registers (2 with
    # queries on rows).
    lse_ahead: bool
    # The CTAs launched in order of their query-tile steps, most first (a 1-D grid through a host
    # permutation), so few long CTAs are left for the last wave, when the grid is at most this many
    # waves of one CTA per SM (0: never). In a longer grid the tail is a small share and the grid
    # order's L2 reuse (consecutive CTAs read one head's Q and dO) is worth more. Not in
    # deterministic mode, whose key tiles wait for the ones before them.
    longest_ctas_first_waves: int
    # That order by length class (`tile_plan.longest_first`): this many equal ranges of steps, each
    # in grid order, so the CTAs running together mostly share a KV head's query heads (their Q, dO
    # and dQ accumulator) in L2; by exact length (0), CTAs of all KV heads run together and the L2
    # hit rate fell to 44% on causal documents (78% with the CTAs in KV-head order, which the
    # classes approximate).
    longest_ctas_first_buckets: int
    # Causal masks: the steps that only the causal diagonal cuts (no key's bounds reach their
    # rows) masked by the causal comparison alone, without loading the keys' bounds.
    diagonal_steps: bool
    # Masks over Sq = Sk whose rows split into independent segments: key tiles (the CTAs) and query
    # steps aligned to the segments through the virtual rows of `segments.py`, as the forward's
    # `segment_tiles`; the preprocess and postprocess map their tiles the same way. 128-key tiles
    # only (the plan's granule), and masks whose query heads of one KV head share one mask head.
    segment_steps: bool
    # Warp 2 of the producer warpgroup issues the dQ reduce-adds (FA3/FA4's dQ warp): a consumer
    # warpgroup writes its dQ half to smem and arrives on a barrier, where otherwise it waits for
    # its lane 0 to issue the add and, before the next step's dS barrier, for the add to have
    # read smem (the wait that grows when the adds queue in L2).
    dq_writer: bool
    # Q/dO stages in short grids (at most `longest_ctas_first_waves` waves: the CTAs longest first
    # or split, `for_short_grid`), 0 for `q_stages` there too: a short grid's CTAs run together
    # from the start, and with the dQ writer two stages can beat three there. It overrides
    # `q_stages` in short grids: set it to 0 with a `q_stages` meant for every grid.
    short_grid_q_stages: int
    # Short grids (at most `longest_ctas_first_waves` waves) in grid order, a CTA that would end past
    # the grid's ideal makespan split into 2 or up to this many CTAs (2 or 4; 0: never, the
    # longest-first order instead), each walking a part of the
    # key tile's query tiles: grid order keeps one KV head's CTAs running together (their Q, dO and
    # dQ accumulator in L2), the parts shorten the tail. The parts' dK and dV meet in a global fp32
    # workspace; the last one to finish adds them up and stores (`tile_plan.backward_split_plan`).
    # Not in deterministic mode.
    split_ctas_max_parts: int
    # The deadline of that split: the ideal makespan plus this percentage (-100 splits every CTA).
    split_ctas_slack_pct: int
    # Calls without a mask, or with the causal one alone, over keys that fill whole tiles: each key
    # tile's query tiles counted in registers by the producer and the consumers, as FA4 walks its
    # steps, instead of listed by the mask warp and handed on with each Q stage (no smem word
    # between the Q wait and the S GEMM, no stage for a head's end); only the causal diagonal cuts
    # a step. The plan keeps the list for every other call.
    counted_steps: bool

    def __post_init__(self) -> None:
        if self.q_stages not in (2, 3):
            raise ValueError(f"q_stages must be 2 or 3, got {self.q_stages}")
        if self.key_tile % 16 != 0 or not 16 <= self.key_tile <= 128:
            raise ValueError(f"key_tile must be a multiple of 16 from 16 to 128, got {self.key_tile}")
        if self.query_tile not in (64, 128):
            raise ValueError(f"query_tile must be 64 or 128, got {self.query_tile}")
        if self.query_tile == 128 and (
            not self.keys_on_rows
            or self.lse_ahead
            or self.segment_steps
            or 3 in (self.q_stages, self.short_grid_q_stages)
        ):
            raise ValueError(
                "query_tile=128 takes keys_on_rows=True, lse_ahead=False, segment_steps=False and two Q/dO stages "
                f"(q_stages=2, short_grid_q_stages 0 or 2), got keys_on_rows={self.keys_on_rows}, "
                f"lse_ahead={self.lse_ahead}, segment_steps={self.segment_steps}, q_stages={self.q_stages}, "
                f"short_grid_q_stages={self.short_grid_q_stages}"
            )
        if not 0 <= self.do_stages <= self.q_stages:
            raise ValueError(
                f"do_stages must be from 0 (as many as Q's) to q_stages={self.q_stages}, got {self.do_stages}"
            )
        if self.keys_on_rows and (self.key_tile != 128 or self.do_stages not in (0, self.q_stages)):
            raise ValueError(
                "keys_on_rows=True takes key_tile=128 (64 keys per warpgroup) and as many dO stages as Q's "
                f"(do_stages 0 or q_stages), got key_tile={self.key_tile}, do_stages={self.do_stages}"
            )
        if self.segment_steps and self.key_tile != 128:
            raise ValueError(f"segment_steps needs key_tile=128 (the segments' granule), got key_tile={self.key_tile}")
        if self.longest_ctas_first_waves < 0:
            raise ValueError(f"longest_ctas_first_waves must be >= 0, got {self.longest_ctas_first_waves}")
        if self.short_grid_q_stages not in (0, 2, 3):
            raise ValueError(f"short_grid_q_stages must be 0 (as q_stages), 2 or 3, got {self.short_grid_q_stages}")
        if self.longest_ctas_first_buckets < 0:
            raise ValueError(f"longest_ctas_first_buckets must be >= 0, got {self.longest_ctas_first_buckets}")
        if self.split_ctas_max_parts not in (0, 2, 4):
            raise ValueError(f"split_ctas_max_parts must be 0 (off), 2 or 4, got {self.split_ctas_max_parts}")
        if self.split_ctas_slack_pct < -100:
            raise ValueError(f"split_ctas_slack_pct must be >= -100, got {self.split_ctas_slack_pct}")

    @property
    def do_depth(self) -> int:
        """dO pipeline stages: `do_stages`, or Q's count where it is 0."""
        return self.do_stages or self.q_stages

    def for_short_grid(self) -> BwdConfig:
        """The configuration a short grid (the CTAs longest first, or split) runs: `short_grid_q_stages`."""
        return dataclasses.replace(self, q_stages=self.short_grid_q_stages or self.q_stages)


LONGEST_TILES_FIRST_WAVES = 128
"""The forward draws its work tiles longest first when there are at most this many per SM."""
LONGEST_TILES_FIRST_WAVES_HEAD_DIM_192 = 64
"""The same at head dim 192, whose K/V tiles are 1.5x larger, so the index order's L2 reuse
weighs more: at 124 per SM it is +10% on causal and +1.7% on causal documents against longest
first; at 31 per SM longest first still wins on documents (+4-6%). Head dim 256 takes it too
(its work tiles read 2x head dim 128's K/V; not yet measured there)."""
LONGEST_CTAS_FIRST_WAVES = 16
"""The backward's CTAs go longest first in grids of at most this many waves."""
SPLIT_CTA_SLOTS_PER_SM = 4
"""Workspace slots for split CTAs' parts (`BwdConfig.split_ctas_max_parts`) per SM: the split rule
used at most 3.3 per SM over the shapes modelled (`tools/tail_model.py`); past them CTAs stay whole."""
LONGEST_CTAS_FIRST_BUCKETS = 8
"""The backward's longest-first order sorts by this many length classes. Fewer, wider classes keep
more of a KV head's CTAs running together (their Q, dO and dQ accumulator shared in L2), which
weighs more where DRAM is slower: at the training shape on an H100, against 16 classes, fwd+bwd
+10% on causal documents, +6% share-question, +1.4-3% on document, prefix-LM documents and
causal blockwise, -1.5% on the sliding window (4 classes: +15% and +14% on those two, -3% on the
sliding window); on an H200, 16 classes were within 1-2% of 8 on six masks."""


def fwd_config(head_dim: int, causal: bool, mask_width: int, segmented: bool = False, plain: bool = False) -> FwdConfig:
    """The forward's configuration for this head dim and mask variant (`segmented`: the mask's
    `ColumnMask.segmented` hint; `plain`: a call without a mask, or with the causal one alone).
    192-row query tiles at head dim 64 (FA3/FA4's SM90 shape: 1.5x the rows per K/V load; +8-12% on
    four of five masks at 8K, -7.5% on the sliding window), 128 at 128; two K/V stages (a third
    measured no faster); the persistent grid (up to +21% over one CTA per work tile on the
    short-list masks, even on the dense ones); uniform partial tiles masked per row (+1-4% on the
    document-like masks at 8K, 0 on full); at 128-row tiles the K stage released after the mask
    (+0.5-4.5% on every mask, bit for bit the same numbers); one Q buffer at head dims 192 and 256,
    where two do not fit beside two K/V stages, and their work tiles longest first only up to 64 per
    SM; 64-key tiles at head dim 256 (FA4's SM90 choice there is 80; a 64-key tile keeps the scores'
    registers beside O's 128 per thread and two K/V stages in smem); at head dim 128 the row maxima
    by fmax chains on the non-causal variants (+0.9-2.4% on full and document; -0.1 to -2.4% on the
    causal masks, so not there); O rescaled lazily (only when a row's max moves by more than 2^8) on
    the variants where it was measured and checked on a GPU: at head dim 256 every variant (+4-11%
    on six masks with one or two bounds at 8K, +7-8% on causal blockwise and qk-sparse, +2.5-6.9% at
    equal clocks, +3.8% on the global sliding window, on an H100), at 128 the non-causal two-bound
    ones (full and documents +2.7-5.0%); not on the causal masks at 128 (-1.6 to +1%, where ptxas
    exposes more of the exponentials; deciding over the warpgroup instead of the warp, with a
    barrier, lost 9-10%) nor at 192/128 (-6 to -1.5% on causal documents); on the causal masks with
    one bound per key, the tiles only the diagonal cuts masked without their bounds (sliding window
    +5.2% at 8K, +0.9-1.1% at 32K, the others within +-0.7%; on causal_blockwise, two bounds, -0.9%
    at 32K, so not there; not at 192-row tiles either, whose consumers it makes spill more); on the
    causal masks with two bounds per key at 128-row tiles, the partial tiles the diagonal does not
    cut masked by their bounds alone (causal_blockwise +0.7-1.7% at 8K and 32K, qk_sparse -0.2 to
    -0.4%; with one bound it gains on share_question, +1.9-5.5%, and loses on causal and the 32K
    sliding window, -1 to -4.3%); at 128-row tiles (head dims 128, 192/128 and 256) on segmented
    masks, the tiles aligned to the segments (`segments.py`, planned without a host sync; on an H100
    +1.5-8.0% on the four document masks at 8K and 32K at 128; at 256 +4.3-6.6% on documents,
    +1.5-17.6% on causal documents, +1.8% on share-question and +10.8% on prefix-LM documents in two
    runs; at 192/128 +4.5-7.0% on the four at 8K; but -1 to -3.4% on masks without segments, hence
    only on the hint); at head dims 192 and 256, O stored from registers and Q's buffer freed after
    the last S GEMM (on an H100 at 8K +0.1-6.0% at 256, +1.0-4.6% at 192/128 on full, causal, causal
    documents and documents; at 128, measured with two Q buffers, -2 to -3% on the sliding window
    and share-question, and its causal builds hold registers in local memory, so not there). 128-key
    tiles at head dim 128 also without a mask: FA3's 176 (one Q buffer, O from registers) measured
    -2.0 to +4.5% against them there, on an H100 in four runs, and -1 to -10% on the masks with
    partial tiles; at head dim 256 FA4's 80-key tiles (causal masks with one bound per key: what
    fits in smem) +1.5% on causal, -6% on the sliding window and within 0.3% on causal documents and
    share-question (an H100, 8K). At 192/128 the consumer warpgroups issue their GEMMs without
    taking turns, FA4's choice above head dim 128 (on an H100 at 8K +0.9-4.1% on full, causal, the
    documents, share-question and causal blockwise); at 256 that loses 7.6% on share-question and is
    within 1% elsewhere, so not there. At head dim 128 on the non-causal masks with four bounds per
    key, the partial tiles that one interval alone reaches masked by its two bounds (the global
    sliding window +10.6% and +11.2% at 8K in two runs on an H100, at equal clocks; with two bounds
    per key +0.1-2.6% on documents and prefix-LM documents but -3.3 and -4.5% on prefix-LM causal,
    at a lower clock each time, so not there). On plain calls the key tiles counted in registers
    instead of listed (on an H100 at head dim 128 +1.0-3.5% on full and +0.3-5.8% on causal at 8K,
    32K and the training shape; at 192/128 +3.4% on full, -0.7% on causal at 32K, within the
    clocks' spread), but not by the causal build at 192-row tiles, whose consumers then hold 35
    values in local memory against the list's 18."""
    tile_m = 192 if head_dim == 64 else 128
    return FwdConfig(
        tile_m=tile_m,
        tile_n=64 if head_dim == 256 else 128,
        num_stages=2,
        q_buffers=1 if head_dim > 128 else 2,
        persistent=True,
        uniform_tiles=True,
        longest_tiles_first_waves=(
            LONGEST_TILES_FIRST_WAVES_HEAD_DIM_192 if head_dim > 128 else LONGEST_TILES_FIRST_WAVES
        ),
        late_k_release=tile_m == 128,
        fmax_row_max=head_dim == 128 and not causal,
        lazy_rescale=head_dim == 256 or (head_dim == 128 and not causal and mask_width == 2),
        diagonal_tiles=causal and mask_width == 1 and tile_m == 128,
        off_diagonal_tiles=causal and mask_width == 2 and tile_m == 128,
        one_interval_tiles=head_dim == 128 and not causal and mask_width == 4,
        segment_tiles=tile_m == 128 and segmented,
        o_from_registers=head_dim > 128,
        turn_barriers=head_dim != 192,
        counted_keys=plain and not (causal and tile_m == 192),
    )


def bwd_config(
    head_dim: int, causal: bool, mask_width: int, deterministic: bool = False, plain: bool = False
) -> BwdConfig:
    """The backward's configuration for this head dim, mask variant and mode (`deterministic`;
    `plain`: a call without a mask, or with the causal one alone).
    At head dim 64, 128 query rows per step (FA4's SM90 step there; two Q/dO stages, the LSE after
    the S GEMM) where that build keeps its registers: non-causal masks with two bounds per key and
    causal ones with one (on an H100 at 8K, fwd+bwd +6.6 to +10.3% on full, documents, causal and
    causal documents, +2.9 to +8.1% on share-question, the sliding window, prefix-LM documents and
    random eviction), and causal ones with two without the dQ writer (+3.8 to +4.2%: causal
    blockwise, qk-sparse); four bounds per key and deterministic mode spill with it and keep 64.
    Otherwise at head dims 64 and 128 (keys on rows, 128 keys per CTA): three Q/dO stages (fwd+bwd
    +0.3 to +2.2% on the document, share-question and prefix-LM masks at the training shape, -1.0%
    on the global window there, -0.8 to +0.8% at 8K); the LSE ahead of the S GEMM (+0.5-1.8%),
    except with four bounds per key (mask width 4), where its registers make ptxas spill; on causal
    masks, the steps only the diagonal cuts masked without their keys' bounds (-0.1 to +1.6%, +0.5%
    on average over three shapes). The step itself is in the peers' order (dV after dS is in smem,
    dQ before dK, the dQ add while dK runs: +1.1-1.4% fwd+bwd at 8K over issuing dV and dK first).
    The dQ reduce-adds from a warp of their own (on an H100, fwd+bwd +2.5-7% at the training shape
    on six masks, +1.5-3.8% at 8K on five, +1-5% at head dims 64, 192 and 256; -0.2 to -2.3% on
    causal documents and share-question at the training shape, -4% on documents at 8K), except at
    head dim 192 with four bounds per key and in head dim 64's causal two-bound 128-row step, whose
    consumers spill with it. With the
    writer, at head dim 128 on the causal masks with one bound per key, short grids (the CTAs
    longest first) take two Q/dO stages (on an H100 at the training shape fwd+bwd +6.2-6.7% on
    causal documents, +10.8-10.9% share-question, +3.2% causal, -3.9% sliding window; at 8K, in
    grid order, two and three within 1.6%). At head dim 128 on the causal masks with one bound per
    key, short grids keep grid order and split their long CTAs in up to four parts (on an H100 at
    the training shape fwd+bwd, three runs against the length classes: +5.1 to +6.5% on causal
    documents and share-question, +5.6% sliding window, -0.8 to +1.9% causal; two parts at most:
    -8.6 to +3.7%); not on the non-causal masks (documents -4.8 to +2.2% in four runs, prefix-LM
    documents -0.2 to -4.7%, prefix-LM causal -9%, the global window -4.4%), nor at head dim 64 (-3
    to -5% on the document masks). The causal masks with two bounds per key split too (three runs at
    the training shape: causal blockwise +2.9 to +4.1%, qk-sparse +2.7 to +2.9%). At
    192/128 (on an H100, the training shape) they split too, up to two bounds per key (+12.6% causal
    documents, +12.8% share-question, +3.9% documents, +0.5 to +1.9% prefix-LM documents, causal and
    the sliding window), not with four (the global window -3.4%).
    On calls without a mask or with the causal one alone, each key tile's query steps counted in
    registers instead of listed (`counted_steps`; on an H100 over three runs fwd+bwd +1.0 to +3.0%
    on full and +0.3 to +1.2% on causal at 8K, -3.9 to +7.5% on full and -2.5 to +1.2% on causal
    at the training shape, where the clock the 700 W cap leaves moved more than the kernel: per
    clock +1.2 to +7% in 11 of 12 pairs).
    Head dims 192 (with v 128) and 256 take FA4's SM90 shapes, queries on rows: 96 and 48 keys per
    CTA, two Q stages, two and one dO stages, the LSE ahead at every mask width (two values per
    thread; read after the S GEMM, the width-4 build at 192 spills)."""
    queries_on_rows = head_dim > 128
    rows_128 = head_dim == 64 and not deterministic and (mask_width == 2 or (causal and mask_width == 1))
    # Causal masks with two bounds per key keep their 128-row step in registers without the writer.
    rows_128_no_writer = rows_128 and causal and mask_width == 2
    # At 128 the non-causal masks lose.
    split_ctas = (head_dim == 128 and causal) or (head_dim == 192 and mask_width < 4)
    return BwdConfig(
        key_tile={192: 96, 256: 48}.get(head_dim, 128),
        query_tile=128 if rows_128 else 64,
        keys_on_rows=not queries_on_rows,
        q_stages=2 if queries_on_rows or rows_128 else 3,
        do_stages=1 if head_dim == 256 else 0,
        lse_ahead=queries_on_rows or (mask_width < 4 and not rows_128),
        longest_ctas_first_waves=LONGEST_CTAS_FIRST_WAVES,
        longest_ctas_first_buckets=LONGEST_CTAS_FIRST_BUCKETS,
        diagonal_steps=causal,
        segment_steps=False,
        dq_writer=not ((head_dim == 192 and mask_width == 4) or rows_128_no_writer),  # their consumers spill with it
        short_grid_q_stages=2 if head_dim == 128 and causal and mask_width == 1 else 0,
        split_ctas_max_parts=4 if split_ctas and not deterministic else 0,
        split_ctas_slack_pct=2,
        counted_steps=plain,
    )


Config = TypeVar("Config", FwdConfig, BwdConfig)


def config_fields() -> dict[str, type]:
    """Every field of both configurations and its type (`bool` or `int`)."""
    types = {"bool": bool, "int": int}
    return {f.name: types[str(f.type)] for cls in (FwdConfig, BwdConfig) for f in dataclasses.fields(cls)}


def apply_overrides(config: Config, overrides: Mapping[str, bool | int]) -> Config:
    """`config` with the entries of `overrides` that name its fields replaced (the others belong to
    the other direction's configuration); a name of neither is an error. A `q_stages` given
    without `short_grid_q_stages` holds in short grids too."""
    unknown = sorted(set(overrides) - set(config_fields()))
    if unknown:
        raise ValueError(f"no kernel config field {', '.join(unknown)}; the fields: {', '.join(config_fields())}")
    own = {f.name for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {name: value for name, value in overrides.items() if name in own}
    if "q_stages" in changes:
        changes.setdefault("short_grid_q_stages", 0)
    return dataclasses.replace(config, **changes)
