"""The documents agree with the code: the README's configuration and metric tables name exactly the keys the config
accepts and the series the connector registers, `docs/architecture.md` names every module there is, every relative
link resolves, and the README stays short enough to read (the results live in `docs/results/`)."""

import re
from dataclasses import fields
from pathlib import Path

from offload_connector.config import DebugConfig, OffloadConfig
from offload_connector.metrics_prom import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _table_after(heading: str) -> list[str]:
    """First cells of the table under a README heading."""
    section = README.split(heading, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append(line.split("|")[1])
    return rows[1:]  # the header row


def test_the_configuration_table_names_every_key_the_config_accepts():
    cells = _table_after("### Configuration keys")
    documented = {key for cell in cells for key in re.findall(r"`([a-z_]+)`", cell)}
    accepted = {f.name for f in fields(OffloadConfig)}
    assert documented == accepted, (sorted(accepted - documented), sorted(documented - accepted))


def test_the_debug_row_names_every_key_of_the_debug_section():
    row = next(line for line in README.split("### Configuration keys", 1)[1].splitlines()
               if line.startswith("| `debug` |"))
    documented = set(re.findall(r"`([a-z_]+)`", row.split("|")[3]))
    assert {f.name for f in fields(DebugConfig)} <= documented


def test_the_metrics_table_names_every_series_the_connector_registers():
    documented = set()
    for cell in _table_after("### Metrics"):
        names = [n.split("{")[0] for n in re.findall(r"`([^`]+)`", cell)]
        # `…_x` after a full name shares its stem: `vllm:offload_connector_<tier>_tier` for tier series, else the
        # prefix (`…_stored_bytes_total` after `vllm:offload_connector_loaded_bytes_total`).
        tier = re.match(r"(vllm:offload_connector_[a-z]+_tier)_", names[0])
        stem = tier.group(1) if tier else "vllm:offload_connector"
        documented |= {stem + n[1:] if n.startswith("…") else n for n in names}
    assert documented == set(METRIC_NAMES), (sorted(set(METRIC_NAMES) - documented),
                                             sorted(documented - set(METRIC_NAMES)))


def _files_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("\n## Files\n", 1)[1]


def test_the_architecture_page_names_every_module_of_the_connector():
    files = _files_section()
    named = set(re.findall(r"`([A-Za-z_./]+\.(?:py|c|cu))`", files))
    named |= {part for n in list(named) for part in n.split(" / ")}
    modules = {p for top in ("offload_connector", "kernels") for p in (ROOT / top).rglob("*")
               if p.suffix in (".py", ".c", ".cu") and p.name != "__init__.py" and "__pycache__" not in p.parts}
    missing = sorted(str(p.relative_to(ROOT)) for p in modules
                     if p.name not in {Path(n).name for n in named})
    assert missing == []
    gone = sorted(n for n in named if n.startswith(("offload_connector/", "kernels/")) and not (ROOT / n).exists())
    assert gone == []
    basenames = {p.name for p in modules}
    stale = sorted(n for n in named if "/" not in n and n.endswith((".c", ".cu")) and n not in basenames)
    assert stale == []


def test_every_relative_link_in_the_documents_resolves():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_the_readme_is_short_and_the_results_are_in_dated_pages():
    assert len(README.splitlines()) <= 300
    pages = sorted((ROOT / "docs" / "results").glob("20[0-9][0-9]-[01][0-9]-[0-3][0-9]-*.md"))
    assert pages
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    assert [p.name for p in pages if p.name not in index] == []


def test_every_benchmark_command_the_documents_name_exists():
    """The benchmarks are one command: every `offload-connector NAME` in the documents (and the tools' own usage
    lines) is a subcommand, and no document still runs a script by its old path."""
    from offload_bench.tools import TOOLS

    known = {"replay", "soak", "stall-demo", *TOOLS}
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").iterdir(),
             *(ROOT / "benchmarks" / "offload_bench" / "tools").glob("*.py")]
    unknown, old = [], []
    for path in texts:
        text = path.read_text()
        named = re.findall(r"offload-connector ([a-z][a-z-]*)(?![a-z-]|\.\.\.)", text)  # "..." ends a cut cell
        unknown += [f"{path.relative_to(ROOT)}: {n}" for n in named if n not in known]
        old += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"(?<![\w/])benchmarks/[a-z_]+\.py", text)]
    assert unknown == []
    assert old == []
