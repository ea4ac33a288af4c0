"""Adding a copy backend or an eviction policy is one new module and one registry line: the registries are the only
lists, and everything that names backends or policies reads them."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from offload_connector import backends, config
from offload_connector.kernels import select
from offload_connector.kernels.api import BlockCopier

KERNELS = Path(select.__file__).parent


def test_config_and_selection_read_the_backend_registry() -> None:
    assert config.TRANSFER_BACKENDS == select.BACKENDS == ("auto", *backends.COPY_BACKENDS)
    assert select.CUDA_BACKENDS == tuple(n for n, (_, _, cuda) in backends.COPY_BACKENDS.items() if cuda)


@pytest.mark.parametrize("name", list(backends.COPY_BACKENDS))
def test_each_registered_backend_names_a_block_copier_module(name: str) -> None:
    module, cls, needs_cuda = backends.COPY_BACKENDS[name]
    path = KERNELS / f"{module}.py"
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert cls in classes, f"{path} defines no class {cls}"
    if not needs_cuda:  # importable here: check it is a real copier, built the way select builds it
        built = select._backend_class(name)
        assert inspect.isclass(built) and issubclass(built, BlockCopier) and built.__name__ == cls


def test_unknown_backend_is_refused_naming_the_registry() -> None:
    with pytest.raises(ValueError, match=r"backend 'dma' is not one of \('auto', 'reference'"):
        select._backend_class("dma")


def test_no_other_module_lists_backend_names() -> None:
    """A hand-written tuple of backend names anywhere in the package would drift from the registry."""
    names = set(backends.COPY_BACKENDS)
    package = Path(backends.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and len(node.elts) >= 3 and all(
                    isinstance(e, ast.Constant) and e.value in names for e in node.elts):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders, offenders


def test_eviction_registry_is_the_list_config_accepts() -> None:
    from offload_connector.scheduler.eviction import BUILTIN_POLICIES, EvictionPolicy, policy_names

    assert tuple(policy_names()) == tuple(BUILTIN_POLICIES) == config.EVICTION_POLICIES
    pkg = Path(importlib.util.find_spec("offload_connector.scheduler.eviction").origin).parent
    for name, cls in BUILTIN_POLICIES.items():
        assert issubclass(cls, EvictionPolicy) and cls.name == name
        assert Path(inspect.getfile(cls)).parent == pkg  # one module per policy, in the package


def test_both_second_tiers_keep_the_worker_contract() -> None:
    """`worker/side.py` calls a second tier only through `WorkerSecondTier`; each one implements all of it, and the
    read handles they return implement `ReadHandle`."""
    import inspect

    from offload_connector.disk.store import DiskIO
    from offload_connector.worker.disk_io import WorkerDiskTier
    from offload_connector.worker.remote_io import FetchIO, WorkerRemoteTier
    from offload_connector.worker.second_tier import ReadHandle, WorkerSecondTier

    for contract, impls in ((WorkerSecondTier, (WorkerDiskTier, WorkerRemoteTier)), (ReadHandle, (DiskIO, FetchIO))):
        members = [n for n in vars(contract) if not n.startswith("_")]
        assert members
        for impl in impls:
            for name in members:
                assert hasattr(impl, name), f"{impl.__name__} lacks {contract.__name__}.{name}"
                want, got = getattr(contract, name), getattr(impl, name)
                if inspect.isfunction(want):
                    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), \
                        (impl.__name__, name)
