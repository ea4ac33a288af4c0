import pytest

from offload_connector.config import ConfigError, DebugConfig, OffloadConfig


def test_defaults_and_suffixes():
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": "64g"})
    assert cfg.cpu_bytes == 64 * 10**9 and cfg.reservation == "exact"
    assert OffloadConfig.from_extra_config({"cpu_bytes": "512Mi"}).cpu_bytes == 512 * 2**20
    assert OffloadConfig.from_extra_config({"cpu_bytes": "64G"}).cpu_bytes == 64 * 2**30  # vLLM: upper case is binary
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1024.0}).cpu_bytes == 1024
    assert cfg.admission_policy == "fair" and cfg.window_checkpoint_tokens is None and cfg.fair_hold_after_steps == 1000
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": 0}).window_checkpoint_tokens == 0


@pytest.mark.parametrize("extra, needle", [
    ({}, "'cpu_bytes' is required"),
    (None, "'cpu_bytes' is required"),
    ({"cpu_bytes": 0}, "'cpu_bytes' must be a positive whole number of bytes"),
    ({"cpu_bytes": -5}, "'cpu_bytes' must be a positive whole number of bytes"),
    ({"cpu_bytes": "lots"}, "'cpu_bytes' must be a positive whole number of bytes"),
    ({"cpu_bytes": True}, "'cpu_bytes' must be a positive whole number of bytes"),
    ({"cpu_bytes": 10, "reservation": "loose"}, "'reservation' must be one of ['exact', 'vllm']"),
    ({"cpu_bytes": 10, "eviction": "mru"}, "'eviction' must be one of ['lru', 'slru', 'arc'] or \"module.path:"),
    ({"cpu_bytes": 10, "max_deferral_steps": 0}, "'max_deferral_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "cpu_bytes_to_use": 5}, "unknown key(s) ['cpu_bytes_to_use']"),
    # A key with one possible value that nothing read; a deferral that ages out is always recomputed.
    ({"cpu_bytes": 10, "deferral_fallback": "recompute"}, "unknown key(s) ['deferral_fallback']"),
    ({"cpu_bytes": 10, "transfer_backend": "dma"},
     "'transfer_backend' must be one of ['auto', 'reference', 'kernel', 'batch', 'per_page', 'host']"),
    ({"cpu_bytes": 10, "debug": {"corrupt_load": "yes"}}, "'debug.corrupt_load' must be true or false"),
    ({"cpu_bytes": 10, "stall_watchdog_steps": -1}, "'stall_watchdog_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "load_timeout_s": -1}, "'load_timeout_s' must be a number of seconds >= 0"),
    ({"cpu_bytes": 10, "load_timeout_s": "5s"}, "'load_timeout_s' must be a number of seconds >= 0"),
    ({"cpu_bytes": 10, "debug": {"fail_load": 1}}, "'debug.fail_load' must be true or false"),
    ({"cpu_bytes": 10, "debug": {"load_delay_steps": -2}}, "'debug.load_delay_steps' must be an integer >= 0"),
    ({"cpu_bytes": 10, "fair_hold_after_steps": -3}, "'fair_hold_after_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "admission_policy": "fifo"}, "'admission_policy' must be one of ['fair', 'greedy']"),
    ({"cpu_bytes": 10, "load_completion": "soon"}, "'load_completion' must be one of ['ordered', 'landed']"),
    ({"cpu_bytes": 10, "load_completion": None}, "'load_completion' must be one of ['ordered', 'landed']"),
    ({"cpu_bytes": 10, "load_completion": ["landed"]}, "'load_completion' must be one of ['ordered', 'landed']"),
    ({"cpu_bytes": 10, "window_checkpoint_tokens": -1}, "'window_checkpoint_tokens' must be a positive integer"),
    ({"cpu_bytes": 10, "window_checkpoint_tokens": 1.5}, "'window_checkpoint_tokens' must be a positive integer"),
])
def test_bad_config_names_key_and_accepted_values(extra, needle):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config(extra)
    assert needle in str(err.value)


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "typo": 1})
    assert "reservation" in str(err.value) and "cpu_bytes" in str(err.value)


# ---------------------------------------------------------------------------------------------- cpu_bytes
# Every malformed value: one ConfigError, one line, naming the key and saying why.
BAD_CPU_BYTES = [
    (float("nan"), "not a finite number"),
    (float("inf"), "not a finite number"),
    (float("-inf"), "not a finite number"),
    ("nan", "not a byte size"),
    ("inf", "not a byte size"),
    ("infg", "not a byte size"),  # float("inf") * 10**9 used to reach int(): OverflowError
    ("1e400g", "not a byte size"),  # float("1e400") is inf
    ("1e9", "not a byte size"),  # vLLM's parser takes no exponents either
    (1e30, "more than 2^63-1 bytes"),
    (10**30, "more than 2^63-1 bytes"),
    (2**63, "more than 2^63-1 bytes"),
    ("99999999999T", "more than 2^63-1 bytes"),
    ("9" * 5000, "more than 2^63-1 bytes"),  # past int()'s 4300-digit limit: must not escape as a bare ValueError
    ("\u00b2", "only ASCII digits"),  # "²": str.isdigit() is True, int() refuses it
    ("1\u00b2g", "only ASCII digits"),
    ("\u0661\u0662\u0663", "only ASCII digits"),  # Arabic-Indic 123: int() and \d accept them
    ("\uff16\uff14g", "only ASCII digits"),  # full-width 64
    ("\u09e8G", "only ASCII digits"),  # Bengali 2
    (-5, "must be positive"),
    (-1.0, "must be positive"),
    ("-5", "not a byte size"),
    ("-1g", "not a byte size"),
    ("+5", "not a byte size"),
    (0, "must be positive"),
    (0.0, "must be positive"),
    ("0", "must be positive"),
    ("0g", "must be positive"),
    ("0.0Gi", "no decimals with a binary suffix"),
    (1.5, "not a whole number of bytes"),
    (1e-3, "not a whole number of bytes"),
    ("1.5", "decimals only with a decimal suffix"),
    ("1024.0", "decimals only with a decimal suffix"),
    ("0.0001k", "not a whole number of bytes"),
    ("1.0000000001g", "not a whole number of bytes"),
    ("1.5G", "no decimals with a binary suffix"),
    ("1.5GiB", "no decimals with a binary suffix"),
    (True, "a boolean"),
    (False, "a boolean"),
    ([1], "a list"),
    ([], "a list"),
    ({"g": 64}, "a dict"),
    (None, "null"),
    (b"64g", "a bytes"),
    ("", "not a byte size"),
    ("   ", "not a byte size"),
    ("64GB", "ambiguous suffix"),
    ("64gb", "ambiguous suffix"),
    ("512MB", "ambiguous suffix"),
    ("64 g", "not a byte size"),
    ("64gi", "not a byte size"),
    ("64g ish", "not a byte size"),
    ("lots", "not a byte size"),
    ("0x10", "not a byte size"),
    ("1_000", "not a byte size"),
    ("1,000", "not a byte size"),
    ("64P", "not a byte size"),
]


@pytest.mark.parametrize("value, why", BAD_CPU_BYTES, ids=[repr(v)[:24] for v, _ in BAD_CPU_BYTES])
def test_malformed_cpu_bytes_is_one_named_error(value, why):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": value})
    msg = str(err.value)
    assert type(err.value) is ConfigError and "\n" not in msg and len(msg) < 400, msg
    assert msg.startswith("kv_connector_extra_config: 'cpu_bytes' must be a positive whole number of bytes"), msg
    assert f"({why}" in msg, msg


GOOD_CPU_BYTES = [
    (1, 1), (4096, 4096), (1024.0, 1024), (1e9, 10**9), (2**63 - 1, 2**63 - 1), ("100", 100), (" 100 ", 100),
    ("0001", 1), ("1k", 10**3), ("1K", 2**10), ("1Ki", 2**10), ("1KiB", 2**10), ("64g", 64 * 10**9),
    ("64G", 64 * 2**30), ("64Gi", 64 * 2**30), ("64GiB", 64 * 2**30), ("512m", 512 * 10**6), ("512M", 512 * 2**20),
    ("512Mi", 512 * 2**20), ("2t", 2 * 10**12), ("2T", 2 * 2**40), ("2TiB", 2 * 2**40), ("1.5g", 1_500_000_000),
    ("25.6k", 25_600), ("4.35k", 4_350), ("0.5k", 500),
]


@pytest.mark.parametrize("value, expected", GOOD_CPU_BYTES)
def test_cpu_bytes_sizes(value, expected):
    assert OffloadConfig.from_extra_config({"cpu_bytes": value}).cpu_bytes == expected


def test_suffixes_mean_what_vllm_means():
    """Every suffix vLLM's own parser knows gives the same bytes here (lower case decimal, upper case binary)."""
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    for text in ("1k", "1K", "25.6k", "2m", "2M", "3g", "3G", "7t", "7T", "100", "64g", "64G", "0.5g"):
        assert OffloadConfig.from_extra_config({"cpu_bytes": text}).cpu_bytes == \
            argparse_utils.human_readable_int(text), text
    with pytest.raises(Exception):  # vLLM refuses decimals with binary suffixes; so do we (above)
        argparse_utils.human_readable_int("1.5G")


# ------------------------------------------------------------------------------------------- host memory
from offload_connector.config import (  # noqa: E402
    check_at_startup, check_host_memory, host_available_bytes, local_worker_count,
)


def _meminfo(tmp_path, available_kb: int):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       24684084 kB\nMemFree:         1000000 kB\nMemAvailable:   {available_kb} kB\n")
    return str(p)


def test_host_available_reads_meminfo_and_cgroup_limits(tmp_path):
    none = tmp_path / "no-cgroup"
    assert host_available_bytes(_meminfo(tmp_path, 17_000_000), str(none)) == \
        (17_000_000 * 1024, "MemAvailable in /proc/meminfo")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8000000000\n")
    (v2 / "memory.current").write_text("3000000000\n")
    (v2 / "memory.stat").write_text("anon 2000000000\ninactive_file 500000000\n")
    have, source = host_available_bytes(_meminfo(tmp_path, 17_000_000), str(v2))
    assert have == 8_000_000_000 - 3_000_000_000 + 500_000_000 and "memory.max" in source
    (v2 / "memory.max").write_text("max\n")  # no limit: MemAvailable again
    assert host_available_bytes(_meminfo(tmp_path, 17_000_000), str(v2))[1] == "MemAvailable in /proc/meminfo"
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000000000\n")
    have, source = host_available_bytes(_meminfo(tmp_path, 17_000_000), str(v1))
    assert have == 3_000_000_000 and "memory.limit_in_bytes" in source
    assert host_available_bytes(str(tmp_path / "missing"), str(none)) is None


def test_tier_larger_than_the_host_is_one_error_naming_key_request_and_available():
    avail = (17 * 10**9, "MemAvailable in /proc/meminfo")
    check_host_memory(16 * 10**9, 1, available=avail)  # fits
    with pytest.raises(ConfigError) as err:
        check_host_memory(20 * 10**9, 1, available=avail)  # "20g" with 17 GB available
    msg = str(err.value)
    assert "\n" not in msg and "'cpu_bytes'" in msg, msg
    assert "20,000,000,000 bytes" in msg and "17,000,000,000 bytes" in msg and "MemAvailable" in msg, msg
    with pytest.raises(ConfigError) as err:  # 9 GB per worker fits once, not for two tensor-parallel workers
        check_host_memory(9 * 10**9, 2, available=avail)
    assert "per worker x 2 workers on this host = 18,000,000,000 bytes" in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"\+ 8,000,000,000 bytes of KV cache = 18,000,000,000 bytes"):
        check_host_memory(10 * 10**9, 1, 8 * 10**9, "of KV cache", available=avail)


