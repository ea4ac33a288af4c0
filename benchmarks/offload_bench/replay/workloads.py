"""Built-in workloads (seeded, deterministic) and resolution of `--trace`.

`gemma4-31b-returning` and `deepseek-v4-flash-1m` follow models-and-traces.md §5: each ends in a phase made to
exercise admission of simultaneous loads; `deepseek-v4-flash-pp-mtp` replays DeepSeek-V4-Flash in the seed's
deployment (pipeline parallel 4, MTP speculative decoding, contexts to 1M tokens; the workload carries those engine
settings). `agent-tool-prefix`, `rag-shared-docs` and `decode-heavy` exercise
reuse: prefixes shared across requests that end inside a later prompt (not where an earlier one ended), returning
turns behind filler that evicts the GPU prefix cache, and loads that must wait behind long decoders. All are scaled
down so that every connector replays in minutes on a small CPU machine (shorter outputs, fewer sessions; what is
scaled is listed in each generator). They are Mooncake-format records with the optional `session`/`turn` fields
(see trace.py): later turns resume at the end of the previous answer, as a chat does.
"""

from __future__ import annotations

import gzip
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from offload_bench.replay.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace, parse_lines

B = MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class Workload:
    name: str
    records: tuple[TraceRecord, ...]
    description: str
    default_model: str | None = None
    # Engine settings the workload was made for (None: the replay's defaults); --pipeline-parallel-size and
    # --num-speculative-tokens override them.
    pipeline_parallel_size: int | None = None
    num_speculative_tokens: int | None = None


