"""An answer in OpenAI's format: a request's choices, as their engine events arrive
(`frontend.LoopBridge`: the engine's tokens and their text), leave as one completion or chat
completion (`Answer.complete`) or as server-sent events in OpenAI's chunk format (`Answer.stream`).
Every answer carries a `trtspec` object: the block size run and its acceptance statistics.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from starlette.responses import Response

from trtspec.errors import Cancelled, TrtspecError
from trtspec.runtime.stats import DecodeStats
from trtspec.serving import logprobs as logprob_objects
from trtspec.serving.frontend import COMMIT, FINISH, LoopBridge, Reply
from trtspec.serving.protocol import ApiError, ParsedRequest, bad_request


@dataclass
class _Outcome:
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    completion_tokens: int = 0
    stats: DecodeStats | None = None
    logprob_at: int = 0    # streaming: tokens whose logprobs were sent
    text_offset: int = 0   # streaming completions: the text offset of the next token


class Answer:
    """One request's answer: `choices` are its (Reply, LoopBridge) pairs, one per choice, already
    submitted; `ident` its id. Leaving early (a disconnect) cancels every choice's engine request."""

    def __init__(self, parsed: ParsedRequest, choices: list, ident: str, *, codec, metrics, model_name: str,
                 replica: dict | None = None):
        self.parsed, self.choices, self.ident = parsed, choices, ident
        self.codec, self.metrics, self.model_name, self.replica = codec, metrics, model_name, replica

    async def _events(self, reply: Reply, bridge: LoopBridge, outcome: _Outcome):
        """Text pieces as the engine commits tokens, each with the count of tokens committed since the
        last piece; `outcome` is filled in at the end. The engine ends the request (at a stop string,
        a stop id or its limit); it is cancelled when the consumer goes away."""
        finished, pending = False, 0
        try:
            while True:
                kind, payload = await bridge.queue.get()
                if kind == FINISH:
                    break
                if kind == COMMIT:
                    reply.commit(payload)
                    outcome.completion_tokens += len(payload)
                    pending += len(payload)
                else:  # TEXT: the text these tokens completed
                    yield payload, pending
                    pending = 0
            finished = True
        finally:
            if not finished:
                reply.request.cancel()
                self.metrics.observe_failed("cancelled")
        try:
            generation = reply.end()
        except Cancelled:
            self.metrics.observe_failed("cancelled")
            raise ApiError(503, "the request was cancelled (the server is shutting down)", "service_unavailable")
        except TrtspecError as exc:
            self.metrics.observe_failed("error")
            raise bad_request(str(exc)) from None
        except Exception:
            self.metrics.observe_failed("error")
            raise
        outcome.stats = generation.stats
        outcome.finish_reason = generation.stats.finish_reason or "stop"
        outcome.completion_tokens = len(generation.tokens)

    def _usage(self, outcomes: list[_Outcome]) -> dict:
        prompt, completion = len(self.parsed.prompt_ids), sum(o.completion_tokens for o in outcomes)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}  # no prefix cache: every prompt token is computed

    async def complete(self, http) -> dict | Response:
        outcomes = [_Outcome() for _ in self.choices]

        async def collect(reply, bridge, outcome):
            async for piece, _ in self._events(reply, bridge, outcome):
                outcome.text_parts.append(piece)

        async def disconnected():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(asyncio.gather(*(collect(r, b, o) for (r, b), o in zip(self.choices, outcomes)),
                                                    return_exceptions=True))  # every choice's end is collected
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
        if not work.done() or work.cancelled():
            await asyncio.gather(work, return_exceptions=True)  # its cleanup cancels the engine requests
            return Response(status_code=499)  # nobody is listening
        failed = next((e for e in work.result() if isinstance(e, BaseException)), None)
        if failed is not None:  # a choice failed: the answer is its error
            raise failed
        answers = []
        for index, outcome in enumerate(outcomes):
            text = (self.parsed.echo or "") + "".join(outcome.text_parts)
            request = self.choices[index][0].request
            listed = logprob_objects.entries(request.tokens[:outcome.completion_tokens],
                                             request.logprobs[:outcome.completion_tokens])
            choice = {"index": index, "finish_reason": outcome.finish_reason,
                      "logprobs": self._logprobs(request, listed, 0, echo=self.parsed.echo is not None)}
            choice.update({"message": {"role": "assistant", "content": text}} if self.parsed.chat else {"text": text})
            if self.parsed.n > 1:
                choice["trtspec"] = self._extension(outcome.stats)
            answers.append(choice)
        return {"id": self.ident, "object": "chat.completion" if self.parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": answers,
                "usage": self._usage(outcomes), "trtspec": self._extension(outcomes[0].stats)}

    def _extension(self, stats: DecodeStats) -> dict:
        out = stats.to_dict()
        if self.replica is not None:
            out["replica"] = self.replica
        return out

    def _logprobs(self, request, listed: list, offset: int, echo: bool = False) -> dict | None:
        """The choice's logprobs object for these (token, logprob) entries; `echo`: the prompt's first."""
        if self.parsed.config.logprobs is None:
            return None
        if self.parsed.chat:
            return logprob_objects.chat_logprobs(self.codec, listed)
        if echo:
            listed = logprob_objects.entries(self.parsed.prompt_ids, request.prompt_logprobs) + listed
        return logprob_objects.completion_logprobs(self.codec, listed, offset)

    def _streamed_logprobs(self, request, outcome: _Outcome, count: int) -> dict | None:
        """The logprobs of a stream chunk's `count` tokens, the next after those already sent."""
        if self.parsed.config.logprobs is None or not count:
            return None
        at = outcome.logprob_at
        listed = logprob_objects.entries(request.tokens[at:at + count], request.logprobs[at:at + count])
        outcome.logprob_at += count
        out = self._logprobs(request, listed, outcome.text_offset)
        if not self.parsed.chat:
            outcome.text_offset += sum(len(t) for t in out["tokens"])
        return out

    async def stream(self):
        """Server-sent events: each choice's pieces as they come, tagged with its index; its finish
        chunk when it ends; then the usage (if asked) and [DONE]. Leaving early (a disconnect)
        cancels every choice's engine request."""
        created, outcomes = int(time.time()), [_Outcome() for _ in self.choices]
        kind = "chat.completion.chunk" if self.parsed.chat else "text_completion"
        events: asyncio.Queue = asyncio.Queue()

        def chunk(index: int, piece: str | None, finish: str | None = None, logprobs: dict | None = None,
                  role: bool = False, **extra) -> str:
            """One choice's chunk; `role`: a chat's first, which names the assistant."""
            if self.parsed.chat:
                delta = {} if piece is None else {"content": piece}
                if role:
                    delta = {"role": "assistant", **delta}
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
            body = {"id": self.ident, "object": kind, "created": created, "model": self.model_name, "choices": [choice],
                    **extra}
            if self.parsed.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far, in every chunk
                body["usage"] = self._usage(outcomes)
            elif self.parsed.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def produce(index: int, reply: Reply, bridge: LoopBridge) -> None:
            try:
                async for piece, count in self._events(reply, bridge, outcomes[index]):
                    events.put_nowait((index, piece, None, count))
                events.put_nowait((index, None, None, 0))
            except ApiError as exc:
                events.put_nowait((index, None, exc, 0))
            except Exception as exc:  # noqa: BLE001 - a bug: the stream ends with its error, never hangs
                events.put_nowait((index, None, ApiError(500, f"internal error ({type(exc).__name__})",
                                                         "internal_error"), 0))

        if self.parsed.chat:
            for index in range(len(self.choices)):
                yield chunk(index, "", role=True)
        tasks = [asyncio.ensure_future(produce(i, r, b)) for i, (r, b) in enumerate(self.choices)]
        echoed: set[int] = set()
        try:
            running = len(tasks)
            while running:
                index, piece, error, count = await events.get()
                request = self.choices[index][0].request
                if self.parsed.echo is not None and index not in echoed and error is None:
                    echoed.add(index)  # the prompt, once it is prefilled (its logprobs are known then)
                    yield chunk(index, self.parsed.echo, logprobs=self._logprobs(request, [], 0, echo=True))
                    outcomes[index].text_offset = len(self.parsed.echo)
                if error is not None:  # the status line is sent: report the error as an event, as OpenAI does
                    for reply, _ in self.choices:
                        reply.request.cancel()
                    failure = {"message": error.message, "type": error.kind, "code": error.code}
                    yield f"data: {json.dumps({'error': failure})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if piece is not None:
                    yield chunk(index, piece, logprobs=self._streamed_logprobs(request, outcomes[index], count))
                    continue
                running -= 1
                outcome = outcomes[index]
                yield chunk(index, None, outcome.finish_reason, trtspec=self._extension(outcome.stats))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()  # its _events cancels its engine request
        if self.parsed.include_usage:
            usage = {"id": self.ident, "object": kind, "created": created, "model": self.model_name, "choices": [],
                     "usage": self._usage(outcomes)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
