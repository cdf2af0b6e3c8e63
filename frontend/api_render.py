"""OpenAI response bodies (as JSON-ready dicts) from a request's engine outputs, whole or as stream chunks."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from itertools import accumulate

from transformers.convert_slow_tokenizer import bytes_to_unicode

from frontend.api_errors import APIError
from frontend.api_params import Job, SamplingRequest
from frontend.output_processor import CompletionOutput, RequestOutput
from frontend.reasoning import ReasoningStream, split_reasoning

# Byte-level BPE vocabularies (Qwen2's) write each byte as one printable character; this maps them back.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
Entry = tuple[str, float, list[int]]  # a logprob entry: (token text, logprob, the token's own UTF-8 bytes)


class Renderer:
    """A request's engine outputs as its response, or as stream chunks of what is new. Choice index = prompt index
    * n + sample index. Outputs are cumulative and their text only grows (stop strings are held back, never
    retracted), so a delta is a suffix past what was sent."""

    object: str  # of a stream chunk
    done: str | None = "data: [DONE]\n\n"  # the stream's last line

    def __init__(self, response_id: str, model: str, jobs: list[Job], tokenizer, request: SamplingRequest):
        self.id, self.model, self.jobs, self.tokenizer, self.request = response_id, model, jobs, tokenizer, request
        self.created = int(time.time())
        self.n = jobs[0].params.n
        self._sent: dict[int, tuple[int, int]] = {}  # choice -> (chars, tokens) already streamed
        self._done: set[int] = set()

    def deltas(self, job: int, out: RequestOutput) -> list[tuple[int, CompletionOutput, int, int]]:
        """(choice index, output, chars sent before, tokens sent before) for each choice with news."""
        news = []
        for o in out.outputs:
            index = job * self.n + o.index
            chars, tokens = self._sent.get(index, (0, 0))
            new_tokens = o.logprobs is not None and len(o.token_ids) > tokens
            if index in self._done or not (len(o.text) > chars or o.finish_reason or new_tokens):
                continue
            news.append((index, o, chars, tokens))
            self._sent[index] = (len(o.text), len(o.token_ids))
            if o.finish_reason is not None:
                self._done.add(index)
        return news

    def entry(self, token_id: int, logprob: float | None) -> Entry:
        if self.request.return_tokens_as_token_ids:
            return f"token_id:{token_id}", logprob, list(f"token_id:{token_id}".encode())
        # A token holding part of a character decodes to U+FFFD; its own bytes, joined with the next token's,
        # give the character. Whole characters, or a vocabulary that is not byte-level: the text's bytes.
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if "\ufffd" in text else None
        if isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return text, logprob, [_BYTE_OF_CHAR[c] for c in piece]
        return text, logprob, list(text.encode())

    def logprob_rows(self, tokens: list[int], logprobs: list[dict[int, float]]) -> list[tuple[Entry, list[Entry]]]:
        """(each token's entry, its top-k entries) of tokens and their {token id: logprob} maps."""
        k = self.jobs[0].params.logprobs or 0
        return [
            (self.entry(token, lps[token]), [self.entry(t, lp) for t, lp in _top(lps, k)])
            for token, lps in zip(tokens, logprobs)
        ]

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: logprob, rank, decoded_token} of
        it and the top prompt_logprobs tokens."""
        if self.request.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        rows: list[dict | None] = [None]
        for token, lps, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_ranks[1:]):
            top = _top(lps, self.request.prompt_logprobs)
            ranks = {t: i + 1 for i, (t, _) in enumerate(top)} | {token: rank}
            rows.append(
                {
                    str(t): {"logprob": lp, "rank": ranks[t], "decoded_token": self.entry(t, lp)[0]}
                    for t, lp in [(token, lps[token]), *top]
                }
            )
        return rows

    def usage(self, finals: list[RequestOutput]) -> dict:
        """Prompt tokens once per prompt (not per sample); completion tokens of every sample."""
        prompt = sum(len(job.token_ids) for job in self.jobs)
        completion = 0 if self.request.prompt_only else sum(len(o.token_ids) for out in finals for o in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_so_far(self, job: int, o: CompletionOutput | None) -> dict | None:
        """A stream chunk's usage under continuous_usage_stats: its prompt and its sample's tokens so far."""
        if not self.request.continuous_usage:
            return None
        prompt, completion = len(self.jobs[job].token_ids), len(o.token_ids) if o is not None else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, choices: list[dict], usage: dict | None = None, object: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": object or self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def opening(self) -> list[dict]:
        return []

    def closing(self, finals: list[RequestOutput]) -> list[dict]:
        """What the stream sends after every choice has finished."""
        return [self.chunk([], self.usage(finals))] if self.request.include_usage else []

    def event(self, chunk: dict) -> str:
        return f"data: {json.dumps(chunk)}\n\n"

    def error(self, exc: APIError) -> dict:
        """An error after the 200 header is out: it travels in the stream, as OpenAI's does."""
        return exc.body()