def test_64g_on_this_host_is_refused_before_any_allocation():
    avail = host_available_bytes()
    if avail is None or avail[0] >= 64 * 10**9:
        pytest.skip("needs a host with /proc/meminfo and less than 64 GB available")
    with pytest.raises(ConfigError, match="'cpu_bytes' asks for 64,000,000,000 bytes"):
        check_host_memory(OffloadConfig.from_extra_config({"cpu_bytes": "64g"}).cpu_bytes)


def _vllm_config(extra, *, tp=1, pp=1, dp_local=1, nnodes_within=1, backend="mp", device="cuda", kv_bytes=None):
    from types import SimpleNamespace as NS
    world = tp * pp
    return NS(kv_transfer_config=NS(kv_connector_extra_config=extra),
              parallel_config=NS(world_size=world, local_world_size=world // nnodes_within,
                                 data_parallel_size_local=dp_local, distributed_executor_backend=backend,
                                 tensor_parallel_size=tp, pipeline_parallel_size=pp),
              device_config=NS(device_type=device), cache_config=NS(kv_cache_memory_bytes=kv_bytes))


def test_local_worker_count():
    assert local_worker_count(_vllm_config({})) == 1
    assert local_worker_count(_vllm_config({}, tp=4, pp=2)) == 8  # one host: tensor x pipeline ranks
    assert local_worker_count(_vllm_config({}, tp=8, pp=2, nnodes_within=2)) == 8  # half of 16 ranks on this node
    assert local_worker_count(_vllm_config({}, tp=2, dp_local=2)) == 4  # two data-parallel engines on this host
    assert local_worker_count(_vllm_config({}, tp=2, dp_local=2, backend="external_launcher")) == 2


