"""The key of a block in every tier: (KV cache group index, vLLM block hash). Defined once, here, with nothing else:
the scheduler side, the worker side, the messages between them and the tiers' storage all name it, and the storage
modules must stay importable without vLLM or torch."""
from __future__ import annotations

from typing import Hashable

BlockKey = tuple[int, Hashable]
