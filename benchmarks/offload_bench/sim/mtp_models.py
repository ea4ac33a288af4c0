"""The models whose MTP drafter the simulation lays out (their draft layers' KV caches are known: see
`sim.layouts.mtp_draft_specs`), by `model_type`, each with the bundled config that has one. Free of vLLM imports: the
replay's argument check reads it before vLLM is loaded."""

MTP_MODELS = {"deepseek_v4": "deepseek-v4-flash", "qwen3_next": "qwen3-next-80b", "qwen3_5": "qwen3.5-9b"}
