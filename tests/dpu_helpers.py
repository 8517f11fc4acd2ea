"""Shared pieces for frontend tests: a tiny tokenizer trained on the spot, a fake engine, and
the app served by uvicorn on a loopback port (in a thread, or as a subprocess with
``python tests/dpu_helpers.py PORT [create_app options as JSON]``)."""
from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator, Iterator

import httpx
import uvicorn
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from fake_engine_client import FakeEngineClient  # tests/ is on sys.path (importer or script)

from blink.dpu.app import create_app
from blink.dpu.tokenizer import Tokenizer

MODEL = "tiny-test"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ANSWER = "Hello world 😀 this is a test. Grüße!"
MESSAGES = [{"role": "user", "content": "Say hello"}]


def tiny_tokenizer() -> Tokenizer:
    """A tiny byte-level BPE trained on the spot (milliseconds) with ChatML specials."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator([ANSWER, "Say hello to the world, user and assistant"] * 5, trainer)
    return Tokenizer(hf.to_str(), {"eos_token": "<|im_end|>", "chat_template": CHATML}, {})


def make_engine(tok: Tokenizer, answer: str = ANSWER, **kw: Any) -> FakeEngineClient:
    ids = tok.encode(answer, add_special_tokens=False)
    kw.setdefault("max_model_len", 256)
    return FakeEngineClient(model_name=MODEL, responder=lambda p, s: ids,
                            vocab_size=tok.vocab_size, **kw)


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve_in_thread(app: Any, limits: Any = None) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port; yields the base URL. ``limits``
    (a :class:`blink.dpu.http_server.ConnectionLimits`): serve it as the frontend does, with
    those connection bounds."""
    sock = free_socket()
    if limits is None:
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
    else:
        from blink.dpu.http_server import uvicorn_config

        config = uvicorn_config(app, limits, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=5)
        sock.close()


async def asgi_request(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request to ``app`` in process (no socket)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kw)


@contextlib.asynccontextmanager
async def ring_frontend(llm: Any, **app_options: Any) -> AsyncIterator[Any]:
    """The frontend app (model name "tiny") over a ring client of its own on an offline
    ``LLM``'s engine, as ``blink serve``'s frontend reaches it; closing it closes the client."""
    from blink.dpu.ring_engine_client import RingEngineClient
    from blink.dpu.ring_protocol import RingClient
    from blink.transport import InProcessTransport, LoopbackTransport

    region = llm.engine.region
    transport = (InProcessTransport(region) if region.kind == "inprocess"
                 else LoopbackTransport(region.name, region.total_bytes))
    client = RingEngineClient(RingClient(transport), model_name="tiny",
                              max_model_len=llm.max_model_len,
                              poll_min_interval_s=1e-4, poll_max_interval_s=1e-3)
    client.start()
    try:
        yield create_app(client, llm.tokenizer, model_name="tiny", **app_options)
    finally:
        await client.close()


def grammar_accepts(grammar: Any, tok: Tokenizer, text: str) -> bool:
    """Whether a compiled constraint lets ``text`` through, token by token, and then lets
    the output end (EOS allowed)."""
    masker = grammar.new_masker()
    for t in tok.encode(text, add_special_tokens=False):
        words = masker.mask()
        if not (int(words[t // 32]) >> (t % 32)) & 1:
            return False
        masker.advance([t])
    eos = tok.eos_token_ids[0]
    return bool((int(masker.mask()[eos // 32]) >> (eos % 32)) & 1)


def _main(argv: list[str]) -> None:
    """Serve the fake-engine app on ``argv[0]`` (a port); ``argv[1]``: JSON create_app kwargs
    (``"limits"`` as a dict of RequestLimits fields; ``"connections"``, a dict of
    ConnectionLimits fields, serves it as the frontend process does: the open-files limit
    raised, h11 with those bounds)."""
    port = int(argv[0])
    options = json.loads(argv[1]) if len(argv) > 1 else {}
    if "limits" in options:
        from blink.dpu.limits import RequestLimits

        options["limits"] = RequestLimits(**options["limits"])
    connections = options.pop("connections", None)
    tok = tiny_tokenizer()
    app = create_app(make_engine(tok), tok, model_name=MODEL, **options)
    if connections is None:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        return
    from blink.dpu.http_server import ConnectionLimits, uvicorn_config
    from blink.supervision import raise_open_files_limit

    raise_open_files_limit()
    config = uvicorn_config(app, ConnectionLimits(**connections), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    _main(sys.argv[1:])
