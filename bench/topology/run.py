#!/usr/bin/env python3
"""bench/topology/run.py: refitd relays over an emulated cross-region link (README.md here).

One command, as root. Region A (the publisher's network namespace) and region B (the rollout
namespace) are joined by bench/wan's link_relay (one-way delay, rate, tail-drop queue). In
region B: relay-1 (a subscriber with serve_peers, upstream the publisher across the link),
relay-2 (upstream relay-1), --subs-per-relay subscribers behind each relay, and one subscriber
straight from the publisher across the link ("direct": the baseline, measured in the same run).
Every connection is mTLS. The realistic trajectory of bench/wan is published as a trainer does
(TrainerApi), and every version is waited for on every subscriber and relay (bit-exact: their
version digests equal the publisher's).

The topology runs twice in the same link window: relays that encode every version again for
their peers (relay_cut_through: false, the path before relays) and cut-through relays. Per
version: bytes the publisher sent over the region link (to the relay, and to the direct
subscriber), the delta's size, e2e per daemon (publish call to applied), per-hop added latency.

    sudo bench/topology/run.py                          # medium model, 50 ms / 1 Gbit/s
    sudo bench/topology/run.py --model tiny --versions 3 --out-dir /tmp/topo   # smoke

Exit status: 0 ok; 1 a failure (a daemon died, a digest differed); 77 skipped (no privileges).
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench", "wan"))
import run as wan  # noqa: E402  (bench/wan/run.py: namespaces, link relay, daemons, trajectory)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
    p.add_argument("--model", default="medium", help="bench/wan trajectory preset")
    p.add_argument("--link", default="50ms-1g", help="RTTms-RATE[m|g]")
    p.add_argument("--versions", type=int, default=8, help="delta versions after the keyframe")
    p.add_argument("--warmup-deltas", type=int, default=2)
    p.add_argument("--shards", type=int, default=4,
                   help="shard publishers in region A (K; 1 = one unsharded publisher)")
    p.add_argument("--subs-per-relay", type=int, default=3)
    p.add_argument("--selections", default="model.layers.0.*;model.layers.1.*,model.norm.weight",
                   help="';'-separated tensor selections (comma-separated patterns each): one "
                        "more subscriber per selection, behind relay-1, relay-2, relay-1, ...")
    p.add_argument("--streams", type=int, default=4, help="upstream.connections of every daemon")
    p.add_argument("--modes", default="reencode,cut-through",
                   help="relay modes, run in this order in the same link window")
    p.add_argument("--background-nice", type=int, default=None,
                   help="every subscriber's background_nice (default: the daemon's, 10); 0 "
                        "runs background threads at the data path's priority (comparison)")
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    a = p.parse_args(argv)
    a.mode_list = [m for m in a.modes.split(",") if m]
    if any(m not in ("reencode", "cut-through") for m in a.mode_list) or not a.mode_list:
        p.error(f"--modes: {a.modes!r}: reencode and/or cut-through")
    if a.versions < 1 or a.subs_per_relay < 0 or not 1 <= a.shards <= 64:
        p.error("--versions must be >= 1, --subs-per-relay >= 0 and --shards 1 .. 64")
    a.selection_list = [[x for x in sel.split(",") if x] for sel in a.selections.split(";")
                        if sel.strip(",")]
    # bench/wan's options for what its helpers read (threads, digests, queue, sysctls, ...).
    a.wan = wan.parse_args(["--build-dir", a.build_dir, "--models", a.model, "--links", a.link,
                            "--versions", str(a.versions), "--streams", str(a.streams)])
    return a


def relay_yaml(base: str, pki: dict, cut_through: bool) -> str:
    """A bench/wan subscriber config that also serves peers on loopback (mTLS, region B)."""
    return base + (f"  listen: {wan.q('127.0.0.1:0')}\n"
                   f"  tls:\n    cert: {wan.q(pki['server']['cert'])}\n"
                   f"    key: {wan.q(pki['server']['key'])}\n    ca: {wan.q(pki['ca'])}\n"
                   f"  serve_peers: true\n"
                   f"  relay_cut_through: {'true' if cut_through else 'false'}\n")


SHARD_SET = "wan"


def publishers(link, d: str, traj: str, pki: dict, args, bins: dict) -> list:
    """Region A: one publisher, or K shard publishers (publisher.shard, each in its own
    directory: ready file, sockets, persisted baseline)."""
    sharded = args.shards > 1
    out = []
    for k in range(args.shards):
        sd, name = (os.path.join(d, f"shard-{k}"), f"wan-pub-{k}") if sharded else (d, "wan-pub")
        os.makedirs(sd, exist_ok=True)
        y = wan.publisher_yaml(sd, link.pub_ip, pki, os.path.dirname(traj), args.wan,
                               args.streams).replace("name: wan-pub\n", f"name: {name}\n", 1)
        if sharded:
            y += f"  shard:\n    set: {SHARD_SET}\n    index: {k}\n    count: {args.shards}\n"
        out.append(wan.Daemon(link, link.pub_ns, "publisher", name, sd, y, bins))
    return out


def upstream_lines(upstream, tensors=None) -> str:
    """The subscriber's upstream block: one address, or a list of shard addresses
    (upstream.shards, shard_set); with `tensors`, a selection (upstream.tensors)."""
    if isinstance(upstream, list):
        out = f"    shard_set: {SHARD_SET}\n    shards:\n" + "".join(
            f"    - addresses: [{wan.q(x)}]\n" for x in upstream)
    else:
        out = f"    addresses: [{wan.q(upstream)}]\n"
    if tensors:
        out += "    tensors: [" + ", ".join(wan.q(t) for t in tensors) + "]\n"
    return out


def subscriber(link, d: str, name: str, upstream, pki: dict, args, bins: dict,
               relay: bool = False, cut_through: bool = True, tensors=None) -> wan.Daemon:
    y = wan.subscriber_yaml(d, name, "", pki, args.wan, args.streams,
                            upstream_lines(upstream, tensors))
    if args.background_nice is not None:
        y += f"  background_nice: {args.background_nice}\n"
    if relay:
        y = relay_yaml(y, pki, cut_through)
    daemon = wan.Daemon(link, link.sub_ns, "subscriber", name, d, y, bins)
    daemon.start()
    return daemon


def cpu_snapshot(daemons: list) -> dict:
    """CPU (ms) each daemon process has used so far, by name."""
    return {x.name: wan.cpu_ms(x.proc) for x in daemons}


def session_bytes(bins: dict, pubs: list) -> dict:
    """Payload bytes the publishers sent per session, by subscriber name (summed over shards)."""
    out = {}
    for pub in pubs:
        st = wan.refitctl_status(bins, pub.control())
        for s in st.get("sessions", []):
            out[s.get("name")] = out.get(s.get("name"), 0) + wan.i64(s.get("bytes_sent"))
    return out


def check_digests(k: int, raw: dict, digests: dict) -> None:
    """Every daemon's version digest (in the format it verified in) equals the digest of the
    trainer's whole version, computed by wan_step from the file, and (unsharded) the
    publisher's."""
    exp = raw.get("expected", {})
    want = {1: wan.i64(exp.get("version_digest")), 2: wan.i64(exp.get("version_digest_v2"))}
    if raw.get("shards", 0) == 0:
        # The publisher's v1 digest is 0 (left pending) unless a v1 session was admitted.
        pub = raw.get("publisher_status", {})
        pub_v1 = wan.i64(pub.get("version_digest_v1"))
        if wan.i64(pub.get("version_digest")) != want[2] or pub_v1 not in (0, want[1]):
            raise wan.Failure(f"version {k + 1}: the publisher's digests differ from the file's")
    bad = [n for n, (dg, fmt) in digests.items() if dg != want.get(fmt if fmt else 1)]
    if bad:
        raise wan.Failure(f"version {k + 1}: version digests differ from the trainer's: {bad}")