def test_startup_check_counts_local_workers_and_the_cpu_kv_cache(monkeypatch):
    import offload_connector.config as config
    monkeypatch.setattr(config, "host_available_bytes", lambda: (17 * 10**9, "MemAvailable in /proc/meminfo"))
    assert check_at_startup(_vllm_config({"cpu_bytes": "8g"})).cpu_bytes == 8 * 10**9
    with pytest.raises(ConfigError, match=r"x 4 workers on this host = 32,000,000,000 bytes"):
        check_at_startup(_vllm_config({"cpu_bytes": "8g"}, tp=4))
    with pytest.raises(ConfigError, match="of KV cache"):  # CPU backend: 8 GB tier + 10 GB KV cache > 17 GB
        check_at_startup(_vllm_config({"cpu_bytes": "8g"}, device="cpu", kv_bytes=10 * 10**9))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['typo'\]"):
        check_at_startup(_vllm_config({"cpu_bytes": "8g", "typo": 1}))


# --------------------------------------------------------------------- the early hooks vLLM calls on the class
def test_early_hooks_validate_the_extra_config(monkeypatch):
    from offload_connector.connector import OffloadConnector
    import offload_connector.config as config

    assert OffloadConnector.requires_piecewise_for_cudagraph({"cpu_bytes": "1G"}) is False
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['typo'\]"):
        OffloadConnector.requires_piecewise_for_cudagraph({"cpu_bytes": "1G", "typo": 1})
    with pytest.raises(ConfigError, match="'cpu_bytes' must be"):
        OffloadConnector.requires_piecewise_for_cudagraph({"cpu_bytes": "infg"})
    monkeypatch.setattr(config, "host_available_bytes", lambda: (17 * 10**9, "MemAvailable in /proc/meminfo"))
    assert OffloadConnector.get_required_kvcache_layout(_vllm_config({"cpu_bytes": "1G"})) is None
    with pytest.raises(ConfigError, match="'cpu_bytes' asks for 20,000,000,000 bytes"):
        OffloadConnector.get_required_kvcache_layout(_vllm_config({"cpu_bytes": "20g"}))


