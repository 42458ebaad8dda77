"""CheckpointManager: save every N steps and resume, on one process or many.

    mgr = ckptstore.CheckpointManager("runs/exp1", keep_last=3, keep_every=1000, async_save=True)
    mgr.save(step, {"model": model, "optim": optimizer, "data": loader})
    step = mgr.restore({"model": model, "optim": optimizer, "data": loader})  # None if none

Values may be Stateful (`state_dict()` / `load_state_dict()`: modules, optimizers, schedulers,
GradScaler, the dataloader) or plain nested state (dicts of tensors etc., restored in place).
Checkpoints are named `step-<N>`. The latest is the newest whole one in commit order, not the
one with the largest N: a run that went back to step 50 and saved step 51 resumes from 51,
not from the abandoned step 100 (see Retention for what is kept). Under
torch.distributed (initialized, world size > 1) `save` and `restore` are collective: every
rank calls them with its own state (see ckptstore.training.distributed).

With `async_save=True, staging="overlap"` a save returns before copying the state and copies
it in the background within `max_host_bytes` (CheckpointStore.save_async). The manager then
guards every optimizer of the state (its `step()` waits until the save has copied the
parameters and state tensors it changes) and copies at call time what no guard covers: module
buffers, numpy arrays, tensors under `COPY_AT_CALL_BYTES`, and the tensors of other Stateful
objects and plain entries, and DTensor parameters no guarded optimizer steps (in-place
foreach ops on DTensors move no version counter). Other module parameters no guarded
optimizer steps (frozen layers) are left to the version check (docs/training.md, "Overlapped
async saves").

Retention runs inside the save, after its commit: checkpoints the policy drops are deleted and
exactly the blobs no remaining checkpoint references are removed (a targeted sweep, not an
age-based gc; the next save cannot start before it ends).

Tiered repositories (a list of URIs, nearest first; docs/recovery.md): `keep_last`,
`keep_every` and `every` take one value per tier (a scalar applies to all). `every=[1, 10]`
saves every call on tier 0 and replicates every 10th to tier 1; retention runs per tier with
the overrides of retention.TieredRetention (no tier-0 deletion before replication, no loss of
a last copy tier 0's policy keeps); `wait()` also waits for replication and then retains.

Why one module: CheckpointManager's save, retention and restore share its per-tier policy
and bookkeeping (the counts, the kept history, the doomed blobs).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, cast

from ..deps import missing

try:
    import torch
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import (
    CkptStoreError,
    FormatError,
    IntegrityError,
    KeyMismatchError,
    LeaseBusyError,
    TierUnreachableError,
    UnrestorableCheckpointError,
)
from ..format.torch_types import is_dtensor
from ..format.tree import flatten_arrays
from ..layout import blob_key
from ..maintenance import leases
from ..pipeline.commit import Committer, LocalCommitter
from ..pipeline.options import SaveInfo, Staging
from ..pipeline.overlap import guard_target
from ..repository import CheckpointStore, SaveHandle
from ..stores.base import Store
from ..tiers import config as tier_config
from ..tiers import pending
from . import distributed as cdist
from .collectives import all_gather_json
from .peers import PeerMap, PeerReplicas, choose_steps, ranks_per_node
from .rank_save import RankMemory
from .retention import Retention, TieredRetention
from .rng import RNGState

STEP_NAME = re.compile(r"step-(\d+)")
#: overlapped saves: tensors smaller than this are copied at call time (cheaper than tracking)
COPY_AT_CALL_BYTES = 1 << 20


def _step_times(created: Mapping[str, float]) -> list[tuple[int, float]]:
    """[(step, commit time)] of the checkpoints named like steps."""
    return [(int(m.group(1)), c) for n, c in created.items() if (m := STEP_NAME.fullmatch(n))]


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


class CheckpointManager:
    """Periodic checkpoints of a training job: retention, sync or async, one rank or many."""

    def __init__(self, uri_or_repo: str | Sequence[str] | CheckpointStore, *,
                 keep_last: int | None | Sequence[int | None] = None,
                 keep_every: int | None | Sequence[int | None] = None,
                 every: int | Sequence[int] = 1, async_save: bool = False,
                 staging: str = "copy", max_host_bytes: int | None = None,
                 peer_replicas: int = 0, peer_timeout: float = 300.0,
                 **repo_options: Any) -> None:
        stage = Staging(staging, max_host_bytes)  # checked once, before anything opens
        if type(peer_replicas) is not int or peer_replicas < 0:
            raise ValueError(f"peer_replicas must be a non-negative int, got {peer_replicas!r}")
        self.distributed = cdist.is_distributed()
        if peer_replicas and not self.distributed:
            raise ValueError("peer_replicas needs torch.distributed with more than one rank")
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        if isinstance(uri_or_repo, CheckpointStore):
            self.repo = uri_or_repo
        else:
            uris = tier_config.tier_uris(uri_or_repo)
            if any(tier_config.has_placeholders(u) for u in uris):
                if self.distributed and not peer_replicas:
                    raise ValueError("per-rank or per-node tiers ({rank}/{node}) need "
                                     "peer_replicas >= 1: a collective checkpoint must be "
                                     "whole on every tier")
                per_node = ranks_per_node()
                uris = [tier_config.expand(u, rank=self.rank, node=self.rank // per_node,
                                           local_rank=self.rank % per_node) for u in uris]
            self.repo = CheckpointStore(uris if len(uris) > 1 else uris[0], **repo_options)
        #: async saves only: "copy" stages the whole state at call time (extra host memory =
        #: the state's size); "overlap" copies it in the background within max_host_bytes
        self.staging = stage.mode
        self.max_host_bytes = stage.max_host_bytes
        #: per-tier retention and intervals (one tier: just keep_last / keep_every)
        self.tier_policy = TieredRetention.of(len(self.repo.tiers), keep_last, keep_every,
                                              every)
        self.retention = self.tier_policy.policies[0]
        self._since: list[int] | None = None  # saves since each tier last received one
        self._doomed: list[set[str]] = [set() for _ in self.repo.tiers]  # blobs to sweep
        self.async_save = async_save
        if type(peer_timeout) not in (int, float) or not peer_timeout > 0:
            raise ValueError(f"peer_timeout must be a positive number of seconds, got "
                             f"{peer_timeout!r}")
        # peer traffic waits at most peer_timeout for a rank (a dead or stuck one is then
        # noticed instead of holding everyone for the default 10 minutes)
        self.group = cdist.checkpoint_group(
            timedelta(seconds=peer_timeout) if peer_replicas else timedelta(minutes=10)
        ) if self.distributed else None
        self._last: SaveHandle | None = None
        #: collective saves: this rank's cached plan and its part of its last checkpoint
        self._rank_memory = RankMemory()
        #: peer mode: every rank saves its own checkpoint in its own tiers (training/peers.py)
        self.peers: PeerReplicas | None = None
        if peer_replicas:
            self.peers = PeerReplicas(self.repo, self.group, PeerMap(
                torch.distributed.get_world_size(), ranks_per_node(), peer_replicas))
        self._peer_pending: tuple[str, SaveHandle | None] | None = None
        #: names retention never deletes (peer copies as "<sender>/<name>"): the history a
        #: deliberate fresh start found (restore(fresh_ok=True))
        self._kept: set[str] = set()

    # ------------------------------------------------------------------ names
    @staticmethod
    def name_of(step: int) -> str:
        return f"step-{step}"

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints this manager's naming recognises, in commit
        order (oldest first; see CheckpointStore.history)."""
        return [int(m.group(1)) for name in self.repo.history()
                if (m := STEP_NAME.fullmatch(name))]

    def latest_step(self, before: int | None = None) -> int | None:
        """The step of the newest whole checkpoint in commit order (a manifest that cannot be
        read is skipped), or None. With `before`: the newest committed before that step's
        checkpoint."""
        steps = self.steps()
        if before is not None:
            steps = steps[: steps.index(before)] if before in steps else []
        for step in reversed(steps):
            if self.repo.find_manifest(self.name_of(step)) is not None:
                return step
        return None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any],
             metadata: dict[str, Any] | None = None) -> SaveInfo | SaveHandle:
        """Checkpoint `state` as step `step`. Synchronous: returns SaveInfo once committed.
        With async_save: returns a SaveHandle once the state is staged (the trainer may go on
        changing its tensors). Collective under torch.distributed."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        meta = dict(metadata or {})
        meta.update(step=step, world_size=torch.distributed.get_world_size()
                    if self.distributed else 1)
        self._flush_peers()
        collective = cdist.CollectiveCommitter(self.group, self._retain,
                                               self._rank_memory) if (
            self.distributed and self.peers is None) else None
        committer: Committer = collective or _RetainingCommitter(self._retain)
        name = self.name_of(step)
        tiers = self._due_tiers()
        if self.peers is not None:
            return self._save_with_peers(name, state, meta, committer, tiers)
        try:
            plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
            if self.async_save and self.staging == "overlap":
                # guarded from the start: a save whose guard fails commits nothing
                handle = self.repo.save_async(name, plain, meta, committer=committer,
                                              staging="overlap", tiers=tiers,
                                              max_host_bytes=self.max_host_bytes,
                                              copy_keys=_unguarded_keys(state, plain),
                                              guard=[v for v in state.values() if _guarded(v)])
                self._last = handle
                return handle
            if self.async_save:
                self._last = self.repo.save_async(name, plain, meta, committer=committer,
                                                  staging="copy", tiers=tiers)
                return self._last
            return self.repo.save(name, plain, meta, committer=committer, tiers=tiers)
        except Exception as exc:
            if collective is not None and not collective.joined:
                # fail on every rank now instead of leaving them waiting in the collective
                cdist.report_failure(self.group, f"rank {self.rank}: {type(exc).__name__}: {exc}")
            raise

    def _save_with_peers(self, name: str, state: Mapping[str, Any], meta: dict[str, Any],
                         committer: Committer, tiers: list[int]) -> SaveInfo | SaveHandle:
        """Peer mode: this rank's own checkpoint in its own tiers; the copy to its peers is
        sent now (sync) or at the next save / wait / restore / close (async), collectively."""
        try:
            plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
            if self.async_save:
                handle = self.repo.save_async(name, plain, meta, committer=committer,
                                              staging="copy", tiers=tiers)
                self._last = handle
                self._peer_pending = (name, handle)
                return handle
            info = self.repo.save(name, plain, meta, committer=committer, tiers=tiers)
        except Exception:
            self._peer_pending = (name, None)
            self._flush_peers(ok=False)
            raise
        self._peer_pending = (name, None)
        self._flush_peers()
        return info

    def _flush_peers(self, ok: bool = True) -> None:
        """Peer mode: send the last saved checkpoint to the peers (collective; every rank
        calls it at the same point), then drop the copies the tier-0 policy no longer keeps.
        An async save's error is raised after the exchange (the others must not wait)."""
        if self.peers is None:
            return
        self.peers.settle()  # a restore's write of peer data to tier 0 comes first
        if self._peer_pending is None:
            return
        name, handle = self._peer_pending
        self._peer_pending = None
        error: BaseException | None = None
        if handle is not None:
            try:
                handle.wait()
            except BaseException as exc:
                error, ok = exc, False
        self.peers.replicate(name, ok)
        policy = self.tier_policy.policies[0]
        for sender in self.peers.map.held_by(self.rank):
            copy = self.peers.copies_of(sender)
            steps = [int(m.group(1)) for n in copy.history() if (m := STEP_NAME.fullmatch(n))]
            drop = set(Retention(policy.keep_last, policy.keep_every).to_delete(steps))
            keep = {self.name_of(s) for s in steps if s not in drop}
            keep |= {n for n in copy.names() if f"{sender}/{n}" in self._kept}
            self.peers.prune_copies(sender, keep)
        if error is not None:
            raise error

    def _due_tiers(self) -> list[int]:
        """The tiers this save goes to (`every`); counts kept in memory, rebuilt from the
        tiers' listings on the first save (a restarted job resumes the count)."""
        n = len(self.repo.tiers)
        if n == 1:
            return [0]
        if self._since is None:
            history = self.repo.history()
            self._since = [0]
            for tier in self.repo.tiers[1:]:
                held = set(tier.known_created())  # a tier down: as last seen, or nothing
                last = max((i for i, name in enumerate(history) if name in held), default=-1)
                self._since.append(len(history) - 1 - last if last >= 0 else 1 << 30)
        due = self.tier_policy.due(self._since)
        self._since = [0 if i in due else c + 1 for i, c in enumerate(self._since)]
        return due

    def _retain(self, info: SaveInfo | None) -> None:
        """Apply every tier's retention (after a commit, and from `wait()`)."""
        saved_match = STEP_NAME.fullmatch(info.name) if info is not None else None
        saved = int(saved_match.group(1)) if saved_match else None
        history = self.steps()
        tiers = self.repo.tiers
        busy: set[int] = set()
        if len(tiers) == 1:
            holdings = [set(history)]
            waiting: set[int] = set()
        else:
            # a far tier that is down counts as holding what it held when last seen (or
            # nothing), so the nearer tiers keep at least as much, and its own retention
            # waits until it is back (docs/recovery.md, "When a far tier is down")
            holdings = [{int(m.group(1)) for name in (t.names() if i == 0 else t.known_created())
                         if (m := STEP_NAME.fullmatch(name))} for i, t in enumerate(tiers)]
            waiting = self._drop_superseded(holdings, history, saved)
            # a checkpoint the replicator is sending now is left for the next retention:
            # deleting it would wait for that replication (the foreground must not)
            busy = {int(m.group(1)) for n in self.repo.replicating()
                    if (m := STEP_NAME.fullmatch(n))}
            waiting |= busy
        for i, tier in enumerate(tiers):
            if not tier.reachable:
                continue
            try:
                for step in self.tier_policy.to_delete(i, holdings, history, saved, waiting):
                    name = self.name_of(step)
                    if name in self._kept or step in busy:
                        continue  # a deliberate fresh start's history; or being replicated
                    try:
                        self._doomed[i] |= tier.manifest(name).blob_digests()
                        if len(tiers) == 1:
                            self.repo.delete(name)
                        else:
                            self.repo.delete(name, tier=i)
                        holdings[i].discard(step)
                    except FileNotFoundError:
                        continue
                    except FormatError:  # unreadable: left for the user (gc reports it)
                        continue
                if self._doomed[i]:
                    self._sweep(i)
            except TierUnreachableError:
                continue  # went down meanwhile: its retention waits until it is back

    def _drop_superseded(self, holdings: list[set[int]], history: list[int],
                         saved: int | None) -> set[int]:
        """The steps still waiting for replication (their records on tier 0), after dropping
        from each record the later tiers whose policy would delete that step anyway once
        every waiting step arrived (TieredRetention.superseded): through a long outage of
        a far tier, tier 0 then holds about that tier's keep_last checkpoints, not every
        save, and the catch-up sends only what the far tier keeps."""
        near = self.repo.tiers[0].store
        records = {int(m.group(1)): r for r in pending.read_records(near)
                   if (m := STEP_NAME.fullmatch(r.name))}
        for tier in range(1, len(self.repo.tiers)):
            waiting = {s for s, r in records.items() if tier in r.tiers}
            for step in self.tier_policy.superseded(tier, holdings, history, saved, waiting):
                self.repo.forget_replication(records[step].name, tier)
                left = tuple(t for t in records[step].tiers if t != tier)
                records[step] = replace(records[step], tiers=left)
        return {s for s, r in records.items() if r.tiers}

    def _sweep(self, i: int) -> None:
        """Delete the blobs of tier i's dropped checkpoints that no checkpoint there still
        references. The sweep deletes at once (no grace period), so it must not run while
        another party saves or replicates into that tier, nor block the save while a killed
        party's last requests may still land: it is skipped then and tried again at the next
        retention (a `ckpt gc` also collects them). Runs after this save's own
        lease is released: see CheckpointStore._write."""
        tier = self.repo.tiers[i]
        try:
            with leases.gc_lease(tier.store, wait=0, settle_block=False):
                try:
                    still_used = tier.referenced_blobs()
                except CkptStoreError as exc:  # an unreadable manifest: it could use any
                    warnings.warn(f"retention on {tier.uri} deleted checkpoints but not their "
                                  f"blobs: {exc}; `ckpt gc` collects them once it is fixed",
                                  RuntimeWarning, stacklevel=2)
                    return
                tier.store.delete_many(blob_key(blob)
                                       for blob in sorted(self._doomed[i] - still_used))
                tier.store.sync()
                self._doomed[i] = set()
        except LeaseBusyError:
            pass

    # ------------------------------------------------------------------ restore
    def restore(self, state: Mapping[str, Any], step: int | None = None, *,
                fresh_ok: bool = False, map_location: Any = None) -> int | None:
        """Load the latest checkpoint (or `step`) into `state` in place and return its step;
        None if there is none. Collective under torch.distributed: rank 0 picks the step.

        Peer mode (`peer_replicas`): the step every rank can obtain whole, saved by this
        many ranks. If checkpoints exist but none qualifies (restarted on another number of
        ranks; a rank lost its node, its peer's copy and its far tier), every rank raises
        UnrestorableCheckpointError, saying why; `fresh_ok=True` returns None instead (a
        decision to start over), and the checkpoints found are then never deleted by this
        manager's retention.

        The latest is the newest whole checkpoint in commit order. On one process, if it turns
        out damaged while loading (a missing or corrupt blob), a warning names it and the one
        before it is loaded instead (every tensor of `state` is then overwritten again).
        Tiered: waits for this manager's save in flight, not for replication (a restore after
        a crash must not wait for the far tier); chunks come from the nearest good copy.

        `map_location` (as torch.load's: "cuda:0", "cuda", a torch.device; None: host): where
        the tensors made new are created (optimizer states and the tensors of other Stateful
        values, which their `load_state_dict` adopts), straight from the checkpoint through
        page-locked buffers. Tensors restored in place (module parameters and buffers, plain
        entries) stay on their own devices; RNGState is always restored on the host."""
        if map_location is not None:
            from ..format.torch_types import resolve_device

            resolve_device(map_location)  # one clear error before anything is read
        if self.peers is not None:
            self._flush_peers()
            return self._restore_with_peers(state, step, fresh_ok, map_location)
        last, self._last = self._last, None
        self.repo.wait()
        if last is not None:
            last.wait()
        chosen = step is None
        if self.distributed:
            step = self._agreed_step(step)
        elif step is None:
            step = self.latest_step()
        while step is not None:
            try:
                self._load_into(state, step, device=map_location)
                failure: BaseException | None = None
            except (IntegrityError, FormatError) as exc:
                failure = exc
            except Exception as exc:
                if not self.distributed:
                    raise
                failure = exc  # the other ranks must hear of it, not wait for this one
            if self.distributed:
                failure = self._all_loaded(step, failure)
            if failure is None:
                return step
            if not chosen or not isinstance(failure, (IntegrityError, FormatError)):
                raise failure
            older = self.latest_step(before=step)
            if self.distributed:
                older = cdist.broadcast_json(older, self.group)
            if older is None:
                raise failure
            warnings.warn(f"checkpoint step {step} is damaged ({failure}); resuming from step "
                          f"{older}", RuntimeWarning, stacklevel=2)
            step = older
        return None

    def _agreed_step(self, asked: int | None) -> int | None:
        """The step every rank restores: the one asked for, which must be the same on every
        rank (None on all, or one step: CkptStoreError otherwise), else rank 0's latest.
        Every rank makes the same collective calls whatever it asked."""
        every = all_gather_json(asked, self.group)
        if len(set(every)) > 1:
            raise CkptStoreError(f"restore(step=...) asked for different steps on the ranks "
                                 f"({dict(enumerate(every))}); nothing was restored")
        if asked is not None:
            return asked
        latest = self.latest_step() if self.rank == 0 else None
        return cast(int | None, cdist.broadcast_json(latest, self.group))

    def _all_loaded(self, step: int, failure: BaseException | None) -> BaseException | None:
        """After every rank tried to restore `step`: None if every rank did, else the error
        this rank raises: its own, or, on a rank that succeeded, the first failed rank's, of
        the same kind where it is damage (every rank then takes the same older step)."""
        text = None if failure is None else f"{type(failure).__name__}: {failure}"
        reports = all_gather_json(text, self.group)
        failed = [(r, t) for r, t in enumerate(reports) if t is not None]
        if not failed or failure is not None:
            return failure
        rank, first = failed[0]
        damage = first.split(":", 1)[0] in ("IntegrityError", "FormatError")
        cls = FormatError if damage else CkptStoreError
        return cls(f"checkpoint step {step}: rank {rank} could not restore it ({first}); "
                   "this rank's tensors may hold part of it")

    def _restore_with_peers(self, state: Mapping[str, Any], step: int | None,
                            fresh_ok: bool, device: Any = None) -> int | None:
        """Peer mode: the newest step in commit order that every rank can obtain (its tiers
        or a peer's whole copy) and that was saved by this many ranks (peers.choose_steps);
        ranks whose tier 0 lacks it load it from the bytes a peer sent (or, when no peer
        can, from their far tier), then write it to tier 0 in the background. Every rank
        then reports its load; if one failed, every rank tries the next older step. So every
        rank restores the same step whole, or every rank raises UnrestorableCheckpointError
        (a rank that left is noticed within the peer timeout)."""
        assert self.peers is not None and self.group is not None
        self.repo.wait()
        world = torch.distributed.get_world_size()
        mine = {"own": self._own_steps(), "held": {
            str(s): [[int(m.group(1)), h.created, h.world] for h in held
                     if (m := STEP_NAME.fullmatch(h.name))]
            for s, held in self.peers.held_steps().items()}}
        choice = choose_steps(self.peers.gather_views(mine), world)
        candidates = choice.candidates
        if step is not None:
            if step not in candidates:
                why = choice.reason or f"restorable steps: {candidates or 'none'}"
                raise UnrestorableCheckpointError(f"step {step} cannot be restored on every "
                                                  f"rank; {why}")
            candidates = [step]
        if not candidates:
            if not choice.history:
                return None  # a new job: nothing anywhere
            if not fresh_ok:
                raise UnrestorableCheckpointError(choice.reason)
            warnings.warn(f"starting over as asked (fresh_ok=True): {choice.reason}",
                          RuntimeWarning, stacklevel=3)
            self._keep_history()
            return None
        failures: list[str] = []
        for s in candidates:
            received = self.peers.fetch(self.name_of(s))
            outcome: str | None = None
            try:
                self._load_into(state, s, prefer=received, device=device)
            except Exception as exc:  # reported to every rank below, which all move on
                outcome = f"{type(exc).__name__}: {exc}"
            outcomes = self.peers.agree(outcome)
            bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
            if not bad:
                if received is not None:  # tier 0 whole again, after the load (peers.py)
                    self.peers.persist(self.name_of(s), received)
                return s
            text = "; ".join(f"rank {r}: {o}" for r, o in bad)
            failures.append(f"step {s}: {text}")
            warnings.warn(f"step {s} could not be loaded on every rank ({text}); every rank "
                          "tries the next older step", RuntimeWarning, stacklevel=3)
        raise UnrestorableCheckpointError("no step could be loaded whole on every rank: "
                                          + " | ".join(failures))

    def _own_steps(self) -> list[list[Any]]:
        """[step, created, world size saved with] of this rank's checkpoints that its tiers
        hold with a readable manifest (peer mode)."""
        out = []
        for name, created in self.repo.created_times().items():
            m = STEP_NAME.fullmatch(name)
            manifest = self.repo.find_manifest(name) if m else None
            if m and manifest is not None:
                world = manifest.metadata.get("world_size")
                out.append([int(m.group(1)), created, world if type(world) is int else None])
        return out

    def _keep_history(self) -> None:
        """After a deliberate fresh start: every checkpoint this rank holds now (its own
        and its peers' copies) is left out of retention for good."""
        self._kept |= set(self.repo.names())
        if self.peers is not None:
            for sender in self.peers.map.held_by(self.rank):
                self._kept |= {f"{sender}/{n}" for n in self.peers.copies_of(sender).names()}

    def _load_into(self, state: Mapping[str, Any], step: int,
                   prefer: Store | None = None, device: Any = None) -> None:
        into: dict[str, Any] = {}
        for k, v in state.items():
            if isinstance(v, torch.nn.Module) or not _is_stateful(v):
                into[k] = v.state_dict() if _is_stateful(v) else v
            elif not isinstance(v, RNGState) and _holds_shards(sd := v.state_dict()):
                into[k] = sd  # sharded state (e.g. a sharded optimizer): read only our rows
            # other Stateful objects get fresh tensors, adopted by their load_state_dict
        # map_location: RNGState's tensors are host tensors whatever the device (torch's)
        on_host = ([k for k, v in state.items() if isinstance(v, RNGState)]
                   if device is not None else [])
        where = {} if device is None else {"device": device}  # (a default load as before)
        loaded = self.repo.load(self.name_of(step), into=into, strict=False, prefer=prefer,
                                keys=[k for k in state if k not in on_host], **where)
        if on_host:
            loaded.update(self.repo.load(self.name_of(step), keys=on_host, strict=False,
                                         prefer=prefer))
        missing = [k for k in state if k not in loaded]
        if missing:
            raise KeyMismatchError(f"checkpoint step {step} has no entries {missing}")
        for k, v in state.items():  # a plain entry's tensors must all have been restored
            if not _is_stateful(v) and not isinstance(v, torch.nn.Module):
                absent = sorted(set(flatten_arrays(v, (k,)))
                                - set(flatten_arrays(loaded[k], (k,))))
                if absent:
                    raise KeyMismatchError(
                        f"checkpoint step {step} has no tensors {absent[:10]}"
                        + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
                        + " of the state given to restore (the others were restored)")
        for k, v in state.items():
            if isinstance(v, torch.nn.Module):
                _finish_module(v, into[k], loaded[k])
            elif _is_stateful(v):
                v.load_state_dict(loaded[k])
            else:
                _assign_in_place(v, loaded[k], k)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> SaveInfo | None:
        """Wait for the save in flight (raises its error; returns its SaveInfo if any). A
        tiered repository: then wait for replication (raises a ReplicationError) and apply
        retention on every tier once more (the checkpoints just replicated count)."""
        last, self._last = self._last, None
        self.repo.wait()
        info = last.wait() if last is not None else None
        self._flush_peers()
        if len(self.repo.tiers) > 1:
            self.repo.wait_replicated()
            if self.rank == 0 or self.peers is not None:
                self._retain(None)
        return info

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.peers is not None:
                self.peers.close()
            self.repo.close()
            if self.group is not None:
                torch.distributed.destroy_process_group(self.group)
                self.group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RetainingCommitter(LocalCommitter):
    """A single-process save whose commit is followed by the manager's retention."""

    def __init__(self, retain: Callable[[SaveInfo], None]) -> None:
        self._retain = retain

    def committed(self, info: SaveInfo) -> None:
        self._retain(info)


