"""Spare windows of one-shot prompts are evicted before those of shared ones (`tier_index.py`).

decode-heavy on a layout the project does not ship (five 4,096-token windows per full-attention layer, 64-token blocks,
one of the layout sweep's cases): long parents that share a system prompt are followed by one-shot fillers and a
stream of short one-shot requests, then by siblings that branch inside the parents' prompts at 512-token boundaries,
where only spare windows can serve them. With one spare list, the one-shot traffic's regular stores evicted the
parents' spare windows first and the siblings recomputed 12,288 tokens (28x the patched vLLM's 448 with the returning
sessions); evicting the one-shot prompts' own spare windows first keeps the parents'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_bench.cli import main
from offload_bench.sim.layouts import BLOCK_SIZE_ENV
from offload_bench.tools.layout_sweep import LAYOUTS, write_config
from offload_connector.scheduler import tier_index


def _siblings_recomputed(tmp_path: Path, mp: pytest.MonkeyPatch, name: str) -> int:
    # The replay's --block-size sets the variable for its process: set here first so that it is restored afterwards
    # (the suite's later tests lay models out with the block size the suite pins).
    mp.setenv(BLOCK_SIZE_ENV, "64")
    layout = next(lay for lay in LAYOUTS if lay.name == "gemma4-w4096-k5-b64")
    cfg = write_config(layout, tmp_path / "layouts")
    out = tmp_path / f"{name}.json"
    assert main(["replay", "--model", str(cfg), "--trace", "decode-heavy", "--block-size", "64",
                 "--connectors", "offload", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert not result["stalled"] and result["requests_completed"] == result["requests_total"]
    return result["per_phase"]["siblings"]["recomputed_tokens"]


def test_siblings_resume_inside_their_parents_prompts_despite_one_shot_traffic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _siblings_recomputed(tmp_path, monkeypatch, "oneshot-first") == 0


def test_with_one_spare_list_the_siblings_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule removed: the one-shot list forgotten before each spare eviction, so spare entries go oldest first.
    real = tier_index.TierIndex._evict_spare

    def one_list(self: tier_index.TierIndex) -> int:
        self._spare_oneshot.clear()
        return real(self)
    monkeypatch.setattr(tier_index.TierIndex, "_evict_spare", one_list)
    # 12,288 tokens before a finished request's spare windows were renewed at its end (`scheduler/ranking.py`), 8,704
    # since: the renewal keeps some parents' windows without the rule, the rule keeps them all (0 above).
    assert _siblings_recomputed(tmp_path, monkeypatch, "one-list") >= 4_096
