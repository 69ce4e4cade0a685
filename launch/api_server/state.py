"""What every handler shares in one API process: the engine connection, the text side, the limits, and the
handlers in flight (ended with a 503 when the server shuts down, so none is left running)."""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from launch.api_server.auth import ApiKeys
from launch.api_server.errors import ApiError
from launch.api_server.fairness import EngineSlots, UserAdmission
from launch.api_server.text_model import TextModel
from launch.client import AsyncEngineClient
from protocol.config import ServerConfig

T = TypeVar("T")
TEXT_THREADS = 2  # tokenising and chat templating run here, never on the event loop
HEALTH_TIMEOUT = 10.0  # seconds for the engine to answer a stats probe
STOP_WAIT = 10.0  # seconds for the handlers to answer once shutdown has cancelled them (a liveness bound)


@dataclass
class Served:
    engine: AsyncEngineClient
    text: TextModel
    model_name: str
    max_model_len: int
    metrics_url: str
    config: ServerConfig = field(default_factory=ServerConfig)
    engine_window: int = 256  # engine requests in flight from this process (see fairness.EngineSlots)
    priority_scheduling: bool = False  # the engine's --scheduling-policy is priority: a request's priority counts
    stopping: bool = False
    handlers: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        config = self.config
        self.keys = ApiKeys(config.http_api_keys(), config.http_admin_key(), config.cache_salt_per_api_key)
        self.admission = UserAdmission(config.max_user_requests)
        self.slots = EngineSlots(self.engine_window)
        self.text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="text")
        self.max_prompt_chars = self.max_model_len * self.text.longest_token_chars
        self.probe: asyncio.Future | None = None
        self.reset_lock = asyncio.Lock()

    async def engine_answers(self) -> None:
        """Raise EngineDeadError or TimeoutError unless the engine answers a stats probe. Concurrent callers share
        one probe, so that no client can queue more messages at the engine than the generation window."""
        if self.probe is None or self.probe.done():
            self.probe = asyncio.ensure_future(asyncio.wait_for(self.engine.get_stats(), HEALTH_TIMEOUT))
        await asyncio.shield(self.probe)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`", "model")

    async def run_text(self, work: Callable[..., T], *args: object) -> T:
        """work(*args) on a text thread: the event loop keeps serving other clients meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, work, *args)

    async def stop(self) -> None:
        """Shutdown: every handler in flight is cancelled, answers 503 (see guard.Guard) and ends."""
        self.stopping = True
        handlers = list(self.handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=STOP_WAIT)
        self.text_pool.shutdown(wait=False, cancel_futures=True)
