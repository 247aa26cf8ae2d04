"""What a transfer leaves behind and sends: open resources after it, and no pickle on the wire."""

from __future__ import annotations

import os
import pickle
import pickletools
import threading
from collections.abc import Callable, Mapping

from conformance.checks.base import fail
from conformance.transfers.cases import Transfer


def open_resources() -> dict[str, int]:
    """Threads and file descriptors (sockets among them) this process holds now."""
    counts = {"threads": threading.active_count()}
    for name, path in (("native threads", "/proc/self/task"), ("file descriptors", "/proc/self/fd")):
        if os.path.isdir(path):
            counts[name] = len(os.listdir(path))
    return counts


#: Calls before the resources are counted (caches fill), and calls after which none may have grown.
WARMUP_CALLS, COUNTED_CALLS = 3, 50


def check_resources(t: Transfer) -> None:
    """After warm-up, 50 more calls open no new threads, descriptors, streams or communicators."""
    declared: Callable[[], Mapping[str, int]] = t.implementation.options["resources"] or dict
    for _ in range(WARMUP_CALLS):
        t.call("resources")
    before = {**open_resources(), **declared()}
    for _ in range(COUNTED_CALLS):
        t.call("resources")
    after = {**open_resources(), **declared()}
    grown = {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}
    if grown:
        text = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in grown.items())
        raise fail(
            t,
            "resources",
            f"{COUNTED_CALLS} calls after warm-up grew {text}",
            ["each call must reuse what the first calls made (streams, communicators, threads, sockets)"],
        )


def is_pickle_stream(value: bytes | str) -> bool:
    """Whether ``value`` parses, to its last byte, as a pickle stream (protocol 2 or later)."""
    raw = value.encode("latin-1") if isinstance(value, str) else bytes(value)
    if len(raw) < 3 or raw[0] != 0x80 or raw[-1:] != b".":
        return False
    try:
        ops = list(pickletools.genops(raw))
    except Exception:
        return False
    return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] == len(raw) - 1


class _WatchedClient:
    """Stands in for the ``jax.distributed`` client while a transfer runs: forwards everything,
    and notes every value written that is a pickle stream (``isinstance`` still sees the client)."""

    def __init__(self, client, events: list[str]) -> None:
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_events", events)

    @property
    def __class__(self):
        return type(self._client)

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if name not in ("key_value_set", "key_value_set_bytes"):
            return attr

        def write(key, value, *args, **kwargs):
            if is_pickle_stream(value):
                self._events.append(f"{name}({key!r}, <a pickle stream of {len(value)} bytes>)")
            return attr(key, value, *args, **kwargs)

        return write


class _PickleWatch:
    """Records pickle loads, and pickle streams written to the key-value store, while active."""

    LOADERS = ("loads", "load", "Unpickler")

    def __init__(self) -> None:
        self.events: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> _PickleWatch:
        from jax._src import distributed as jax_distributed

        for name in self.LOADERS:
            self._swap(pickle, name, self._loader(getattr(pickle, name), f"pickle.{name}"))
        state = jax_distributed.global_state
        if state.client is not None:
            self._swap(state, "client", _WatchedClient(state.client, self.events))
        return self

    def _swap(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _loader(self, orig, what: str):
        def load(*args, **kwargs):
            self.events.append(f"{what} called")
            return orig(*args, **kwargs)

        return load

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def check_no_pickle(t: Transfer) -> None:
    """No pickle is loaded during a transfer, and nothing written to the key-value store is one."""
    with _PickleWatch() as watch:
        t.call("no_pickle")
        t.call("no_pickle")
    if watch.events:
        raise fail(
            t,
            "no_pickle",
            "the transfer unpickles or publishes a pickle",
            [
                *watch.events[:5],
                "a pickle read from the network runs code; send raw bytes "
                "or text (an NCCL unique id is 128 raw bytes)",
            ],
        )