def _unguarded_keys(state: Mapping[str, Any], plain: Mapping[str, Any]) -> set[str]:
    """Dotted keys of the tensors an overlapped save copies at call time: what no optimizer
    guard covers (module buffers, other Stateful objects, plain entries), every tensor
    under COPY_AT_CALL_BYTES, and the DTensor parameters no guarded optimizer steps (an
    in-place `torch._foreach_*` op on a DTensor moves no version counter: the check that
    covers other unguarded parameters is blind to it). Other module parameters and optimizer
    states are not among them."""
    stepped = {id(p) for v in state.values() if (opt := guard_target(v)) is not None
               and _is_stateful(v) for group in opt.param_groups for p in group["params"]}
    keys: set[str] = set()
    for k, v in state.items():
        arrays = flatten_arrays(plain[k], (k,))
        if isinstance(v, torch.nn.Module):
            buffers = {f"{k}.{name}" for name, _b in v.named_buffers()}
            blind = {f"{k}.{name}" for name, p in v.named_parameters()
                     if is_dtensor(p) and id(p) not in stepped}
            keys |= (buffers | blind) & set(arrays)
        elif not _guarded(v):
            keys |= set(arrays)
        keys |= {key for key, a in arrays.items()
                 if getattr(a, "nbytes", 0) < COPY_AT_CALL_BYTES}
    return keys


