import pytest

from offload_connector.config import ConfigError, OffloadConfig


def test_defaults_and_suffixes():
    cfg = OffloadConfig.from_extra_config({"cpu_bytes": "64g"})
    assert cfg.cpu_bytes == 64 * 10**9 and cfg.reservation == "exact"
    assert OffloadConfig.from_extra_config({"cpu_bytes": "512Mi"}).cpu_bytes == 512 * 2**20
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1024.0}).cpu_bytes == 1024
    assert cfg.admission_policy == "fair" and cfg.window_checkpoint_tokens == 8192 and cfg.fair_hold_after_steps == 1000
    assert OffloadConfig.from_extra_config({"cpu_bytes": 1, "window_checkpoint_tokens": 0}).window_checkpoint_tokens == 0


@pytest.mark.parametrize("extra, needle", [
    ({}, "'cpu_bytes' is required"),
    (None, "'cpu_bytes' is required"),
    ({"cpu_bytes": 0}, "'cpu_bytes' must be a positive integer"),
    ({"cpu_bytes": -5}, "'cpu_bytes' must be a positive integer"),
    ({"cpu_bytes": "lots"}, "'cpu_bytes' must be a positive integer"),
    ({"cpu_bytes": True}, "'cpu_bytes' must be a positive integer"),
    ({"cpu_bytes": 10, "reservation": "loose"}, "'reservation' must be one of ['exact', 'vllm']"),
    ({"cpu_bytes": 10, "eviction": "arc"}, "'eviction' must be one of ['lru']"),
    ({"cpu_bytes": 10, "max_deferral_steps": 0}, "'max_deferral_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "cpu_bytes_to_use": 5}, "unknown key(s) ['cpu_bytes_to_use']"),
    ({"cpu_bytes": 10, "transfer_backend": "dma"},
     "'transfer_backend' must be one of ['auto', 'reference', 'kernel', 'batch', 'per_page', 'host']"),
    ({"cpu_bytes": 10, "debug_corrupt_load": "yes"}, "'debug_corrupt_load' must be true or false"),
    ({"cpu_bytes": 10, "stall_watchdog_steps": -1}, "'stall_watchdog_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "load_timeout_s": -1}, "'load_timeout_s' must be a number of seconds >= 0"),
    ({"cpu_bytes": 10, "load_timeout_s": "5s"}, "'load_timeout_s' must be a number of seconds >= 0"),
    ({"cpu_bytes": 10, "debug_fail_load": 1}, "'debug_fail_load' must be true or false"),
    ({"cpu_bytes": 10, "debug_load_delay_steps": -2}, "'debug_load_delay_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "fair_hold_after_steps": -3}, "'fair_hold_after_steps' must be a positive integer"),
    ({"cpu_bytes": 10, "admission_policy": "fifo"}, "'admission_policy' must be one of ['fair', 'greedy']"),
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
