"""Structured outputs on the frontend: a constraint (:class:`blink.shared.structured_outputs.
StructuredOutputs`) -> a regex (:mod:`.regex`) -> a token automaton for the model's vocabulary
(:mod:`.compiler`, outlines-core) -> an entry of the ring's grammar region (:mod:`.region`).
Torch-free, like the rest of the frontend."""
