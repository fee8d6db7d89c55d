"""Keep several vLLM replicas on the same adapter versions: `Fleet`.

Why: a Pipeline RL deployment runs several `vllm serve --plugin art` replicas behind whatever
load balancer the team already has. Requests keep going through that balancer; the trainer
only has to make every replica serve each new policy version, and to know which replicas do
not (so it can drain them from the balancer and bring them back). One publish is one
operation: the same `operation_id` goes to every replica, so a retry after a lost answer is
recognised by the replica instead of applied twice.

Rules (docs/scale-out.md, "Several servers: the fleet"):
- `publish(slot, path, version)` posts the update to every replica concurrently (one thread
  each), retries connection errors, timeouts and 5xx with backoff up to the deadline
  (`RetryPolicy`), never retries a 4xx. Every publish carries the adapter's digest: the one
  given, else `art_protocol.digest.digest_dir` of `path` read here (a path this process cannot
  read needs `digest=`). A 409 is checked against the replica's `/art/v1/slots`: a replica
  already at that version *with that digest* counts as `already_applied`; one reporting another
  digest, or none (it cannot show what it holds), is a refusal.
- The fleet's target for a slot moves when at least one replica applied the version. A replica
  is quarantined (left out of `healthy()`) when it does not serve the target after a publish,
  when a call to it failed for connection/5xx reasons, or when `slots()` sees it behind (a
  version or a digest other than the target's, or no digest). Quarantine ends when a later
  `publish` or `reconcile()` leaves it on every target (version and digest), checked on its
  own `/art/v1/slots`.
- `reconcile()` re-publishes each slot's target (path, version, digest) to every replica
  that is not on it, e.g. one that restarted at version 0.
- `publish(..., push=True)` pushes the adapter's bytes instead of its path (`art_protocol.push`):
  the local directory is read once, and the same bytes, digest and `operation_id` go to every
  replica; no replica needs to see the directory. `reconcile()` pushes a pushed target again,
  read anew from that directory and checked against the target's digest.
- One publisher per fleet: `publish`, `reconcile` and `slots` run one at a time; `healthy()`
  never waits for them. The fleet assumes it is the only publisher of its slots.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx

from art_protocol.client.fleet_types import (
    FleetConfig,
    Outcome,
    PublishResult,
    ReconcileResult,
    ReplicaResult,
    RetryPolicy,
    SlotView,
)
from art_protocol.digest import digest_dir
from art_protocol.push import AdapterBytes, multipart_files
from art_protocol.updates import UpdateRequest

UPDATE_ROUTE = "/art/v1/lora/update"
SLOTS_ROUTE = "/art/v1/slots"


class _Unreachable(Exception):
    """`GET /art/v1/slots` got no usable answer."""


def _published_digest(slot: str, path: str, version: int, digest: str | None) -> str | None:
    """The digest a publish carries: `digest`, else that of the adapter at `path` read here."""
    if digest is not None:
        return digest
    try:
        return digest_dir(path)
    except OSError as exc:
        raise ValueError(
            f"publish of {slot}@{version}: no digest given and the adapter at {path!r} is not "
            f"readable here ({exc}); pass digest= (art_protocol.digest.digest_dir of the "
            "adapter), the fleet checks every replica's content against it"
        ) from exc


def _same_content(have_digest: str | None, target: UpdateRequest) -> bool:
    """A replica holds the target's bytes only if it reports the same digest (none: unknown)."""
    return have_digest is not None and have_digest == target.digest


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except Exception:
        return resp.text[:500]


