"""The engines' two API keys: who may generate, and who may change what an engine serves.

SGLang takes two keys (`--api-key`, `--admin-api-key`; `srt/utils/auth.py`
`decide_request_auth`, 0.5.23). Its routes marked ADMIN_OPTIONAL (`@auth_level` in
`srt/entrypoints/http_server.py`: weights, the weight version, pause and continue, abort, the
cache flush, memory release, LoRA loading...) then take the admin key only; every other route
takes the API key only (the admin key does not open `/generate`); /health*, /ready* and
/metrics* take none. The built-in engine decides the same way (`decide`).

A run has one key of each (`RUN/keys/engine.token`, `RUN/keys/engine-admin.token`, 0600):

- the API key (generation) goes to the roles that generate: the rollouter (it probes /health)
  and the agent workers, and to the router, which proxies /generate only;
- the admin key goes to the roles that change the engines: the trainer (weight updates, the
  version, memory under colocation), the synchronizer (it pauses and resumes the engines, and
  aborts their requests at an abort-mode pause: `abort_while`) and the launcher.

So a rollouter or an agent worker, whatever runs in it, cannot move an engine's weights or
version: only the trainer's sync path can. A role that holds both sends the admin key to the
admin routes and the API key to the others (`key_for`).
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

API_KEY_FILE = "engine.token"  # in a run's keys directory, beside the CURVE keys
ADMIN_KEY_FILE = "engine-admin.token"

# Routes SGLang lets through without a key (matched by prefix, for probes and scrapers).
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")

# SGLang 0.5.23's ADMIN_OPTIONAL routes (http_server.py, `@auth_level(AuthLevel.ADMIN_OPTIONAL)`
# under each route's decorator), every one, whether the built-in engine serves it or not.
ADMIN_PATHS = frozenset({
    "/set_internal_state", "/flush_cache",
    "/add_external_corpus", "/remove_external_corpus", "/list_external_corpora",
    "/hicache/storage-backend/clear", "/hicache/storage-backend",
    "/get_hicache_l3_cache_layout",
    "/start_profile", "/stop_profile", "/set_trace_level", "/freeze_gc",
    "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weights_from_disk", "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance", "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation",
    "/weights_checker", "/slow_down", "/pd_role_switch",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/configure_logging", "/abort_request", "/pause_generation", "/continue_generation",
})
ADMIN_PREFIXES = ("/dumper/",)  # `/dumper/{method}`


def is_admin(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)


def _bearer(authorization: str | None, expected: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), expected.encode())


def decide(method: str, path: str, authorization: str | None, api_key: str | None,
           admin_key: str | None) -> bool:
    """Whether a request may pass, as SGLang's `decide_request_auth` decides it for its
    routes' levels (module docstring); a refusal is SGLang's 401 `{"error": "Unauthorized"}`."""
    if method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES):
        return True
    if is_admin(path):
        key = admin_key or api_key  # admin key set: only it; else the API key, if any
    else:
        key = api_key  # the admin key alone leaves these open, as SGLang does
    return key is None or _bearer(authorization, key)


def key_for(path: str, api_key: str | None, admin_key: str | None) -> str | None:
    """The key a client holding these sends on `path`."""
    if admin_key is not None and is_admin(path):
        return admin_key
    return api_key


@dataclass(frozen=True)
class EngineKeys:
    """A run's two engine keys, or what a role holds of them (None: not held)."""

    api: str | None = None
    admin: str | None = None

    @classmethod
    def for_run(cls, keys_dir: Path, resume: bool) -> EngineKeys:
        """The keys a run's launcher uses: a resumed run's from its files (an admin key made
        now for a run made before there were two); a new run's made now. `write` saves them."""
        def read(name: str) -> str | None:
            path = keys_dir / name
            if not (resume and path.exists()):
                return None
            return path.read_text().strip() or None

        return cls(read(API_KEY_FILE) or secrets.token_urlsafe(32),
                   read(ADMIN_KEY_FILE) or secrets.token_urlsafe(32))

    def write(self, keys_dir: Path) -> None:
        """Each key to its file (0600) where the file is not there yet."""
        for name, key in ((API_KEY_FILE, self.api), (ADMIN_KEY_FILE, self.admin)):
            path = keys_dir / name
            if key is None or path.exists():
                continue
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key + "\n")

    @classmethod
    def load(cls, keys_dir: str | None, *, admin: bool = False) -> EngineKeys:
        """A role's keys from its run's keys directory: the API key, and the admin key only
        for a role that changes the engines (`admin`); none where there is no such file (tests
        that start engines without keys)."""
        return cls(_read(keys_dir, API_KEY_FILE), _read(keys_dir, ADMIN_KEY_FILE) if admin
                   else None)


def _read(keys_dir: str | None, name: str) -> str | None:
    if not keys_dir:
        return None
    path = os.path.join(keys_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None