def _guarded(value: Any) -> bool:
    """Whether an overlapped save guards `value` (an optimizer, or a wrapper of one such as
    accelerate's AcceleratedOptimizer, whose steps run torch's step pre-hooks) rather than
    copying its tensors at call time."""
    return _is_stateful(value) and guard_target(value) is not None


def _holds_shards(state: Any) -> bool:
    from ..pipeline.loading import local_part

    arrays = flatten_arrays(state)
    return any(local_part(v, k)[1] is not None for k, v in arrays.items())


def _finish_module(module: torch.nn.Module, dest: Mapping[str, Any], loaded: Any) -> None:
    """Tensors were filled in place; hand anything else (extra state) to load_state_dict,
    and everything when a tensor of `module.state_dict()` was not the module's own memory
    (a state-dict hook that clones or casts, a wrapper): filling it in place changed
    nothing the module holds."""
    if set(dest) != set(loaded):
        missing = sorted(set(dest) - set(loaded))
        unexpected = sorted(set(loaded) - set(dest))
        raise KeyMismatchError(f"module state mismatch: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    own = {_memory_of(t) for t in (*module.parameters(), *module.buffers())}
    if any(not isinstance(v, torch.Tensor) or _memory_of(v) not in own
           for v in dest.values()):
        module.load_state_dict(loaded)


def _memory_of(t: torch.Tensor) -> int | None:
    """Where a tensor's values live (its local part's, for a DTensor); None if unknown."""
    local = t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _assign_in_place(dest: Any, loaded: Any, path: str) -> None:
    """Copy non-tensor values of a plain state back into the caller's containers (tensors
    were already filled in place)."""
    if isinstance(dest, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if k in dest and isinstance(dest[k], (dict, list)):
                _assign_in_place(dest[k], v, f"{path}.{k}")
            elif k not in dest or dest[k] is not v:
                dest[k] = v
    elif isinstance(dest, list) and isinstance(loaded, list):
        if len(dest) != len(loaded):
            dest[:] = loaded
            return
        for i, v in enumerate(loaded):
            if isinstance(dest[i], (dict, list)):
                _assign_in_place(dest[i], v, f"{path}.{i}")
            elif dest[i] is not v:
                dest[i] = v
    elif dest is not loaded:
        raise CkptStoreError(f"{path}: cannot restore a {type(dest).__name__} in place; pass "
                             "a dict, a list or a Stateful object")
