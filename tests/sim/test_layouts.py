"""The offline layouts must match what vLLM builds for the real models (numbers measured in
/work/shared/notes/models-and-traces.md), and the real scheduler must run a request to completion over them.

The per-layer specs are derived from vLLM's model code (`layouts._derive`); the built-in models must keep exactly the
layouts of the hand tables they replaced (tests/layout_tables.py), so published replay results stay valid."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from offload_bench.sim import layouts as L
from offload_bench.sim.vllm_compat import runner_output
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from tests.layout_tables import TABLES

GEMMA, DSV4, GPT_OSS = "gemma-4-31b", "deepseek-v4-flash", "gpt-oss-20b"
GEMMA_BLOCKS, DSV4_BLOCKS, GPT_OSS_BLOCKS = 2188, 8192, 2304


def _build(name: str, max_model_len: int, num_blocks: int, **kw):
    vc = L.build_vllm_config(name, max_model_len=max_model_len, max_num_batched_tokens=1024,
                             num_gpu_blocks=num_blocks, **kw)
    return vc, L.build_sim_model(name, vllm_config=vc, num_blocks=num_blocks)


@pytest.fixture(scope="module")
def gemma():
    return _build(GEMMA, 32768, GEMMA_BLOCKS)


@pytest.fixture(scope="module")
def dsv4():
    return _build(DSV4, 1_048_576, DSV4_BLOCKS)


@pytest.fixture(scope="module")
def gptoss():
    return _build(GPT_OSS, 32768, GPT_OSS_BLOCKS)


def _bytes_per_block_id(sim: L.SimModel) -> int:
    # All planner tensors alias one backing allocation of num_blocks block ids.
    sizes = {t.size for t in sim.worker_kv_cache_config.kv_cache_tensors}
    assert len(sizes) == 1
    return sizes.pop() // sim.worker_kv_cache_config.num_blocks


def _cap(spec, vc) -> int:
    return spec.max_admission_blocks_per_request(vc.max_in_flight_tokens, vc.model_config.max_model_len)


def test_model_dir_resolution(tmp_path: Path):
    d = L.model_dir(GEMMA)
    assert (Path(d) / "config.json").is_file()
    assert L.model_dir(d) == d
    assert L.model_dir(str(Path(d) / "config.json")) == d
    with pytest.raises(FileNotFoundError):
        L.model_dir(str(tmp_path))


def test_restores_gpu_scheduling_settings(gemma, dsv4):
    for vc in (gemma[0], dsv4[0]):
        sc, cc = vc.scheduler_config, vc.cache_config
        assert sc.async_scheduling and sc.enable_chunked_prefill and cc.enable_prefix_caching
        assert sc.max_num_batched_tokens == 1024
        assert not sc.disable_hybrid_kv_cache_manager
        assert vc.max_concurrent_batches == 2 and vc.max_in_flight_tokens == 2048
    assert dsv4[0].cache_config.cache_dtype == "fp8_ds_mla"
    assert dsv4[1].max_model_len == 1_048_576


def test_gemma4_31b_layout(gemma):
    vc, sim = gemma
    kc = sim.kv_cache_config
    assert kc.num_blocks == sim.worker_kv_cache_config.num_blocks == GEMMA_BLOCKS
    assert vc.cache_config.num_gpu_blocks == GEMMA_BLOCKS
    assert len(kc.kv_cache_groups) == 6
    for g, group in enumerate(kc.kv_cache_groups[:5]):
        assert group.kv_cache_spec == SlidingWindowSpec(
            block_size=16, num_kv_heads=16, head_size=256, dtype=group.kv_cache_spec.dtype, sliding_window=1024)
        assert group.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(g, 60, 6)]
    full = kc.kv_cache_groups[5]
    assert type(full.kv_cache_spec) is FullAttentionSpec
    s = full.kv_cache_spec
    assert (s.block_size, s.num_kv_heads, s.head_size, s.head_size_v) == (32, 4, 512, 512)  # k_eq_v keeps V
    assert full.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(5, 60, 6)]
    assert {g.kv_cache_spec.page_size_bytes for g in kc.kv_cache_groups} == {262_144}
    assert _bytes_per_block_id(sim) == 2_621_440
    assert (sim.scheduler_block_size, sim.hash_block_size) == (32, 16)
    assert sim.worker_kv_cache_config.kv_cache_layout == "LBNHC"
    assert _cap(kc.kv_cache_groups[0].kv_cache_spec, vc) == 193


def test_gpt_oss_20b_layout(gptoss):
    """Alternating window-128 and full layers of equal shape: two groups of 12, nothing for the planner to scale."""
    vc, sim = gptoss
    kc = sim.kv_cache_config
    assert kc.num_blocks == sim.worker_kv_cache_config.num_blocks == GPT_OSS_BLOCKS
    assert vc.cache_config.num_gpu_blocks == GPT_OSS_BLOCKS
    sw, full = kc.kv_cache_groups
    assert sw.kv_cache_spec == SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=64,
                                                 dtype=sw.kv_cache_spec.dtype, sliding_window=128)
    assert sw.kv_cache_spec.dtype == torch.bfloat16
    assert sw.layer_names == [f"model.layers.{i}.attn.attn" for i in range(0, 24, 2)]
    assert type(full.kv_cache_spec) is FullAttentionSpec
    s = full.kv_cache_spec
    assert (s.block_size, s.num_kv_heads, s.head_size, s.head_size_v) == (16, 8, 64, 64)
    assert full.layer_names == [f"model.layers.{i}.attn.attn" for i in range(1, 24, 2)]
    # 16 tokens x 8 heads x 64 x (K, V) x 2 B per layer; one block id spans the 12 layers of a group.
    assert {g.kv_cache_spec.page_size_bytes for g in kc.kv_cache_groups} == {32_768}
    assert _bytes_per_block_id(sim) == 12 * 32_768 == 393_216
    assert (sim.scheduler_block_size, sim.hash_block_size) == (16, 16)
    assert sim.worker_kv_cache_config.kv_cache_layout == "LBNHC"
    assert _cap(sw.kv_cache_spec, vc) == 137  # cdiv(127 + 2048, 16) + 1
    # vLLM's start-up check: a cold 32k request needs 2,048 full + 137 window blocks.
    with pytest.raises(ValueError, match="max seq len"):
        _build(GPT_OSS, 32768, 2048)


def test_gpt_oss_layer_types_that_vllm_would_ignore_are_refused(tmp_path: Path):
    """vLLM slides even layers whatever `layer_types` says; a config saying otherwise is not silently replayed."""
    cfg = json.loads((Path(L.model_dir(GPT_OSS)) / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"] * 12
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    vc = L.build_vllm_config(str(tmp_path), max_model_len=4096, max_num_batched_tokens=1024, num_gpu_blocks=1024)
    with pytest.raises(NotImplementedError, match="even layers"):
        L.layer_specs(vc)


def _former_backends(name: str) -> tuple[type, ...]:
    """The CUDA backends the hand-table version resolved the KV cache layout from."""
    if name == DSV4:
        from vllm.models.deepseek_v4.compressor import CompressorBackend
        from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
        return (DeepseekSparseSWABackend, CompressorBackend, DeepseekV4IndexerBackend)
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return (FlashAttentionBackend,)


def _from_table(name: str, max_model_len: int, num_blocks: int, monkeypatch: pytest.MonkeyPatch):
    """The layout the hand table gave: the same planner over the table's per-layer specs."""
    vc = L.build_vllm_config(name, max_model_len=max_model_len, max_num_batched_tokens=1024,
                             num_gpu_blocks=num_blocks)
    derived = L._derive(vc)  # the block size and cache dtype loading the model sets (the table assumed them)
    table = TABLES[name](vc)
    vc = L.build_vllm_config(name, max_model_len=max_model_len, max_num_batched_tokens=1024,
                             num_gpu_blocks=num_blocks)
    vc.cache_config.block_size, vc.cache_config.cache_dtype = derived.block_size, derived.cache_dtype
    with monkeypatch.context() as m:
        m.setattr(L, "_derive", lambda _vc: L._Derived(table, _former_backends(name), derived.block_size,
                                                        derived.cache_dtype))
        return table, L.build_sim_model(name, vllm_config=vc, num_blocks=num_blocks)


