"""Messages between the router, the engine hosts and the KV lifecycle service.

Plain ``msgspec.Struct``s: cheap to pickle through Ray and to encode for logs. Times
cross process (and node) boundaries only as durations (``*_in_s``); each side converts
them to its own monotonic clock on receipt.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engines.kv_params import KVTransferParams
from policies.kv_records import RecomputeReason

__all__ = [
    "Beat",
    "Claim",
    "Handover",
    "IntegrityMismatch",
    "KVDecision",
    "KeptBlocks",
    "LeaseWatch",
    "LeasedRecord",
    "LedgerReport",
    "SessionInfo",
    "SessionPrefix",
    "TurnDone",
    "TurnLease",
]


class SessionPrefix(msgspec.Struct, frozen=True, kw_only=True):
    """What the session's last turn covered, for tokenizing the next one (see
    ``orchestrator.kv.session_tokens``). ``text`` is None when it was sent as token ids."""

    owned: bool = True  # False: another API key owns the session (nothing else is told)
    text: str | None = None
    token_ids: list[int] = []


class KVDecision(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's KV plan: pull the kept KV back, extend it in place, or recompute it and
    why. Built by ``orchestrator.kv.decider.kv_decision`` alone (the service's plan and a
    turn lease's alike); a pull becomes an ``extend`` in the router
    (``orchestrator.router.extend_plan``): the turn runs on the decode engine that kept
    the blocks, which prefills only the new tokens. Invariant: ``reason`` is None
    exactly for a pull or an extend, which names its blocks."""

    kind: Literal["pull", "extend", "recompute"]
    reason: RecomputeReason | None = None
    kv_transfer_params: KVTransferParams | None = None  # a pull: the kept blocks
    num_reusable_tokens: int = 0
    source_pool: str = "decode"  # a pull: the kept blocks' pool ("host": a host tier)

    def __post_init__(self) -> None:
        if (self.kind != "recompute") != (self.reason is None):
            raise ValueError(f"a {self.kind} with reason {self.reason!r}")

    @property
    def reason_text(self) -> str:
        """The plan's reason as a turn reports it: ``reuse`` for a pull or an extend."""
        return "reuse" if self.reason is None else self.reason.value


class IntegrityMismatch(msgspec.Struct, frozen=True, kw_only=True):
    """A sampled turn that pulled kept KV back, whose first tokens' log probabilities,
    computed again without reuse, differed from its decode's by more than the tolerance
    (``orchestrator.router.integrity``): the pull's engines and what was seen.

    ``prefill_engine_id`` pulled the KV back from ``source_engine_id`` (the engine that
    kept it: the session's previous decode engine); ``decode_engine_id`` decoded the
    turn from the prefill's KV. ``max_abs_diff`` is the largest difference over the
    ``num_tokens`` compared (``inf`` where one side was not a number). ``owner`` is the
    name of the key whose turn it was (None: no keys): only it and operators see the
    session and request ids in ``/kvtide/stats``."""

    prefill_engine_id: str
    source_engine_id: str
    decode_engine_id: str | None = None
    session_id: str | None = None
    request_id: str = ""
    owner: str | None = None
    num_tokens: int = 0
    max_abs_diff: float = 0.0
    tolerance: float = 0.0


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """The service's answer when a turn asks to run on a session.

    ``claimed``: the caller's key owns the session and this turn is its only one running
    (from ``begin_turn``: with the turn's ``decision``);
    ``not_found``: another key owns it (the caller sees the same 404 as for no session);
    ``turn_in_progress``: a turn of this session is running (409, retry after it);
    ``limit``: a session limit refuses a new session (429; ``code`` and ``message`` say
    which, ``retry_after_s`` when waiting helps);
    ``retokenize`` (``begin_turn`` only): the prompt was tokenized from another last turn
    than the session's; nothing was claimed: tokenize again from ``prefix`` and ask again.
    """

    outcome: Literal["claimed", "not_found", "turn_in_progress", "limit", "retokenize"]
    code: str | None = None
    message: str = ""
    retry_after_s: float | None = None
    decision: KVDecision | None = None
    prefix: SessionPrefix | None = None


class TurnDone(msgspec.Struct, frozen=True, kw_only=True):
    """A finished turn: what the decode engine kept, and what the session continues from.

    ``token_ids`` are the prompt's and the output's (the record covers the first
    ``remote_num_tokens`` of them). ``next_text``/``next_token_ids`` are what the next
    turn's tokenization continues from (None: forget, e.g. a stop string cut the text).

    Sent as what the turn added: with ``prefix_len`` > 0, ``token_ids`` leave out the
    session's last turn (the service's copy, ``prefix_len`` ids whose ``prefix_digest``
    is given), and ``next_len`` says ``next_token_ids`` are the first ``next_len`` of
    the whole turn's ids (not sent again). ``KVService.whole`` puts them back.
    """

    session_id: str | None
    token_ids: list[int]
    kv_transfer_params: KVTransferParams | None = None
    kv_expires_in_s: float | None = None
    next_text: str | None = None
    next_token_ids: list[int] | None = None
    owner: str | None = None  # the API key's name: its ownership is refreshed
    prefix_len: int = 0
    prefix_digest: int | None = None
    next_len: int | None = None
    holder: str | None = None  # the ingress replica that asks to hold the next turn
    lease_id: int | None = None  # the turn ran under this lease (TurnLease)
    # The id the holder proposes for the next turn's lease: it may already run that
    # turn under a provisional lease of its own (``orchestrator.kv.turn_leases``).
    next_lease_id: int | None = None


class LeasedRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A held session's kept KV, as the lessee needs it to plan the next turn itself
    (``policies.kv_cost.decide_turn``'s checks): pull it when the prompt starts with its
    ``num_tokens`` tokens (``prefix_hash``), the offer is still open and ``not_worth``
    is None (else the recompute reason the record alone gives)."""

    kv_transfer_params: KVTransferParams
    num_tokens: int
    prefix_hash: str
    offer_in_s: float  # from the grant: the offer's end, less the lease's margin
    not_worth: str | None = None
    source_pool: str = "decode"  # where the blocks are kept ("host": a host tier)


class TurnLease(msgspec.Struct, frozen=True, kw_only=True):
    """The session's next turn, held for the ingress replica that ran its last one
    (``orchestrator.kv.turn_leases``): claimed for ``owner`` and planned from
    ``record`` there, without a service call on the turn's path. Usable for
    ``lasts_s`` from before the grant, while the replica's copy of the last turn has
    ``digest``; ``epoch`` is the granting service instance's."""

    session_id: str
    lease_id: int
    epoch: str
    lasts_s: float
    owner: str | None
    digest: int
    record: LeasedRecord | None = None


class Handover(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to ``turn_done``: ``accepted`` False when the turn names a last turn
    the service does not hold (send it whole); with ``lease`` the next turn is held."""

    accepted: bool
    lease: TurnLease | None = None


class LeaseWatch(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a lessee's ``lease_watch``: the leases to give back (unused ones
    are released with the next watch; a used one ends with its turn), and the sessions
    it is asked about: is its turn of each still generating (answered with the next
    watch, at once)."""

    epoch: str
    revoked: list[int] = []
    asked: list[str] = []
    # The engines no turn pulls from (an integrity check turned their reuse off): the
    # lessee's provisional leases plan recompute for their records.
    reuse_off: list[str] = []


class Beat(msgspec.Struct, frozen=True, kw_only=True):
    """The service's answer to an engine host's heartbeat: its epoch (a new one: report
    the ledger), and the blocks of the engine's that its books hold for sessions between
    turns (records not yet pulled, expired or evicted): exact where the host's ledger
    counts each kept entry until its TTL."""

    epoch: str
    kept_blocks: int = 0


class KeptBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks a decode engine kept after a request, as its host saw them."""

    engine_id: str
    request_id: str
    session_id: str | None
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int]  # prompt + output: the first num_tokens are covered
    kv_transfer_params: KVTransferParams
    expires_in_s: float
    age_s: float  # seconds since the turn finished: newer turns win on rebuild


class LedgerReport(msgspec.Struct, frozen=True, kw_only=True):
    """An engine host's ledger, sent to a (re)started service.

    A decode host lists the blocks its engine still holds for pulls; a prefill host
    lists the kept blocks it has read (pulls and drains), which the decode engine freed
    on that read: ``consumed`` holds ``(remote_engine_id, remote_request_id)`` pairs.
    """

    engine_id: str
    role: str
    kept: list[KeptBlocks] = []
    consumed: list[tuple[str, str]] = []
    # A large ledger travels in pages (``pages``): the service applies it at the last.
    page: int = 0
    last: bool = True

    def pages(self, max_bytes: int) -> list[LedgerReport]:
        """This report cut into pages of at most about ``max_bytes`` each (one entry
        larger than that travels alone), so that no call carries the whole ledger."""
        out: list[LedgerReport] = []
        kept: list[KeptBlocks] = []
        consumed: list[tuple[str, str]] = []
        size = 0

        def flush() -> None:
            nonlocal kept, consumed, size
            out.append(
                LedgerReport(
                    engine_id=self.engine_id,
                    role=self.role,
                    kept=kept,
                    consumed=consumed,
                    page=len(out),
                    last=False,
                )
            )
            kept, consumed, size = [], [], 0

        for k in self.kept:
            n = len(msgspec.msgpack.encode(k))
            if size and size + n > max_bytes:
                flush()
            kept.append(k)
            size += n
        for pair in self.consumed:
            n = len(pair[0]) + len(pair[1]) + 8
            if size and size + n > max_bytes:
                flush()
            consumed.append(pair)
            size += n
        flush()
        out[-1] = msgspec.structs.replace(out[-1], last=True)
        return out


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where kvtide holds a session's KV now (``known`` False: never seen or closed)."""

    session_id: str
    known: bool
    engine_id: str | None = None
    num_tokens: int = 0
    bytes_held: int = 0
    expires_in_s: float | None = None
    lease_expires_in_s: float | None = None