class Fleet:
    """Publish adapter versions to several replicas; track which replicas are current.

    `Fleet(urls, api_key=..., deadline_s=...)`; `deadline_s` overrides `config.retry`'s.
    Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        deadline_s: float | None = None,
        config: FleetConfig | None = None,
    ):
        urls = [str(u).rstrip("/") for u in urls]
        if not urls:
            raise ValueError("Fleet needs at least one replica URL, got none")
        if len(set(urls)) != len(urls):
            raise ValueError(f"Fleet got a replica URL more than once: {urls}")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        config = config or FleetConfig()
        if api_key is not None:
            config = replace(config, api_key=api_key)
        if deadline_s is not None:
            config = replace(config, retry=replace(config.retry, deadline_s=deadline_s))
        self.config = config
        self.urls: tuple[str, ...] = tuple(urls)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = {
            url: httpx.Client(base_url=url, headers=headers, timeout=config.retry.attempt_timeout_s)
            for url in urls
        }
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="art-fleet")
        self._op_lock = threading.Lock()  # one publish / reconcile / slots at a time
        self._state_lock = threading.Lock()  # guards _targets and _quarantined
        self._targets: dict[str, UpdateRequest] = {}
        self._pushed: set[str] = set()  # slots whose target was pushed (path: a local dir)
        self._quarantined: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._http.values():
            client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------

    def healthy(self) -> list[str]:
        """Replicas known to serve every version this fleet published (send traffic here)."""
        with self._state_lock:
            return [u for u in self.urls if u not in self._quarantined]

    def quarantined(self) -> dict[str, str]:
        """url -> why it is quarantined."""
        with self._state_lock:
            return dict(self._quarantined)

    def targets(self) -> dict[str, int]:
        """slot -> the last version this fleet published to at least one replica."""
        with self._state_lock:
            return {slot: t.version for slot, t in self._targets.items()}

    def _quarantine(self, url: str, why: str) -> None:
        with self._state_lock:
            self._quarantined[url] = why

    # -- publish ---------------------------------------------------------------------------

    def publish(
        self,
        slot: str,
        path: str,
        version: int,
        digest: str | None = None,
        operation_id: str | None = None,
        push: bool = False,
    ) -> PublishResult:
        """Post `{slot, path, version, digest}` to every replica at once.

        Returns every replica's result; raises only on bad arguments. `digest` is the
        adapter's content digest (`art_protocol.digest.digest_dir`), checked by each replica
        and compared with what each reports; without it the fleet digests `path` itself, and
        a path not readable here is refused (ValueError) before anything is sent.
        `operation_id` defaults to a fresh id per call; pass your own (e.g. derived from the
        training step) to make a trainer that restarts and publishes the same step again
        idempotent: replicas that applied it answer with the first response.

        `push=True`: `path` is a directory on this machine; its two files are read once here
        and the same bytes are pushed to every replica (`art_protocol.push`), with `digest`
        (default: the digest of those bytes). A directory that cannot be read is refused
        (ValueError) before anything is sent.
        """
        if operation_id is None:
            operation_id = f"fleet-{uuid.uuid4().hex}"
        # Checks every field (UpdateRequestError, a ValueError) before anything is sent.
        UpdateRequest(slot, str(path), version, operation_id, digest=digest)
        adapter = AdapterBytes.read(path) if push else None
        if adapter is not None and digest is None:
            digest = adapter.digest()
        digest = _published_digest(slot, str(path), version, digest)
        target = UpdateRequest(slot, str(path), version, operation_id, digest=digest)
        with self._op_lock:
            deadline = time.monotonic() + self.config.retry.deadline_s
            quarantined = self.quarantined()
            futures = [
                self._pool.submit(
                    self._send, url, slot, target, deadline, url in quarantined, adapter
                )
                for url in self.urls
            ]
            results = tuple(f.result() for f in futures)
            self._settle(slot, target, results, pushed=push)
        return PublishResult(slot, target.path, version, target.operation_id, results)

    def _settle(
        self,
        slot: str,
        target: UpdateRequest,
        results: Iterable[ReplicaResult],
        pushed: bool = False,
    ) -> None:
        """Move the target if any replica applied it; quarantine or release each replica."""
        results = list(results)
        moved = any(r.ok for r in results)
        with self._state_lock:
            before = self._targets.get(slot)
            if moved:
                self._targets[slot] = target
                if pushed:
                    self._pushed.add(slot)
                else:
                    self._pushed.discard(slot)
        was_quarantined = self.quarantined()
        for r in results:
            if not r.ok and (moved or r.outcome is Outcome.FAILED):
                self._quarantine(r.url, r.error or f"{r.outcome.value} on {slot}@{r.version}")
            elif r.ok and (r.url in was_quarantined or self._diverged(r, before)):
                self._release_if_current(r.url)

    @staticmethod
    def _diverged(r: ReplicaResult, before: UpdateRequest | None) -> bool:
        """The replica's answer says it was not on the previous target (e.g. it restarted).

        Servers that report `previous_version` (issue 14) let a publish notice a restarted
        replica; it is then checked on every slot, not only the one just published.
        """
        previous = (r.response or {}).get("previous_version")
        return before is not None and previous is not None and previous != before.version

    def _release_if_current(self, url: str) -> None:
        """End `url`'s quarantine if its own `/art/v1/slots` shows every target."""
        try:
            reported = self._get_slots(url)
        except _Unreachable as exc:
            self._quarantine(url, str(exc))
            return
        with self._state_lock:
            off = {}
            for s, t in self._targets.items():
                have, have_digest = reported.get(s, (None, None))
                if have != t.version:
                    off[s] = (have, t.version)
                elif not _same_content(have_digest, t):
                    off[s] = (f"{have} digest {have_digest}", f"{t.version} digest {t.digest}")
            if off:
                self._quarantined[url] = (
                    f"{url} is not on the fleet's versions: {off} (slot: (have, want))"
                )
            else:
                self._quarantined.pop(url, None)

    def _send(
        self,
        url: str,
        slot: str,
        target: UpdateRequest,
        deadline: float,
        quarantined: bool,
        adapter: AdapterBytes | None = None,
    ) -> ReplicaResult:
        """One replica: post until it answers for good, the attempts or the deadline run out.
        With `adapter`, the update is a push of those bytes (`target.path` is only the local
        directory they were read from)."""
        policy: RetryPolicy = self.config.retry
        max_attempts = self.config.quarantined_attempts if quarantined else policy.max_attempts
        if adapter is None:
            send = {"json": target.to_json()}
        else:
            send = {"files": multipart_files(replace(target, path=None), adapter)}
        http = self._http[url]
        t0 = time.monotonic()
        delays = policy.delays()
        attempts = 0
        last_error = "no attempt made before the deadline"
        last_status = None

        def result(outcome: Outcome, **kw) -> ReplicaResult:
            return ReplicaResult(
                url, slot, target.version, outcome, attempts, time.monotonic() - t0, **kw
            )

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                resp = http.post(
                    UPDATE_ROUTE, **send, timeout=min(policy.attempt_timeout_s, remaining)
                )
            except httpx.TransportError as exc:
                last_error, last_status = f"{type(exc).__name__}: {exc}", None
            else:
                status = resp.status_code
                if status < 300:
                    payload = resp.json()
                    replayed = isinstance(payload, dict) and bool(payload.get("replayed"))
                    outcome = Outcome.ALREADY_APPLIED if replayed else Outcome.APPLIED
                    return result(outcome, status=status, response=payload)
                if status == 409:
                    return self._check_conflict(url, slot, target, _message(resp), result)
                if status < 500:
                    return result(
                        Outcome.REFUSED,
                        status=status,
                        error=f"{url} refused {slot}@{target.version}: {status} {_message(resp)}",
                    )
                last_error, last_status = f"{status} {_message(resp)}", status
            if max_attempts is not None and attempts >= max_attempts:
                break
            delay = next(delays)
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        why = "attempts" if max_attempts is not None and attempts >= max_attempts else "deadline"
        return result(
            Outcome.FAILED,
            status=last_status,
            error=(
                f"{url} did not apply {slot}@{target.version}: {attempts} attempt(s) in "
                f"{time.monotonic() - t0:.1f}s, stopped by the {why} "
                f"(deadline {policy.deadline_s:g}s, max attempts {max_attempts}); "
                f"last error: {last_error}"
            ),
        )

    def _check_conflict(
        self, url, slot, target: UpdateRequest, message: str, result
    ) -> ReplicaResult:
        """A 409: the same version already there counts as applied; anything else refuses."""
        try:
            reported = self._get_slots(url)
        except _Unreachable as exc:
            return result(
                Outcome.FAILED, status=409, error=f"{url} answered 409 ({message}); then {exc}"
            )
        have, have_digest = reported.get(slot, (None, None))
        if have == target.version and _same_content(have_digest, target):
            return result(Outcome.ALREADY_APPLIED, status=409, response={"conflict": message})
        return result(
            Outcome.REFUSED,
            status=409,
            error=(
                f"{url} refused {slot}@{target.version}: 409 {message} (the replica reports "
                f"version {have}, digest {have_digest}; the fleet published digest "
                f"{target.digest})"
            ),
        )

    # -- observe and repair ----------------------------------------------------------------

    def _get_slots(self, url: str) -> dict[str, tuple[int, str | None]]:
        """slot -> (version, digest or None) as the replica reports them."""
        try:
            resp = self._http[url].get(SLOTS_ROUTE, timeout=self.config.slots_timeout_s)
        except httpx.TransportError as exc:
            raise _Unreachable(f"{url} {SLOTS_ROUTE}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise _Unreachable(f"{url} {SLOTS_ROUTE}: {resp.status_code} {_message(resp)}")
        try:
            return {s["slot"]: (s["version"], s.get("digest")) for s in resp.json()}
        except (ValueError, KeyError, TypeError) as exc:
            raise _Unreachable(
                f"{url} {SLOTS_ROUTE}: unexpected answer {resp.text[:200]!r}"
            ) from exc

    def _survey(self) -> dict[str, dict[str, tuple[int, str | None]] | None]:
        """Every replica's slots at once; None for a replica that did not answer."""

        def one(url):
            try:
                return self._get_slots(url)
            except _Unreachable as exc:
                return exc

        answers = dict(zip(self.urls, self._pool.map(one, self.urls), strict=True))
        for url, answer in answers.items():
            if isinstance(answer, _Unreachable):
                self._quarantine(url, str(answer))
        return {u: (None if isinstance(a, _Unreachable) else a) for u, a in answers.items()}

    def slots(self) -> dict[str, SlotView]:
        """slot -> what each replica reports and the fleet's target; `SlotView.agreed`.

        Replicas that do not answer, or are behind a target (e.g. restarted at version 0),
        are quarantined; only `publish` and `reconcile` end a quarantine.
        """
        with self._op_lock:
            survey = self._survey()
            return self._views(survey)

    def _views(self, survey) -> dict[str, SlotView]:
        with self._state_lock:
            targets = dict(self._targets)
        names = set(targets)
        for answer in survey.values():
            names.update(answer or ())
        views = {}
        for name in sorted(names):
            versions = {u: (a or {}).get(name, (None, None))[0] for u, a in survey.items()}
            digests = {u: (a or {}).get(name, (None, None))[1] for u, a in survey.items()}
            target = targets.get(name)
            views[name] = SlotView(
                name,
                target.version if target else None,
                versions,
                digests,
                target.digest if target else None,
            )
            for url in views[name].behind:
                self._quarantine(
                    url,
                    f"{url} serves {name}@{versions[url]} (digest {digests[url]}), the fleet "
                    f"published {name}@{target.version} (digest {target.digest})",
                )
        return views

    def reconcile(self) -> ReconcileResult:
        """Bring every replica to every target: re-publish what it misses, then re-check.

        Each re-publish sends the target's path, version and digest under a fresh operation
        id. A replica ahead of the target (someone else published) is refused by it (409),
        reported, and stays quarantined. A pushed target is pushed again from its local
        directory, read once here for all replicas; if those files no longer have the
        target's digest, nothing is sent and the repair fails, naming both digests.
        """
        with self._op_lock:
            survey = self._survey()
            with self._state_lock:
                targets = dict(self._targets)
                pushed = set(self._pushed)
            deadline = time.monotonic() + self.config.retry.deadline_s
            reread_lock = threading.Lock()
            reread: dict[str, AdapterBytes | ValueError] = {}

            def pushed_bytes(target: UpdateRequest) -> AdapterBytes:
                """The target's files, read once per reconcile, checked against its digest."""
                with reread_lock:
                    if target.slot not in reread:
                        try:
                            adapter = AdapterBytes.read(target.path)
                            if adapter.digest() != target.digest:
                                raise ValueError(
                                    f"cannot push {target.slot}@{target.version} again: the "
                                    f"files in {target.path} now have digest "
                                    f"{adapter.digest()}, the fleet published {target.digest}"
                                )
                            reread[target.slot] = adapter
                        except ValueError as exc:
                            reread[target.slot] = exc
                    found = reread[target.slot]
                if isinstance(found, ValueError):
                    raise found
                return found

            def repair(url: str) -> list[ReplicaResult]:
                have = survey[url]
                out = []
                for slot, target in targets.items():
                    version, digest = (None, None) if have is None else have.get(slot, (None, None))
                    if version == target.version and _same_content(digest, target):
                        continue
                    # A fresh operation id: a replica off the target must apply it, not replay
                    # the answer it gave the original publish before it diverged.
                    again = replace(target, operation_id=f"fleet-reconcile-{uuid.uuid4().hex}")
                    adapter = None
                    if slot in pushed:
                        try:
                            adapter = pushed_bytes(target)
                        except ValueError as exc:
                            out.append(
                                ReplicaResult(
                                    url,
                                    slot,
                                    target.version,
                                    Outcome.FAILED,
                                    0,
                                    0.0,
                                    error=str(exc),
                                )
                            )
                            continue
                    # A replica that did not answer the survey gets the quarantined tries only.
                    out.append(
                        self._send(url, slot, again, deadline, have is None, adapter=adapter)
                    )
                return out

            per_url = dict(zip(self.urls, self._pool.map(repair, self.urls), strict=True))
            updates = tuple(r for rs in per_url.values() for r in rs)
            for url, results in per_url.items():
                failed = [r for r in results if not r.ok]
                if failed:
                    self._quarantine(url, "; ".join(r.error or r.outcome.value for r in failed))
                elif survey[url] is None or results or url in self.quarantined():
                    self._release_if_current(url)
            return ReconcileResult(updates, tuple(self.healthy()), self.quarantined())
