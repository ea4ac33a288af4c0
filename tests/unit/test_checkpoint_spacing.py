"""`windows.checkpoint_spacing`: the tokens between window checkpoints follow from the layout (a checkpoint's windows
take no more CPU-tier slots than the full-attention KV between two checkpoints), and `window_checkpoint_tokens` "auto"
selects it."""
from __future__ import annotations

import pytest

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.groups import GroupInfo, GroupKind
from offload_connector.scheduler.windows import checkpoint_spacing

MiB = 1 << 20


def sliding(i: int, window: int, bs: int, nbytes: int) -> GroupInfo:
    return GroupInfo(i, GroupKind.SLIDING, bs, nbytes, 1, sliding_window=window)


def full(i: int, bs: int, nbytes: int) -> GroupInfo:
    return GroupInfo(i, GroupKind.FULL, bs, nbytes, 1)


def test_one_to_one_window_128_checkpoints_every_window() -> None:
    # gpt-oss-20b: one 128-token sliding group and one full group of the same bytes per block.
    assert checkpoint_spacing([sliding(0, 128, 16, 384 * 1024), full(1, 16, 384 * 1024)], 16) == 128


def test_gemma4_31b_five_1024_windows_weigh_10240_full_tokens() -> None:
    groups = [sliding(i, 1024, 16, int(2.5 * MiB)) for i in range(5)] + [full(5, 32, int(2.5 * MiB))]
    assert checkpoint_spacing(groups, 32) == 10240


def test_the_spacing_is_a_multiple_of_the_alignment_and_grows_with_the_window() -> None:
    prev = 0
    for window in (128, 512, 1000, 4096):
        s = checkpoint_spacing([sliding(0, window, 64, MiB), full(1, 64, MiB)], 64)
        assert s % 64 == 0 and s >= window and s > prev
        prev = s
    # Every block takes one tier slot of the largest group's block size: a window of smaller blocks costs as many
    # slots as one of blocks as large as the full-attention ones.
    light = checkpoint_spacing([sliding(0, 1024, 16, MiB), full(1, 16, MiB)], 16)
    heavy = checkpoint_spacing([sliding(0, 1024, 16, MiB), full(1, 16, 4 * MiB)], 16)
    assert heavy == light


def test_deepseek_v4_windows_are_priced_in_slots_not_block_bytes() -> None:
    # DeepSeek-V4-Flash: compressed MLA in 256-token blocks (the largest, so the slot) and four sliding groups whose
    # restorable window is 2 + 2 + 2 + 16 blocks. In block bytes the windows weigh 4,013 full-attention tokens
    # (4,096 at the alignment); each of the 22 blocks takes a whole slot, which 22 x 256 = 5,632 tokens of MLA fill.
    groups = [sliding(0, 128, 64, 823_680), sliding(1, 128, 64, 786_240), full(2, 256, 1_002_240),
              sliding(3, 8, 4, 49_152), sliding(4, 128, 8, 656_640)]
    assert sum(len(g.restore_range(1 << 20)) for g in groups if g.recycling) == 22
    assert checkpoint_spacing(groups, 256) == 5632


def test_no_sliding_group_means_no_checkpoints_and_no_full_group_every_boundary() -> None:
    chunked = GroupInfo(0, GroupKind.CHUNKED, 16, MiB, 1, chunk_size=8192)
    assert checkpoint_spacing([chunked, full(1, 16, MiB)], 16) == 0
    assert checkpoint_spacing([full(0, 16, MiB)], 16) == 0
    assert checkpoint_spacing([sliding(0, 512, 16, MiB)], 16) == 16


def test_auto_is_the_default_and_the_values_are_checked() -> None:
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1}).window_checkpoint_tokens is None
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": "auto"}) \
        .window_checkpoint_tokens is None
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": 0}).window_checkpoint_tokens == 0
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": 4096}) \
        .window_checkpoint_tokens == 4096
    for bad in ("often", -5, 1.5, True, [1]):
        with pytest.raises(ConfigError, match="'window_checkpoint_tokens' must be a positive integer, 0 .* or \"auto\""):
            OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": bad})