def change_rate(raw: dict):
    """The version's change rate over all shards (weighted by their bytes)."""
    st = raw.get("publishers_status") or [raw.get("publisher_status", {})]
    rates = [(s.get("last_refit", {}).get("change_rate"), wan.i64(s.get("model_bytes")))
             for s in st]
    total = sum(b for _, b in rates)
    if any(r is None for r, _ in rates) or not total:
        return None
    return sum(r * b for r, b in rates) / total


def version_record(k: int, kind: str, raw: dict, daemons: list, before: dict, after: dict,
                   selecting: list) -> dict:
    t0 = raw["publish_start_unix_ns"]
    names = [x.name for x in daemons]
    e2e, wire, digests, arrived = {}, {}, {}, {}
    for x, s in zip(daemons, raw["subscriber_status"]):
        name = x.name
        refit = s.get("last_refit", {})
        if wan.i64(refit.get("version")) != k + 1 or wan.i64(s.get("version")) != k + 1:
            raise wan.Failure(f"version {k + 1}: {name} reports version {s.get('version')}")
        e2e[name] = (wan.i64(refit.get("finished_unix_nanos")) - t0) / 1e6
        # When its last byte arrived: the applied line's latency (header -> announced) minus
        # its receive time (header -> VersionEnd with every frame) is the daemon's own tail.
        sl = wan.parse_sub_log(x.log_text(), k + 1)
        if "latency_ms" in sl and "receive_ms" in sl:
            arrived[name] = e2e[name] - (sl["latency_ms"] - sl["receive_ms"])
        wire[name] = wan.i64(refit.get("wire_bytes"))
        if name not in selecting:  # a selection's digest is over its tensors only
            digests[name] = (wan.i64(s.get("version_digest")), wan.i64(s.get("digest_format")))
    check_digests(k, raw, digests)
    sent = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    relays = {n: s.get("relay", {}) for n, s in zip(names, raw["subscriber_status"])
              if n.startswith("relay")}
    selected = {n: {"wire_bytes": wire[n], "patch_bytes": b}
                for n, b in zip(selecting, raw.get("selected_patch_bytes", []))}
    return {"version": k + 1, "kind": kind, "change_rate": change_rate(raw),
            "delta_bytes": wire.get("direct"), "e2e_ms": e2e, "arrived_ms": arrived,
            "wire_bytes": wire,
            "link_bytes": sent, "link_bytes_to_relays": sent.get("relay-1", 0),
            "selected": selected, "relay_status": relays}


