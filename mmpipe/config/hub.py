"""Hub ids where a config takes pretrained weights: ``org/name`` or ``org/name@revision`` resolved to a
snapshot directory of the Hugging Face cache, before anything reads the path.

A local directory wins (a path that exists is never taken for an id). Otherwise
``huggingface_hub.snapshot_download`` fetches only what a run reads (configs, safetensors shards and
their index, tokenizer, processor and chat-template files) into the standard cache (``HF_HUB_CACHE``,
else ``HF_HOME``/hub), honouring ``HF_HUB_OFFLINE`` (the cache alone serves), ``HF_TOKEN`` and the
revision. Processes of one machine take turns under a file lock in the cache: the first downloads,
the others then find the snapshot complete in the cache and read it (no N-fold download, no half-written
files read). Each resolution is recorded as ``org/name@<commit>``, which the run's ``config.yaml`` keeps
in place of the path, so a resume, ``export`` and ``generate`` use the same snapshot, offline too, and a
later change of ``main`` upstream is not picked up silently.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional

from mmpipe.errors import ConfigError

# what a run reads from a model repository (``allow_patterns``); weights in safetensors only. Sizing a model
# (``mmpipe plan``) reads its configs, tokenizer files and a sharded checkpoint's index only (``weights=False``;
# an unsharded model's one file holds its tensor names, so it is fetched)
CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
WEIGHT_PATTERNS = CONFIG_PATTERNS + ["*.safetensors"]
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")


class Resolved(NamedTuple):
    path: str  # the snapshot directory
    pin: str  # org/name@commit


def looks_like_id(value) -> bool:
    """``org/name`` or ``org/name@revision`` that is not an existing path (a local directory wins)."""
    return (isinstance(value, str) and bool(_ID.match(value)) and not os.path.exists(value)
            and not value.startswith((".", "/")))


def cache_dir() -> str:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def not_found(value: str, key: str, what: str = "directory") -> str:
    """The one line for a ``key`` whose ``value`` is neither a local directory nor a hub id."""
    m = re.match(r"^https?://(?:www\.)?(?:huggingface\.co|hf\.co)/([^/]+/[^/?#]+)", value or "")
    if m:
        return f"{key}: {value} is a web address: give the hub id {m.group(1)} (or a local {what})"
    return (f"{key}: {value} is neither a local {what} (there is none at {os.path.abspath(value or '.')}) nor a "
            "hub id (org/name or org/name@revision)")


def resolve(value: str, key: str, patterns: Optional[list] = None) -> Resolved:
    """The snapshot directory of hub id ``value`` (``key``: the config key, for errors), fetched if missing
    (unless offline); one line naming the id, what is missing and the fix when it cannot be had - after saying
    that no directory of that name is here (an id is shaped as a relative path: a mistyped one reads as an id)."""
    try:
        return _resolve(value, key, patterns)
    except ConfigError as e:
        why = str(e)[len(key) + 2:] if str(e).startswith(f"{key}: ") else str(e)
        raise ConfigError(f"{key}: no directory {value} here (cwd {os.getcwd()}); as a hub id: {why}") from None


def _resolve(value: str, key: str, patterns: Optional[list]) -> Resolved:
    from filelock import FileLock
    repo, _, revision = value.partition("@")
    revision = revision or "main"
    cache = cache_dir()
    os.makedirs(os.path.join(cache, ".locks"), exist_ok=True)
    lock = os.path.join(cache, ".locks", f"mmpipe--{repo.replace('/', '--')}.lock")
    with FileLock(lock):  # one process of the machine downloads; the others wait, then read the cache
        try:
            path = _snapshot(repo, revision, cache, patterns or WEIGHT_PATTERNS, local_only=True)
        except Exception:  # noqa: BLE001 - not (completely) cached: fetch it, unless offline
            if offline():
                raise ConfigError(f"{key}: {value} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                                  f"set: run `huggingface-cli download {repo}"
                                  f"{'' if revision == 'main' else ' --revision ' + revision}` where the hub is "
                                  "reachable (same HF_HUB_CACHE), or unset HF_HUB_OFFLINE") from None
            path = _download(value, repo, revision, cache, patterns or WEIGHT_PATTERNS, key)
    return Resolved(path, f"{repo}@{os.path.basename(os.path.normpath(path))}")


def _snapshot(repo: str, revision: str, cache: str, patterns: list, local_only: bool) -> str:
    from huggingface_hub import snapshot_download
    path = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=local_only,
                             allow_patterns=patterns, token=os.environ.get("HF_TOKEN") or None)
    if local_only and not _has_what_is_read(path, patterns):
        raise FileNotFoundError(path)  # a snapshot folder without what a run reads: fetch it
    return path


def _has_what_is_read(path: str, patterns: list) -> bool:
    """A cached snapshot serves: a model's config.json (and with weights, its safetensors or their index:
    ``check_complete`` then names a missing shard), or a tokenizer's files."""
    has = lambda f: os.path.isfile(os.path.join(path, f))  # noqa: E731
    if has("config.json"):
        return "*.safetensors" not in patterns or has("model.safetensors") or has("model.safetensors.index.json")
    return has("tokenizer_config.json") or has("tokenizer.json")


