"""StructuredOutputManager (vLLM's name): the engine core's side of structured outputs.

A request with structured_outputs waits here, outside the scheduler, while its grammar compiles on a thread of its
own (compiled grammars are kept by their text, so a repeated schema costs a copy); it joins the scheduler once its
grammar is ready, so no step waits for a compile. Each step, the constrained requests that sample get one bitmask row
each (GrammarOutput), computed from their matchers once those have taken every earlier token; the scheduler's
outputs then advance the matchers. A request whose grammar is complete ends with "stop" at that token; one whose
grammar fails (to compile, or on a token) ends with "error": no other request is touched.
"""

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from itertools import chain
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

from engine_core.structured_output.grammar import GrammarCompiler, cache_key, summary
from protocol import EngineCoreOutput, EngineCoreRequest, GrammarOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine_core.request import Request

logger = logging.getLogger(__name__)
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


class StructuredOutputManager:
    def __init__(self, model: str | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.compiler = GrammarCompiler(model, vocab_size, eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiled: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()
        self.waiting: dict[str, tuple[EngineCoreRequest, Future[llguidance.LLMatcher]]] = {}
        self.matchers: dict[str, llguidance.LLMatcher] = {}  # the admitted requests', advanced by their outputs

    # ---- requests in and out ---------------------------------------------------------------

    def hold(self, request: EngineCoreRequest) -> bool:
        """Keep a constrained request until its grammar is compiled (True); False for any other request."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        key = cache_key(params)
        future = self.compiled.get(key)
        if future is None:
            future = self.compiled[key] = self.pool.submit(self.compiler.compile, params)
            if len(self.compiled) > CACHE_SIZE:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(key)
        self.waiting[request.request_id] = (request, future)
        return True

    def take_ready(self) -> tuple[list[EngineCoreRequest], list[EngineCoreOutput]]:
        """The held requests whose grammar is compiled, in arrival order, each with its matcher; and the error
        outputs of those whose grammar failed."""
        ready, failed = [], []
        for request_id, (request, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[request_id]
            error = future.exception()
            if error is None:
                self.matchers[request_id] = future.result().deep_copy()
                ready.append(request)
            else:
                message = summary(str(error)) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
                logger.warning("Request %s: its structured output cannot be compiled: %s", request_id, message)
                failed.append(EngineCoreOutput(request_id, [], finish_reason="error", error=message))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a held request's grammar is ready, or timeout seconds."""
        wait({future for _, future in self.waiting.values()}, timeout, FIRST_COMPLETED)

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Drop the held ones among request_ids (their compile goes on for the cache): their abort outputs."""
        return [EngineCoreOutput(rid, [], "abort") for rid in request_ids if self.waiting.pop(rid, None) is not None]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- one step --------------------------------------------------------------------------

    def sampling_ids(self, so: SchedulerOutput, requests: dict[str, "Request"]) -> list[str]:
        """The step's constrained requests that sample, in the workers' batch order (new requests, then running
        ones): those whose scheduled tokens reach their last known token. Decided when the step is scheduled."""
        if not self.matchers:
            return []
        scheduled = chain((new.req_id for new in so.scheduled_new_reqs), so.scheduled_cached_reqs.req_ids)
        return [rid for rid in scheduled if rid in self.matchers
                and requests[rid].num_computed_tokens >= requests[rid].num_tokens]

    def grammar_output(self, step: int, request_ids: list[str]) -> GrammarOutput:
        """The rows of request_ids from their matchers as they are now (a request finished meanwhile: all ones)."""
        bitmask = np.full((len(request_ids), self.words), -1, np.int32)
        for i, request_id in enumerate(request_ids):
            matcher = self.matchers.get(request_id)
            if matcher is not None:
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, i)
        return GrammarOutput(step, request_ids, bitmask.astype("<i4", copy=False).tobytes())

    def advance(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Feed each constrained request's new tokens to its matcher; drop the matchers of finished requests. The
        outputs of requests that end here get their finish_reason (and error) set; those outputs are returned."""
        ended = []
        for out in outputs:
            matcher = self.matchers.get(out.request_id)
            if matcher is None:
                continue
            if out.finish_reason is None:
                if not matcher.consume_tokens(out.new_token_ids):
                    out.finish_reason = "error"
                    out.error = f"the output left its structured output's grammar: {summary(matcher.get_error())}"
                elif matcher.is_stopped():
                    out.finish_reason = "stop"  # the grammar is complete: nothing more can follow
                if out.finish_reason is not None:
                    ended.append(out)
            if out.finish_reason is not None:
                del self.matchers[out.request_id]
        return ended