class CompletionRenderer(Renderer):
    object = "text_completion"  # a whole completion too: OpenAI uses one shape for both

    def choice(self, job: int, out: RequestOutput, index: int, o: CompletionOutput, chars: int, tokens: int) -> dict:
        """A choice, or the part of it past `chars` and `tokens` (the echoed prompt comes with the first part)."""
        prompt, first = self.jobs[job], chars == tokens == 0
        echo = ""
        if self.request.echo:
            echo = self.tokenizer.decode(prompt.token_ids) if prompt.text is None else prompt.text
        text = (echo if first else "") + ("" if self.request.prompt_only else o.text[chars:])
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": o.finish_reason}
        if self.request.prompt_only and o.finish_reason is not None:
            choice["finish_reason"] = "length"  # of the 0 tokens asked for
        if o.logprobs is not None:
            rows = [] if self.request.prompt_only else self.logprob_rows(o.token_ids[tokens:], o.logprobs[tokens:])
            offsets = list(accumulate([len(entry[0]) for entry, _ in rows], initial=len(echo) + chars))[:-1]
            if self.request.echo and first:  # the prompt's own rows: its first token has no logprob
                prompt_rows = [(self.entry(prompt.token_ids[0], None), None)]
                prompt_rows += self.logprob_rows(prompt.token_ids[1:], out.prompt_logprobs[1:])
                prompt_offsets = accumulate([len(entry[0]) for entry, _ in prompt_rows], initial=0)
                rows, offsets = prompt_rows + rows, list(prompt_offsets)[:-1] + offsets
            # reversed: of top tokens that decode to the same text, the likeliest is written last and kept
            choice["logprobs"] = {
                "tokens": [entry[0] for entry, _ in rows],
                "token_logprobs": [entry[1] for entry, _ in rows],
                "top_logprobs": [None if top is None else {t: lp for t, lp, _ in reversed(top)} for _, top in rows],
                "text_offset": offsets,
            }
        if self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out)
        return choice

    def chunks(self, job: int, out: RequestOutput) -> list[dict]:
        return [
            self.chunk([self.choice(job, out, *delta)], self.usage_so_far(job, delta[1]))
            for delta in self.deltas(job, out)
        ]

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = [
            self.choice(i, out, i * self.n + o.index, o, 0, 0) for i, out in enumerate(finals) for o in out.outputs
        ]
        return self.chunk(choices, self.usage(finals))


class ChatRenderer(Renderer):
    object = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, jobs: list[Job], tokenizer, request: SamplingRequest):
        super().__init__(response_id, model, jobs, tokenizer, request)
        self.tool_format = request.tool_format if request.parses_tool_calls else None
        # choice -> its content (and tool calls, when the answer is parsed for them); its reasoning, if parsed
        self.streams = defaultdict(self.tool_format.stream if self.tool_format else _ContentStream)
        self.reasoning = defaultdict(ReasoningStream) if request.reasoning_parser else None

    def logprobs(self, o: CompletionOutput, start: int) -> dict | None:
        if o.logprobs is None:
            return None
        return {
            "content": [
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": raw,
                    "top_logprobs": [{"token": t, "logprob": l, "bytes": b} for t, l, b in top],
                }
                for (text, lp, raw), top in self.logprob_rows(o.token_ids[start:], o.logprobs[start:])
            ]
        }

    def opening(self) -> list[dict]:
        """OpenAI's first chunk of each choice carries the role and no content."""
        return [
            self.chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                self.usage_so_far(0, None),
            )
            for i in range(len(self.jobs) * self.n)
        ]

    def chunks(self, job: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for i, o, _, tokens in self.deltas(job, out):
            finish, text, delta = o.finish_reason, o.text, {"role": None}
            if self.reasoning is not None:
                thought, text = self.reasoning[i].update(o.text, finish is not None)
                delta["reasoning_content"] = delta["reasoning"] = thought or None
            content, tool_deltas = self.streams[i].update(text, finish is not None)
            delta["content"] = content or None
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
            if finish == "stop" and self.streams[i].called:
                finish = "tool_calls"
            if not (content or tool_deltas or delta.get("reasoning") or finish or o.logprobs):
                continue  # held back: it may begin a call or a marker
            chunks.append(
                self.chunk(
                    [{"index": i, "delta": delta, "logprobs": self.logprobs(o, tokens), "finish_reason": finish}],
                    self.usage_so_far(job, o),
                )
            )
        return chunks

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for o in finals[0].outputs:
            message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if self.reasoning is not None:
                thought, message["content"] = split_reasoning(o.text, final=True)
                message["reasoning_content"] = message["reasoning"] = thought
            if self.tool_format is not None:
                message["content"], calls = self.tool_format.parse(message["content"])
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                {"index": o.index, "message": message, "logprobs": self.logprobs(o, 0), "finish_reason": finish}
            )
        response = self.chunk(choices, self.usage(finals), "chat.completion")
        if self.request.prompt_logprobs is not None:  # vLLM's place for them in a chat: the response's
            response["prompt_logprobs"] = self.vllm_prompt_logprobs(finals[0])
        return response


class _ContentStream:
    """The content of an answer not parsed for tool calls, as the deltas of its cumulative text."""

    called = False

    def __init__(self) -> None:
        self.sent = 0

    def update(self, text: str, final: bool) -> tuple[str, list]:
        new, self.sent = text[self.sent :], len(text)
        return new, []


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]
