"""Benchmarks and test harness of offload_connector, kept out of the installed connector: the simulation of vLLM's
real scheduler on CPU (`sim`), the replay benchmarks (`replay`), the soak runs (`soak`) and the `offload-connector`
command line (`cli`). Installed (editable) from `benchmarks/pyproject.toml` by `scripts/setup-envs`."""
