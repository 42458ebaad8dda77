"""Live healing: heal time, bytes sent and sender stall of ckptstore.torchft.Transport against
torchft's HTTPTransport (whole stream, and 4 chunks) and PGTransport (gloo, receiving in
place), in one run, sender and receiver in their own processes on this machine.

    python bench/heal_bench.py                     # 1 GiB states, then 4 GiB if memory allows
    python bench/heal_bench.py --gib 0.25 --reps 1 --no-big    # a quick sanity run

States (equal float32 tensors of about 43 MiB, plus small ones: biases, Adam step counters):
* `full`: weights and their Adam moments (exp_avg, exp_avg_sq), every weight trained;
* `full-w`: weights only, every one trained (no tensor to create on the receiver: what the
  transports themselves cost, without the page faults of new tensors);
* `frozen`: 90% of the weights frozen (a LoRA-like run); Adam moments for the trained 10%;
* `frozen-w`: the same weights without optimizer state (what a weights-only state sends).

Contestants: `http`, `http-4` (HTTPTransport, one stream and num_chunks=4), `pg`
(PGTransport on gloo, receiving in place), `ours` (Transport as configured by default) and,
for `full` only, `ours-huge` (Transport(huge_pages=True): the moments a receive creates are
backed by transparent huge pages).

The receiver is a replacement: a freshly built model (weights other than the sender's) and
an optimizer without state, passed as destinations. Situations:
* `none`: nothing to reuse; `local`: its near-tier repository holds the previous step (the
  sender's state one update ago: frozen weights unchanged, trained ones all different);
* `in place`: it built the frozen base itself (the pretrained weights), the rest differs.

Sender and receiver are pinned to one core each (two nodes of one core; other work on this
machine still shares them). Heal time = recv_checkpoint plus applying the result to the model
(a copy where the transport returned new tensors; torchft's Manager does it in
load_state_dict), the sender's send_checkpoint and the receiver's recv_checkpoint starting
together, as after a quorum. Bytes sent = what the
sender put on the wire for that heal (ours: the server's count; HTTP: the length of its
streamed torch.save; PG: every tensor it sends through the process group, counted by a
wrapper: its length word, its serialized metadata and the storages). Sender stall = what the
sender's training thread lost while serving (steps of one 1-thread MLP update run all along
on the sender, beside its server, as torchft's Manager runs send_checkpoint on its quorum
thread): the extra time of the steps that ran during the heal over the median step before
it, plus how long `disallow_checkpoint` (should_commit) blocked. In a Manager the healthy
replicas also wait for the heal at their next allreduce: that wait is the heal time.

Every received state is checked against the sender's (xxh3 of every tensor): column `ok`.
Prints a table (median and fastest of `--reps` runs, contestants alternated: this machine is
shared, so runs of one contestant vary by up to 2x) and, last, one JSON line with every
figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

# this checkout's ckptstore, whatever else is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB = 1 << 30
TIMEOUT = timedelta(seconds=300)
#: kind -> (weights, frozen weights, Adam moments for the trained ones)
KINDS = {"full": (8, 0, True), "full-w": (20, 0, False), "frozen": (20, 18, True),
         "frozen-w": (20, 18, False)}


# ------------------------------------------------------------------ states (both sides)
def layout(kind: str, gib: float) -> dict[str, Any]:
    """Tensor names and sizes of a state: {"weights": [...], "frozen": n, "adam": bool, ...}."""
    n_weights, n_frozen, adam = KINDS[kind]
    n_tensors = n_weights + (2 * (n_weights - n_frozen) if adam else 0)
    rows = int(gib * GiB) // 4 // 1024 // n_tensors
    return {"kind": kind, "weights": n_weights, "frozen": n_frozen, "adam": adam,
            "shape": [rows, 1024]}


def weight(lay: dict[str, Any], i: int, version: int) -> Any:
    """Weight i: frozen ones are the pretrained values; trained ones move each step."""
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    t = torch.rand(*lay["shape"], generator=g)
    if i >= lay["frozen"] and version:
        t.add_(version * 1e-3)
    return t


def build_state(lay: dict[str, Any], version: int) -> dict[str, Any]:
    """The sender's state at `version` (the receiver's local repository holds version-1)."""
    import torch

    model: dict[str, Any] = {}
    for i in range(lay["weights"]):
        model[f"layer{i}.weight"] = weight(lay, i, version)
        model[f"layer{i}.bias"] = torch.full((1024,), float(i + version))
    state: dict[str, Any] = {"model": model, "step": version}
    if lay["adam"]:
        moments = {}
        for j, i in enumerate(range(lay["frozen"], lay["weights"])):
            g = torch.Generator().manual_seed(5000 + 10 * i + version)
            moments[j] = {"step": torch.tensor(float(version)),
                          "exp_avg": torch.rand(*lay["shape"], generator=g),
                          "exp_avg_sq": torch.rand(*lay["shape"], generator=g)}
        params = list(range(lay["weights"] - lay["frozen"]))
        state["optim"] = {"state": moments, "param_groups": [
            {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "params": params}]}
    return state


def fresh_destinations(lay: dict[str, Any], dest: dict[str, Any] | None,
                       base_in_place: bool) -> dict[str, Any]:
    """The replacement's model (weights other than the sender's; with `base_in_place` the
    frozen ones are the pretrained values) and an optimizer without state. Reuses `dest`'s
    tensors (refilled) so that no run pays page faults another did not."""
    import torch

    if dest is None:
        model = {}
        for i in range(lay["weights"]):
            model[f"layer{i}.weight"] = (weight(lay, i, 0) if base_in_place and i < lay["frozen"]
                                         else torch.empty(*lay["shape"]))
            model[f"layer{i}.bias"] = torch.empty(1024)
        dest = {"model": model, "step": 0}
    for i in range(lay["weights"]):
        if not (base_in_place and i < lay["frozen"]):
            dest["model"][f"layer{i}.weight"].fill_(0.5)
        dest["model"][f"layer{i}.bias"].fill_(-1.0)
    if lay["adam"]:
        dest["optim"] = {"state": {}, "param_groups": []}
    return dest


def digests(state: Any, prefix: str = "") -> dict[str, str]:
    import torch
    import xxhash

    out: dict[str, str] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(digests(v, f"{prefix}{k}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = xxhash.xxh3_128_hexdigest(state.contiguous().numpy().data)
    return out


# ------------------------------------------------------------------ child processes
def send_line(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class CountingPG:
    """A process group that counts the bytes of every tensor sent through it: what
    PGTransport puts on the wire (the length, its serialized metadata, the tensors), counted
    as sent, without this bench serializing anything itself."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.sent = 0

    def send(self, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.sent += sum(int(t.nbytes) for t in tensors)
        return self._pg.send(tensors, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


class LazyPG:
    """The gloo group of the PG contestant, set up in the background at start (both sides
    must join it together)."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.pg: Any = None
        self._thread: threading.Thread | None = None
        if spec["pg"]:
            self._thread = threading.Thread(target=self._make, args=(spec["pg_port"], rank),
                                            daemon=True)
            self._thread.start()

    def _make(self, port: int, rank: int) -> None:
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(store_addr=f"127.0.0.1:{port}/heal-bench", replica_id="0", rank=rank,
                     world_size=2)
        self.pg = pg

    def get(self) -> Any:
        assert self._thread is not None
        self._thread.join()
        return self.pg


def pin(cpu: int) -> None:
    """Sender on core 0, receiver on core 1 (two nodes of one core each), where there are two
    (HEAL_BENCH_PIN=0: both use every core)."""
    if os.environ.get("HEAL_BENCH_PIN", "1") == "1" and (os.cpu_count() or 1) >= 2 \
            and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def warm_up() -> None:
    """One tiny heal through each HTTP transport in this process: imports and first-call
    costs are not what the bench measures."""
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport

    from ckptstore.torchft import Transport

    tiny = {"model": {"w": torch.rand(1000), "b": torch.rand(3)}}
    for t in (Transport(TIMEOUT), HTTPTransport(TIMEOUT, num_chunks=0)):
        t.send_checkpoint([1], 1, tiny, TIMEOUT)
        t.recv_checkpoint(0, t.metadata(), 1, TIMEOUT)
        t.disallow_checkpoint()
        t.shutdown(wait=False)


def sender_main(spec: dict[str, Any]) -> None:
    import torch
    from torch.utils._pytree import tree_flatten
    from torchft.checkpointing._serialization import _streaming_save
    from torchft.checkpointing.http_transport import HTTPTransport, _split_chunks
    from torchft.checkpointing.pg_transport import PGTransport

    from ckptstore.torchft import Transport

    pin(0)
    torch.set_num_threads(1)
    group = LazyPG(spec, 0)
    warm_up()
    lay = spec["layout"]
    state = build_state(lay, 1)
    steps: list[tuple[float, float]] = []
    lock = threading.Lock()
    training = threading.Event()
    paused = threading.Event()
    want_disallow = threading.Event()
    disallowed = threading.Event()
    current: dict[str, Any] = {}

    def disallow() -> None:
        d0 = time.monotonic()
        current["transport"].disallow_checkpoint()
        current["disallow"] = time.monotonic() - d0
        current["disallow_end"] = time.monotonic()
        disallowed.set()

    def train() -> None:  # the sender's training thread: one small MLP update after another
        net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                  torch.nn.Linear(512, 512))
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        x = torch.rand(128, 512)
        while True:
            if not training.is_set():
                paused.set()
                training.wait()
                paused.clear()
            t0 = time.monotonic()
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            t1 = time.monotonic()
            with lock:
                steps.append((t0, t1))
            if want_disallow.is_set():  # should_commit: disallow, between two steps
                want_disallow.clear()
                disallow()

    transports: dict[str, Any] = {}

    def transport(name: str) -> Any:
        if name not in transports:
            if name.startswith("ours"):
                transports[name] = Transport(TIMEOUT)
            elif name.startswith("http"):
                transports[name] = HTTPTransport(TIMEOUT, num_chunks=int(name[5:] or 0))
            else:
                transports[name] = PGTransport(CountingPG(group.get()), TIMEOUT,
                                               torch.device("cpu"))
        return transports[name]

    def wire_bytes(name: str) -> int:
        """What the transport put on the wire for one heal of `state` (module docstring)."""
        if name.startswith("ours"):
            served: int = transports[name].bytes_served
            return served

        class Count:
            n = 0

            def write(self, b: Any) -> int:
                k = len(memoryview(b).cast("B"))
                self.n += k
                return k

        if name.startswith("http"):
            chunks = int(name[5:] or 0)
            parts: list[Any] = [state]
            if chunks:
                values, treespec = tree_flatten(state)
                parts = [treespec, *_split_chunks(values, chunks)]
            total = 0
            for part in parts:
                c = Count()
                _streaming_save(part, c)  # type: ignore[arg-type]
                total += c.n
            return total
        sent_by_pg: int = transports[name]._pg.sent  # torchft serializes its metadata itself
        return sent_by_pg

    threading.Thread(target=train, daemon=True).start()
    training.set()
    send_line({"digests": digests(state)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "metadata":
            send_line({"metadata": transport(cmd["transport"]).metadata()})
        elif cmd["cmd"] == "prepare":  # undisturbed steps (the baseline), then pause if idle
            time.sleep(0.6)
            current.clear()
            current["busy"] = cmd["busy"]
            if not cmd["busy"]:
                training.clear()
                paused.wait()
            name = cmd["transport"]
            current["transport"] = transport(name)
            current["before"] = (int(transports[name].bytes_served) if name.startswith("ours")
                                 else transports[name]._pg.sent if name == "pg" else 0)
            send_line({"ready": True})
        elif cmd["cmd"] == "send":
            current["sent_at"] = time.monotonic()

            def send(t: Any = current["transport"], step: int = cmd["step"]) -> None:
                s0 = time.monotonic()  # torchft's Manager sends from its quorum thread
                t.send_checkpoint([1], step, state, TIMEOUT)
                current["send"] = time.monotonic() - s0

            current["quorum"] = threading.Thread(target=send)
            current["quorum"].start()
        elif cmd["cmd"] == "finish":  # the receiver is done: should_commit, then figures
            current["quorum"].join()
            if current["busy"]:
                want_disallow.set()
                disallowed.wait()
            else:
                disallow()
            disallowed.clear()
            training.set()
            with lock:
                base = [b - a for a, b in steps
                        if current["sent_at"] - 0.5 < a and b < current["sent_at"]]
                during = [b - a for a, b in steps
                          if current["sent_at"] <= a <= current["disallow_end"]]
            median = statistics.median(base) if base else float("nan")
            extra = sum(d - median for d in during)  # signed: noise cancels, it is not summed
            name = cmd["transport"]
            sent = wire_bytes(name) - current["before"]
            send_line({"stall": extra + current["disallow"], "extra_steps": extra,
                       "disallow": current["disallow"], "send": current["send"],
                       "step_ms": median * 1e3, "steps_during": len(during),
                       "bytes_sent": sent})
    for t in transports.values():
        if hasattr(t, "shutdown"):
            t.shutdown(wait=False)


def receiver_main(spec: dict[str, Any]) -> None:
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    import ckptstore
    from ckptstore.torchft import Transport

    pin(1)
    torch.set_num_threads(1)
    group = LazyPG(spec, 1)
    warm_up()
    lay = spec["layout"]
    local_dir = spec.get("local_dir")
    if local_dir:  # the previous step, saved by this node before it failed
        repo = ckptstore.CheckpointStore(local_dir)
        repo.save("step-0", build_state(lay, 0))
        repo.close()
        gc.collect()
    dests: dict[bool, dict[str, Any]] = {}
    send_line({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        name, situation = cmd["transport"], cmd["situation"]
        base = situation == "in place"
        dest = dests[base] = fresh_destinations(lay, dests.get(base), base)

        def into(dest: dict[str, Any] = dest) -> dict[str, Any]:
            return dest

        if name.startswith("ours"):
            t: Any = Transport(TIMEOUT, destinations=into, huge_pages=name == "ours-huge",
                               local=local_dir if situation == "local" else None)
        elif name.startswith("http"):
            t = HTTPTransport(TIMEOUT, num_chunks=int(name[5:] or 0))
        else:
            t = PGTransport(group.get(), TIMEOUT, torch.device("cpu"), state_dict=into)
        gc.collect()
        t0 = time.monotonic()
        got = t.recv_checkpoint(0, cmd["metadata"], cmd["step"], TIMEOUT)
        for k, v in got["model"].items():  # apply (load_state_dict)
            held = dest["model"][k]
            if v is not held:
                held.copy_(v)
        if lay["adam"]:
            dest["optim"] = got["optim"]
        seconds = time.monotonic() - t0
        info = t.last_receive if name.startswith("ours") else None
        send_line({"seconds": seconds, "info": None if info is None else info.__dict__})
        ok = digests({"model": dest["model"], **({"optim": dest["optim"]} if lay["adam"]
                                                 else {})}) == cmd["expect"]
        send_line({"ok": ok})
        if name != "pg":
            t.shutdown(wait=False)
        del got
        if lay["adam"]:
            dest["optim"] = {"state": {}, "param_groups": []}
        gc.collect()


# ------------------------------------------------------------------ the parent
class Child:
    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", role, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        if doc is not None:
            self.tell(doc)
        return self.read()

    def tell(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench child exited ({self.proc.wait()})")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell({"cmd": "quit"})
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_state(kind: str, gib: float, plan: list[tuple[str, str, str]], reps: int,
              tmp: str) -> list[dict[str, Any]]:
    """Heal `reps` times per (transport, situation, sender mode) in `plan`, alternated."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    lay = layout(kind, gib)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = {"layout": lay, "pg_port": store.port, "pg": any(p[0] == "pg" for p in plan)}
    local_dir = os.path.join(tmp, f"near-{kind}-{gib}")
    sender = Child("sender", spec)
    receiver = Child("receiver", {**spec, "local_dir": local_dir if any(
        p[1] == "local" for p in plan) else None})
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {p: [] for p in plan}
    step = 10
    try:
        expect = sender.read()["digests"]
        receiver.read()
        metadata = {name: sender.ask({"cmd": "metadata", "transport": name})["metadata"]
                    for name in {p[0] for p in plan}}
        for _rep in range(reps):
            for name, situation, mode in plan:
                step += 1
                sender.ask({"cmd": "prepare", "transport": name, "busy": mode == "busy"})
                sender.tell({"cmd": "send", "step": step})  # both at once, as after a quorum
                receiver.tell({"cmd": "recv", "transport": name, "situation": situation,
                               "metadata": metadata[name], "step": step, "expect": expect})
                got = receiver.read()
                fin = sender.ask({"cmd": "finish", "transport": name})
                got.update(receiver.read())  # checked after the sender's figures are taken
                rows[(name, situation, mode)].append({**got, **fin})
                print(f"  {kind:8} {gib:4.2f} GiB {name:7} {situation:8} {mode:4} heal "
                      f"{got['seconds']:6.2f} s  sent {fin['bytes_sent'] / GiB:6.3f} GiB  "
                      f"stall {fin['stall']:5.2f} s  ok={got['ok']}", file=sys.stderr)
    finally:
        sender.close()
        receiver.close()
        shutil.rmtree(local_dir, ignore_errors=True)
    state_bytes = 4 * lay["shape"][0] * lay["shape"][1] * (
        lay["weights"] + (2 * (lay["weights"] - lay["frozen"]) if lay["adam"] else 0))
    out = []
    for (name, situation, mode), runs in rows.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in runs))

        out.append({"state": kind, "gib": round(state_bytes / GiB, 3), "transport": name,
                    "situation": situation, "sender": mode, "heal_s": med("seconds"),
                    "heal_min_s": min(r["seconds"] for r in runs),
                    "heal_all_s": [round(r["seconds"], 3) for r in runs],
                    "bytes_sent": int(med("bytes_sent")),
                    "sent_fraction": med("bytes_sent") / state_bytes,
                    "stall_s": med("stall"), "disallow_s": med("disallow"),
                    "extra_step_s": med("extra_steps"), "send_call_s": med("send"),
                    "step_ms": med("step_ms"), "ok": all(r["ok"] for r in runs),
                    "info": runs[-1]["info"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--big-gib", type=float, default=4.0)
    ap.add_argument("--no-big", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--states", default="full,full-w,frozen,frozen-w",
                    help="which states to run (comma separated)")
    ap.add_argument("--transports", default="http,http-4,pg,ours,ours-huge",
                    help="which contestants to run (comma separated; a quicker iteration)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        role, spec = args.child
        (sender_main if role == "sender" else receiver_main)(json.loads(spec))
        return
    torchft_all = ["http", "http-4", "pg"]
    results: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="heal-bench-")
    t_start = time.monotonic()
    skipped = None
    try:
        g = args.gib
        contestants = [*torchft_all, "ours"]
        plans = {
            "full": [(t, "none", "idle") for t in contestants] + [("ours", "local", "idle"),
                                                                  ("ours-huge", "none", "idle")]
            + [(t, "none", "busy") for t in contestants],
            "full-w": [(t, "none", "idle") for t in contestants],
            "frozen": [("pg", "in place", "idle"), ("ours", "in place", "idle"),
                       ("ours", "local", "idle")],
            "frozen-w": [("ours", "in place", "idle")],
        }
        chosen = set(args.transports.split(","))
        for kind in args.states.split(","):
            plan = [p for p in plans[kind] if p[0] in chosen]
            if plan:
                results += run_state(kind, g, plan, args.reps if kind != "frozen-w" else 1,
                                     tmp)
        if not args.no_big and any(r["state"] == "full" for r in results):
            need = int(3.2 * args.big_gib * GiB)
            if mem_available() >= need:
                full_1 = [r for r in results if r["state"] == "full" and r["sender"] == "idle"
                          and r["transport"] in torchft_all]
                big = [("ours", "none", "idle")] if "ours" in chosen else []
                if full_1:
                    best = min(full_1, key=lambda r: r["heal_s"])["transport"]
                    big.insert(0, (best, "none", "idle"))
                results += run_state("full", args.big_gib, big, 1, tmp)
            else:
                skipped = (f"{args.big_gib:g} GiB skipped: {mem_available() / GiB:.1f} GiB "
                           f"available, {need / GiB:.1f} needed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{'state':9} {'GiB':>5} {'transport':9} {'situation':9} {'sender':6} "
          f"{'heal s':>7} {'min s':>6} {'sent GiB':>8} {'sent %':>6} {'stall s':>7} {'ok':>3}")
    for r in results:
        print(f"{r['state']:9} {r['gib']:5.2f} {r['transport']:9} {r['situation']:9} "
              f"{r['sender']:6} {r['heal_s']:7.2f} {r['heal_min_s']:6.2f} "
              f"{r['bytes_sent'] / GiB:8.3f} {100 * r['sent_fraction']:6.1f} "
              f"{r['stall_s']:7.2f} {'yes' if r['ok'] else 'NO':>3}")
    summary: dict[str, Any] = {}
    for kind, gib in sorted({(r["state"], r["gib"]) for r in results
                             if r["state"].startswith("full")}):
        full = [r for r in results if r["state"] == kind and r["gib"] == gib
                and r["situation"] == "none"]
        for mode in ("idle", "busy"):
            ours = [r for r in full if r["transport"] == "ours" and r["sender"] == mode]
            huge = [r for r in full if r["transport"] == "ours-huge" and r["sender"] == mode]
            theirs = [r for r in full if r["transport"] in torchft_all and r["sender"] == mode]
            if not ours or not theirs:
                continue
            best = min(theirs, key=lambda r: r["heal_s"])
            entry: dict[str, Any] = {
                "heal_ours_s": ours[0]["heal_s"], "best_torchft": best["transport"],
                "heal_best_torchft_s": best["heal_s"],
                "speedup_vs_best_torchft": best["heal_s"] / ours[0]["heal_s"],
                "speedup_vs_best_torchft_min": min(r["heal_min_s"] for r in theirs)
                / ours[0]["heal_min_s"]}
            if huge:
                entry["heal_ours_huge_pages_s"] = huge[0]["heal_s"]
                entry["speedup_huge_pages_vs_best_torchft"] = best["heal_s"] / huge[0]["heal_s"]
            if mode == "busy":
                entry["stall_ours_s"] = ours[0]["stall_s"]
                entry["stall_torchft_s"] = {r["transport"]: r["stall_s"] for r in theirs}
            summary[f"{kind}_{gib:g}GiB_sender_{mode}"] = entry
    frozen = [r for r in results if r["state"].startswith("frozen") and r["transport"] == "ours"]
    summary["sent_fraction_ours"] = {f"{r['state']}/{r['situation']}": r["sent_fraction"]
                                     for r in frozen}
    if skipped:
        summary["skipped"] = skipped
    print("\nheal s: median of the runs, min s: the fastest; summary:\n" + json.dumps(summary))
    print(json.dumps({"bench": "heal", "seconds": time.monotonic() - t_start,
                      "cpus": os.cpu_count(), "results": results, "summary": summary}))


if __name__ == "__main__":
    main()
