"""Structured outputs on the frontend (torch-free): a constraint
(:class:`blink.shared.structured_outputs.StructuredOutputs`) -> an llguidance grammar
(:mod:`.grammar`) -> checked in a killable worker process under time and memory limits and
cached (:mod:`.workers`) -> one matcher per request that follows the engine's tokens and
writes each next-token mask into the ring (:mod:`.masker`). docs/architecture.md,
"Structured outputs"."""
