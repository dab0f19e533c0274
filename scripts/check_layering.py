#!/usr/bin/env python3
"""Checks that #include lines follow refitd's layering (docs/ARCHITECTURE.md "Layering").

Each source file belongs to a component (a directory, or a named group of files within one);
a component may include only from the components listed as below it. Also:
  - only daemon/metrics includes prometheus-cpp ("prometheus/...");
  - the cores (the subscriber and the serving/publisher cores) include no concrete store and no
    file format (daemon/model);
  - the metrics implementation (the rest of daemon/metrics) only in a daemon's top level
    (…_daemon.cc), which assembles the endpoint;
  - includes are followed: a header of an allowed component that itself includes (directly or
    further down) a header of a component the file may not use is a violation of the file too
    ("through" names the chain), so a layer cannot be reached through another's header.
Prints each violation as FILE:LINE: what and why, and exits 1 if there is any; 0 otherwise.
Usage: scripts/check_layering.py [REPO_ROOT]
"""
import os
import re
import sys

# Component -> the components it may include (besides itself and generated protos "refit/v1/").
# Listed bottom-up; a component may use only those above it in this list, as named.
ALLOWED = {
    "common": set(),
    "codec": {"common"},
    "cuda": {"common", "codec"},
    "model": {"common", "codec"},
    "config": {"common"},
    "sync": {"common", "codec", "model"},
    "metrics": {"common", "config"},
    "auth": {"common", "config"},
    "store": {"common", "codec", "cuda"},
    "serving": {"common", "codec", "cuda", "sync", "store", "metrics_api", "config", "auth",
                "model"},
    # The daemons reach file formats only through serving (version_file.h writes an export).
    "subscriber": {"common", "codec", "cuda", "sync", "store", "serving", "metrics_api", "config",
                   "auth", "runtime"},
    "publisher": {"common", "codec", "cuda", "sync", "store", "serving", "metrics_api", "config",
                  "auth", "runtime"},
    # The daemon's runtime: servers, signals, and the whole config's checks (GPU UUIDs through
    # cuda/device.h, which names the codec's types; tensor selections through sync).
    "runtime": {"common", "config", "metrics", "metrics_api", "auth", "cuda", "sync", "codec"},
    "cli": {"common", "config", "runtime", "publisher", "subscriber", "serving", "metrics", "auth",
            "sync", "store", "codec", "cuda", "model", "metrics_api"},
    "client": {"common", "config", "runtime", "sync", "codec", "model", "metrics", "auth"},
}
# The metrics interface (what the cores call) sits below everything that reports metrics; only
# its prometheus-cpp implementation (the rest of daemon/metrics) may include prometheus.
METRICS_API_FILES = {"daemon/metrics/refit_metrics.h"}
ALLOWED["metrics_api"] = {"common"}
ALLOWED["metrics"] |= {"metrics_api"}

# Files of the cores: no concrete store, no file format.
CORE_FILES = re.compile(
    r"^daemon/(subscriber/(subscriber_core|transfer_plan|verification|slot_staging|"
    r"standby_refresh|single_copy|single_copy_refit|change_log|staged_transfer)|"
    r"serving/publisher_core[a-z_]*)\.(h|cc)$")
CONCRETE = re.compile(r'^daemon/(store/(shm_store|cuda_store)\.h|model/)')
# Concrete stores: above daemon/store only a daemon's top level names them (it builds the store
# factory); cores and services use the TensorStore interface (TensorStore::Region for consumers).
CONCRETE_STORE = re.compile(r'^daemon/store/(shm_store|cuda_store)\.h$')
STORE_USERS = {"serving", "subscriber", "publisher"}
# A daemon's top level (it assembles the stores, services and the metrics endpoint).
DAEMON_FILES = re.compile(r"^daemon/(publisher|subscriber)/[a-z_]+_daemon\.(h|cc)$")


def component(path):
    """The component of a repo-relative path, or None for files outside the layering."""
    if path in METRICS_API_FILES:
        return "metrics_api"
    parts = path.split("/")
    if parts[0] == "daemon" and len(parts) > 2:
        return parts[1]
    if parts[0] in ("cuda", "client"):
        return parts[0]
    return None


def is_test_file(path):
    base = os.path.basename(path)
    return (base.endswith(("_test.cc", "_testing.cc", "_testing.h", "_fuzzer.cc", "_main.cc"))
            or "fuzz" in base or "golden" in base or base.startswith("make_")
            or "/emu/" in path or base.endswith("_test.cu"))


INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


def includes_of(root, path, cache):
    """[(line, included path)] of the project headers `path` includes (those that exist)."""
    if path not in cache:
        found = []
        full = os.path.join(root, path)
        if os.path.isfile(full):
            with open(full, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m and os.path.isfile(os.path.join(root, m.group(1))):
                        found.append((lineno, m.group(1)))
        cache[path] = found
    return cache[path]


def reached_through(root, header, allowed, comp, cache):
    """The first header below `header` (transitively) of a component `comp` may not use, as the
    chain of includes from `header` to it; None when there is none."""
    seen = {header}
    stack = [(header, [header])]
    while stack:
        path, chain = stack.pop()
        for _, inc in includes_of(root, path, cache):
            if inc in seen:
                continue
            seen.add(inc)
            target = component(inc)
            if target is not None and target != comp and target not in allowed:
                return chain + [inc]
            stack.append((inc, chain + [inc]))
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    bad = []
    files = 0
    cache = {}
    for top in ("daemon", "cuda", "client"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                if not name.endswith((".h", ".cc", ".cu", ".cuh", ".inc")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), root)
                comp = component(path)
                if comp is None:
                    continue
                files += 1
                test = is_test_file(path)
                with open(os.path.join(root, path), encoding="utf-8") as f:
                    for lineno, line in enumerate(f, 1):
                        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                        if not m:
                            continue
                        inc = m.group(1)
                        where = f"{path}:{lineno}"
                        if inc.startswith("prometheus/") and comp != "metrics":
                            bad.append(f"{where}: includes {inc}: only daemon/metrics uses "
                                       "prometheus-cpp (others report through refit_metrics.h)")
                            continue
                        target = component(inc)
                        if target is None or target == comp:
                            continue
                        if not test and CORE_FILES.match(path) and CONCRETE.match(inc):
                            bad.append(f"{where}: includes {inc}: a core knows the store "
                                       "interface and no file format")
                            continue
                        if (not test and comp in STORE_USERS and CONCRETE_STORE.match(inc)
                                and not DAEMON_FILES.match(path)):
                            bad.append(f"{where}: includes {inc}: only a daemon's top level "
                                       "names a concrete store (others use TensorStore)")
                            continue
                        if test and comp not in ("common",):
                            continue  # tests and tools may use any lower or sibling layer
                        if DAEMON_FILES.match(path) and target == "metrics":
                            continue  # a daemon assembles its metrics endpoint
                        allowed = ALLOWED.get(comp, set())
                        if target not in allowed:
                            bad.append(f"{where}: includes {inc}: {comp} may not depend on "
                                       f"{target} (allowed: {', '.join(sorted(allowed)) or 'nothing'})")
                            continue
                        chain = reached_through(root, inc, allowed, comp, cache)
                        if chain is not None:
                            bad.append(f"{where}: includes {inc}, which reaches {chain[-1]} "
                                       f"(through {' -> '.join(chain)}): {comp} may not depend "
                                       f"on {component(chain[-1])}")
    for b in bad:
        print(b)
    print(f"check_layering: {files} files, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
