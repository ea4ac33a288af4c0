"""offload_connector: a CPU-offloading KV-cache connector for vLLM with exact per-group admission accounting.

Use with `--kv-transfer-config '{"kv_connector": "OffloadConnector", "kv_connector_module_path":
"offload_connector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": 64000000000}}'`.
"""

__version__ = "0.1.0"


def _source_tree_kernels() -> None:
    """In a source checkout the copy kernels are `kernels/` at the repository root (the wheel maps that directory to
    `offload_connector.kernels`, pyproject's package-dir): a finder that resolves exactly that one name there, lazily,
    so importing the package still pulls in no torch."""
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    root = here.parent / "kernels"
    if (here / "kernels" / "__init__.py").is_file() or not (root / "__init__.py").is_file():
        return  # an installed wheel, or not this repository's layout (a stale __pycache__ there does not count)

    class _KernelsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
            if fullname != __name__ + ".kernels":
                return None
            return importlib.util.spec_from_file_location(fullname, root / "__init__.py",
                                                          submodule_search_locations=[str(root)])

    if not any(type(f).__name__ == "_KernelsFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsFinder())


_source_tree_kernels()


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