def region_b(link, d: str, upstream, pki: dict, args, bins: dict, cut: bool) -> tuple:
    """direct (the baseline), relay-1 (across the link), relay-2 (behind relay-1), the plain
    subscribers behind each relay and the selecting ones. Returns (daemons, the selecting
    subscribers' patterns by name)."""
    daemons = [subscriber(link, d, "direct", upstream, pki, args, bins)]
    r1 = subscriber(link, d, "relay-1", upstream, pki, args, bins, relay=True, cut_through=cut)
    r2 = subscriber(link, d, "relay-2", r1.ready["listen"], pki, args, bins, relay=True,
                    cut_through=cut)
    daemons += [r1, r2]
    for i in range(args.subs_per_relay):
        daemons.append(subscriber(link, d, f"hop1-{i}", r1.ready["listen"], pki, args, bins))
        daemons.append(subscriber(link, d, f"hop2-{i}", r2.ready["listen"], pki, args, bins))
    selecting = {}
    for i, sel in enumerate(args.selection_list):
        hop = 1 + i % 2
        name = f"sel{hop}-{i}"
        relay = (r1, r2)[hop - 1]
        daemons.append(subscriber(link, d, name, relay.ready["listen"], pki, args, bins,
                                  tensors=sel))
        selecting[name] = sel
    return daemons, selecting


