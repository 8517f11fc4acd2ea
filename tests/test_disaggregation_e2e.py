"""``blink serve --disaggregated`` end to end (docs/disaggregation.md): a decode engine, a
prefill engine and the frontend as separate processes, driven with the official openai client.

- greedy fp32 outputs equal a colocated ``blink serve``'s;
- the bytes the prefill engine wrote into the decode engine equal the prompts' KV, rounded up
  to whole blocks: 2 * layers * kv_heads * head_dim * 4 (fp32) * block_size * ceil(tokens / block_size);
- with ARK path selection on (``--fabric``: every KV transfer reserves a spine first; over
  loopback the port is reserved, not applied, and the log says so), all of the above holds;
- SIGKILL of the decode engine while a request's KV is in flight (the prefill engine holds the
  ready word back for a while: tests/hooks/kv_ready_delay) resumes the request on the prefill
  engine with the same tokens; nothing is left held in the prefill engine (slots, KV blocks),
  and once the decode engine is back requests are disaggregated again.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from e2e_helpers import ServeProcess, child_pids, cmdline, read_metrics, wait_until  # noqa: E402
from test_engine import tiny_model_dir  # noqa: E402

from blink.ring import (  # noqa: E402
    C_STAT_KV_BLOCKS_USED,
    C_STAT_KV_BYTES_SENT,
    C_STAT_KV_TRANSFERS,
    SLOT_FREE,
    RingLayout,
    read_header,
)
from blink.transport import connect, load_secret_file  # noqa: E402

BLOCK = 8
PROMPTS = ["The quick brown fox jumps", "Blink moves KV blocks with one-sided writes.", "hi"]
MAX_TOKENS = 12
#: a sitecustomize that makes prefill engines hold their ready words back a second
KV_READY_DELAY_HOOK = Path(__file__).parent / "hooks" / "kv_ready_delay"


def _flags(model: Path) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
            "--kv-cache-tokens", "4096", "--block-size", str(BLOCK), "--max-num-seqs", "8",
            "--threads", "1", "--max-num-batched-tokens", "256"]


def _engine_pid(server: ServeProcess, role: str) -> int:
    for pid in child_pids(server.pid):
        argv = cmdline(pid)
        if "engine" in argv and role in argv:
            return pid
    raise AssertionError(f"no {role} engine under {server.pid}")


def _engine_address(server: ServeProcess, role: str) -> tuple[str, int]:
    found = re.findall(rf"role {role}, .*bootstrap at (\S+):(\d+)", server.log())
    assert found, server.tail()
    host, port = found[-1]
    return host, int(port)


def _control(address: tuple[str, int], secret: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(control block, slot state words) of an engine, read as a monitor."""
    _, transport = connect(*address, secret=secret, role="monitor", timeout_s=5.0)
    try:
        header = transport.read(0, 32 * 8)
        buf = np.zeros(int(header.view("<i8")[2]), dtype=np.uint8)
        buf[: header.size] = header
        layout = RingLayout(read_header(buf))
        spec = layout.fields["state"]
        states = transport.read(spec.offset, spec.nbytes).view("<i4")
        return header.view("<i8").copy(), states
    finally:
        transport.close()


def _complete(client: openai.OpenAI, prompt: str) -> tuple[str, int]:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.prompt_tokens


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("disagg-e2e"))
    secret_file = str(Path(tempfile.mkdtemp(prefix="blink-secret-")) / "bootstrap.secret")
    fabric = Path(tempfile.mkdtemp(prefix="blink-fabric-")) / "fabric.yaml"
    with socket.socket() as s:  # the prefill engine's ARK bus address
        s.bind(("127.0.0.1", 0))
        bus_port = s.getsockname()[1]
    fabric.write_text("topology: {leaves: 2, spines: 4, hosts_per_leaf: 2}\n"
                      "hash: {algorithm: crc32, seed: 3}\n"
                      f"senders: {{prefill-0: {{bus: '127.0.0.1:{bus_port}', leaf: 0}}}}\n"
                      "decode: [{leaf: 1}]\n")
    # the prefill engine holds its ready words back (tests/hooks/kv_ready_delay/sitecustomize.py)
    python_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(KV_READY_DELAY_HOOK), python_path) if p)
    try:
        disagg = ServeProcess(*_flags(model), "--served-model-name", "m", "--disaggregated",
                              "--fabric", str(fabric), "--bootstrap-secret-file", secret_file, name="disagg-serve")
    finally:
        if python_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = python_path
    colocated = ServeProcess(*_flags(model), "--served-model-name", "m", name="colocated-serve")
    try:
        colocated.wait_ready()
        disagg.wait_for_output(re.escape("Blink is serving"))
        yield {"disagg": disagg, "colocated": colocated, "model": model,
               "secret": load_secret_file(secret_file)}
    finally:
        for s in (disagg, colocated):
            status = s.stop()
            for pid in child_pids(s.pid):
                os.kill(pid, signal.SIGKILL)
            assert status == 0, s.tail()


