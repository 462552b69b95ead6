"""Real parts for the API tests: the app under a real uvicorn on a free loopback port (in a thread of the test
process, so a test can hold the clock), the official openai client against it, and batch files."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omlx_jobs.api import ServeConfig, create_app
from tests.fault_harness import free_port


class Clock:
    """A wall clock a test can move forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@contextmanager
def live_server(config: ServeConfig, *, housekeeping: bool = True) -> Iterator[str]:
    """Serve `config` with uvicorn on 127.0.0.1:<free port>; yields the base URL (without /v1)."""
    import uvicorn

    app = create_app(config, housekeeping=housekeeping)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def openai_client(base_url: str, api_key: str = "test-key-123456", **kw: Any) -> Any:
    """The official client, validating every response strictly against its types."""
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key, _strict_response_validation=True, max_retries=0, **kw)


def chat_line(i: int, model: str = "tiny", max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly and clearly."},
                {"role": "user", "content": f"question {i}"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        },
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    with path.open("w") as fh:
        for line in lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
