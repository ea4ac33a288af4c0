"""Soak runs: our connector (exact ledger) through vLLM's real scheduler for simulated hours, with randomized
aborts, preemptions, injected load / store failures and a CPU tier small enough to evict constantly, checking the
lifecycle invariants after every step and that nothing leaks at the end. `offload-connector soak` (command.py)."""