def test_disaggregated_equals_colocated_and_moves_the_prompts_kv(servers):
    disagg = openai.OpenAI(base_url=servers["disagg"].base_url + "/v1", api_key="x", max_retries=0)
    colocated = openai.OpenAI(base_url=servers["colocated"].base_url + "/v1", api_key="x", max_retries=0)
    prefill = _engine_address(servers["disagg"], "prefill")
    before = _control(prefill, servers["secret"])[0]
    tokens = []
    for prompt in PROMPTS:
        got, n = _complete(disagg, prompt)
        want, _ = _complete(colocated, prompt)
        assert got == want, prompt
        tokens.append(n)
    after = _control(prefill, servers["secret"])[0]
    cfg = json.loads((servers["model"] / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    expected = sum(per_token * BLOCK * -(-n // BLOCK) for n in tokens)
    assert after[C_STAT_KV_TRANSFERS] - before[C_STAT_KV_TRANSFERS] == len(PROMPTS)
    assert after[C_STAT_KV_BYTES_SENT] - before[C_STAT_KV_BYTES_SENT] == expected
    # ARK was on and said that over loopback the reserved port is applied nowhere
    log = servers["disagg"].log()
    assert "ARK path selection on" in log and "chosen and reserved" in log, servers["disagg"].tail()
    # prometheus client counters get a _total suffix
    assert read_metrics(servers["disagg"].base_url)["blink:kv_transfer_bytes_total"] == after[C_STAT_KV_BYTES_SENT]


def test_decode_engine_killed_mid_transfer_resumes_on_the_prefill_engine(servers):
    server = servers["disagg"]
    disagg = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    colocated = openai.OpenAI(base_url=servers["colocated"].base_url + "/v1", api_key="x", max_retries=0)
    prompt = PROMPTS[1]
    want, _ = _complete(colocated, prompt)
    decode_pid = _engine_pid(server, "decode")
    pieces: list[str] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            for chunk in disagg.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0].text)
                first.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    # The first token comes from the prefill engine, which then holds the decode engine's
    # ready word back for 1 s: kill the decode engine inside that window.
    assert first.wait(60), "no first token"
    os.kill(decode_pid, signal.SIGKILL)
    t.join(60)
    assert not errors, errors
    assert "".join(pieces) == want
    # the decode leg was lost after the first token and the rest came from the prefill engine
    wait_until(lambda: "resuming elsewhere" in server.log(), 10, what="the router's resume")
    prefill = _engine_address(server, "prefill")
    secret = servers["secret"]

    def prefill_idle() -> bool:
        control, states = _control(prefill, secret)
        return control[C_STAT_KV_BLOCKS_USED] == 0 and bool((states == SLOT_FREE).all())

    wait_until(prefill_idle, 20, what="the prefill engine to hold nothing")
    # the supervisor restarts the decode engine on its port; the router uses it again
    wait_until(lambda: "the decode engine is back" in server.log(), 120, what="decode restart")
    before = _control(prefill, secret)[0][C_STAT_KV_TRANSFERS]

    def disaggregated_again() -> bool:
        assert _complete(disagg, PROMPTS[0])[0] == _complete(colocated, PROMPTS[0])[0]
        return _control(prefill, secret)[0][C_STAT_KV_TRANSFERS] > before

    wait_until(disaggregated_again, 60, interval_s=0.5, what="a disaggregated request after the restart")
