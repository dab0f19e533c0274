#!/usr/bin/env python3
"""Checks the shipped deploy files against docs/SECURITY.md (ctest `deploy_hardening`, label security).

  check_deploy.py REFITD_BIN CONFIG_CHECK_BIN

- systemd: `systemd-analyze verify` of the unit (ExecStart pointed at the built refitd) is clean,
  and `systemd-analyze security --offline=true` rates its exposure at most 2.0 ("OK").
- Kubernetes: every container runs as non-root with a read-only root filesystem, no privilege
  escalation, all capabilities dropped; the pod uses the RuntimeDefault seccomp profile and does not
  mount a service-account token; the socket volume (/run/refitd) is an emptyDir mounted by exactly
  the sidecar and the inference container; the ConfigMap's subscriber.yaml validates; and what the
  subscriber relies on matches its config: the image this repo builds (refitd:<version>), probes on
  the gRPC health port of `listen`, the metrics port (containerPort and prometheus.io/port) of
  `metrics.listen`, --config on the mounted ConfigMap, TLS files in a Secret,
  sockets in the shared volume, /dev/shm memory-backed for an shm store, the image's USER the
  pod's runAsUser.
Prints one line per failed check and exits 1 if any failed.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


UNITS = ("refitd-publisher.service", "refitd-subscriber.service")


def check_systemd(refitd):
    if shutil.which("systemd-analyze") is None:
        print("check_deploy: systemd-analyze not installed; systemd checks skipped")
        return
    for name in UNITS:
        with open(os.path.join(HERE, "systemd", name)) as f:
            text = f.read()
        # Readiness and the watchdog (the daemons speak sd_notify: daemon/common/systemd_notify.h).
        for line in ("Type=notify", "NotifyAccess=main"):
            check(line in text.splitlines(), f"{name}: no {line}")
        check(any(l.startswith("WatchdogSec=") for l in text.splitlines()),
              f"{name}: no WatchdogSec=")
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, name)
            with open(copy, "w") as f:
                f.write(text.replace("/usr/local/bin/refitd", refitd))
            v = subprocess.run(["systemd-analyze", "verify", copy], capture_output=True, text=True)
            out = (v.stdout + v.stderr).strip()
            check(v.returncode == 0 and out == "",
                  f"{name}: systemd-analyze verify: rc {v.returncode}: {out}")
            s = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=20",
                                copy], capture_output=True, text=True)
            overall = [l for l in s.stdout.splitlines() if "Overall exposure" in l]
            check(s.returncode == 0, f"{name}: systemd exposure above 2.0: {overall}")


def check_k8s(config_check):
    with open(os.path.join(HERE, "k8s", "subscriber-sidecar.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    deploy = next(d for d in docs if d.get("kind") == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    psc = pod.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True, "pod securityContext.runAsNonRoot is not true")
    check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
          "pod seccompProfile is not RuntimeDefault")
    check(pod.get("automountServiceAccountToken") is False,
          "pod mounts a service-account token")
    for c in pod["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        check(sc.get("runAsNonRoot") is True or psc.get("runAsNonRoot") is True,
              f"{name}: runAsNonRoot")
        check(sc.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem")
        check(sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation")
        check(sc.get("privileged", False) is False, f"{name}: privileged")
        check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{name}: capabilities not dropped")
    run = [v for v in pod["volumes"] if v["name"] == "run"]
    check(len(run) == 1 and "emptyDir" in run[0], "socket volume 'run' is not an emptyDir")
    mounts = [c["name"] for c in pod["containers"]
              for m in c.get("volumeMounts", []) if m["name"] == "run"]
    check(sorted(mounts) == ["inference", "refitd-subscriber"],
          f"socket volume mounted by {mounts}, expected exactly the sidecar and inference")
    cm = next(d for d in docs if d.get("kind") == "ConfigMap")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(cm["data"]["subscriber.yaml"])
        f.flush()
        r = subprocess.run([config_check, f.name], capture_output=True, text=True)
        check(r.returncode == 0, f"ConfigMap subscriber.yaml: {r.stdout}{r.stderr}")
    annotations = deploy["spec"]["template"].get("metadata", {}).get("annotations", {})
    check_sidecar_wiring(pod, annotations,
                         yaml.safe_load(cm["data"]["subscriber.yaml"])["subscriber"])


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def project_version():
    with open(os.path.join(HERE, "..", "CMakeLists.txt")) as f:
        for line in f:
            if line.startswith("project(refitd VERSION "):
                return line.split()[2]
    return None


def mounted_at(container, path):
    """The volume whose mount covers `path` in `container`, or None."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[1]):
                best = (m["name"], mp)
    return best[0] if best else None