def run_mode(link, mode: str, traj: str, bins: dict, pki: dict, args, workdir: str) -> dict:
    cut = mode == "cut-through"
    d = tempfile.mkdtemp(prefix=f"topo-{mode}-", dir=workdir)
    os.makedirs(os.path.join(d, "export"))
    pubs = publishers(link, d, traj, pki, args, bins)
    daemons, records, stepper = [], [], None
    try:
        addrs = [p.start()["listen"] for p in pubs]
        upstream = addrs if args.shards > 1 else addrs[0]
        daemons, selecting = region_b(link, d, upstream, pki, args, bins, cut)
        for p in pubs:
            wan.wait_connected(bins, p, 2)
        names = [x.name for x in daemons]
        extra = [a for sel in args.selection_list for a in ("--selected-patch-bytes",
                                                             ",".join(sel))]
        stepper = wan.WanStep(bins, pubs if args.shards > 1 else pubs[0], daemons,
                              "trainer_api", d, extra)
        everyone = pubs + daemons
        for k in range(args.versions + 1):
            before = session_bytes(bins, pubs)
            c0 = cpu_snapshot(everyone)
            if records:  # what the previous version still cost after its step (e.g. adopting)
                records[-1]["cpu_after_ms"] = {n: c0[n] - c_end[n] for n in c0}
            raw = stepper.step(k + 1, wan.version_file(traj, k), k == args.versions)
            c_end = cpu_snapshot(everyone)
            kind = "keyframe" if k == 0 else ("warmup_delta" if k <= args.warmup_deltas
                                              else "steady_delta")
            rec = version_record(k, kind, raw, daemons, before, session_bytes(bins, pubs),
                                 selecting)
            rec["cpu_ms"] = {n: c_end[n] - c0[n] for n in c0}
            if k == args.versions and not all(v.get("ok") for v in raw.get("verify", [])):
                raise wan.Failure(f"version {k + 1}: Verify failed somewhere: {raw.get('verify')}")
            records.append(rec)
            log_version(mode, kind, rec, names)
        check_exports(bins, daemons, selecting, wan.version_file(traj, args.versions))
    finally:
        if stepper is not None:
            stepper.close()
        for x in daemons:
            x.stop()
        for p in pubs:
            p.stop()
    return {"mode": mode, "versions": records,
            "summary": summarise(records, names, [p.name for p in pubs], selecting),
            "logs": {x.name: x.log_path for x in pubs + daemons}}


def log_version(mode: str, kind: str, rec: dict, names: list) -> None:
    e = rec["e2e_ms"]
    wan.log(f"  {mode} v{rec['version']} {kind}: delta {rec['delta_bytes']} B, to relays "
            f"{rec['link_bytes_to_relays']} B; e2e direct {e['direct']:.0f}, relay-1 "
            f"{e['relay-1']:.0f}, relay-2 {e['relay-2']:.0f}" +
            "".join(f", {n} {e[n]:.0f}" for n in names if n.startswith(("hop", "sel"))) + " ms" +
            "".join(f"; {n} {x['wire_bytes']} B of patches {x['patch_bytes']} B"
                    for n, x in rec["selected"].items()))


def check_exports(bins: dict, daemons: list, selecting: dict, source: str) -> None:
    """After the last version every subscriber exports the trainer's tensors byte for byte
    (Export through refitctl, compared tensor by tensor): the whole file, or exactly the
    tensors its selection names."""
    want = wan.read_safetensors(source)
    for x in daemons:
        out = os.path.join(x.dir, "export", f"{x.name}.safetensors")
        wan.sh(bins["refitctl"], "--target", x.control(), "export", "--safetensors", out)
        got = wan.read_safetensors(out)
        os.remove(out)
        sel = selecting.get(x.name)
        expect = want if sel is None else {
            n: v for n, v in want.items() if any(fnmatch.fnmatchcase(n, p) for p in sel)}
        if got != expect:
            raise wan.Failure(f"{x.name}: its export ({len(got)} tensors) differs from the "
                              f"trainer's {source} ({len(expect)} tensors"
                              f"{' selected' if sel else ''})")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def arrival_of(r: dict, name: str) -> bool:
    a = r.get("arrived_ms", {})
    return name in a and "direct" in a and ("relay-1" in a or name == "relay-1")


