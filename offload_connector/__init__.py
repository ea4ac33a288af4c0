"""offload_connector: a CPU-offloading KV-cache connector for vLLM with exact per-group admission accounting.

Use with `--kv-transfer-config '{"kv_connector": "OffloadConnector", "kv_connector_module_path":
"offload_connector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": 64000000000}}'`.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import offload_connector` (e.g. for the CLI or config validation) does not pull in vLLM.
    if name == "OffloadConnector":
        from offload_connector.connector import OffloadConnector
        return OffloadConnector
    if name in ("OffloadConfig", "ConfigError"):
        from offload_connector import config
        return getattr(config, name)
    raise AttributeError(name)


__all__ = ["OffloadConnector", "OffloadConfig", "ConfigError", "__version__"]