class _Gen:
    """Hash-id allocation and record building; ids are fresh unless a prefix is shared on purpose."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1_000_000  # clear of the Mooncake file's ids, so mixing never aliases by accident
        self.records: list[TraceRecord] = []
        self.last: dict[str, TraceRecord] = {}

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def add(self, t_ms: float, n_in: int, n_out: int, ids: list[int], phase: str,
            session: str | None = None, turn: int | None = None) -> TraceRecord:
        rec = TraceRecord(round(t_ms, 3), n_in, n_out, tuple(ids), 0, session, turn, (("phase", phase),))
        self.records.append(rec)
        if session is not None:
            self.last[session] = rec
        return rec

    def one_shot(self, t_ms: float, n_in: int, n_out: int, phase: str, prefix: list[int] = ()) -> TraceRecord:
        ids = list(prefix) + self.fresh(math.ceil(n_in / B) - len(prefix))
        return self.add(t_ms, n_in, n_out, ids, phase)

    def turn(self, session: str, t_ms: float, new_tokens: int, n_out: int, phase: str,
             first_input: int = 0, prefix: list[int] = ()) -> TraceRecord:
        prev = self.last.get(session)
        if prev is None:
            n_in = first_input
            ids = list(prefix) + self.fresh(math.ceil(n_in / B) - len(prefix))
            return self.add(t_ms, n_in, n_out, ids, phase, session, 0)
        ctx = prev.input_length + prev.output_length
        n_in = ctx + new_tokens
        keep = list(prev.hash_ids[: ctx // B])  # blocks wholly inside the previous context keep their ids
        ids = keep + self.fresh(math.ceil(n_in / B) - len(keep))
        return self.add(t_ms, n_in, n_out, ids, phase, session, (prev.turn or 0) + 1)

    def filler(self, end_ms: float, mean_gap_ms: float, prompt: tuple[float, float, int, int], phase: str) -> None:
        """Unrelated one-shot requests (Poisson arrivals until `end_ms`, lognormal prompts, short answers) that
        push shared prefixes out of the GPU prefix cache."""
        t = 0.0
        while t < end_ms:
            t += self.rng.expovariate(1 / mean_gap_ms)
            self.one_shot(t, self.lognormal(*prompt), self.lognormal(48, 0.6, 16, 128), phase)

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, self.rng.lognormvariate(math.log(median), sigma))))

    def done(self) -> tuple[TraceRecord, ...]:
        return tuple(sorted(self.records, key=lambda r: r.timestamp_ms))


def gemma4_31b_returning(seed: int = 0) -> Workload:
    """§5.1 scaled: 12 sessions x 3 turns (not 48 x 5), outputs median 64 (not mean 343), one burst cell per k.

    1. steady: turn-1 prompts lognormal (median 6k, 1.5k-14k) behind a shared 1,024-token system prefix; each next
       turn adds the previous answer and 300-1,500 new tokens after 8-20 s; sessions start 1.5 s apart on average.
    2. burst: for (k, H) in (2, 20k), (3, 10.5k), (4, 5k) (inside the stall region §5.1 predicts for vLLM's
       reservation on this pool): k sessions compute H-token contexts, 80k tokens of one-shot filler evict them
       from the GPU prefix cache, then all k return in the same step with 1-2k new tokens each.
    3. edge: one session returns with a ~30k context while 8 short requests decode.
    """
    g = _Gen(seed)
    system = g.fresh(2)
    t = 0.0
    for s in range(12):
        t += g.rng.expovariate(1 / 1500)
        name = f"steady-{s}"
        first = g.lognormal(6000, 0.6, 1500, 14000)
        tt = t
        g.turn(name, tt, 0, g.lognormal(64, 0.5, 16, 200), "steady", first_input=first, prefix=system)
        for _ in range(2):
            tt += g.rng.uniform(8000, 20000)
            g.turn(name, tt, g.rng.randint(300, 1500), g.lognormal(64, 0.5, 16, 200), "steady")
    t = max(r.timestamp_ms for r in g.records) + 15000
    for k, hit in ((2, 40 * B), (3, 21 * B), (4, 10 * B)):
        names = [f"burst-k{k}-{i}" for i in range(k)]
        for i, name in enumerate(names):
            g.turn(name, t + 300 * i, 0, 8, "burst-warm", first_input=hit + 200)
        for i in range(10):
            g.one_shot(t + 3000 + 400 * i, 8000, 8, "burst-filler")
        ret = t + 12000
        for name in names:
            g.turn(name, ret, g.rng.randint(1000, 2000), 32, f"burst-k{k}")
        t = ret + 13000
    g.turn("edge", t, 0, 8, "edge-warm", first_input=30000)
    for i in range(10):
        g.one_shot(t + 2000 + 400 * i, 8000, 8, "edge-filler")
    ret = t + 12000
    for i in range(8):
        g.one_shot(ret - 1000 + 50 * i, 256, 128, "edge-background")
    g.turn("edge", ret, 1000, 32, "edge")
    return Workload("gemma4-31b-returning", g.done(), gemma4_31b_returning.__doc__ or "", "gemma-4-31b")


def deepseek_v4_flash_1m(seed: int = 0) -> Workload:
    """§5.2 cell A scaled: one agent session (not two) grows 128k -> 256k -> 512k -> 737k, a burst sweep of 2, 3 and 4
    sessions returning in the same step, then one ~1M context returning over 16 mixed requests (not 64).

    1. grow: session A at 128k, 256k, 512k, then 737k context (2-8k new tokens on the first turns, 200-token
       answers), interleaved with 6 one-shot 8-32k requests.
    2. burst: for (k, H) in (2, 737k), (3, 490k), (4, 366k), each inside the stall region of vLLM's reservation on
       the 6,144-block pool (k loaded footprints of H/256 + 22 blocks leave under the ~420 blocks one 1,024-token
       chunk needs, while the last returner still passes vLLM's gate of about H/256 blocks): fresh sessions compute
       H-token contexts one after another (A is one of the k = 2 pair), 128k tokens of one-shot filler evict
       their windows from the GPU, then all k return in the same step with 1-2k new tokens each.
    3. edge: A grows to a ~1M context (of max_model_len 1,048,576; one such request fits the pool, two do not)
       right after its k = 2 return, is evicted by the later cells, and returns last while 16 one-shot requests
       (lognormal median 7k, 1k-64k) arrive and decode around it.
    """
    g = _Gen(seed)
    k = 1024
    step_ms = 0.03  # > simulated cost of one prompt token at 1,024-token steps, for spacing long prefills

    def grow(session: str, t_ms: float, ctx: int, n_out: int, phase: str) -> TraceRecord:
        """A turn whose prompt plus answer reach `ctx` tokens."""
        prev = g.last[session]
        return g.turn(session, t_ms, ctx - n_out - prev.input_length - prev.output_length, n_out, phase)

    g.turn("agent-A", 0, 0, 200, "grow", first_input=128 * k)
    t = 0.0
    for target in (256 * k, 512 * k):
        t += 25000 if target == 256 * k else 30000
        prev = g.last["agent-A"]
        g.turn("agent-A", t, target - prev.input_length - prev.output_length, 200, "grow")
    for i in range(6):
        g.one_shot(2000 + 9000 * i, g.rng.randint(8 * k, 32 * k), 32, "grow-filler")
    t += 30000
    grow("agent-A", t, 737 * k, 200, "grow")
    t += 737 * k * step_ms * 1.3
    for kk, ctx in ((2, 737 * k), (3, 490 * k + 116), (4, 366 * k)):
        names = [f"burst-k{kk}-{i}" for i in range(kk)]
        if kk == 2:
            names[0] = "agent-A"
        for name in names:
            if name in g.last:
                continue
            g.turn(name, t, 0, 16, "burst-warm", first_input=ctx - 16)
            t += ctx * step_ms * 1.3
        for i in range(4):
            g.one_shot(t + 500 * i, 32 * k, 8, "burst-filler")
        t += 8000
        for name in names:
            g.turn(name, t, g.rng.randint(1000, 2000), 64, f"burst-k{kk}")
        # Room for recompute (connector off: k contexts again, with preemptions) before the next phase.
        t += kk * ctx * step_ms * 1.5 + 20000
        if kk == 2:
            grow("agent-A", t, 1_000_000, 16, "edge-warm")
            t += 1_000_000 * step_ms * 1.3
    for i in range(4):
        g.one_shot(t + 500 * i, 32 * k, 8, "edge-filler")
    ret = t + 8000
    tb = ret - 3000
    for i in range(16):
        g.one_shot(tb, g.lognormal(7000, 1.0, 1000, 64 * k), g.lognormal(200, 0.5, 16, 512), "edge-background")
        tb += g.rng.expovariate(1 / 500)
    g.turn("agent-A", ret, 1000, 32, "edge")
    return Workload("deepseek-v4-flash-1m", g.done(), deepseek_v4_flash_1m.__doc__ or "", "deepseek-v4-flash")


# The seed's deployment of DeepSeek-V4-Flash: pipeline parallel, MTP speculative decoding, contexts to 1M tokens.
DSV4_PP_MTP_PIPELINE = 4
DSV4_PP_MTP_SPEC_TOKENS = 2


def deepseek_v4_flash_pp_mtp(seed: int = 0, scale: float = 1.0) -> Workload:
    """DeepSeek-V4-Flash in the seed's configuration: pipeline parallel 4, MTP speculative decoding with 2 drafts per
    step, three multi-turn agent sessions whose contexts grow to ~1M tokens (max_model_len 1,048,576; 6,144-block
    pool, 48 GiB tier, max_num_batched_tokens 1,024).

    1. grow: sessions A (192k), B (256k) and C (128k) start; A grows to 720k and B to 700k; one-shot 16-32k
       requests between turns evict them from the GPU prefix cache (256-token answers throughout, so the drafts
       matter).
    2. burst: A and B return in the same step with 1-2k new tokens each after ~100k tokens of filler: two ~710k-token
       loads that fit the pool together (2 x ~2,800 blocks of 6,144) but leave less than one more chunk needs with 4
       batches in flight (the stall region of vLLM's reservation, as in deepseek-v4-flash-1m's k = 2 cell).
    3. grow-1m: C returns (a ~128k load) and grows to 384k; then A grows to 1,000,000 tokens (a ~722k load plus
       ~278k computed).
    4. edge: after filler, A returns with a ~1M context (1,000 new tokens, 32 answered) while 6 one-shot requests
       (4-32k) decode around it.

    Simulated: vLLM's real scheduler (AsyncScheduler) and KV cache manager over DeepSeek V4's layout with the MTP
    draft layer's window cache added as vLLM adds it (one `SlidingWindowMLASpec` layer, `is_draft`, which joins a
    window group and makes it the EAGLE-drop group), `num_speculative_tokens` 2 with 2 lookahead slots and
    `max_concurrent_batches` 4 as vLLM derives them; each step accepts a seeded uniform 0..2 of a request's drafts
    (vLLM rolls the rest back). Not simulated: the MTP layer's forward and real acceptance rates (tokens are
    synthetic), the stages' split of the layers (one worker holds all of them and moves whole blocks; a real stage
    moves its own layers, in parallel with the others), the pipeline's overlap in time (steps run one after another
    at the single-GPU step cost) and Model Runner V2 (a Hopper deployment's runner keeps PP + 1 batches in flight;
    the CPU build's V1 runner, whose scheduler paths the drivers follow, keeps PP). `scale` < 1 shrinks every
    context and filler for tests (phase 4 then reaches scale x 1M).
    """
    g = _Gen(seed)
    k = round(1024 * scale)
    step_ms = 0.03  # > simulated cost of one prompt token at 1,024-token steps
    out_n = 256

    def grow(session: str, t_ms: float, ctx: int, n_out: int, phase: str) -> TraceRecord:
        prev = g.last[session]
        return g.turn(session, t_ms, ctx - n_out - prev.input_length - prev.output_length, n_out, phase)

    def fillers(t_ms: float, n: int, phase: str) -> float:
        for i in range(n):
            g.one_shot(t_ms + 400 * i, g.rng.randint(16 * k, 32 * k), 16, phase)
        return t_ms + 400 * n + 32 * k * n * step_ms * 1.3

    t = 0.0
    for name, ctx in (("agent-A", 192 * k), ("agent-B", 256 * k), ("agent-C", 128 * k)):
        g.turn(name, t, 0, out_n, "grow", first_input=ctx - out_n)
        t += ctx * step_ms * 1.3 + 2000
    t = fillers(t, 3, "grow-filler")
    for name, ctx in (("agent-A", 720 * k), ("agent-B", 700 * k)):
        prev = g.last[name]
        grow(name, t, ctx, out_n, "grow")
        t += (ctx - prev.input_length - prev.output_length) * step_ms * 1.3 + 2000
    t = fillers(t, 4, "burst-filler")
    for name in ("agent-A", "agent-B"):
        g.turn(name, t, g.rng.randint(1000, 2000), out_n, "burst")
    t += 2 * 720 * k * step_ms * 1.5 + 20000
    prev = g.last["agent-C"]
    grow("agent-C", t, 384 * k, out_n, "grow-1m")
    t += (384 * k - prev.input_length - prev.output_length) * step_ms * 1.3 + 2000
    prev = g.last["agent-A"]
    grow("agent-A", t, round(1_000_000 * scale), 16, "grow-1m")
    t += (round(1_000_000 * scale) - prev.input_length - prev.output_length) * step_ms * 1.3 + 5000
    t = fillers(t, 3, "edge-filler")
    tb = t - 3000
    for i in range(6):
        g.one_shot(tb, g.rng.randint(4 * k, 32 * k), g.lognormal(200, 0.5, 64, 512), "edge-background")
        tb += g.rng.expovariate(1 / 500)
    g.turn("agent-A", t, 1000, 32, "edge")
    return Workload("deepseek-v4-flash-pp-mtp", g.done(), deepseek_v4_flash_pp_mtp.__doc__ or "", "deepseek-v4-flash",
                    pipeline_parallel_size=DSV4_PP_MTP_PIPELINE, num_speculative_tokens=DSV4_PP_MTP_SPEC_TOKENS)


def agent_tool_prefix(seed: int = 0) -> Workload:
    """Agentic traffic behind one long shared tool prefix, with sub-agent calls that share the prefix and diverge
    inside it. The shape is Mooncake's tool&agent trace's (8.6k-token prompts, 182-token answers, 59% of prompt
    tokens cached, models-and-traces.md §4): long shared prompts, short answers, many calls per task; here prompts
    average 9.2k tokens, answers 72, and 72% of prompt tokens repeat an earlier request's prefix.

    - prefix: a 1,024-token system prompt and 6,144 tokens of tool definitions (14 hash blocks, 7,168 tokens)
      shared by every request of this workload except the filler; each of 3 agent roles adds its own 1-3k tokens
      of instructions (2-6 blocks) behind them. A later agent's first prompt shares this prefix with earlier
      agents' prompts and diverges inside them.
    - agents: 12 sessions starting 4.5 s apart on average, each a task (300-1,500 tokens) and then 3-5 tool rounds:
      the previous answer (a tool call, lognormal median 60 tokens) plus the tool's output (lognormal median
      1,200, 200-4,000 tokens) after 5-25 s of tool latency; the last answer is longer (100-300). Contexts reach
      12-20k tokens.
    - sub-agent calls: 24 one-shot requests that share the tool prefix (half of them the role block too) and then
      diverge (500-3,000 tokens of their own): the shared prefix ends at a hash-block boundary inside earlier
      prompts, not where one of them ended.
    - filler: unrelated chat requests (lognormal median 4k, 1.5-10k tokens, 16-128-token answers) every 3 s on
      average for the whole run. With the other agents' turns, more new KV than a default GPU pool holds passes
      between two turns of one agent, so the GPU prefix cache keeps the hot tool prefix but not the sessions.

    Scaled down: 12 agents of at most 6 calls (real agent runs make tens of calls and live for minutes), answers
    capped at 300 tokens, one tool prefix (real deployments serve several tool sets).
    """
    g = _Gen(seed)
    shared = g.fresh(2) + g.fresh(12)  # system prompt, then tool definitions
    roles = [shared + g.fresh(g.rng.randint(2, 6)) for _ in range(3)]
    t = end = 0.0
    for a in range(12):
        t += g.rng.expovariate(1 / 4500)
        name = f"agent-{a}"
        role = roles[a % 3]
        tt = t
        g.turn(name, tt, 0, g.lognormal(60, 0.6, 16, 300), "agent",
               first_input=len(role) * B + g.rng.randint(300, 1500), prefix=role)
        rounds = g.rng.randint(3, 5)
        for k in range(rounds):
            tt += g.rng.uniform(5000, 25000)
            n_out = g.rng.randint(100, 300) if k == rounds - 1 else g.lognormal(60, 0.6, 16, 300)
            g.turn(name, tt, g.lognormal(1200, 0.7, 200, 4000), n_out, "agent")
        end = max(end, tt)
    for i in range(24):
        prefix = g.rng.choice(roles) if i % 2 else shared
        g.one_shot(g.rng.uniform(3000, end), len(prefix) * B + g.rng.randint(500, 3000),
                   g.lognormal(48, 0.5, 16, 160), "sub-agent", prefix=prefix)
    g.filler(end, 3000, (4000, 0.6, 1500, 10000), "chat-filler")
    return Workload("agent-tool-prefix", g.done(), agent_tool_prefix.__doc__ or "", "gpt-oss-20b")


def rag_shared_docs(seed: int = 0) -> Workload:
    """Retrieval-augmented queries over a shared pool of documents: the prompt is a system prompt, the retrieved
    documents in rank order, then the question, so two queries share a prefix up to the first document where their
    retrievals differ: a document boundary inside both prompts.

    - system prompt: 1,024 tokens (2 hash blocks), shared by every query.
    - documents: 20, each 4-16 whole hash blocks (2-8k tokens; lognormal median 4k), so each document boundary is a
      hash-block boundary.
    - queries: 64, 3 s apart on average. Each picks one of 8 topics (Zipf(1) popularity; a topic ranks 5 of the
      documents) and takes the topic's top k (k = 2-4) documents in rank order; half of the queries perturb that
      list (a later document swapped with its neighbour or replaced by another one of the pool), so they share
      only up to the perturbed position. Lists are cut so the prompt stays under 26k tokens. Question: 60-400
      tokens; answer: lognormal median 96 (32-256).
    - follow-ups: 30% of queries get a second turn 15-45 s later (a 60-300-token question after the answer): reuse
      that ends where the earlier prompt's answer ended.
    - filler: unrelated one-shot prompts (lognormal median 6k, 2-14k tokens, 16-128-token answers) every 3.5 s on
      average, so that between two queries of a topic the GPU prefix cache has turned over and the documents' KV
      must come from the CPU tier.

    Scaled down: 64 queries over about three minutes (a real RAG service sees many queries a second), a
    20-document pool (real corpora are far larger, with a long tail that is never reused), answers capped at 256
    tokens.
    """
    g = _Gen(seed)
    system = g.fresh(2)
    docs = [g.fresh(min(16, max(4, round(g.rng.lognormvariate(math.log(8), 0.45))))) for _ in range(20)]
    topics = [g.rng.sample(range(len(docs)), 5) for _ in range(8)]
    popularity = [1 / (i + 1) for i in range(len(topics))]
    max_blocks = 26000 // B
    t = 0.0
    for q in range(64):
        t += g.rng.expovariate(1 / 3000)
        ranked = topics[g.rng.choices(range(len(topics)), popularity)[0]]
        k = g.rng.randint(2, 4)
        chosen = list(ranked[:k])
        if g.rng.random() < 0.5:
            j = g.rng.randint(1, k - 1)
            if j + 1 < k and g.rng.random() < 0.5:
                chosen[j], chosen[j + 1] = chosen[j + 1], chosen[j]
            else:
                chosen[j] = g.rng.choice([d for d in range(len(docs)) if d not in chosen])
        ids = list(system)
        for d in chosen:
            if len(ids) + len(docs[d]) + 1 > max_blocks:  # + 1: the question's block
                break
            ids += docs[d]
        name = f"rag-{q}"
        g.turn(name, t, 0, g.lognormal(96, 0.5, 32, 256), "rag", first_input=len(ids) * B + g.rng.randint(60, 400),
               prefix=ids)
        if g.rng.random() < 0.3:
            g.turn(name, t + g.rng.uniform(15000, 45000), g.rng.randint(60, 300), g.lognormal(96, 0.5, 32, 256),
                   "rag-followup")
    end = max(r.timestamp_ms for r in g.records)
    g.filler(end, 3500, (6000, 0.5, 2000, 14000), "rag-filler")
    return Workload("rag-shared-docs", g.done(), rag_shared_docs.__doc__ or "", "gemma-4-31b")


def decode_heavy(seed: int = 0) -> Workload:
    """Long decoders hold the pool while requests with long shared prefixes return behind them, and short requests
    keep arriving behind those: the mix in which a load deferred for want of blocks can age out, because every
    block a finishing request frees is taken by a short request first.

    Three waves, 60 s apart, each:
    1. warm: 4 sessions compute 5-12k-token contexts (a 1,024-token system prefix shared by all, then a document
       of their own) with 16-token answers. Each has 2 one-shot siblings (sent in step 4) that share its first
       8-16 blocks (4-8k tokens) and diverge there, inside its prompt.
    2. decoders: 2 requests (2-5k-token prompts) arrive together 4 s later and decode 1-3.5k tokens each (a
       reasoning model's long answers); their KV grows for most of the wave on Gemma 4 31B's step times (15-60 s),
       for a quarter of that on gpt-oss-20b's.
    3. filler: 4 one-shot 6-10k-token prompts right behind the decoders, which with the decoders' growth evict the
       warm contexts from the GPU prefix cache.
    4. return: 8-12 s after the decoders start, the 4 sessions return (their context plus 300-1,000 new tokens)
       and the 8 siblings arrive within the next second, all behind the decoders.
    5. short: requests of 100-800 tokens with 16-96-token answers arrive every 400-900 ms from the decoders' start
       to the end of the wave (and 20 s past the last one), taking blocks as soon as they free.

    Scaled down: 3 waves (a service runs this mix continuously), 2 decoders per wave, answers up to 3.5k tokens
    (reasoning traces run longer).
    """
    g = _Gen(seed)
    system = g.fresh(2)
    waves, wave_ms = 3, 60000
    for w in range(waves):
        t = w * wave_ms
        names = [f"w{w}-ctx-{i}" for i in range(4)]
        siblings: list[tuple[list[int], int]] = []
        for i, name in enumerate(names):
            rec = g.turn(name, t + 500 * i, 0, 16, "wave-warm", first_input=g.rng.randint(5000, 12000),
                         prefix=system)
            for _ in range(2):
                keep = g.rng.randint(8, min(16, len(rec.hash_ids) - 1))
                siblings.append((list(rec.hash_ids[:keep]), keep * B + g.rng.randint(300, 2000)))
        td = t + 4000
        for i in range(2):
            g.one_shot(td + 10 * i, g.rng.randint(2000, 5000), g.rng.randint(1000, 3500), "decoders")
        for i in range(4):
            g.one_shot(td + 200 + 300 * i, g.rng.randint(6000, 10000), 8, "decode-filler")
        tr = td + g.rng.uniform(8000, 12000)
        for i, name in enumerate(names):
            g.turn(name, tr + 100 * i, g.rng.randint(300, 1000), g.lognormal(96, 0.5, 32, 256), "return")
        for i, (prefix, n_in) in enumerate(siblings):
            g.one_shot(tr + 500 + 60 * i, n_in, g.lognormal(96, 0.5, 32, 256), "siblings", prefix=prefix)
        ts, stop = td, t + wave_ms + (20000 if w == waves - 1 else 0)
        while ts < stop:
            ts += g.rng.uniform(400, 900)
            g.one_shot(ts, g.rng.randint(100, 800), g.rng.randint(16, 96), "short-background")
    return Workload("decode-heavy", g.done(), decode_heavy.__doc__ or "", "gemma-4-31b")


MOONCAKE_FILE = "mooncake-synthetic.jsonl.gz"


def mooncake_synthetic(seed: int = 0) -> Workload:
    """Mooncake's synthetic trace (ShareGPT + L-Eval + LooGLE, Poisson arrivals; 3,993 requests; Apache-2.0),
    carried gzipped in the package. The seed only changes the token ids each hash block expands to."""
    ref = resources.files("offload_bench.replay") / "data" / MOONCAKE_FILE
    with resources.as_file(ref) as path, gzip.open(path, "rt", encoding="utf-8") as fh:
        records = parse_lines(fh, f"{MOONCAKE_FILE}")
    return Workload("mooncake-synthetic", tuple(records), mooncake_synthetic.__doc__ or "")


BUILTIN: dict[str, Callable[[int], Workload]] = {
    "gemma4-31b-returning": gemma4_31b_returning,
    "deepseek-v4-flash-1m": deepseek_v4_flash_1m,
    "deepseek-v4-flash-pp-mtp": deepseek_v4_flash_pp_mtp,
    "mooncake-synthetic": mooncake_synthetic,
    "agent-tool-prefix": agent_tool_prefix,
    "rag-shared-docs": rag_shared_docs,
    "decode-heavy": decode_heavy,
}


def resolve_trace(name_or_path: str, seed: int) -> Workload:
    """A built-in workload name, or a Mooncake-format JSONL file (optionally .gz)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path](seed)
    p = Path(name_or_path)
    if not p.exists():
        raise FileNotFoundError(f"--trace {name_or_path!r} is neither a built-in workload "
                                f"({', '.join(BUILTIN)}) nor an existing file")
    return Workload(p.name, tuple(load_trace(p)), f"Mooncake-format trace {p}")
