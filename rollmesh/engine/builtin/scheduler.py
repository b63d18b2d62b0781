"""The built-in engine's scheduler: one thread that owns the model, the KV cache and the batch.

Continuous batching: every loop iteration (1) applies the commands that arrived (new requests,
aborts, pause/continue, weight loads), (2) admits waiting requests up to the running limit and
prefills them (requests with prompts of equal length share one forward pass), and (3) runs one
batched decode step for every running request; finished requests leave the batch right away.
Aborts, pauses and weight loads therefore take effect between two decode steps. The decode
step is decoder.py's (a slot KV cache, CUDA graphs on CUDA) for Llama/Qwen2/Qwen3, the
model's own forward over kvcache.BatchKV for the rest (`decode_backend`).

A GRPO group's prompt is prefilled once (unless the prefix cache is disabled, SGLang's
`--disable-radix-cache`, which turns all sharing off): requests admitted together with the same
token ids (the n samples of one `n` > 1 request, admitted whole through their `prefill_key`, or
separate requests) get one row of the prefill forward, its KV copied into each one's batch row;
and every prefilled prompt's KV goes into the prefix cache (kvcache.PrefixCache), where a later
request finds its longest cached prefix and prefills only the rest (at least its last token,
whose logits it samples from), over that prefix as past; when the rest is that last token
alone (a GRPO group's later samples), the request joins the batch with the cached KV and the
next decode step runs the token, no prefill forward at all. Input log-probs (`logprob_start`) come
from the same prefill forward: it keeps the logits of the positions they need, and a request
asking them matches no further than `logprob_start`.

The cached KV is the current weights' own: every weight update clears the cache
(`weights_changing`). Requests kept running across an in-place update keep the KV they have
(their own batch rows, computed under the old weights, as SGLang's `in_place` pause keeps its
KV); a request admitted after the update never reads KV the old weights made, so its prompt is
encoded by the weights its tokens are attributed to.

Nothing else touches the model: the HTTP server talks to this thread through `submit` (commands
answered with a concurrent Future) and through each request's `on_progress` callback.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollmesh.engine.builtin.decoder import FastDecoder, SlotBatch, unsupported_reason
from rollmesh.engine.builtin.kvcache import (
    KV,
    BatchKV,
    PrefixCache,
    new_cache,
    past_cache,
    row_kv,
    select_rows,
)
from rollmesh.engine.builtin.sampling import SamplingParams, sample_rows, top_pairs
from rollmesh.runtime.log import get_logger

from rollmesh.config.engine_args import DEFAULT_PREFIX_CACHE_TOKENS  # noqa: E402
PREFILL_TOKEN_BUDGET = 8192  # tokens per prefill forward: bounds activation memory
INPUT_LOGPROB_CHUNK = 512  # prompt positions per float32 log-softmax for input log-probs


def abort_reason(message: str = "Aborted", status_code: int | None = None,
                 err_type: str | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    # Called on the scheduler thread when tokens were added (streaming) and when finished.
    on_progress: Callable[[Request], None]
    stream: bool = False
    received_at: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    generator: torch.Generator | None = None
    length: int = 0  # tokens of this request in the KV cache
    internal: bool = False  # the engine's own (warm-up, health check): not counted as served
    # Log-prob options (api.py sets them; SGLang's names in brackets):
    # first prompt position whose log-prob is reported [logprob_start_len], None = no input ones
    logprob_start: int | None = None
    top_logprobs_num: int = 0  # [top_logprobs_num]: per position, input and output
    return_text_in_logprobs: bool = False  # [return_text_in_logprobs]
    # The n samples of one request share a non-None key: admitted together, prefilled once.
    prefill_key: Any = None
    # [cached_tokens] prompt tokens this request did not prefill itself (prefix cache hit, or
    # the copy of another request's prefill row: then all but the last, as SGLang counts it).
    cached_tokens: int = 0
    # SGLang's layout: entry j is token input_ids[logprob_start + j]; the first is None.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # SGLang's weight_versions: [{"version", "start", "end"}], output tokens [start, end) per
    # weight version they were sampled with.
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    lora: str | None = None  # [lora_path] the LoRA adapter it names (lora.py), None: none

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Prompt:
    """One distinct prompt of an admission: prefilled once for all its requests."""

    ids: list[int]
    requests: list[Request]
    cached: int = 0  # leading tokens whose KV the prefix cache holds
    kv: KV | None = None  # their KV

    @property
    def suffix(self) -> int:
        return len(self.ids) - self.cached


@dataclass
class _Command:
    kind: str
    args: tuple = ()
    future: Future | None = None


class Scheduler:
    def __init__(self, model: Any, tokenizer: Any, *, weight_version: str,
                 max_running_requests: int, seed: int | None = None,
                 prefix_cache_tokens: int | None = DEFAULT_PREFIX_CACHE_TOKENS,
                 decode_backend: str = "auto", decode_graphs: bool | None = None) -> None:
        """prefix_cache_tokens: the prefix cache's size in tokens; None = no sharing of prompt
        prefills at all (`--disable-radix-cache`), 0 = share only among requests admitted
        together. decode_backend: fast (decoder.py's slot cache and step), hf (the model's own
        forward over BatchKV) or auto (fast where the architecture allows it); decode_graphs:
        capture the fast step as CUDA graphs (None: on CUDA)."""
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.weight_version = weight_version
        self.max_running = max_running_requests
        self.eos_ids = _eos_ids(model, tokenizer)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.log = get_logger("rollmesh.engine.builtin.scheduler")

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.fast = self._decoder(model, decode_backend, decode_graphs)
        self.kv: BatchKV | SlotBatch = BatchKV() if self.fast is None else SlotBatch(self.fast.kv)
        self.prefix_cache = (None if prefix_cache_tokens is None
                             else PrefixCache(prefix_cache_tokens))
        self.paused = False
        self.busy_loading = False
        # memory.py: tags given back (/release_memory_occupation); nothing is admitted meanwhile
        self.memory_released: set[str] = set()
        self.decode_steps = 0
        # Every token sampled for a client, aborted requests' included: what a caller can check
        # against the tokens it received (nothing generated twice, nothing generated and lost).
        self.generated_tokens = 0
        self.peak_running = 0
        self.prefill_forwards = 0  # model forwards over prompts (parallel sampling counts one)
        self.prefill_tokens = 0  # prompt tokens run through the model
        self.prefill_seconds = 0.0
        self.prompt_tokens = 0  # prompt tokens of the requests admitted
        self.cached_prompt_tokens = 0  # of which not prefilled (their cached_tokens)
        self.fatal: BaseException | None = None
        self.lora: Any = None  # the server's lora.LoRAState where LoRA is enabled
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ---- API for the server (any thread) ----
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def add(self, request: Request) -> None:
        self._commands.put(_Command("add", (request,)))

    def add_all(self, requests: list[Request]) -> None:
        """Queue several requests at once, in order (a batch, or a parallel-sampling group that
        must be admitted together to share its prefill)."""
        self._commands.put(_Command("add", tuple(requests)))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._commands.put(_Command("abort", (rid, abort_all)))

    def abort_request(self, request: Request) -> None:
        """Abort this very request (its client went away), whatever its rid."""
        self._commands.put(_Command("abort_one", (request,)))

    def submit(self, kind: str, *args: Any) -> Future:
        """pause(mode) | continue | flush | call(fn) | shutdown -> Future of the result."""
        fut: Future = Future()
        self._commands.put(_Command(kind, args, fut))
        return fut

    def stats(self) -> dict[str, Any]:
        return {
            "running_requests": len(self.running),
            "waiting_requests": len(self.waiting),
            "paused": self.paused,
            "memory_released": sorted(self.memory_released),
            "weight_version": self.weight_version,
            "decode_steps": self.decode_steps,
            "generated_tokens": self.generated_tokens,
            "peak_running_requests": self.peak_running,
            "prefill_forwards": self.prefill_forwards,
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache": self.prefix_cache is not None,
            "prefix_cache_tokens": self.prefix_cache.tokens if self.prefix_cache else 0,
            "prefix_cache_max_tokens": self.prefix_cache.max_tokens if self.prefix_cache else 0,
            "prefix_cache_evicted_tokens":
                self.prefix_cache.evicted_tokens if self.prefix_cache else 0,
        }

    def _decoder(self, model: Any, backend: str, graphs: bool | None) -> FastDecoder | None:
        if backend not in ("auto", "fast", "hf"):
            raise ValueError(f"decode backend must be auto, fast or hf, got {backend!r}")
        reason = "decode backend hf asked" if backend == "hf" else unsupported_reason(model)
        if reason is not None and backend == "fast":
            raise ValueError(f"decode backend fast: {reason}")
        if reason is not None:
            self.log.info("decode_backend", backend="hf", reason=reason)
            return None
        fast = FastDecoder(model, slots=self.max_running, graphs=graphs)
        self.log.info("decode_backend", backend="fast", cuda_graphs=fast.graphs)
        return fast

    def weights_changing(self) -> None:
        """Called (scheduler thread) before the weights change: cached KV is theirs, and the
        fast decoder's fused weight copies are rebuilt before its next step."""
        if self.fast is not None:
            self.fast.stale = True
        if self.prefix_cache is not None and self.prefix_cache.tokens:
            self.log.info("prefix_cache_cleared", reason="weight update",
                          tokens=self.prefix_cache.tokens)
            self.prefix_cache.clear()

    def release_kv(self) -> None:
        """(scheduler thread, idle) Drop every KV allocation: the batch's, the prefix cache's,
        and the fast decoder's slot cache, graphs and fused copies (rebuilt at the next step)."""
        self.kv.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.fast is not None:
            self.fast.release_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- the loop (scheduler thread only below this line) ----
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop:
                    held = self.paused or bool(self.memory_released)
                    idle = held or not (self.running or self.waiting)
                    self._apply_commands(block=idle)
                    if self._stop or self.paused or self.memory_released:
                        continue
                    self._admit()
                    if self.running:
                        self._decode_step()
        except BaseException as e:  # the thread must not die silently: health turns 503
            self.fatal = e
            self.log.exception("scheduler_crashed")
            self._finish_all(abort_reason(f"engine error: {e}", 500, type(e).__name__))
        finally:
            self._refuse_pending()

    def _refuse_pending(self) -> None:
        """After the loop ended, answer whatever is still queued instead of leaving it hanging."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd.kind == "add":
                for r in cmd.args:
                    self._finish(r, abort_reason("engine stopped", 503, "ServiceUnavailable"))
            elif cmd.future is not None and not cmd.future.cancelled():
                cmd.future.set_exception(RuntimeError("engine stopped"))

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            # A command runs even if its caller gave up waiting (a weight broadcast cannot be
            # skipped once announced); only the answer is then dropped.
            try:
                result = self._apply(cmd)
                if cmd.future is not None and not cmd.future.cancelled():
                    cmd.future.set_result(result)
            except Exception as e:
                if cmd.future is None:
                    raise
                if not cmd.future.cancelled():
                    cmd.future.set_exception(e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Command) -> Any:
        if cmd.kind == "add":
            self.waiting.extend(cmd.args)
        elif cmd.kind == "abort":
            rid, abort_all = cmd.args
            # SGLang: an abort goes through only if some request has exactly this rid (or
            # abort_all); then every request whose rid starts with it is aborted.
            if abort_all or any(r.rid == rid for r in (*self.waiting, *self.running)):
                self._abort(lambda r: abort_all or r.rid.startswith(rid))
        elif cmd.kind == "abort_one":
            self._abort(lambda r: r is cmd.args[0])
        elif cmd.kind == "pause":
            (mode,) = cmd.args
            if mode == "abort":
                self._abort(lambda r: True)
            # in_place and retract both keep the requests and their KV where they are.
            self.paused = True
            self.log.info("generation_paused", mode=mode, running=len(self.running))
        elif cmd.kind == "continue":
            self.paused = False
            self.log.info("generation_continued", running=len(self.running),
                          waiting=len(self.waiting))
        elif cmd.kind == "flush":
            if self.running or self.waiting:
                return False  # SGLang's flush refuses while requests are pending
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            return True
        elif cmd.kind == "call":
            (fn,) = cmd.args
            self.busy_loading = True
            try:
                return fn(self)
            finally:
                self.busy_loading = False
        elif cmd.kind == "shutdown":
            self._finish_all(abort_reason("server shutting down", 503, "ServiceUnavailable"))
            self._stop = True
        else:
            raise ValueError(f"unknown scheduler command {cmd.kind!r}")
        return None

    def _abort(self, match: Callable[[Request], bool]) -> None:
        for r in [r for r in self.waiting if match(r)]:
            self.waiting.remove(r)
            self._finish(r, abort_reason())
        hit = [r for r in self.running if match(r)]
        for r in hit:
            self._finish(r, abort_reason())
        if hit:
            self._drop_finished()
            self.log.info("requests_aborted", count=len(hit), rids=[r.rid for r in hit][:8])

    def _finish_all(self, reason: dict[str, Any]) -> None:
        for r in [*self.waiting, *self.running]:
            if not r.finished:
                self._finish(r, reason)
        self.waiting.clear()
        self.running.clear()
        self.kv.clear()

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        r.finish_reason = reason
        r.weight_version = self.weight_version
        r.on_progress(r)

    # ---- admission and prefill ----
    def _admit(self) -> None:
        admitted: list[Request] = []
        while self.waiting:
            # A parallel-sampling group is admitted whole (it shares one prefill); a group larger
            # than the running limit goes in alone once the batch is empty.
            group = self._next_group()
            room = self.max_running - len(self.running) - len(admitted)
            if len(group) > room and (room < 1 or self.running or admitted):
                break
            for _ in group:
                self.waiting.popleft()
            for r in group:
                refused = (None if self.lora is None or r.internal
                           else self.lora.admissible(r.lora))
                if refused is not None:  # the adapter changed while it waited (lora.py)
                    self._finish(r, abort_reason(refused, 400, "BadRequest"))
                    continue
                if r.max_new_tokens == 0:
                    self._score(r)  # prefill only: its input log-probs, if asked
                    self._finish(r, {"type": "length", "length": 0})
                    continue
                if r.params.sampling_seed is not None:
                    r.generator = torch.Generator(device=self.device)
                    r.generator.manual_seed(r.params.sampling_seed)
                admitted.append(r)
        if not admitted:
            return
        by_suffix: dict[int, list[_Prompt]] = {}
        joining: list[_Prompt] = []
        for p in self._prompts(admitted):
            if p.suffix == 1 and p.cached:
                joining.append(p)  # all but the last token cached: no prefill forward at all
            else:
                by_suffix.setdefault(p.suffix, []).append(p)
        if joining:
            self._join_cached(joining)
        for suffix, prompts in by_suffix.items():
            per_forward = max(1, PREFILL_TOKEN_BUDGET // suffix)  # distinct prompts
            for i in range(0, len(prompts), per_forward):
                self._prefill(prompts[i : i + per_forward])

    def _prompts(self, admitted: list[Request]) -> list[_Prompt]:
        """The distinct prompts of the admitted requests (each its own with sharing off), each
        with the longest prefix the cache holds for it."""
        if self.prefix_cache is None:
            return [_Prompt(r.input_ids, [r]) for r in admitted]
        by_ids: dict[tuple[int, ...], _Prompt] = {}
        for r in admitted:
            key = tuple(r.input_ids)
            if key in by_ids:
                by_ids[key].requests.append(r)
            else:
                by_ids[key] = _Prompt(r.input_ids, [r])
        for p in by_ids.values():
            # The last token is always prefilled (its logits give the first output token), and
            # input log-probs need the logits of the positions from logprob_start on.
            limit = min([len(p.ids) - 1] + [r.logprob_start for r in p.requests
                                            if r.logprob_start is not None])
            if limit > 0:
                p.cached, p.kv = self.prefix_cache.match(p.ids, limit)
        return list(by_ids.values())

    def _next_group(self) -> list[Request]:
        first = self.waiting[0]
        if first.prefill_key is None:
            return [first]
        group = []
        for r in self.waiting:
            if r.prefill_key != first.prefill_key:
                break
            group.append(r)
        return group

    def _prefill(self, prompts: list[_Prompt]) -> None:
        """One forward over the prompts' uncached tokens (as many for each), on their cached
        prefixes as past; then each prompt's KV row is copied to its requests' batch rows."""
        start = time.perf_counter()
        suffix = prompts[0].suffix
        keep = max([len(p.ids) - r.logprob_start for p in prompts for r in p.requests
                    if r.logprob_start is not None], default=1)
        ids = torch.tensor([p.ids[p.cached:] for p in prompts], device=self.device)
        extra: dict[str, Any] = {}
        past = [p.cached for p in prompts]
        if max(past):
            cache = past_cache([p.kv for p in prompts], past)
            lengths = torch.tensor(past, device=self.device)
            extra["position_ids"] = lengths[:, None] + torch.arange(suffix, device=self.device)
            if min(past) < max(past):  # rows right-aligned: left padding masked, as decoding
                slots = torch.arange(max(past) + suffix, device=self.device)
                extra["attention_mask"] = slots[None, :] >= (max(past) - lengths)[:, None]
            for p in prompts:
                p.kv = None  # the past holds them now
        else:
            cache = new_cache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=keep, **extra)
        self.prefill_forwards += 1
        self.prefill_tokens += ids.numel()
        logits = out.logits
        done: dict[tuple[int, int, int], Request] = {}
        for u, p in enumerate(prompts):
            length = len(p.ids)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(p.ids, row_kv(cache, u, length))
            for k, r in enumerate(p.requests):
                r.length = length
                r.cached_tokens = p.cached if k == 0 else max(p.cached, length - 1)
                self.prompt_tokens += length
                self.cached_prompt_tokens += r.cached_tokens
                if r.logprob_start is None:
                    continue
                same = done.get((u, r.logprob_start, r.top_logprobs_num))
                if same is not None:
                    r.input_logprobs = list(same.input_logprobs)
                    r.input_top_logprobs = list(same.input_top_logprobs)
                else:
                    self._input_logprobs(r, logits[u, keep - (length - r.logprob_start):])
                    done[(u, r.logprob_start, r.top_logprobs_num)] = r
        rows = [u for u, p in enumerate(prompts) for _ in p.requests]
        requests = [r for p in prompts for r in p.requests]
        index = torch.tensor(rows, device=self.device)
        if len(rows) != len(prompts):
            select_rows(cache, index)
        self._merge(cache, requests)
        self.prefill_seconds += time.perf_counter() - start
        self._sample_and_advance(logits[:, -1, :].index_select(0, index),
                                 first_row=len(self.running) - len(requests))

    def _join_cached(self, prompts: list[_Prompt]) -> None:
        """Prompts cached but for their last token join the batch with the cached KV as their
        rows: the next decode step runs that token (as every row's newest token) and samples
        their first output token from its logits. (A forward of its own would cost a whole
        pass over the weights for one token per row.)"""
        start = time.perf_counter()
        cache = past_cache([p.kv for p in prompts], [p.cached for p in prompts])
        rows = [u for u, p in enumerate(prompts) for _ in p.requests]
        requests = [r for p in prompts for r in p.requests]
        if len(rows) != len(prompts):
            select_rows(cache, torch.tensor(rows, device=self.device))
        for p in prompts:
            p.kv = None
            for r in p.requests:
                r.length = p.cached
                r.cached_tokens = p.cached
                self.prompt_tokens += len(p.ids)
                self.cached_prompt_tokens += p.cached
                self.prefill_tokens += 1  # its last prompt token, in the decode step
                if r.logprob_start is not None:  # == len - 1 (the match stops there): no values
                    r.input_logprobs = [None]
                    if r.top_logprobs_num > 0:
                        r.input_top_logprobs = [None]
        self._merge(cache, requests)
        self.prefill_seconds += time.perf_counter() - start

    def _merge(self, cache: Any, requests: list[Request]) -> None:
        if self.fast is None:
            self.kv.merge(cache)
        else:
            self.kv.merge(cache, [r.length for r in requests])
        self.running.extend(requests)

    def _score(self, r: Request) -> None:
        """A request with max_new_tokens 0 generates nothing; with input log-probs asked (a
        prompt scored, as SGLang's prefill-only requests) one forward computes them."""
        if r.logprob_start is None or r.logprob_start >= len(r.input_ids):
            return
        keep = len(r.input_ids) - r.logprob_start
        out = self.model(input_ids=torch.tensor([r.input_ids], device=self.device),
                         logits_to_keep=keep)
        self.prefill_forwards += 1
        self.prefill_tokens += len(r.input_ids)
        self._input_logprobs(r, out.logits[0])

    @staticmethod
    def _input_logprobs(r: Request, logits: torch.Tensor) -> None:
        """SGLang's input log-probs from the logits of positions logprob_start..L-1: position p
        scores token p + 1; the first entry (token logprob_start) is None, the last position
        (which scores the first output token) is not an input log-prob. Raw log-softmax: no
        temperature, as SGLang's logits processor by default."""
        targets = torch.tensor(r.input_ids[r.logprob_start + 1 :], device=logits.device)
        values: list[float | None] = [None]
        top: list[list[tuple[float, int]] | None] = [None]
        # In chunks of positions: a long prompt's float32 log-probs over a large vocabulary
        # would otherwise be gigabytes at once.
        for s in range(0, len(targets), INPUT_LOGPROB_CHUNK):
            logprobs = torch.log_softmax(logits[s : s + INPUT_LOGPROB_CHUNK].float(), dim=-1)
            chunk = targets[s : s + INPUT_LOGPROB_CHUNK]
            logprobs = logprobs[: len(chunk)]
            values += logprobs.gather(1, chunk[:, None])[:, 0].tolist()
            if r.top_logprobs_num > 0:
                top += top_pairs(logprobs, [r.top_logprobs_num] * len(chunk))
        r.input_logprobs = values
        if r.top_logprobs_num > 0:
            r.input_top_logprobs = top

    # ---- decoding ----
    def _decode_step(self) -> None:
        if self.fast is not None:
            self._fast_step()
            return
        rows = self.running
        seq_len = self.kv.seq_len
        # A row's newest token: its last output token, or its prompt's last one when it
        # joined with the rest of its prompt cached (_join_cached).
        last = torch.tensor([[r.output_ids[-1] if r.output_ids else r.input_ids[-1]]
                             for r in rows], device=self.device)
        lengths = torch.tensor([r.length for r in rows], device=self.device)
        # Row r's tokens sit in the last length_r slots (plus the new one): left padding masked.
        slots = torch.arange(seq_len + 1, device=self.device)
        mask = slots[None, :] >= (seq_len - lengths)[:, None]
        out = self.model(input_ids=last, attention_mask=mask, position_ids=lengths[:, None],
                         past_key_values=self.kv.cache, use_cache=True, logits_to_keep=1)
        for r in rows:
            r.length += 1
        self.peak_running = max(self.peak_running, len(rows))
        self._sample_and_advance(out.logits[:, -1, :], first_row=0)
        self.decode_steps += 1

    def _fast_step(self) -> None:
        """One decode step on the fast path: sampling runs inside it for the rows whose
        parameters it covers exactly; the others (penalties, banned tokens, logit_bias, top
        log-probs, their own seed) go through sample_rows on the logits, as on the HF path."""
        rows = self.running
        ps = [r.params for r in rows]
        tokens, logprobs, logits = self.fast.step(
            self.kv.slots, [r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in rows],
            [r.length for r in rows], [0.0 if p.greedy else p.temperature for p in ps],
            [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps], self.generator)
        for r in rows:
            r.length += 1
        self.peak_running = max(self.peak_running, len(rows))
        tops: list[list] = [[] for _ in rows]
        general = [i for i, r in enumerate(rows) if self._general(r)]
        if general:
            sub = [rows[i] for i in general]
            s = self._sample(logits.index_select(0, torch.tensor(general, device=logits.device)),
                             sub)
            for j, i in enumerate(general):
                tokens[i], logprobs[i], tops[i] = s.tokens[j], s.logprobs[j], s.top[j]
        self._advance(rows, tokens, logprobs, tops)
        self.decode_steps += 1

    def _general(self, r: Request) -> bool:
        p = r.params
        return bool(p.penalised or p.logit_bias or r.top_logprobs_num or r.generator is not None
                    or self._banned(r))

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> Any:
        banned = [self._banned(r) for r in rows]
        penalised = any(r.params.penalised for r in rows)
        return sample_rows(logits, [r.params for r in rows], [r.generator for r in rows],
                           self.generator, banned=banned,
                           outputs=[r.output_ids for r in rows] if penalised else None,
                           top_logprobs=[r.top_logprobs_num for r in rows])

    def _sample_and_advance(self, logits: torch.Tensor, first_row: int) -> None:
        rows = self.running[first_row:]
        s = self._sample(logits, rows)
        self._advance(rows, s.tokens, s.logprobs, s.top)

    def _advance(self, rows: list[Request], tokens: list[int], logprobs: list[float],
                 tops: list[list]) -> None:
        self.generated_tokens += sum(not r.internal for r in rows)
        for r, token, logprob, top in zip(rows, tokens, logprobs, tops):
            # The token itself last: a response built meanwhile on the event loop copies
            # output_ids first, and finds log-probs and weight-version spans for all of them.
            r.output_logprobs.append(logprob)
            if r.top_logprobs_num > 0:
                r.output_top_logprobs.append(top)
            spans, count = r.weight_versions, len(r.output_ids) + 1
            if spans and spans[-1]["version"] == self.weight_version:
                spans[-1]["end"] = count
            else:
                spans.append({"version": self.weight_version, "start": count - 1, "end": count})
            r.weight_version = self.weight_version  # every streamed chunk carries it
            r.output_ids.append(token)
            reason = self._check_finished(r)
            if reason is not None:
                self._finish(r, reason)
            elif r.stream:
                r.on_progress(r)
        if any(r.finished for r in rows):
            self._drop_finished()

    def _banned(self, r: Request) -> list[int]:
        if len(r.output_ids) >= r.params.min_new_tokens or r.params.ignore_eos:
            return []
        return sorted(self.eos_ids | set(r.params.stop_token_ids))

    def _check_finished(self, r: Request) -> dict[str, Any] | None:
        # SGLang's order: length first, then stop tokens (unless ignore_eos), then stop strings.
        if len(r.output_ids) >= r.max_new_tokens:
            return {"type": "length", "length": r.max_new_tokens}
        token = r.output_ids[-1]
        if not r.params.ignore_eos and (token in self.eos_ids or token in r.params.stop_token_ids):
            return {"type": "stop", "matched": token}
        if r.params.stop:
            window = max(len(s.encode()) for s in r.params.stop) + 1
            tail = self.tokenizer.decode(r.output_ids[-window:])
            for s in r.params.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.finished]
        self.running = [self.running[i] for i in keep]
        self.kv.select(keep, [r.length for r in self.running])


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
