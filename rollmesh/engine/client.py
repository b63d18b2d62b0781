"""The one client every generating role uses: SGLang's HTTP API over one or more servers.

Nothing above this module knows whether a server is real SGLang or rollmesh's built-in engine
(`docs/sglang-api.md`). It owns:

- request ids: fixed width, so that SGLang's prefix matching on abort never hits another
  request (`s-4` would abort `s-42`);
- balancing (`routing`): a /generate with an affinity key (the agent loops pass the trajectory's
  group id) goes to the key's server by rendezvous hashing, so a GRPO group's siblings and every
  turn of a trajectory find their prompt in that engine's prefix cache, unless that server is
  loaded past a bound (`_pick`); without a key, or with `routing="least_loaded"`, to the healthy
  server with the fewest requests in flight. The client remembers where each rid runs so an
  abort reaches the right server;
- prefix-cache figures: per server, the prompt tokens sent and the tokens of them the engine
  found cached (`meta_info.cached_tokens`), for the agent workers' status (`cache_stats`);
- failure handling: connection errors and 5xx are retried with exponential back-off (on
  another server where there is one), 4xx are not; a server that fails is taken out of the
  rotation and put back when its /health answers 200 again;
- engine outages (`wait_s`, the rollout's `engine_wait_s`): a generation whose server dies
  (no answer, 503) or that finds no healthy server does not fail at once: it waits, probing
  the servers' /health with back-off, and is sent again, whole, to the first healthy one (the
  tokens the dead server made are lost with it; the caller's input is kept), for up to
  `wait_s` from when the outage began; only then does it fail (`EngineUnavailable`). The wait
  ends early, with `GenerationCancelled`, when the caller's `cancel` event is set (a weight
  sync). `wait_s = 0` (the default: control calls, the trainer's publisher) keeps the plain
  retries;
- the weight-update calls, fired without waiting as the contract requires (they block inside
  the collective): `start_*` returns a task, the caller joins the group or broadcasts, then
  awaits it;
- a router (`router_url`, `engine.router = "sglang-router"`): /generate goes to it, whole,
  and it picks the engine (SGLang's router is cache-aware: a group's siblings land where their
  prompt is cached); an outage behind it (its 503 "no available workers", an engine that died
  under a request it proxied, the router itself down) waits and fails over by the same
  `wait_s` rules, the router standing in for the servers. Every other call (pause, resume,
  abort, weight updates, flush_cache, health, info) still goes to each engine itself; an abort
  goes to every healthy engine, since the router alone knows where a request runs;
- applying the one rule for an engine's weight version (`rollmesh.engine.answers`, beside the
  errors and the /generate answer this client raises and returns).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from rollmesh.engine.answers import (  # the errors are the client's API too
    EngineError, EngineRequestError, EngineUnavailable, GenerateOutput, GenerationCancelled,
    NoHealthyServer, count_of, engine_version, error_message, router_upstream_gone,
    version_number,
)
from rollmesh.engine.auth import EngineKeys, key_for  # noqa: F401 - EngineKeys: the client's API
from rollmesh.runtime.log import get_logger

log = get_logger("rollmesh.engine.client")

RID_WIDTH = 24  # "r" + 23 hex digits: unique per client process and never a prefix of another


@dataclass
class _Server:
    url: str
    tp_size: int = 1
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0
    down_since: float = 0.0
    picked: int = 0  # when it was last chosen: ties go to the least recently chosen
    behind_logged: bool = False  # back after a failure with older weights (said once)
    # what its /generate answers said: requests, prompt tokens, of which cached (prefix cache)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


ROUTINGS = ("affinity", "least_loaded")


def rendezvous_weight(key: str, url: str) -> int:
    """The rendezvous (highest-random-weight) score of `url` for `key`: a hash of both, the
    same in every process (Python's own `hash` of a str is salted per process), so separate
    clients given the same server list prefer the same server for a key without talking, and a
    server that goes away moves only its own keys (each to its next-highest server)."""
    digest = hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class EngineClient:
    """Async client over a fixed list of servers. Use as `async with EngineClient(urls) as c`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        tp_sizes: Sequence[int] | None = None,
        retries: int = 3,
        backoff_s: float = 0.25,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 60.0,
        health_interval_s: float = 2.0,
        max_connections: int = 512,
        api_key: str | None = None,
        admin_key: str | None = None,
        wait_s: float = 0.0,
        router_url: str | None = None,
        routing: str = "affinity",
        affinity_load_factor: float = 1.25,
        affinity_slack: int = 32,
        lora_path: str | None = None,
    ):
        if not urls:
            raise ValueError("EngineClient needs at least one server URL")
        if routing not in ROUTINGS:
            raise ValueError(f"EngineClient routing {routing!r}: expected one of {ROUTINGS}")
        if not affinity_load_factor >= 1.0:
            raise ValueError(f"EngineClient affinity_load_factor {affinity_load_factor!r}: "
                             "expected a number >= 1")
        if affinity_slack < 0:
            raise ValueError(f"EngineClient affinity_slack {affinity_slack!r}: expected >= 0")
        sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(urls)
        self.servers = [_Server(u.rstrip("/"), tp) for u, tp in zip(urls, sizes, strict=True)]
        # /generate goes here instead, when set (module docstring); not one of `servers`: the
        # calls to every engine (pause, weights, info) never go through it
        self.router = _Server(router_url.rstrip("/")) if router_url else None
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_interval_s = health_interval_s
        self.max_connections = max_connections
        # The run's engine keys (rollmesh.engine.auth): `Authorization: Bearer` on every call,
        # the admin key on the admin routes where this client holds it
        self.api_key, self.admin_key = api_key, admin_key
        # How long a generation waits for a server through an outage (module docstring);
        # 0: no waiting, a generation fails after `retries` as any other call.
        self.wait_s = wait_s
        # Affinity routing and its load bound (`_pick`).
        self.routing = routing
        self.affinity_load_factor = affinity_load_factor
        self.affinity_slack = affinity_slack
        # The LoRA adapter every /generate names (SGLang's `lora_path`), None: the base model
        self.lora_path = lora_path
        self._wake_prober = asyncio.Event()  # a server went down: probe it soon
        self._probe_delay = health_interval_s
        self._server_up = asyncio.Event()  # replaced each time a server comes back
        # The newest weight version a generation reported. A server that comes back after a
        # failure with older weights (a restarted engine starts with the initial ones, until
        # the trainer sends it the current ones) stays out of the rotation while it is behind,
        # for up to `behind_hold_s`: what it generated would only be dropped as stale.
        self.version_floor: int | None = None
        self.behind_hold_s = 60.0
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._where: dict[str, _Server] = {}  # rid -> server running it
        self._rid_prefix = f"r{os.getpid() & 0xFFFFFF:06x}{random.getrandbits(32):08x}"
        self._rid_counter = itertools.count()
        self._picks = itertools.count(1)

    async def __aenter__(self) -> EngineClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
        )
        self._prober = asyncio.create_task(self._probe_down_servers())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
            self._prober = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- request ids and balancing -----------------------------------------------------------

    def new_rid(self) -> str:
        """A fixed-width id, unique in this client, never a prefix of another."""
        n = next(self._rid_counter)
        return f"{self._rid_prefix}{n:0{RID_WIDTH - len(self._rid_prefix)}x}"

    def _pick(self, exclude: set[str] = frozenset(),  # type: ignore[assignment]
              affinity: str | None = None) -> _Server:
        """The server for the next request: healthy, not in `exclude` (the servers this request
        already failed on) unless no other is healthy.

        Without an affinity key (or with routing "least_loaded"): the one with the fewest
        requests in flight, ties to the least recently chosen.

        With a key: the healthy servers in rendezvous order for the key (`rendezvous_weight`),
        and the first of them whose load is within the bound: its requests in flight are fewer
        than max(affinity_load_factor x the mean in flight counting this request,
        the fewest in flight + affinity_slack). The least-loaded server always qualifies, so a
        preferred server loaded past the bound gives way to the key's next server in the same
        order (the same one in every client: a large group's overflow still lands together).
        Both terms must be exceeded to pass a server over (as in sglang-router 0.3.2's
        cache_aware policy, which balances only past 64 more than the least loaded and 1.5x it,
        over all requests). The slack (32) rules while few requests are in flight: an agent
        worker with a few dozen running holds a few groups, one server may well get two or
        three more of them than the other, and splitting a group costs a second prefill of its
        prompt (benchmarks/affinity.py: a slack of 8 or 16 split enough groups to lose most of
        the gain). With hundreds in flight the factor rules: a server takes at most 1.25x the
        mean (bounded-load consistent hashing), which leaves room for the unevenness of hashing
        many groups, or groups of uneven sizes, without starving the others. Each client counts
        only its own requests; the engines see the sum over the workers, whose unevenness is
        independent. A dead preferred server is simply not a candidate: its keys go to their next
        server, the others' keys stay where they were."""
        candidates = [s for s in self.servers if s.healthy and s.url not in exclude]
        if not candidates:
            candidates = [s for s in self.servers if s.healthy]
        if not candidates:
            down = ", ".join(s.url for s in self.servers)
            raise NoHealthyServer(f"no healthy inference server (all down: {down})")
        if affinity is None or self.routing == "least_loaded" or len(candidates) == 1:
            server = min(candidates, key=lambda s: (s.in_flight, s.picked))
        else:
            fewest = min(s.in_flight for s in candidates)
            mean = (sum(s.in_flight for s in candidates) + 1) / len(candidates)
            bound = max(self.affinity_load_factor * mean, fewest + self.affinity_slack)
            ranked = sorted(candidates, key=lambda s: rendezvous_weight(affinity, s.url),
                            reverse=True)
            server = next((s for s in ranked if s.in_flight < bound),
                          min(candidates, key=lambda s: (s.in_flight, s.picked)))
        server.picked = next(self._picks)
        return server

    def _pick_for(self, path: str, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                  affinity: str | None = None) -> _Server:
        """Where a request for `path` goes: a /generate to the router where there is one
        (NoHealthyServer while it is down or has no healthy engine; the router chooses the
        engine, the affinity key is not used), else `_pick`."""
        if path != "/generate" or self.router is None:
            return self._pick(exclude, affinity)
        if not self.router.healthy:
            raise NoHealthyServer(f"the router {self.router.url} has no healthy engine "
                                  "or does not answer")
        return self.router

    def preferred(self, affinity: str) -> str:
        """The URL an affinity key goes to when no server is loaded (healthy servers only)."""
        healthy = [s for s in self.servers if s.healthy] or self.servers
        return max(healthy, key=lambda s: rendezvous_weight(affinity, s.url)).url

    def cache_stats(self) -> dict[str, dict[str, Any]]:
        """Per server URL, what its /generate answers from this client said: requests, prompt
        tokens, of which found in its prefix cache (`cached_tokens`), and their ratio
        (`hit_rate`, None before any prompt token). Counters since the client started."""
        return {s.url: {"requests": s.requests, "prompt_tokens": s.prompt_tokens,
                        "cached_tokens": s.cached_tokens,
                        "hit_rate": (round(s.cached_tokens / s.prompt_tokens, 4)
                                     if s.prompt_tokens else None)}
                for s in self._all_servers()}

    def _mark_down(self, server: _Server, reason: str) -> None:
        server.failures += 1
        if server.healthy:
            server.healthy, server.down_since = False, time.monotonic()
            log.warning("engine_down", server=server.url, reason=reason,
                        healthy=sum(s.healthy for s in self.servers))
            # probe it soon, then less and less often (a restart takes seconds or minutes)
            self._probe_delay = min(self.backoff_s, self.health_interval_s)
            self._wake_prober.set()

    @property
    def healthy_count(self) -> int:
        return sum(s.healthy for s in self.servers)

    async def _probe_down_servers(self) -> None:
        """Put servers that failed back into the rotation when their /health answers again:
        probed with back-off from `backoff_s` up to `health_interval_s` after a failure."""
        while True:
            try:
                await asyncio.wait_for(self._wake_prober.wait(), self._probe_delay)
                await asyncio.sleep(self._probe_delay)  # woken by a failure: give it a moment
            except asyncio.TimeoutError:
                pass
            self._wake_prober.clear()
            down = [s for s in self._all_servers() if not s.healthy]
            if not down:
                self._probe_delay = self.health_interval_s
                continue
            answers = list(await asyncio.gather(*(self._up(s) for s in down)))
            for i, (server, up) in enumerate(zip(down, answers)):
                if up and not server.healthy and await self._behind(server):
                    answers[i] = False
                elif up and not server.healthy:
                    server.healthy, server.failures, server.behind_logged = True, 0, False
                    log.info("engine_up", server=server.url,
                             down_s=round(time.monotonic() - server.down_since, 1))
            if any(answers):
                self._server_up.set()  # wake every generation waiting for a server
                self._server_up = asyncio.Event()
            self._probe_delay = min(self._probe_delay * 2, self.health_interval_s)

    def _all_servers(self) -> list[_Server]:
        return self.servers + ([self.router] if self.router is not None else [])

    async def _up(self, server: _Server) -> bool:
        """Whether a server that failed can take requests again: an engine's /health; the
        router's /readiness (200 while it has a healthy engine, 503 without: its /health says
        only that the router runs)."""
        if server is not self.router:
            return await self.health(server.url)
        try:
            await self._call(server, "GET", "/readiness", timeout_s=self.connect_timeout_s + 5)
            return True
        except EngineError:
            return False

    async def _behind(self, server: _Server) -> bool:
        """Whether a server that answers again holds weights older than the newest version a
        generation reported (`version_floor`), within `behind_hold_s` of its failure."""
        if self.version_floor is None or server is self.router:
            return False  # (the router picks the engine: rollmesh cannot hold one back)
        held = time.monotonic() - server.down_since
        try:
            info = await self._call(server, "GET", "/get_model_info",
                                    timeout_s=self.connect_timeout_s + 5)
            version = engine_version(info)
        except (EngineError, AttributeError, TypeError, ValueError):
            version = None
        if version is None:
            return False  # cannot tell: serve
        if version >= self.version_floor:
            return False
        if held > self.behind_hold_s:
            log.warning("engine_behind_served", server=server.url, version=version,
                        newest=self.version_floor, held_s=round(held, 1))
            return False
        if not server.behind_logged:
            log.warning("engine_behind", server=server.url, version=version,
                        newest=self.version_floor,
                        note="kept out of the rotation until it holds the current weights")
        server.behind_logged = True
        return True

    async def _sleep(self, seconds: float, cancel: asyncio.Event | None,
                     *events: asyncio.Event) -> None:
        """Sleep up to `seconds`; return early when `cancel` or one of `events` is set."""
        waits = [asyncio.ensure_future(e.wait()) for e in (cancel, *events) if e is not None]
        try:
            if waits:
                await asyncio.wait(waits, timeout=max(0.0, seconds))
            else:
                await asyncio.sleep(max(0.0, seconds))
        finally:
            for w in waits:
                w.cancel()
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled("cancelled while waiting for an inference server")

    async def _wait_for_server(self, deadline: float, cancel: asyncio.Event | None,
                               what: str, last: EngineError | None,
                               path: str = "", affinity: str | None = None) -> _Server:
        """A healthy server, waiting for one (the prober puts them back) until `deadline`."""
        waited = time.monotonic()
        logged = False
        while True:
            try:
                server = self._pick_for(path, affinity=affinity)
                if logged:
                    log.info("engine_wait_over", request=what, server=server.url,
                             waited_s=round(time.monotonic() - waited, 1))
                return server
            except NoHealthyServer:
                pass
            now = time.monotonic()
            if now >= deadline:
                down = ", ".join(s.url for s in self.servers)
                if path == "/generate" and self.router is not None:
                    down = f"the router {self.router.url} in front of {down}"
                raise EngineUnavailable(
                    f"{what}: no inference server could run it for {self.wait_s:g}s "
                    f"(rollout.engine_wait_s; down: {down})"
                    + (f"; last error: {last}" if last is not None else ""),
                    last.status if last else None, last.url if last else None)
            if not logged:
                log.info("engine_wait", request=what, limit_s=self.wait_s,
                            left_s=round(deadline - now, 1))
                logged = True
            await self._sleep(min(deadline - now, self.health_interval_s), cancel,
                              self._server_up)

    # -- HTTP ----------------------------------------------------------------------------------

    async def _call(self, server: _Server, method: str, path: str, body: Any = None,
                    timeout_s: float | None = None) -> Any:
        """One HTTP call. 4xx -> EngineRequestError; 5xx/connection -> EngineError."""
        assert self._session is not None, "use EngineClient inside 'async with'"
        url = f"{server.url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        key = key_for(path, self.api_key, self.admin_key)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            async with self._session.request(method, url, json=body, timeout=timeout,
                                             headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    cls = EngineRequestError if resp.status < 500 else EngineError
                    err = cls(f"{url}: HTTP {resp.status}: {error_message(text)}", resp.status,
                              server.url)
                    err.upstream_gone = (server is self.router and resp.status >= 500
                                         and router_upstream_gone(resp.status, text))
                    raise err
                if not text:
                    return None
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    return text
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise EngineError(f"{url}: {type(e).__name__}: {e}", None, server.url) from None

    async def _with_retries(self, path: str, body: dict[str, Any], timeout_s: float | None,
                            rid: str | None = None, *, wait_s: float = 0.0,
                            cancel: asyncio.Event | None = None,
                            affinity: str | None = None) -> tuple[_Server, Any]:
        """POST to the healthy server `_pick` chooses (for `affinity`, a key, where routing
        is "affinity"); on 5xx or no answer, back off and try another (the key's next one). `rid`
        is recorded while it runs, so `abort(rid)` finds its server.

        With `wait_s > 0` (generation through an outage): a server that does not answer (or
        answers 503) is taken out and the request goes, whole, to another healthy one, or
        waits for one, for up to `wait_s` from the moment the outage began for this request
        (a call that ran for a while before its server died starts a new outage). Other 5xx
        count against `retries` as before. `cancel` set: `GenerationCancelled` instead of
        sending it again or waiting further."""
        tried: set[str] = set()
        last: EngineError | None = None
        errors = 0  # answers with an error: the server is up but failing
        gone = 0  # the router's answers that the engine it chose is gone
        outage_since: float | None = None
        what = f"{path} {rid or ''}".strip()
        while True:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled(f"{what}: cancelled before it was sent again")
            try:
                server = self._pick_for(path, tried, affinity)
            except NoHealthyServer:
                if wait_s <= 0:
                    raise
                outage_since = outage_since or time.monotonic()
                server = await self._wait_for_server(outage_since + wait_s, cancel, what, last,
                                                     path, affinity)
            tried.add(server.url)
            server.in_flight += 1
            if rid is not None:
                self._where[rid] = server
            sent = time.monotonic()
            try:
                return server, await self._call(server, "POST", path, body, timeout_s)
            except EngineRequestError:
                raise
            except EngineError as e:
                last = e
                # (through a router: it has no healthy engine, or the one it chose died)
                unreachable = e.status is None or e.status == 503 or e.upstream_gone
                # no answer at all, or not serving: this server is down; but a router that
                # says the engine it chose is gone is up, and serves the other engines
                if unreachable and not e.upstream_gone:
                    self._mark_down(server, str(e))
            finally:
                server.in_flight -= 1
                if rid is not None:
                    self._where.pop(rid, None)
            now = time.monotonic()
            if unreachable and wait_s > 0:
                if outage_since is None or now - sent > self.health_interval_s:
                    outage_since = now  # it ran a while there: a new outage for it
                if now - outage_since >= wait_s:
                    raise EngineUnavailable(
                        f"{what}: no inference server could run it for {wait_s:g}s "
                        f"(rollout.engine_wait_s); last error: {last}", last.status, last.url)
                log.info("engine_failover", request=what, server=server.url,
                            healthy=self.healthy_count, error=str(last))
                if last.upstream_gone:
                    # The router keeps choosing the dead engine (the least loaded, or where
                    # the prompt is cached) until its health check takes it out (~2 s,
                    # rollmesh.engine.router): send again after a growing pause
                    gone += 1
                    await self._sleep(min(self.backoff_s * 2 ** (gone - 1),
                                          self.health_interval_s), cancel)
                continue  # the next pick is another healthy server, or waits for one
            errors += 1
            if errors > self.retries:
                raise EngineError(f"{what} failed after {errors} attempt(s): {last}",
                                  last.status, last.url)
            delay = self.backoff_s * 2 ** (errors - 1) * (0.5 + random.random())
            log.info("engine_retry", server=server.url, path=path, attempt=errors,
                     delay_s=round(delay, 3), error=str(last))
            await self._sleep(delay, cancel)

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                       rid: str | None = None, return_logprob: bool = True,
                       timeout_s: float | None = None, wait_s: float | None = None,
                       cancel: asyncio.Event | None = None,
                       affinity: str | None = None) -> GenerateOutput:
        """Generate from token ids; an aborted request returns its partial output.

        `affinity`: a key (a GRPO group's id) whose requests should share an engine's prefix
        cache: they go to the key's server unless it is loaded past the bound (`_pick`).

        Through an outage it waits up to `wait_s` (default: the client's) for a server, and
        a request whose server dies is sent again to another; `cancel` ends that wait with
        `GenerationCancelled` (module docstring)."""
        rid = rid or self.new_rid()
        body = {"rid": rid, "input_ids": list(input_ids), "sampling_params": sampling_params,
                "return_logprob": return_logprob}
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        server, out = await self._with_retries(
            "/generate", body, timeout_s, rid=rid,
            wait_s=self.wait_s if wait_s is None else wait_s, cancel=cancel, affinity=affinity)
        result = GenerateOutput.from_response(rid, server.url, out)
        server.requests += 1
        server.prompt_tokens += result.prompt_tokens
        server.cached_tokens += count_of(result.raw["meta_info"].get("cached_tokens"))
        version = version_number(result.weight_version)
        if version is not None:
            self.version_floor = max(self.version_floor or 0, version)
        return result

    async def abort(self, rid: str) -> bool:
        """Abort one request where it runs; False if the client has no such request. Sent
        through a router, it runs where the router chose: the abort goes to every healthy
        engine (an unknown rid is a no-op there: SGLang's and the built-in engine's)."""
        server = self._where.get(rid)
        if server is None:
            return False
        body = {"rid": rid, "abort_all": False}
        if server is self.router:
            await self._all("POST", "/abort_request", body)
            return True
        await self._call(server, "POST", "/abort_request", body, self.control_timeout_s)
        return True

    async def _all(self, method: str, path: str, body: Any = None, only_healthy: bool = True,
                   timeout_s: float | None = None, errors: bool = False) -> list[Any]:
        """The call on every (healthy) server; `errors`: each one's exception in its place."""
        servers = [s for s in self.servers if s.healthy or not only_healthy]
        return await asyncio.gather(*(self._call(s, method, path, body,
                                                 timeout_s or self.control_timeout_s)
                                      for s in servers), return_exceptions=errors)

    async def abort_all(self) -> None:
        await self._all("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def abort_while(self, pending: Any, first_s: float = 0.005,
                          every_s: float = 0.2) -> Any:
        """Await `pending` (a Pause sent to the rollouter in abort mode) while every engine's
        requests are aborted: after `first_s`, then after twice as long each time up to
        `every_s`, until it is answered. The rollouter cancels its workers' trajectories; a
        generation a worker sent before its Cancel arrived is cut by a later round. The workers
        do not abort on the engines themselves (they hold the API key only:
        rollmesh.engine.auth); an aborted request answers its partial output, which its
        trajectory keeps. An engine that does not answer is left out (down, or being
        restarted: its requests end with it)."""
        task = asyncio.ensure_future(pending)
        try:
            wait_s = first_s
            while True:
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    return task.result()
                wait_s = min(wait_s * 2, every_s)
                answers = await self._all("POST", "/abort_request",
                                          {"rid": "", "abort_all": True},
                                          timeout_s=min(self.control_timeout_s, 10.0), errors=True)
                for a in answers:
                    if isinstance(a, BaseException):
                        log.info("abort_all_failed", error=str(a)[:200])
        finally:
            if not task.done():
                task.cancel()

    async def pause(self, mode: str = "abort") -> None:
        """Pause every server; in `abort` mode each in-flight request returns its partial."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: expected abort, retract or in_place")
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._all("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache")

    async def release_memory(self, tags: list[str]) -> None:
        """SGLang's /release_memory_occupation on every server (colocated mode: the engines
        give the device back while the trainer steps; they must be idle)."""
        await self._all("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str]) -> None:
        await self._all("POST", "/resume_memory_occupation", {"tags": tags})

    # -- health and info -----------------------------------------------------------------------

    async def health(self, url: str, *, generate: bool = False) -> bool:
        server = next((s for s in self.servers if s.url == url.rstrip("/")), None) or _Server(url)
        try:
            await self._call(server, "GET", "/health_generate" if generate else "/health",
                             timeout_s=self.connect_timeout_s + 5)
            return True
        except EngineError:
            return False

    async def wait_healthy(self, timeout_s: float = 300.0, *, generate: bool = True) -> None:
        """Wait until every server answers /health_generate (what a launcher waits for)."""
        deadline = time.monotonic() + timeout_s
        pending = [s.url for s in self.servers]
        while pending:
            pending = [u for u in pending if not await self.health(u, generate=generate)]
            if pending and time.monotonic() > deadline:
                raise EngineError(f"not healthy after {timeout_s:g}s: {', '.join(pending)}")
            if pending:
                await asyncio.sleep(0.5)
        for server in self.servers:
            server.healthy = True

    async def model_info(self) -> list[dict[str, Any]]:
        return await self._all("GET", "/get_model_info")

    async def server_info(self) -> list[dict[str, Any]]:
        return await self._all("GET", "/get_server_info")

    async def server_info_each(self, timeout_s: float = 5.0) -> list[dict[str, Any] | None]:
        """/get_server_info of every server, None where one does not answer (for monitoring)."""
        async def one(server: _Server) -> dict[str, Any] | None:
            try:
                return await self._call(server, "GET", "/get_server_info", timeout_s=timeout_s)
            except EngineError:
                return None

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def weight_versions(self) -> list[str]:
        return [str(info.get("weight_version")) for info in await self.model_info()]

    # -- weights -------------------------------------------------------------------------------

    def rank_offsets(self) -> list[int]:
        """Engine i's first rank in the weight-update group: 1 + the TP sizes before it."""
        offsets, rank = [], 1
        for server in self.servers:
            offsets.append(rank)
            rank += server.tp_size
        return offsets

    @property
    def weight_group_world_size(self) -> int:
        return 1 + sum(s.tp_size for s in self.servers)

    def start_init_weights_update_group(self, master_address: str, master_port: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> asyncio.Task:
        """Fire /init_weights_update_group at every server; await the task after joining."""
        world = self.weight_group_world_size
        calls = [self._call(s, "POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": off,
            "world_size": world, "group_name": group_name, "backend": backend,
        }, self.control_timeout_s) for s, off in zip(self.servers, self.rank_offsets())]
        return asyncio.create_task(self._checked("init_weights_update_group", calls))

    def start_update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        weight_version: str, group_name: str = "weight_update_group", flush_cache: bool = True,
        abort_all_requests: bool = False, load_format: str | None = None,
    ) -> asyncio.Task:
        """Fire /update_weights_from_distributed; broadcast in `names` order, then await.
        `load_format="flattened_bucket"`: the tensors travel as one broadcast of their bytes
        back to back (SGLang's format; the built-in engine receives per tensor)."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                "weight_version": weight_version}
        if load_format is not None:
            body["load_format"] = load_format
        calls = [self._call(s, "POST", "/update_weights_from_distributed", body,
                            self.control_timeout_s) for s in self.servers]
        return asyncio.create_task(self._checked("update_weights_from_distributed", calls))

    async def update_weights_from_tensor(self, body_for: Any) -> None:
        """POST /update_weights_from_tensor to every server, `body_for(server)` each (its
        handles depend on the server's TP size); raises unless all succeed."""
        await self._checked("update_weights_from_tensor", [
            self._call(s, "POST", "/update_weights_from_tensor", body_for(s),
                       self.control_timeout_s) for s in self.servers])

    async def weight_update_session(self, begin: bool) -> None:
        """SGLang 0.5.23's /begin_weight_update or /end_weight_update on every server."""
        path = "/begin_weight_update" if begin else "/end_weight_update"
        await self._checked(path.lstrip("/"), [
            self._call(s, "POST", path, {}, self.control_timeout_s) for s in self.servers])

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._checked("destroy_weights_update_group", [
            self._call(s, "POST", "/destroy_weights_update_group", {"group_name": group_name},
                       self.control_timeout_s) for s in self.servers])

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._checked("update_weights_from_disk", [
            self._call(s, "POST", "/update_weights_from_disk", {
                "model_path": model_path, "weight_version": weight_version, "flush_cache": True,
            }, self.control_timeout_s) for s in self.servers])

    async def update_weight_version(self, new_version: str) -> None:
        await self._all("POST", "/update_weight_version",
                        {"new_version": new_version, "abort_all_requests": False},
                        only_healthy=False)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """SGLang's /load_lora_adapter on every server: the peft adapter directory `path`
        (adapter_config.json + adapter_model.safetensors, readable by the engines) under
        `name`; raises EngineError with the engine's message unless all succeed."""
        await self._checked("load_lora_adapter", [
            self._call(s, "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path},
                       self.control_timeout_s) for s in self.servers])

    async def unload_lora_adapter(self, name: str, *, missing_ok: bool = False) -> None:
        """SGLang's /unload_lora_adapter on every server; with `missing_ok`, a server that
        has no adapter of that name (SGLang's "LoRA with name ... does not exist") counts as
        done."""
        async def one(server: _Server) -> Any:
            try:
                return await self._call(server, "POST", "/unload_lora_adapter",
                                        {"lora_name": name}, self.control_timeout_s)
            except EngineRequestError as e:
                if missing_ok and f"LoRA with name {name} does not exist" in str(e):
                    return {"success": True}
                raise

        await self._checked("unload_lora_adapter", [one(s) for s in self.servers])

    async def _checked(self, what: str, calls: list[Any]) -> list[Any]:
        replies = await asyncio.gather(*calls)
        failed = [(s.url, r) for s, r in zip(self.servers, replies)
                  if not (isinstance(r, dict) and r.get("success"))]
        if failed:
            raise EngineError(f"{what} failed on {len(failed)} server(s): "
                              + "; ".join(f"{u}: {r}" for u, r in failed))
        return replies