def summarise(records: list, names: list, pub_names: list, selecting: dict) -> dict:
    steady = [r for r in records if r["kind"] == "steady_delta"]
    sel_ratio = {n: [r["selected"][n]["wire_bytes"] / r["selected"][n]["patch_bytes"]
                     for r in steady if r["selected"][n]["patch_bytes"]] for n in selecting}
    e2e = {n: med([r["e2e_ms"][n] for r in steady]) for n in names}
    far = [n for n in names if n.startswith("hop2")] or ["relay-2"]
    hop2 = med([r["e2e_ms"][n] for r in steady for n in far])
    each = [r["e2e_ms"][n] / r["e2e_ms"]["direct"] for r in steady for n in far
            if r["e2e_ms"]["direct"]]
    return {
        "steady_versions": len(steady),
        "e2e_median_ms": e2e,
        "hop2_over_direct": hop2 / e2e["direct"] if hop2 and e2e["direct"] else None,
        # Per steady version and subscriber two hops down: its e2e over the direct one's.
        "hop2_over_direct_each": {"median": med(each), "max": max(each) if each else None,
                                  "within_1.1": sum(1 for x in each if x <= 1.1),
                                  "of": len(each)},
        # What each hop adds (medians of per-version differences).
        "added_ms": {
            "relay-1 - direct": med([r["e2e_ms"]["relay-1"] - r["e2e_ms"]["direct"] for r in steady]),
            "relay-2 - relay-1": med([r["e2e_ms"]["relay-2"] - r["e2e_ms"]["relay-1"]
                                      for r in steady]),
        },
        # When the last byte arrived (e2e minus the daemon's own verify/apply tail): what each
        # relay hop adds on the path itself, without the CPU the daemons of this one machine
        # take from each other for their tails.
        "arrival_added_ms": {
            "relay-1 - direct": med([r["arrived_ms"]["relay-1"] - r["arrived_ms"]["direct"]
                                     for r in steady if arrival_of(r, "relay-1")]),
            "relay-2 - relay-1": med([r["arrived_ms"]["relay-2"] - r["arrived_ms"]["relay-1"]
                                      for r in steady if arrival_of(r, "relay-2")]),
            "hop2 - direct": med([r["arrived_ms"][n] - r["arrived_ms"]["direct"]
                                  for r in steady for n in far if arrival_of(r, n)]),
        },
        # Region link: bytes sent to relay-1 (everything region B needs besides the direct
        # baseline subscriber) per byte of the delta.
        "link_over_delta": med([r["link_bytes_to_relays"] / r["delta_bytes"] for r in steady
                                if r["delta_bytes"]]),
        "delta_bytes_median": med([r["delta_bytes"] for r in steady]),
        # CPU per steady version and daemon: during the step (publish to every daemon applied)
        # plus after it until the next publish (a relay installing the version for its peers).
        "cpu_ms_median": {n: med([r["cpu_ms"][n] + r.get("cpu_after_ms", {}).get(n, 0)
                                  for r in steady]) for n in pub_names + names},
        # Selections: the selecting subscriber's wire bytes per byte of its tensors' patches
        # (wan_step encodes them from the files), median and largest over the steady versions.
        "selected_over_patches": {n: {"median": med(x), "max": max(x) if x else None}
                                  for n, x in sel_ratio.items()},
        "change_rate_median": med([r["change_rate"] for r in steady]),
    }