@pytest.mark.parametrize("which,name,max_model_len,num_blocks", [
    ("gemma", GEMMA, 32768, GEMMA_BLOCKS), ("gptoss", GPT_OSS, 32768, GPT_OSS_BLOCKS),
    ("dsv4", DSV4, 1_048_576, DSV4_BLOCKS)])
def test_derived_layout_is_exactly_the_former_hand_table(which, name, max_model_len, num_blocks, request,
                                                         monkeypatch):
    """Same layers in the same order with equal specs, hence the same groups, block ids, pool and block sizes."""
    vc, sim = request.getfixturevalue(which)
    table, former = _from_table(name, max_model_len, num_blocks, monkeypatch)
    specs = L.layer_specs(vc)
    assert list(specs.items()) == list(table.items())
    assert sim.kv_cache_config == former.kv_cache_config
    assert sim.worker_kv_cache_config == former.worker_kv_cache_config
    assert (sim.scheduler_block_size, sim.hash_block_size) == (former.scheduler_block_size, former.hash_block_size)


def test_deepseek_v4_table_order_is_the_only_difference_from_vllms_own(dsv4, monkeypatch):
    """vLLM's model code derives DeepSeek V4's specs exactly, in another order (see `_dsv4_in_table_order`): the
    layouts keep the table's order, which decides the packed full group's scheduler-side spec."""
    vc, _ = dsv4
    monkeypatch.setattr(L, "_derived_cache", {})
    monkeypatch.setattr(L, "_dsv4_in_table_order", lambda _vc, derived: derived)
    raw = L.layer_specs(vc)
    table = TABLES[DSV4](vc)
    assert set(raw) == set(table) and list(raw) != list(table)
    assert {n: L.without_kernel_block_note(s) for n, s in raw.items()} == table
    assert list(raw)[2:5] == ["model.layers.2.attn.indexer.k_cache", "model.layers.2.attn.indexer.compressor."
                              "state_cache", "model.layers.2.attn.swa_cache"]
    sim = L.build_sim_model(DSV4, vllm_config=vc, num_blocks=DSV4_BLOCKS)
    full = sim.kv_cache_config.kv_cache_groups[2]
    assert full.layer_names[0] == "model.layers.2.attn.indexer.k_cache" and full.kv_cache_spec.head_size == 132