def test_vllm_reaches_the_layout_hook_through_its_own_code(monkeypatch):
    """resolve_kv_cache_layout (EngineCore._initialize_kv_caches) asks the connector class through this function."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector",
                          kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "1G", "typo": 1})
    vc = _vllm_config(kv.kv_connector_extra_config)
    vc.kv_transfer_config = kv
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['typo'\]"):
        get_kv_connector_cache_layout(vc)
    kv.kv_connector_extra_config = {"cpu_bytes": "1G"}
    assert get_kv_connector_cache_layout(vc) is None


def test_vllm_config_construction_reaches_the_cudagraph_hook(monkeypatch):
    """On CUDA (full CUDA graphs, the default) VllmConfig.__post_init__ asks requires_piecewise_for_cudagraph: a bad
    key then stops `vllm serve` while it parses its arguments. No GPU here: the platform is told it has graphs."""
    import vllm.platforms
    from vllm.config import CacheConfig, CompilationConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    from offload_bench.sim.layouts import model_dir
    from offload_bench.sim.vllm_compat import cpu_configs

    monkeypatch.setattr(type(vllm.platforms.current_platform), "support_static_graph_mode",
                        classmethod(lambda cls: True))
    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector",
                          kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "1G", "typo": 1})
    mc = ModelConfig(model=model_dir("gemma-4-31b"), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    with pytest.raises(ValueError, match=r"kv_connector_extra_config: unknown key\(s\) \['typo'\]"), cpu_configs():
        VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16),
                   scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096,
                                                    is_encoder_decoder=False),
                   device_config=DeviceConfig("cpu"), kv_transfer_config=kv,
                   compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))


@pytest.mark.parametrize("extra, needle", [
    ({"cpu_bytes": 10, "verify_loads": "on"}, "'verify_loads' must be true or false"),
    ({"cpu_bytes": 10, "verify_loads": 1}, "'verify_loads' must be true or false"),
    ({"cpu_bytes": 10, "debug": {"copy_delay_s": -0.5}}, "'debug.copy_delay_s' must be a number of seconds >= 0"),
    ({"cpu_bytes": 10, "debug": {"copy_delay_s": "2s"}}, "'debug.copy_delay_s' must be a number of seconds >= 0"),
])
def test_verify_loads_and_copy_delay_are_validated(extra, needle):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config(extra)
    assert needle in str(err.value)


def test_verify_loads_and_copy_delay_defaults():
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10})
    assert cfg.verify_loads is False and cfg.debug.copy_delay_s == 0.0
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10, "verify_loads": True, "debug": {"copy_delay_s": 2}})
    assert cfg.verify_loads is True and cfg.debug.copy_delay_s == 2.0


@pytest.mark.parametrize("key", ["fail_load_ranks", "fail_store_ranks"])
@pytest.mark.parametrize("value", [1, "1", [True], [-1], [1.0], None, {"1": 1}])
def test_debug_fail_ranks_are_validated(key, value):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": {key: value}})
    assert str(err.value) == (f"kv_connector_extra_config: 'debug.{key}' must be a list of worker ranks (integers "
                              f">= 0, pp_rank x tensor_parallel_size + tp_rank; e.g. [1]); got {value!r}")


def test_debug_fail_ranks_parse_and_must_name_ranks_the_engine_has(monkeypatch):
    import offload_connector.config as config
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10})
    assert cfg.debug.fail_load_ranks == cfg.debug.fail_store_ranks == ()
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": {"fail_load_ranks": [3, 1, 3],
                                                                      "fail_store_ranks": []}})
    assert cfg.debug.fail_load_ranks == (1, 3) and cfg.debug.fail_store_ranks == ()
    monkeypatch.setattr(config, "host_available_bytes", lambda: None)
    extra = {"cpu_bytes": 10, "debug": {"fail_store_ranks": [3]}}
    assert check_at_startup(_vllm_config(extra, tp=2, pp=2)).debug.fail_store_ranks == (3,)
    with pytest.raises(ConfigError) as err:
        check_at_startup(_vllm_config(extra, tp=2))
    assert str(err.value) == ("kv_connector_extra_config: 'debug.fail_store_ranks' must name worker ranks 0..1 "
                              "(tensor_parallel_size x pipeline_parallel_size = 2); got [3]")


# ------------------------------------------------------------------------------------------- the debug section
def test_debug_section_defaults_to_all_off():
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10})
    assert cfg.debug == DebugConfig() and not cfg.debug.enabled
    assert OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": {}}).debug == DebugConfig()
    assert OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": None}).debug == DebugConfig()


def test_debug_section_parses_every_key():
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": {
        "corrupt_load": True, "fail_load": False, "fail_load_ranks": [2, 0, 2], "fail_store_ranks": [1],
        "load_delay_steps": 3, "copy_delay_s": 0.5}})
    assert cfg.debug == DebugConfig(corrupt_load=True, fail_load=False, fail_load_ranks=(0, 2), fail_store_ranks=(1,),
                                    load_delay_steps=3, copy_delay_s=0.5)
    assert cfg.debug.enabled
    assert OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": {"load_delay_steps": 2.0}}).debug == \
        DebugConfig(load_delay_steps=2)


@pytest.mark.parametrize("section, message", [
    ({"corrupt": True}, "kv_connector_extra_config: unknown key(s) ['debug.corrupt']; accepted keys in 'debug' are "
                        "['debug.corrupt_load', 'debug.fail_load', 'debug.fail_load_ranks', 'debug.fail_store_ranks', "
                        "'debug.load_delay_steps', 'debug.copy_delay_s']"),
    ({"fail_load": "yes"}, "kv_connector_extra_config: 'debug.fail_load' must be true or false; got 'yes'"),
    ({"load_delay_steps": True}, "kv_connector_extra_config: 'debug.load_delay_steps' must be an integer >= 0 (steps; "
                                 "0 disables it); got True"),
    ({"load_delay_steps": 1.5}, "kv_connector_extra_config: 'debug.load_delay_steps' must be an integer >= 0 (steps; "
                                "0 disables it); got 1.5"),
    ({"copy_delay_s": float("inf")}, "kv_connector_extra_config: 'debug.copy_delay_s' must be a number of seconds >= "
                                     "0 (0 disables it); got inf"),
    ({"fail_store_ranks": [-1]}, "kv_connector_extra_config: 'debug.fail_store_ranks' must be a list of worker ranks "
                                 "(integers >= 0, pp_rank x tensor_parallel_size + tp_rank; e.g. [1]); got [-1]"),
])
def test_debug_section_names_the_bad_key(section, message):
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": section})
    assert str(err.value) == message


@pytest.mark.parametrize("section", [True, [1], "fail_load", 3])
def test_debug_section_must_be_an_object(section):
    with pytest.raises(ConfigError, match=r"'debug' must be a JSON object of test aids \(keys \['debug.corrupt_load'"):
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug": section})


def test_flat_debug_keys_are_deprecated_aliases_of_the_section(monkeypatch, caplog):
    import offload_connector.config as config
    monkeypatch.setattr(config, "_WARNED_ALIASES", set())
    extra = {"cpu_bytes": 10, "debug_fail_load_ranks": [1], "debug_load_delay_steps": 3, "debug_copy_delay_s": 2,
             "debug": {"corrupt_load": True}}
    for _ in range(2):
        cfg = OffloadConfig.from_extra_config(extra)
        assert cfg.debug == DebugConfig(corrupt_load=True, fail_load_ranks=(1,), load_delay_steps=3, copy_delay_s=2.0)
    warnings = {id(r): r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()}
    assert list(warnings.values()) == [
        "kv_connector_extra_config: ['debug_copy_delay_s', 'debug_fail_load_ranks', 'debug_load_delay_steps'] are "
        'deprecated; write them in the debug section: "debug": {"copy_delay_s": ..., "fail_load_ranks": ..., '
        '"load_delay_steps": ...}']
    # A bad value names the key as written.
    with pytest.raises(ConfigError, match="'debug_fail_load' must be true or false"):
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug_fail_load": 1})
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "debug_fail_load": True, "debug": {"fail_load": True}})
    assert str(err.value) == ("kv_connector_extra_config: 'debug_fail_load' (deprecated) and 'debug.fail_load' are "
                              "both given; keep 'debug.fail_load'")


def test_the_accepted_keys_name_the_section_not_the_aliases():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_extra_config({"cpu_bytes": 10, "nope": 1})
    assert "'debug'" in str(err.value) and "debug_" not in str(err.value)


def test_recurrent_state_outside_align_mode_is_one_line():
    """A Mamba/GDN hybrid is refused before any KV cache exists unless vLLM runs it in align mode (with or without
    speculative decoding)."""
    from types import SimpleNamespace

    from offload_connector.config import check_recurrent_state

    def cfg(hybrid, mode, spec=None):
        return SimpleNamespace(model_config=SimpleNamespace(is_hybrid=hybrid, is_attention_free=False,
                                                            architectures=["Qwen3NextForCausalLM"]),
                               cache_config=SimpleNamespace(mamba_cache_mode=mode), speculative_config=spec)

    check_recurrent_state(cfg(False, "none"))  # attention only: nothing to check
    check_recurrent_state(cfg(True, "align"))
    with pytest.raises(ConfigError, match=r"^offload_connector: Qwen3NextForCausalLM .*'none'.*--enable-prefix"):
        check_recurrent_state(cfg(True, "none"))
    check_recurrent_state(cfg(True, "align", spec=object()))
    with pytest.raises(ConfigError) as exc:
        check_recurrent_state(cfg(True, "none", spec=object()))
    assert "\n" not in str(exc.value)
    pure = cfg(False, "align")
    pure.model_config.is_attention_free = True
    with pytest.raises(ConfigError, match="only Mamba/linear-attention state"):
        check_recurrent_state(pure)
