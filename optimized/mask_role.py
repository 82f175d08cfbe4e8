"""The mask role: one warp that classifies tiles ahead of the others and hands them a compacted list.

Each CTA works on tiles of one dimension (the forward: query tiles, persistently, which the mask
warp also draws: tile_scheduler.py; the backward: one key tile) and walks the tiles of the other.
The mask warp classifies those 32 at a time, one per lane, from the per-key-block min/max of the
boundary vectors (`block_minmax`, computed once per call on the GPU; FlashMask's rule, exactly
`ColumnMask.block_classes`): SKIP tiles are left out, the others are published in order as
`tile << FLAG_BITS | flags` (PARTIAL, UNIFORM, OFF_DIAGONAL, LOWER_ONLY, UPPER_ONLY) into a small
smem ring (`TileList`), then -1. The TMA producer reads the ring (and in the forward the consumer
warps too; the backward's producer hands each entry on with its Q stage), so skipped tiles cost
neither loads nor MMAs and UNMASKED tiles cost no mask arithmetic.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .tile_scheduler import NO_MORE_WORK, WorkTiles, draw_work_tile
from .timeline import Event, Timeline

END_OF_LIST = -1
PARTIAL = 1  # entry flag: the tile needs the element mask
# Entry flag of a PARTIAL forward tile whose keys all have the same bounds (min == max of every
# boundary column, no ragged end): its mask is a set of rows, read from one key's bounds.
UNIFORM = 2
# UNIFORM without PARTIAL (a causal tile, with `flag_diagonal`): no key's bounds reach the
# tile's rows and no key is past the end, so only the causal diagonal cuts it: no bounds to read.
DIAGONAL_ONLY = UNIFORM
# Entry flag of a PARTIAL causal forward tile that the causal diagonal does not cut (with
# `flag_off_diagonal`): its keys' bounds alone mask it, no per-element causal comparison.
OFF_DIAGONAL = 4
# Entry flags of a PARTIAL non-causal forward tile that only one of the mask's two intervals
# reaches (with `flag_one_interval`): the lower one, [LTS, LTE) or [LTS, Sq), or the upper one,
# [UTS, UTE) or [0, UTE). Its element mask tests that interval's bounds alone (half the compares).
LOWER_ONLY = 8
UPPER_ONLY = 16
FLAG_BITS = 5  # an entry is its tile index shifted past the flags


@cute.jit
def entry_tile(entry: Int32) -> Int32:
    """The tile index of a list entry."""
    return entry >> FLAG_BITS


@dataclass(frozen=True)
class TileList:
    """A ring of `slots` int32 entries in smem, one full and one empty mbarrier per slot.

    One writer lane per entry (the mask warp); `readers` warps each read every entry and release
    its slot right after (one arrive per warp), so the mask warp may run up to `slots` entries ahead.
    """

    ring: cute.Tensor  # Int32 smem, (slots,)
    full: cute.Pointer  # Int64 smem, 2 * slots: the full barriers, then the empty ones
    slots = 64
    slot_bits = slots.bit_length() - 1  # positions never go negative: slot and phase by mask and shift

    @classmethod
    def slot(cls, position: Int32) -> Int32:
        """The ring slot of entry number `position`."""
        return position & (cls.slots - 1)

    @classmethod
    def phase(cls, position: Int32) -> Int32:
        """The parity of the round of the ring that `position` falls in."""
        return (position >> cls.slot_bits) & 1

    @property
    def empty(self) -> cute.Pointer:
        return self.full + self.slots

    @cute.jit
    def init(self, readers: int, warp: Int32, warps: cutlass.Constexpr[int]) -> None:
        """Called by all `warps` warps of the CTA before its mbarrier init fence: they take the slots in
        turn (128 barriers initialized by one thread cost a CTA ~1-3% of its time on short lists)."""
        for slot in cutlass.range(warp, self.slots, warps, unroll=1):
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(self.full + slot, 1)
                cute.arch.mbarrier_init(self.empty + slot, readers)

    @cute.jit
    def wait_free(self, position: Int32) -> None:
        """Wait until every reader has read the entry `slots` before `position`, hence (readers go in
        order) every earlier one: the slots up to `position` may be written."""
        cute.arch.mbarrier_wait(self.empty + self.slot(position), self.phase(position) ^ 1)

    @cute.jit
    def wait_taken(self, position: Int32, next_position: Int32) -> None:
        """Wait until every reader has taken entry `position`, the writer being at `next_position`.
        Once the writer is more than `slots` past it, its own `wait_free` proved that already (and the
        slot's barrier has moved on, so waiting on its parity could block for good)."""
        if next_position <= position + self.slots:
            cute.arch.mbarrier_wait(self.empty + self.slot(position), self.phase(position))

    @cute.jit
    def put(self, position: Int32, entry: Int32) -> None:
        """Write entry number `position` (one lane; after `wait_free` of it or a later position)."""
        slot = self.slot(position)
        self.ring[slot] = entry
        cute.arch.mbarrier_arrive(self.full + slot)

    @cute.jit
    def read(self, position: Int32) -> Int32:
        """Entry number `position`, read by a whole warp (END_OF_LIST after the last tile)."""
        slot = self.slot(position)
        cute.arch.mbarrier_wait(self.full + slot, self.phase(position))
        entry = self.ring[slot]
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(self.empty + slot)
        return entry


@cute.jit
def tile_flags(
    bounds: cute.Tensor,
    row_start: Int32,
    row_end: Int32,
    key_start: Int32,
    tile_n: cutlass.Constexpr[int],
    seqlen_k: Int32,
    causal_offset: Int32,
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
):
    """(listed, partial, uniform, diagonal_only, on_diagonal, lower_only, upper_only) of the tile rows
    [row_start, row_end) x keys [key_start, key_start + tile_n); uniform: every boundary column's min
    equals its max and no key is past the end; diagonal_only: partial by the causal diagonal alone
    (no interval reaches the rows, no key past the end); on_diagonal: the causal diagonal cuts it
    (False when not causal); lower_only / upper_only (non-causal only, else False): of the two
    intervals, only the lower / the upper one reaches the rows.

    `bounds` holds the key block's min of each of the `width` boundary columns, then their max.
    A tile is SKIP when one interval covers all its rows for every key (or the causal part hides
    it), PARTIAL when some interval reaches into it (or the causal diagonal or the end of the keys
    cuts it). Variants: causal 1 = [LTS, Sq), causal 2 = [LTS, LTE), non-causal 2 = [LTS, Sq) and
    [0, UTE), non-causal 4 = [LTS, LTE) and [UTS, UTE).
    """
    lo0, hi0 = bounds[0], bounds[width]
    lower_touched = False  # non-causal: whether each interval reaches the rows
    upper_touched = False
    if const_expr(causal and width == 1):
        covered = hi0 <= row_start
        touched = lo0 < row_end
    elif const_expr(causal or width == 4):
        lo1, hi1 = bounds[1], bounds[width + 1]
        covered = hi0 <= row_start and lo1 >= row_end
        touched = lo0 < row_end and hi1 > row_start
        if const_expr(width == 4):
            lo2, hi2, lo3, hi3 = bounds[2], bounds[6], bounds[3], bounds[7]
            covered = covered or (hi2 <= row_start and lo3 >= row_end)
            lower_touched = touched
            upper_touched = lo2 < row_end and hi3 > row_start
            touched = lower_touched or upper_touched
    else:
        lo1, hi1 = bounds[1], bounds[3]
        covered = hi0 <= row_start or lo1 >= row_end
        lower_touched = lo0 < row_end
        upper_touched = hi1 > row_start
        touched = lower_touched or upper_touched
    key_end = cutlass.min(key_start + tile_n, seqlen_k)
    complete = key_end == key_start + tile_n  # no key past the end
    uniform = complete
    for w in cutlass.range_constexpr(width):
        uniform = uniform and bounds[w] == bounds[width + w]
    touched_by_bounds = touched
    touched = touched or key_end < key_start + tile_n
    on_diagonal = False
    if const_expr(causal):
        covered = covered or key_start > row_end - 1 + causal_offset
        on_diagonal = key_end - 1 > row_start + causal_offset
        touched = touched or on_diagonal
    diagonal_only = touched and not touched_by_bounds and complete
    lower_only = lower_touched and not upper_touched
    upper_only = upper_touched and not lower_touched
    return not covered, touched, uniform, diagonal_only, on_diagonal, lower_only, upper_only


@cute.jit
def _publish_batch(tile_list: TileList, position: Int32, tile: Int32, listed, flags: Int32) -> Int32:
    """Publish the warp's listed tiles in lane order after `position`; return the next position.

    The whole warp waits once for room (not each lane on its own slot): a warp whose lanes wait on
    different barriers keeps waking up, and it shares its SM quarter with two consumer warps.
    """
    lane = cute.arch.lane_idx()
    ballot = cute.arch.vote_ballot_sync(listed)
    count = cute.arch.popc(ballot)
    if count > 0:
        tile_list.wait_free(position + count - 1)
        if listed:
            tile_list.put(position + cute.arch.popc(ballot & ((Int32(1) << lane) - 1)), (tile << FLAG_BITS) | flags)
    return position + count


@cute.jit
def _put_single(tile_list: TileList, position: Int32, entry: Int32) -> None:
    """One entry, from lane 0 (the warp's lanes agree on it)."""
    if cute.arch.lane_idx() == 0:
        tile_list.wait_free(position)
        tile_list.put(position, entry)


@cute.jit
def list_key_tiles(
    tile_list: TileList,
    position: Int32,
    mBounds: cute.Tensor,  # [Tn, 2 * width] int32: the mask head's key-block min/max
    row_start: Int32,
    row_end: Int32,
    seqlen_k: Int32,
    causal_offset: Int32,
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
    flag_uniform: cutlass.Constexpr[bool],
    flag_diagonal: cutlass.Constexpr[bool],
    flag_off_diagonal: cutlass.Constexpr[bool],
    flag_one_interval: cutlass.Constexpr[bool],
) -> Int32:
    """Forward mask warp: the key tiles the query rows [row_start, row_end) see, in key order,
    published from entry `position` on (PARTIAL tiles flagged UNIFORM where they are, if
    `flag_uniform`, OFF_DIAGONAL where they are, if `flag_off_diagonal`, and LOWER_ONLY or
    UPPER_ONLY where they are, if `flag_one_interval`; DIAGONAL_ONLY instead of PARTIAL where they
    are, if `flag_diagonal`); returns the position after END_OF_LIST."""
    lane = cute.arch.lane_idx()
    # Key tiles past the last row's diagonal are SKIP: do not even load their bounds.
    num_tiles = seen_key_tiles(cute.size(mBounds.shape[0]), row_end, causal_offset, tile_n, causal)
    bounds = cute.make_rmem_tensor((2 * width,), Int32)
    for first in cutlass.range(0, num_tiles, 32, unroll=1):
        tile = first + lane
        for w in cutlass.range_constexpr(2 * width):
            bounds[w] = mBounds[cutlass.min(tile, num_tiles - 1), w]
        listed, partial, uniform, diagonal_only, on_diagonal, lower_only, upper_only = tile_flags(
            bounds, row_start, row_end, tile * tile_n, tile_n, seqlen_k, causal_offset, causal, width
        )
        flags = Int32(partial)
        if const_expr(flag_uniform):
            flags = flags | (Int32(UNIFORM) if partial and uniform else Int32(0))
        if const_expr(flag_off_diagonal):
            flags = flags | (Int32(OFF_DIAGONAL) if partial and not on_diagonal else Int32(0))
        if const_expr(flag_one_interval):
            flags = flags | (Int32(LOWER_ONLY) if partial and lower_only else Int32(0))
            flags = flags | (Int32(UPPER_ONLY) if partial and upper_only else Int32(0))
        if const_expr(flag_diagonal):
            flags = Int32(DIAGONAL_ONLY) if diagonal_only else flags
        position = _publish_batch(tile_list, position, tile, listed and tile < num_tiles, flags)
    _put_single(tile_list, position, END_OF_LIST)
    return position + 1


@cute.jit
def seen_key_tiles(
    num_tiles: Int32,
    row_end: Int32,
    causal_offset: Int32,
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
) -> Int32:
    """Of `num_tiles` key tiles, how many the query rows up to `row_end` may see: all, or with
    `causal` those up to the last row's diagonal (none where it comes before the first key)."""
    if const_expr(causal):
        last_key = row_end - 1 + causal_offset
        num_tiles = Int32(0) if last_key < 0 else cutlass.min(num_tiles, last_key // tile_n + 1)
    return num_tiles


@cute.jit
def counted_key_tiles(
    row_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
) -> Int32:
    """With `counted_keys` (no interval hides a row): the key tiles the work tile of rows from
    `row_start` sees, every one or with `causal` up to its last row's diagonal."""
    row_end = cutlass.min(row_start + tile_m, seqlen_q)
    return seen_key_tiles((seqlen_k + tile_n - 1) // tile_n, row_end, seqlen_k - seqlen_q, tile_n, causal)


@cute.jit
def _list_work_tile(
    tile_list: TileList,
    position: Int32,
    tiles_done: Int32,
    work: Int32,
    args: tuple,
    choices: tuple,
    timeline: Timeline,
) -> tuple[Int32, Int32]:
    """Work tile `work`'s header entry at `position`, then its key tiles (`list_work_tiles`' rules,
    its arguments as `list_work_tiles` bundles them: `args` the tensors and runtime values, `choices`
    the compile-time ones), once the consumers took all but one work tile ahead; returns the
    position after its END_OF_LIST and the work tiles listed so far."""
    work_tiles, mBlockBounds, mTileRows, mask_batch_stride, qheads_per_maskhead, seqlen_q, seqlen_k = args
    tile_m, counted_keys, *flags = choices
    tile_n, causal = flags[:2]  # `flags`: list_key_tiles' compile-time arguments, these first
    header = position
    entry = work_tiles.header(work)
    _put_single(tile_list, header, entry)
    if cute.arch.lane_idx() == 0:
        timeline.record(tiles_done, Event.WORK_TILE, work)
        timeline.record(tiles_done, Event.LISTED)
    m_block, head, batch = work_tiles.decode(entry)
    row_start = m_block * tile_m
    if const_expr(counted_keys):
        _put_single(tile_list, header + 1, END_OF_LIST)
        position = header + 2
    elif const_expr(mTileRows is None):
        position = list_key_tiles(
            tile_list,
            header + 1,
            mBlockBounds[batch * mask_batch_stride, head // qheads_per_maskhead, None, None],
            row_start,
            cutlass.min(row_start + tile_m, seqlen_q),
            seqlen_k,
            seqlen_k - seqlen_q,
            *flags,
        )
    else:  # Sq = Sk on the virtual rows
        mask_batch, mask_head = batch * mask_batch_stride, head // qheads_per_maskhead
        real_rows = mTileRows[mask_batch, mask_head, m_block, 1]
        bounds = mBlockBounds[mask_batch, mask_head, None, None]
        position = list_key_tiles(tile_list, header + 1, bounds, row_start, row_start + real_rows, seqlen_k, 0, *flags)
    key_tiles = position - header - 2
    if const_expr(counted_keys):
        key_tiles = counted_key_tiles(row_start, seqlen_q, seqlen_k, tile_m, tile_n, causal)
    if cute.arch.lane_idx() == 0:
        timeline.record(tiles_done, Event.LIST_END)
        timeline.record(tiles_done, Event.KEY_TILES, key_tiles)
    tiles_done += 1
    tile_list.wait_taken(header, position)  # one work tile in reserve, no more
    return position, tiles_done


@cute.jit
def list_work_tiles(
    tile_list: TileList,
    work_tiles: WorkTiles,
    counter: cute.Tensor,  # int32 [1], zero at launch
    num_ctas: Int32,
    mBlockBounds: cute.Tensor,  # [Bm, Hm, Tn, 2 * width] int32
    mTileRows: cute.Tensor | None,  # [Bm, Hm, Tm, 2] int32: real first row and count per query tile, or None
    mask_batch_stride: Int32,
    qheads_per_maskhead: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
    flag_uniform: cutlass.Constexpr[bool],
    flag_diagonal: cutlass.Constexpr[bool],
    flag_off_diagonal: cutlass.Constexpr[bool],
    flag_one_interval: cutlass.Constexpr[bool],
    counted_keys: cutlass.Constexpr[bool],
    timeline: Timeline,
) -> None:
    """Forward mask warp of a persistent CTA: for each work tile it draws (tile_scheduler.py), a
    header entry with the work tile, then its key tile list (with `counted_keys` none: the readers
    count the key tiles, the END_OF_LIST follows the header); NO_MORE_WORK after the last. With
    `mTileRows` (segment-aligned tiles, segments.py) a query tile's key tiles are classified for its
    real rows only (the padding rows' results are not stored), and a tile with none is drawn past:
    nothing to load, compute or store."""
    position = Int32(0)
    tiles_done = Int32(0)
    work = Int32(cute.arch.block_idx()[0])
    args = (work_tiles, mBlockBounds, mTileRows, mask_batch_stride, qheads_per_maskhead, seqlen_q, seqlen_k)
    choices = (
        tile_m,
        counted_keys,
        tile_n,
        causal,
        width,
        flag_uniform,
        flag_diagonal,
        flag_off_diagonal,
        flag_one_interval,
    )
    while work < work_tiles.total:
        if const_expr(mTileRows is None):
            position, tiles_done = _list_work_tile(tile_list, position, tiles_done, work, args, choices, timeline)
        else:
            m_block, head, batch = work_tiles.decode(work_tiles.header(work))
            if mTileRows[batch * mask_batch_stride, head // qheads_per_maskhead, m_block, 1] > 0:
                position, tiles_done = _list_work_tile(tile_list, position, tiles_done, work, args, choices, timeline)
        work = draw_work_tile(counter, num_ctas)
    _put_single(tile_list, position, NO_MORE_WORK)


@cute.jit
def query_tile_range(
    key_start: Int32,
    seqlen_q: Int32,
    causal_offset: Int32,
    tile_m: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    tile_range: tuple[Int32, Int32] | None = None,
) -> tuple[Int32, Int32]:
    """The backward's query tiles [first, end) that may see the keys from `key_start`: every one,
    or with `causal` those from the key tile's diagonal on (the ones ending before it are SKIP);
    `tile_range`: only those in [first, end) (a split CTA's part)."""
    end = (seqlen_q + tile_m - 1) // tile_m
    first = Int32(0)
    if const_expr(causal):
        first = cutlass.max(key_start - causal_offset, 0) // tile_m
    if const_expr(tile_range is not None):
        first = cutlass.max(first, tile_range[0])
        end = cutlass.min(end, tile_range[1])
    return first, end


@cute.jit
def counted_query_tiles(
    key_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    tile_range: tuple[Int32, Int32] | None = None,
) -> tuple[Int32, Int32, Int32]:
    """With `counted_steps` (no interval hides a row, whole key tiles): (first, end, cut_end), the
    query tiles [first, end) that see the key tile from `key_start` (`query_tile_range`), of which
    the causal diagonal cuts those below `cut_end`: tile m is cut where its first row's last
    visible key, m * tile_m + Sk - Sq, comes before the key tile's last key."""
    causal_offset = seqlen_k - seqlen_q
    first, end = query_tile_range(key_start, seqlen_q, causal_offset, tile_m, causal, tile_range)
    cut_end = Int32(0)
    if const_expr(causal):
        cut_end = (cutlass.max(key_start + tile_n - 1 - causal_offset, 0) + tile_m - 1) // tile_m
    return first, end, cut_end


@cute.jit
def list_query_tiles(
    tile_list: TileList,
    position: Int32,
    mBounds: cute.Tensor,  # [2 * width] int32: the key tile's min/max under one mask head
    key_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal_offset: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
    flag_diagonal: cutlass.Constexpr[bool] = False,
    tile_range: tuple[Int32, Int32] | None = None,
) -> Int32:
    """Backward mask warp: the query tiles that see the keys [key_start, key_start + tile_n), in
    query order, published from entry `position` on (DIAGONAL_ONLY instead of PARTIAL where they
    are, if `flag_diagonal`); returns the position after END_OF_LIST. `tile_range`: only the query
    tiles in [first, end) (a split CTA's part)."""
    lane = cute.arch.lane_idx()
    bounds = cute.make_rmem_tensor((2 * width,), Int32)
    for w in cutlass.range_constexpr(2 * width):
        bounds[w] = mBounds[w]
    first, num_tiles = query_tile_range(key_start, seqlen_q, causal_offset, tile_m, causal, tile_range)
    for base in cutlass.range(first, num_tiles, 32, unroll=1):
        tile = base + lane
        row_start = tile * tile_m
        listed, partial, _, diagonal_only, *_ = tile_flags(
            bounds,
            row_start,
            cutlass.min(row_start + tile_m, seqlen_q),
            key_start,
            tile_n,
            seqlen_k,
            causal_offset,
            causal,
            width,
        )
        flags = Int32(partial)
        if const_expr(flag_diagonal):
            flags = Int32(DIAGONAL_ONLY) if diagonal_only else flags
        position = _publish_batch(tile_list, position, tile, listed and tile < num_tiles, flags)
    _put_single(tile_list, position, END_OF_LIST)
    return position + 1
