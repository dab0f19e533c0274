#include "client/refitctl_usage.h"

namespace refit::client {

const char kMainUsage[] =
    R"(usage: refitctl --target ADDR [connection options] VERB [verb options]

Talks to a refitd daemon's Control service (publisher or subscriber).

connection options:
  --target ADDR          daemon address: host:port, [ipv6]:port, unix:/path/to.sock,
                         unix-abstract:NAME, dns:///host:port (required)
  --tls-cert FILE        PEM client certificate (mTLS); with --tls-key and --tls-ca
  --tls-key FILE         PEM private key of --tls-cert
  --tls-ca FILE          PEM CA bundle the daemon's certificate must chain to
  --tls-server-name N    name the daemon's certificate must carry (default: the target's host)
  --insecure             plaintext to a non-loopback target (loopback and unix sockets are
                         plaintext without it)
  --timeout S            RPC deadline in seconds (default 30; publish, export, verify: 600)
  --version              print refitctl's version

verbs:
  status      versions, sessions, traffic and the last refit (--json for JSON)
  publish     publish safetensors files as a new version (publisher)
  export      write the held version to a safetensors file on the daemon's host
  wait        block until the daemon holds a version
  verify      recompute every tensor's digest and compare with the publisher's
  resync      force keyframes for some or all tensors
  metrics     print the daemon's Prometheus metrics (its metrics endpoint, as text)

'refitctl VERB --help' describes a verb. Exit codes: 0 ok, 1 RPC failed / verify mismatch /
wait timed out, 2 usage error.
)";

const char kStatusUsage[] =
    R"(usage: refitctl --target ADDR status [--json | --watch [--interval S] [--count N]]

Prints the daemon's role, version and digest, model size, traffic, its sessions (publisher:
subscribers; subscriber: upstream and peers) with state, acknowledged version, lag and the
last refit, the publisher's patch history and the subscriber's read leases.
  --json        print the StatusResponse as JSON (proto field names)
  --watch       print it again every --interval (the screen cleared first on a terminal),
                until interrupted or --count views; a view whose RPC fails says so and the
                watch goes on (exit 1 if the last one failed)
  --interval S  seconds between views (default 2; 0: none)
  --count N     stop after N views (default 0: until interrupted)
)";

const char kMetricsUsage[] =
    R"(usage: refitctl --target ADDR metrics [--address HOST:PORT]

Prints the daemon's Prometheus metrics in the text exposition format: asks the daemon's Status
for its metrics endpoint (config metrics.listen) and fetches http://<it>/metrics, for when no
Prometheus server scrapes it.
  --address HOST:PORT  fetch this metrics endpoint instead of asking Status for it
)";

const char kPublishUsage[] =
    R"(usage: refitctl --target ADDR publish --safetensors PATH... [--version N] [--request-id ID]
                [--allow-degenerate]

Publishes safetensors files (shards of one model) as a new version (publisher only). The files
are read by the daemon: paths are on its host; relative paths are made absolute against
refitctl's working directory. The publish is idempotent: refitctl sends a random request id and
retries an unreachable daemon (UNAVAILABLE, up to 3 attempts) with the same id, and the daemon
answers a repeated id with the original outcome instead of publishing twice.
  --safetensors PATH...  one or more files (the flag may also be repeated)
  --version N            version number, 1 .. 9007199254740991 (default: the next one)
  --request-id ID        the request id (default: random); reuse it to retry a publish whose
                         outcome you did not see (at most 128 bytes)
  --allow-degenerate     publish even a version that removes most of the current version's
                         tensors or bytes, or holds no bytes (refused otherwise: the
                         publisher's publish_guard)
)";

const char kExportUsage[] =
    R"(usage: refitctl --target ADDR export --safetensors PATH [--version N]

Writes the daemon's current version (or version N, if it still holds it) to a safetensors file
on the daemon's host, atomically. A relative PATH is made absolute against refitctl's working
directory.
  --safetensors PATH  output file
  --version N         version to export (default: the current one)
)";

const char kWaitUsage[] =
    R"(usage: refitctl --target ADDR wait --version N [--timeout S] [--all-subscribers]

Blocks until the daemon holds version N or newer (subscriber: applied; publisher: published).
Exits 1 with DEADLINE_EXCEEDED when it does not within the timeout.
  --version N          version to wait for (>= 1)
  --timeout S          give up after S seconds (default, or 0: the connection --timeout, 30 s)
  --all-subscribers    publisher: also wait until every connected subscriber acknowledged N
)";

const char kVerifyUsage[] =
    R"(usage: refitctl --target ADDR verify

Recomputes the digest of every tensor of the held version and compares it with the publisher's.
Prints the version, its digest and any mismatching tensors; exits 1 when a tensor differs.
)";

const char kResyncUsage[] =
    R"(usage: refitctl --target ADDR resync [--tensor NAME]... [--subscriber NAME]

Forces dense keyframes with the next transfer: for the named tensors (repeatable) or all.
  --tensor NAME       tensor to resend dense (default: every tensor)
  --subscriber NAME   publisher: only this subscriber (default: every subscriber)
)";

}  // namespace refit::client