def test_dsv4_flash_layer_specs(dsv4):
    vc, _ = dsv4
    specs = L.layer_specs(vc)
    assert len(specs) == 43 + 41 + 41 + 21 + 21
    swa = specs["model.layers.0.attn.swa_cache"]
    assert type(swa) is SlidingWindowMLASpec and (swa.block_size, swa.sliding_window) == (64, 128)
    assert swa.page_size_bytes == 37_440  # 64 x 584 B rounded up to 576 B
    assert "model.layers.0.attn" not in specs  # SWA-only layers have no compressed cache
    c4, c128 = specs["model.layers.2.attn"], specs["model.layers.3.attn"]
    assert type(c4) is MLAAttentionSpec and (c4.block_size, c4.tokens_per_state) == (256, 4)
    assert (c4.page_size_bytes, c128.page_size_bytes) == (37_440, 1_728)
    assert specs["model.layers.2.attn.indexer.k_cache"].page_size_bytes == 8_640
    st4, st128 = specs["model.layers.2.attn.compressor.state_cache"], specs["model.layers.3.attn.compressor.state_cache"]
    assert (st4.block_size, st4.sliding_window, st4.head_size) == (4, 8, 2048)
    assert (st128.block_size, st128.sliding_window, st128.head_size) == (8, 128, 1024)
    assert st4.page_size_bytes == st128.page_size_bytes == 32_832
    ist = specs["model.layers.2.attn.indexer.compressor.state_cache"]
    assert (ist.block_size, ist.sliding_window, ist.page_size_bytes) == (4, 8, 8_640)
    assert "model.layers.3.attn.indexer.k_cache" not in specs


def test_dsv4_flash_layout(dsv4):
    vc, sim = dsv4
    kc = sim.kv_cache_config
    assert kc.num_blocks == DSV4_BLOCKS
    shape = [(type(g.kv_cache_spec), g.kv_cache_spec.block_size, getattr(g.kv_cache_spec, "sliding_window", None),
              len(g.layer_names)) for g in kc.kv_cache_groups]
    assert shape == [(SlidingWindowMLASpec, 64, 128, 22), (SlidingWindowMLASpec, 64, 128, 21),
                     (MLAAttentionSpec, 256, None, 62), (SlidingWindowMLASpec, 4, 8, 42),
                     (SlidingWindowMLASpec, 8, 128, 20)]
    # The worker keeps the packed buckets; the scheduler gets one representative spec per group.
    packed = [g.kv_cache_spec for g in sim.worker_kv_cache_config.kv_cache_groups]
    assert [p.page_size_bytes for p in packed] == [823_680, 786_240, 1_002_240, 870_912, 656_640]
    assert _bytes_per_block_id(sim) == 1_002_240
    assert (sim.scheduler_block_size, sim.hash_block_size) == (256, 4)
    assert sim.worker_kv_cache_config.kv_cache_layout == "BLHNC"
    caps = [_cap(kc.kv_cache_groups[i].kv_cache_spec, vc) for i in (0, 3, 4)]
    assert caps == [35, 515, 273]