def markdown(result: dict) -> str:
    out = [f"# bench/topology {result['date']} ({result['git_rev']})", "",
           f"`{result['command']}`: model {result['model']} ({result['model_bytes']} bytes), "
           f"{result['shards']} publisher shard(s), link {result['link']}, "
           f"{result['subs_per_relay']} subscriber(s) per relay and {len(result['selections'])} "
           f"with a selection ({'; '.join(','.join(x) for x in result['selections'])}), "
           f"machine {result['machine']}", "",
           "| relays | delta (B) | link / delta | direct e2e | relay-1 | relay-2 | hop-2 subs / "
           "direct | relay-1 adds | relay-2 adds |", "|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        s = run["summary"]
        e = s["e2e_median_ms"]
        far = [n for n in e if n.startswith("hop2")]
        out.append(f"| {run['mode']} | {wan.fmt(s['delta_bytes_median'])} | "
                   f"{wan.fmt(s['link_over_delta'], '{:.3f}')} | {wan.fmt(e['direct'])} | "
                   f"{wan.fmt(e['relay-1'])} | {wan.fmt(e['relay-2'])} | "
                   f"{wan.fmt(s['hop2_over_direct'], '{:.2f}')}"
                   f"{'' if far else ' (relay-2)'} | {wan.fmt(s['added_ms']['relay-1 - direct'])} | "
                   f"{wan.fmt(s['added_ms']['relay-2 - relay-1'])} |")
    out += ["", "Subscribers two relay hops down, per steady version: e2e over the direct one's "
            "(median, max, versions x subscribers within 1.1x):", ""]
    out += [f"- {run['mode']}: {wan.fmt(run['summary']['hop2_over_direct_each']['median'], '{:.2f}')}"
            f", {wan.fmt(run['summary']['hop2_over_direct_each']['max'], '{:.2f}')}, "
            f"{run['summary']['hop2_over_direct_each']['within_1.1']} of "
            f"{run['summary']['hop2_over_direct_each']['of']}" for run in result["runs"]]
    out += ["", "Last byte arrived, added per hop (ms, medians of the steady deltas): "
            + "; ".join(f"{run['mode']}: " + ", ".join(
                f"{k} {wan.fmt(v)}" for k, v in run["summary"]["arrival_added_ms"].items())
                for run in result["runs"])]
    out += ["", "CPU per steady version (ms, medians; during the step and after it until the next "
            "publish):", "", "| relays | " + " | ".join(result["runs"][0]["summary"]
                                                      ["cpu_ms_median"]) + " |",
            "|---|" + "---|" * len(result["runs"][0]["summary"]["cpu_ms_median"])]
    for run in result["runs"]:
        out.append(f"| {run['mode']} | " + " | ".join(
            wan.fmt(x) for x in run["summary"]["cpu_ms_median"].values()) + " |")
    sel = [(run["mode"], n, x) for run in result["runs"]
           for n, x in run["summary"]["selected_over_patches"].items()]
    if sel:
        out += ["", "Selections: wire bytes per byte of the selected tensors' patches (steady "
                "deltas):", "", "| relays | subscriber | median | max |", "|---|---|---|---|"]
        out += [f"| {m} | {n} | {wan.fmt(x['median'], '{:.4f}')} | {wan.fmt(x['max'], '{:.4f}')} |"
                for m, n, x in sel]
    out += ["", "e2e: publish call to applied (ms, medians of the steady deltas); link / delta: "
            "bytes the publisher sent to relay-1 per byte of the delta; hop-2 subs: subscribers "
            "behind relay-2 (two relay hops)."]
    return "\n".join(out) + "\n"


def main(argv) -> int:
    args = parse_args(argv)
    try:
        wan.check_privileges()
    except wan.Skip as e:
        print(f"bench/topology: SKIPPED: {e}", file=sys.stderr)
        return wan.EXIT_SKIP
    wan.remove_stale_namespaces()
    bins = wan.find_bins(args.build_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="refit-topo-")
    os.chmod(workdir, 0o755)
    wan.log(f"run directory {workdir}")
    pki = wan.make_pki(workdir, ["10.77.0.1", "127.0.0.1"])
    traj = wan.trajectory(bins, args.wan.cache_dir, args.model, args.wan.seed, args.versions)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "git_rev": wan.git_rev(), "command": " ".join(["bench/topology/run.py"] + argv),
              "model": args.model, "model_bytes": os.path.getsize(wan.version_file(traj, 0)),
              "link": args.link, "subs_per_relay": args.subs_per_relay, "shards": args.shards,
              "selections": args.selection_list,
              "machine": {"cpus": os.cpu_count(), "loadavg_before": wan.load_average()},
              "runs": []}
    with wan.Link(0, args.wan.link_specs[0], bins, args.wan, workdir) as link:
        for mode in args.mode_list:
            wan.log(f"{args.model} on {args.link}: relays {mode}")
            result["runs"].append(run_mode(link, mode, traj, bins, pki, args, workdir))
    result["machine"]["loadavg_after"] = wan.load_average()
    stem = "topology-" + result["date"].replace(":", "").replace("-", "")[:15]
    with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, stem + ".md"), "w") as f:
        f.write(markdown(result))
    wan.log(f"wrote {args.out_dir}/{stem}.json and .md")
    sys.stdout.write(markdown(result))
    if args.keep:
        wan.log(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except wan.Failure as e:
        print(f"bench/topology: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