def check_sidecar_wiring(pod, annotations, cfg):
    """The fields the subscriber relies on, against its config: the image this repo builds, the
    probes on its gRPC health port, its config, TLS files, sockets and store reachable in the
    container, the container user the image's."""
    side = next(c for c in pod["containers"] if c["name"] == "refitd-subscriber")
    version = project_version()
    check(side.get("image") == f"refitd:{version}",
          f"sidecar image {side.get('image')} is not refitd:{version} (scripts/build-image.sh)")
    listen = port_of(cfg["listen"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        p = side.get(probe, {})
        check(p.get("grpc", {}).get("port") == listen,
              f"sidecar {probe} is not gRPC health on the listen port {listen}")
    ports = {p["containerPort"] for p in side.get("ports", [])}
    check(listen in ports, f"sidecar does not declare containerPort {listen} (listen)")
    metrics = cfg.get("metrics", {}).get("listen", "")
    if metrics:
        mport = port_of(metrics)
        check(mport in ports, f"sidecar does not declare containerPort {mport} (metrics.listen)")
        got = annotations.get("prometheus.io/port")
        check(got == str(mport), f"prometheus.io/port {got} is not metrics.listen's {mport}")
    args = side.get("args", [])
    config_path = args[args.index("--config") + 1] if "--config" in args else None
    check(config_path is not None and mounted_at(side, config_path) == "config",
          f"sidecar --config {config_path} is not the mounted ConfigMap")
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls_files = [cfg.get("tls", {}).get(k) for k in ("cert", "key", "ca")]
    tls_files += [cfg["upstream"].get("tls", {}).get(k) for k in ("cert", "key", "ca")]
    for path in filter(None, tls_files):
        vol = mounted_at(side, path)
        check(vol is not None and "secret" in volumes.get(vol, {}),
              f"TLS file {path} is not in a mounted Secret")
    sockets = [cfg.get("local_socket"), cfg.get("control_listen", "").replace("unix://", "")]
    for path in filter(None, sockets):
        check(mounted_at(side, path) == "run", f"socket {path} is not in the shared 'run' volume")
        inference = next(c for c in pod["containers"] if c["name"] == "inference")
        check(mounted_at(inference, path) == "run", f"socket {path} is not visible to inference")
    if cfg.get("store", {}).get("kind", "shm") == "shm":
        shm = volumes.get(mounted_at(side, "/dev/shm/x") or "", {})
        check(shm.get("emptyDir", {}).get("medium") == "Memory",
              "shm store: /dev/shm is not a memory-backed emptyDir")
    with open(os.path.join(HERE, "container", "Containerfile")) as f:
        users = [l.split()[1] for l in f if l.startswith("USER ")]
    uid = str(pod.get("securityContext", {}).get("runAsUser"))
    check(users and users[-1].split(":")[0] == uid,
          f"the image's USER {users[-1] if users else None} is not the pod's runAsUser {uid}")


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    check_systemd(sys.argv[1])
    check_k8s(sys.argv[2])
    for f in failures:
        print("check_deploy: FAIL:", f)
    if not failures:
        print("check_deploy: all deploy checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