def test_no_prefix_caching_hashes_at_scheduler_block():
    _, sim = _build(GEMMA, 32768, GEMMA_BLOCKS, enable_prefix_caching=False)
    assert (sim.scheduler_block_size, sim.hash_block_size) == (32, 32)


def test_connector_alone_enables_fine_hashing():
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    _, sim = _build(GEMMA, 32768, GEMMA_BLOCKS, enable_prefix_caching=False, kv_transfer_config=kv)
    assert (sim.scheduler_block_size, sim.hash_block_size) == (32, 16)


def test_sim_model_refuses_a_config_for_another_model(gemma):
    with pytest.raises(ValueError):
        L.build_sim_model(DSV4, vllm_config=gemma[0], num_blocks=GEMMA_BLOCKS)


def test_pool_too_small_for_max_model_len_is_refused():
    # vLLM's own start-up check: one max_model_len request must fit (a cold 1M request needs ~4.6 GiB).
    with pytest.raises(ValueError, match="max seq len"):
        _build(DSV4, 1_048_576, 2048)


def test_speculative_decoding_not_simulated():
    """Only the MTP of DeepSeek V4, Qwen3-Next and Qwen3.5 is simulated (their draft layers' caches are known)."""
    with pytest.raises(L.UnsupportedModelError, match="simulated only as the MTP of DeepSeek V4, Qwen3-Next or"):
        L.build_vllm_config(GEMMA, max_model_len=4096, max_num_batched_tokens=1024, num_gpu_blocks=512,
                            num_speculative_tokens=2)


_ids = itertools.count()


def _request(prompt_len: int, max_tokens: int, hash_block_size: int) -> Request:
    init_none_hash(sha256)
    rid = f"r{next(_ids)}"
    return Request(rid, [(7 * i) % 1000 + 2 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   block_hasher=get_request_block_hasher(hash_block_size, sha256))


def _run_to_completion(sched: Scheduler, max_steps: int = 200) -> tuple[int, int]:
    """Steps with a fake model: one sampled token for each request whose prompt is fully computed.

    Returns the number of steps and the fewest free blocks seen after a schedule."""
    min_free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            return step, min_free
        out = sched.schedule()
        min_free = min(min_free, sched.kv_cache_manager.block_pool.get_num_free_blocks())
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens else []
                   for r in req_ids]
        mro = runner_output(req_ids, sampled, None)
        sched.update_from_output(out, mro)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("which", ["gemma", "dsv4", "gptoss"])
@pytest.mark.parametrize("scheduler_cls", [None, Scheduler])
@pytest.mark.parametrize("prompt_len,steps", [(300, 4), (1500, 5)])  # 1500 needs two prefill chunks
def test_real_scheduler_runs_request_and_frees_pool(which, scheduler_cls, prompt_len, steps, request):
    vc, sim = request.getfixturevalue(which)
    sched = L.build_scheduler(sim, vc, scheduler_cls=scheduler_cls)
    assert type(sched) is (scheduler_cls or AsyncScheduler)
    assert vc.cache_config.num_gpu_blocks == sim.kv_cache_config.num_blocks
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == sim.kv_cache_config.num_blocks - 1
    sched.add_request(_request(prompt_len, 4, sim.hash_block_size))
    taken, min_free = _run_to_completion(sched)
    assert taken == steps
    assert min_free < sim.kv_cache_config.num_blocks - 1  # it really allocated from the pool
    assert not sched.requests and not sched.running and not sched.waiting
    assert pool.get_num_free_blocks() == sim.kv_cache_config.num_blocks - 1


def test_connector_sizes_deepseek_v4_host_slots_by_the_packed_block():
    """Each packed group's block is its UniformTypeKVCacheSpecs page, counted once (not once per layer)."""
    from offload_connector.groups import describe_groups, group_block_bytes

    _, sim = _build(DSV4, 1_048_576, DSV4_BLOCKS)
    sched = describe_groups(sim.kv_cache_config, 8192)
    wc = sim.worker_kv_cache_config
    worker = [group_block_bytes(g, wc) for g in wc.kv_cache_groups]
    # The worker sees the packed pages; the scheduler's per-layer representatives are capped by the block id.
    assert worker == [823_680, 786_240, 1_002_240, 870_912, 656_640]
    assert [g.block_bytes for g in sched] == [823_680, 786_240, 1_002_240, 1_002_240, 656_640]
    # Both sides size host slots alike: one block id.
    assert max(g.block_bytes for g in sched) == max(worker) == _bytes_per_block_id(sim)