def _download(value: str, repo: str, revision: str, cache: str, patterns: list, key: str) -> str:
    from huggingface_hub import errors
    try:
        return _snapshot(repo, revision, cache, patterns, local_only=False)
    except errors.GatedRepoError:
        raise ConfigError(f"{key}: {repo} is gated: accept its terms on huggingface.co and set HF_TOKEN to a token "
                          "of that account") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{key}: {repo} has no revision {revision!r}: give a branch, tag or commit that exists "
                          f"({repo}@main)") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{key}: {repo} was not found on the hub (or is private: set HF_TOKEN); check the id, or "
                          "give a local directory") from None
    except Exception as e:  # noqa: BLE001 - network and the rest: one line
        raise ConfigError(f"{key}: cannot download {value}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          f" (download it with `huggingface-cli download {repo}`, or give a local directory)") from None


def check_complete(path: str, value: str, key: str) -> None:
    """A snapshot with a safetensors index names every shard: one missing is one line."""
    import json
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return
    with open(index) as fh:
        shards = sorted(set(json.load(fh).get("weight_map", {}).values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
    if missing:
        raise ConfigError(f"{key}: the cached snapshot of {value} lacks {missing[0]}"
                          f"{f' (and {len(missing) - 1} more shards)' if len(missing) > 1 else ''}: run "
                          f"`huggingface-cli download {value.partition('@')[0]}` to complete it")


def pretrained_keys(cfg) -> list:
    """(dotted key, section, field) of every pretrained-weights key of a config: each ``pretrained`` of the
    model section and its subsections, and ``data.tokenizer``."""
    import dataclasses
    out = []

    def walk(section, prefix: str) -> None:
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if f.name == "pretrained":
                out.append((f"{prefix}.{f.name}", section, f.name))
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                walk(v, f"{prefix}.{f.name}")
    walk(cfg.model, "model")
    out.append(("data.tokenizer", cfg.data, "tokenizer"))
    return out


def resolve_ids(cfg, weights: bool = True) -> dict:
    """Every pretrained-weights key of ``cfg`` holding a hub id set to its snapshot directory; returns
    {dotted key: org/name@commit} for those (the run's config.yaml keeps the pins). ``weights=False``:
    configs and tokenizer files only (sizing a model: ``mmpipe plan``)."""
    pins = {}
    for dotted, section, name in pretrained_keys(cfg):
        value = getattr(section, name)
        if not looks_like_id(value):
            continue
        r = resolve(value, dotted, WEIGHT_PATTERNS if weights else CONFIG_PATTERNS)
        if not weights and os.path.isfile(os.path.join(r.path, "config.json")) and \
                not os.path.isfile(os.path.join(r.path, "model.safetensors.index.json")):
            # one unsharded file: its tensor names (which a model's structure reads) are in it, not in an index
            r = resolve(value, dotted, WEIGHT_PATTERNS)
        if weights:
            check_complete(r.path, value, dotted)
        object.__setattr__(section, name, r.path)
        pins[dotted] = r.pin
    return pins
