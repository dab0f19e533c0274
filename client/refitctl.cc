#include "client/refitctl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <system_error>
#include <utility>
#include <vector>

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/daemon_runtime.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"
#include "daemon/config/config.h"
#include "daemon/config/credentials.h"
#include "daemon/config/tls_material.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "daemon/metrics/http_get.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit::client {
namespace {

constexpr char kMainUsage[] =
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

constexpr char kStatusUsage[] =
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

constexpr char kMetricsUsage[] =
    R"(usage: refitctl --target ADDR metrics [--address HOST:PORT]

Prints the daemon's Prometheus metrics in the text exposition format: asks the daemon's Status
for its metrics endpoint (config metrics.listen) and fetches http://<it>/metrics, for when no
Prometheus server scrapes it.
  --address HOST:PORT  fetch this metrics endpoint instead of asking Status for it
)";

constexpr char kPublishUsage[] =
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

constexpr char kExportUsage[] =
    R"(usage: refitctl --target ADDR export --safetensors PATH [--version N]

Writes the daemon's current version (or version N, if it still holds it) to a safetensors file
on the daemon's host, atomically. A relative PATH is made absolute against refitctl's working
directory.
  --safetensors PATH  output file
  --version N         version to export (default: the current one)
)";

constexpr char kWaitUsage[] =
    R"(usage: refitctl --target ADDR wait --version N [--timeout S] [--all-subscribers]

Blocks until the daemon holds version N or newer (subscriber: applied; publisher: published).
Exits 1 with DEADLINE_EXCEEDED when it does not within the timeout.
  --version N          version to wait for (>= 1)
  --timeout S          give up after S seconds (default, or 0: the connection --timeout, 30 s)
  --all-subscribers    publisher: also wait until every connected subscriber acknowledged N
)";

constexpr char kVerifyUsage[] =
    R"(usage: refitctl --target ADDR verify

Recomputes the digest of every tensor of the held version and compares it with the publisher's.
Prints the version, its digest and any mismatching tensors; exits 1 when a tensor differs.
)";

constexpr char kResyncUsage[] =
    R"(usage: refitctl --target ADDR resync [--tensor NAME]... [--subscriber NAME]

Forces dense keyframes with the next transfer: for the named tensors (repeatable) or all.
  --tensor NAME       tensor to resend dense (default: every tensor)
  --subscriber NAME   publisher: only this subscriber (default: every subscriber)
)";

// ---- argument cursor --------------------------------------------------------------------------

class ArgCursor {
 public:
  ArgCursor(int argc, const char* const* argv) {
    for (int i = 1; i < argc; ++i) args_.emplace_back(argv[i]);
  }
  bool Done() const { return i_ >= args_.size(); }
  const std::string& Cur() const { return args_[i_]; }
  void Next() { ++i_; }

  // Matches "--name VALUE" or "--name=VALUE" at the cursor: true (value set, cursor advanced),
  // false (no match), or InvalidArgument when the value is missing.
  absl::StatusOr<bool> Value(const std::string& name, std::string* value) {
    if (Done()) return false;
    const std::string& a = Cur();
    if (a == name) {
      if (i_ + 1 >= args_.size() || absl::StartsWith(args_[i_ + 1], "--")) {
        return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      }
      *value = args_[i_ + 1];
      i_ += 2;
      return true;
    }
    if (absl::StartsWith(a, name + "=")) {
      *value = a.substr(name.size() + 1);
      if (value->empty()) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      ++i_;
      return true;
    }
    return false;
  }

  // Matches the switch "--name" at the cursor.
  bool Switch(const std::string& name) {
    if (Done() || Cur() != name) return false;
    ++i_;
    return true;
  }

  // Values following the cursor up to the next option ("--..."): for `--safetensors A B C`.
  std::vector<std::string> TakeOperands() {
    std::vector<std::string> out;
    while (!Done() && !absl::StartsWith(Cur(), "--")) out.push_back(args_[i_++]);
    return out;
  }

 private:
  std::vector<std::string> args_;
  size_t i_ = 0;
};

absl::Status UnknownOption(const std::string& arg, const std::string& where) {
  if (absl::StartsWith(arg, "-")) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown option ", arg, " for ", where, " (see ", where, " --help)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unexpected argument \"", arg, "\" for ", where, " (see ", where, " --help)"));
}

absl::StatusOr<uint64_t> ParseVersionFlag(const std::string& flag, const std::string& text) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " \"", text, "\" is not a version number (an integer >= 1)"));
  }
  return v;
}

absl::StatusOr<absl::Duration> ParseSeconds(const std::string& flag, const std::string& text,
                                            bool allow_zero = false) {
  double s = 0;
  if (!absl::SimpleAtod(text, &s) || !(allow_zero ? s >= 0 : s > 0) || s > 1e7) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " \"", text,
                                                   "\" is not a number of seconds (",
                                                   allow_zero ? ">= 0" : "> 0", ")"));
  }
  return absl::Seconds(s);
}

std::string AbsolutePath(const std::string& path) {
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec) return path;
  return abs.lexically_normal().string();
}

// ---- formatting -------------------------------------------------------------------------------

std::string RoleName(v1::Role role) {
  switch (role) {
    case v1::ROLE_PUBLISHER: return "publisher";
    case v1::ROLE_SUBSCRIBER: return "subscriber";
    default: return "unknown";
  }
}

std::string StateName(v1::SessionState state) {
  switch (state) {
    case v1::SESSION_STATE_CONNECTING: return "connecting";
    case v1::SESSION_STATE_IDLE: return "idle";
    case v1::SESSION_STATE_TRANSFERRING: return "transferring";
    case v1::SESSION_STATE_BACKOFF: return "backoff";
    default: return "-";
  }
}

std::string Percent(double rate) { return absl::StrFormat("%.3f%%", 100.0 * rate); }

std::string FormatUptime(uint64_t ms) {
  const uint64_t s = ms / 1000;
  if (s < 60) return absl::StrFormat("%.1fs", ms / 1000.0);
  if (s < 3600) return absl::StrFormat("%um%02us", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%uh%02um%02us", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%ud%02uh%02um", s / 86400, (s / 3600) % 24, (s / 60) % 60);
}

std::string FormatUnixNanos(uint64_t nanos) {
  if (nanos == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixNanos(static_cast<int64_t>(nanos)),
                          absl::UTCTimeZone());
}

std::string FormatRefit(const v1::RefitStats& r) {
  if (r.version() == 0) return "none";
  std::string s = absl::StrCat("version ", r.version());
  if (r.base_version() != 0) {
    absl::StrAppend(&s, " from ", r.base_version());
  } else {
    absl::StrAppend(&s, " (keyframe)");
  }
  absl::StrAppend(&s, ", change ", Percent(r.change_rate()), ", wire ", FormatBytes(r.wire_bytes()),
                  " of ", FormatBytes(r.dense_bytes()), " dense");
  if (r.dense_bytes() > 0) {
    absl::StrAppend(&s, absl::StrFormat(" (%.2f%%)", 100.0 * r.wire_bytes() / r.dense_bytes()));
  }
  absl::StrAppend(&s, ", ", r.keyframe_tensors(), " keyframe tensors, latency ",
                  FormatMicros(r.latency_micros()), ", digests ",
                  r.digests_verified() ? "verified" : "not verified", ", finished ",
                  FormatUnixNanos(r.finished_unix_nanos()));
  return s;
}

// Columns padded to their widest cell, two spaces apart, indented by two.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = "  ";
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::vector<std::string> SessionHeader() {
  return {"NAME", "STATE", "ACKED", "LAG", "STREAMS", "SENT", "RECEIVED", "LAST REFIT",
          "LATENCY", "CHANGE", "ADDRESS"};
}

std::vector<std::string> SessionRow(const v1::SessionStatus& s) {
  std::string name = s.name().empty() ? "-" : s.name();
  if (!s.identity().empty() && s.identity() != s.name()) absl::StrAppend(&name, " (", s.identity(), ")");
  const v1::RefitStats& r = s.last_refit();
  return {name,
          StateName(s.state()),
          absl::StrCat(s.acked_version()),
          absl::StrCat(s.lag_versions()),
          absl::StrCat(s.streams()),
          FormatBytes(s.bytes_sent()),
          FormatBytes(s.bytes_received()),
          r.version() == 0 ? "-" : absl::StrCat(r.version()),
          r.version() == 0 ? "-" : FormatMicros(r.latency_micros()),
          r.version() == 0 ? "-" : Percent(r.change_rate()),
          s.address().empty() ? "-" : s.address()};
}

std::string SessionErrors(const std::vector<const v1::SessionStatus*>& sessions) {
  std::string out;
  for (const v1::SessionStatus* s : sessions) {
    if (!s->last_error().empty()) {
      absl::StrAppend(&out, "  ", s->name().empty() ? "-" : s->name(), ": last error: ",
                      s->last_error(), "\n");
    }
  }
  return out;
}

// ---- verbs ------------------------------------------------------------------------------------

struct Session {
  v1::Control::Stub* stub;
  absl::Duration timeout;
  std::ostream& out;
  std::ostream& err;
};

// Runs the verb against the daemon: an RPC error (printed by the caller, exit 1) or the exit code.
using Runner = std::function<absl::StatusOr<int>(Session&)>;

struct Parsed {
  bool help = false;
  Runner run;
  // Deadline when --timeout is not given.
  absl::Duration default_timeout = absl::Seconds(30);
  // Added to the RPC deadline (wait: its own --timeout).
  absl::Duration extra_deadline = absl::ZeroDuration();
};

// Calls one Control RPC under the session's deadline.
template <typename Req, typename Resp>
absl::Status Call(const Session& s,
                  grpc::Status (v1::Control::Stub::*rpc)(grpc::ClientContext*, const Req&, Resp*),
                  const Req& req, Resp* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + s.timeout));
  return FromGrpcStatus((s.stub->*rpc)(&ctx, req, resp));
}

// Calls an idempotent RPC (Publish with its request id), retrying UNAVAILABLE (daemon not
// reachable, connection reset) with the same request under the session's overall deadline.
template <typename Req, typename Resp>
absl::Status CallWithRetries(const Session& s,
                             grpc::Status (v1::Control::Stub::*rpc)(grpc::ClientContext*,
                                                                    const Req&, Resp*),
                             const Req& req, Resp* resp, const std::string& verb) {
  constexpr int kAttempts = 3;
  const absl::Time deadline = absl::Now() + s.timeout;
  absl::Duration backoff = absl::Milliseconds(200);
  absl::Status st;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    st = FromGrpcStatus((s.stub->*rpc)(&ctx, req, resp));
    if (!absl::IsUnavailable(st) || attempt == kAttempts || absl::Now() + backoff >= deadline) {
      if (attempt == 1) return st;
      return absl::Status(st.code(), absl::StrCat(st.message(), " (", attempt, " attempts with ",
                                                  verb, " request id ", req.request_id(), ")"));
    }
    absl::SleepFor(backoff);
    backoff *= 2;
  }
}

// 32 hex digits from the OS's random source.
std::string RandomRequestId() {
  std::random_device rd;
  std::string id;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&id, absl::Hex(rd(), absl::kZeroPad8));
  return id;
}

// Reads a verb's options to the end of the command line. --help/-h sets p->help and stops;
// `option` takes the option at the cursor (true) or does not know it (false: an error naming
// `verb`, e.g. "refitctl publish").
absl::Status ParseOptions(ArgCursor& args, const std::string& verb, Parsed* p,
                          const std::function<absl::StatusOr<bool>()>& option) {
  while (!args.Done()) {
    if (args.Switch("--help") || args.Switch("-h")) {
      p->help = true;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(bool taken, option());
    if (!taken) return UnknownOption(args.Cur(), verb);
  }
  return absl::OkStatus();
}

// Matches "--version N" (N >= 1) at the cursor into the request's version.
template <typename Request>
absl::StatusOr<bool> VersionOption(ArgCursor& args, Request* req) {
  std::string v;
  ASSIGN_OR_RETURN(bool found, args.Value("--version", &v));
  if (!found) return false;
  ASSIGN_OR_RETURN(uint64_t version, ParseVersionFlag("--version", v));
  req->set_version(version);
  return true;
}

// status --watch: `count` views (0: until interrupted), `interval` apart, each a header line
// (time, view number) and the status table, or the error its RPC got; the screen is cleared
// before each when refitctl writes to a terminal. The last view's error is the result.
absl::StatusOr<int> WatchStatus(Session& s, absl::Duration interval, uint64_t count) {
  const bool clear = &s.out == &std::cout && isatty(STDOUT_FILENO) == 1;
  absl::Status last;
  for (uint64_t view = 1; count == 0 || view <= count; ++view) {
    if (view > 1) absl::SleepFor(interval);
    v1::StatusResponse resp;
    last = Call(s, &v1::Control::Stub::Status, v1::StatusRequest(), &resp);
    if (clear) s.out << "\x1b[H\x1b[2J";
    s.out << "refitctl status --watch: "
          << absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()) << ", view "
          << view << (count != 0 ? absl::StrCat(" of ", count) : std::string()) << ", every "
          << absl::FormatDuration(interval) << "\n";
    if (last.ok()) {
      s.out << FormatStatusTable(resp);
    } else {
      s.out << "status failed: " << absl::StatusCodeToString(last.code()) << ": " << last.message()
            << "\n";
    }
    s.out << "\n" << std::flush;
  }
  if (!last.ok()) return last;
  return 0;
}

absl::StatusOr<Parsed> ParseStatus(ArgCursor& args) {
  Parsed p;
  bool json = false, watch = false;
  absl::Duration interval = absl::Seconds(2);
  uint64_t count = 0;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl status", &p, [&]() -> absl::StatusOr<bool> {
    if (args.Switch("--json")) {
      json = true;
      return true;
    }
    if (args.Switch("--watch")) {
      watch = true;
      return true;
    }
    std::string v;
    ASSIGN_OR_RETURN(bool found, args.Value("--interval", &v));
    if (found) {
      ASSIGN_OR_RETURN(interval, ParseSeconds("--interval", v, /*allow_zero=*/true));
      return true;
    }
    ASSIGN_OR_RETURN(found, args.Value("--count", &v));
    if (found && !absl::SimpleAtoi(v, &count)) {
      return absl::InvalidArgumentError(absl::StrCat("--count \"", v, "\" is not a number of views"));
    }
    return found;
  }));
  if (p.help) return p;
  if (json && watch) return absl::InvalidArgumentError("--json and --watch do not combine");
  if (!watch && (interval != absl::Seconds(2) || count != 0)) {
    return absl::InvalidArgumentError("--interval and --count need --watch");
  }
  if (watch) {
    p.run = [interval, count](Session& s) { return WatchStatus(s, interval, count); };
    return p;
  }
  p.run = [json](Session& s) -> absl::StatusOr<int> {
    v1::StatusResponse resp;
    RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Status, v1::StatusRequest(), &resp));
    if (json) {
      ASSIGN_OR_RETURN(std::string text, FormatStatusJson(resp));
      s.out << text;
    } else {
      s.out << FormatStatusTable(resp);
    }
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParsePublish(ArgCursor& args) {
  Parsed p;
  p.default_timeout = absl::Seconds(600);
  v1::PublishRequest req;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl publish", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    ASSIGN_OR_RETURN(bool files, args.Value("--safetensors", &v));
    if (files) {
      req.add_safetensors(AbsolutePath(v));
      for (const std::string& more : args.TakeOperands()) req.add_safetensors(AbsolutePath(more));
      return true;
    }
    ASSIGN_OR_RETURN(bool id, args.Value("--request-id", &v));
    if (id) {
      if (v.empty() || v.size() > 128) {
        return absl::InvalidArgumentError("--request-id needs 1 to 128 bytes");
      }
      req.set_request_id(v);
      return true;
    }
    if (args.Switch("--allow-degenerate")) {
      req.set_allow_degenerate(true);
      return true;
    }
    return VersionOption(args, &req);
  }));
  if (p.help) return p;
  if (req.safetensors_size() == 0) {
    return absl::InvalidArgumentError(
        "refitctl publish needs --safetensors PATH... (the files of the version)");
  }
  if (req.request_id().empty()) req.set_request_id(RandomRequestId());
  p.run = [req](Session& s) -> absl::StatusOr<int> {
    v1::PublishResponse resp;
    RETURN_IF_ERROR(CallWithRetries(s, &v1::Control::Stub::Publish, req, &resp, "publish"));
    s.out << absl::StrFormat(
        "published version %u digest %s: %u tensors, %s, change rate %s, publish time %s\n",
        resp.version(), FormatDigest(resp.version_digest()), resp.tensors(),
        FormatBytes(resp.bytes()), Percent(resp.change_rate()),
        FormatMicros(resp.publish_micros()));
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseExport(ArgCursor& args) {
  Parsed p;
  p.default_timeout = absl::Seconds(600);
  v1::ExportRequest req;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl export", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    ASSIGN_OR_RETURN(bool file, args.Value("--safetensors", &v));
    if (file) {
      if (!req.safetensors().empty()) {
        return absl::InvalidArgumentError("refitctl export takes one --safetensors PATH");
      }
      req.set_safetensors(AbsolutePath(v));
      return true;
    }
    return VersionOption(args, &req);
  }));
  if (p.help) return p;
  if (req.safetensors().empty()) {
    return absl::InvalidArgumentError("refitctl export needs --safetensors PATH (the output file)");
  }
  p.run = [req](Session& s) -> absl::StatusOr<int> {
    v1::ExportResponse resp;
    RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Export, req, &resp));
    s.out << absl::StrFormat("exported version %u digest %s to %s: %u tensors, %s\n",
                             resp.version(), FormatDigest(resp.version_digest()), req.safetensors(),
                             resp.tensors(), FormatBytes(resp.bytes()));
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseWait(ArgCursor& args) {
  Parsed p;
  v1::WaitVersionRequest req;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl wait", &p, [&]() -> absl::StatusOr<bool> {
    if (args.Switch("--all-subscribers")) {
      req.set_all_subscribers(true);
      return true;
    }
    ASSIGN_OR_RETURN(bool version, VersionOption(args, &req));
    if (version) return true;
    std::string v;
    ASSIGN_OR_RETURN(bool timeout, args.Value("--timeout", &v));
    if (timeout) {
      ASSIGN_OR_RETURN(absl::Duration d, ParseSeconds("wait --timeout", v, /*allow_zero=*/true));
      // 0: until the RPC deadline (the connection --timeout).
      req.set_timeout_ms(d == absl::ZeroDuration()
                             ? 0
                             : std::max<uint64_t>(1, absl::ToInt64Milliseconds(d)));
      p.extra_deadline = d;
    }
    return timeout;
  }));
  if (p.help) return p;
  if (req.version() == 0) {
    return absl::InvalidArgumentError("refitctl wait needs --version N (the version to wait for)");
  }
  p.run = [req](Session& s) -> absl::StatusOr<int> {
    v1::WaitVersionResponse resp;
    RETURN_IF_ERROR(Call(s, &v1::Control::Stub::WaitVersion, req, &resp));
    s.out << absl::StrFormat("version %u digest %s%s\n", resp.version(),
                             FormatDigest(resp.version_digest()),
                             req.all_subscribers() ? " (acknowledged by every subscriber)" : "");
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseVerify(ArgCursor& args) {
  Parsed p;
  p.default_timeout = absl::Seconds(600);
  RETURN_IF_ERROR(ParseOptions(args, "refitctl verify", &p,
                               []() -> absl::StatusOr<bool> { return false; }));
  if (p.help) return p;
  p.run = [](Session& s) -> absl::StatusOr<int> {
    v1::VerifyResponse resp;
    RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Verify, v1::VerifyRequest(), &resp));
    int bad = 0;
    for (const v1::TensorVerification& t : resp.tensors()) {
      if (t.expected() != t.actual()) {
        ++bad;
        s.out << absl::StrFormat("MISMATCH %s: expected %s, actual %s\n", t.name(),
                                 FormatDigest(t.expected()), FormatDigest(t.actual()));
      }
    }
    s.out << absl::StrFormat("version %u digest %s: %d tensors, %s\n", resp.version(),
                             FormatDigest(resp.version_digest()), resp.tensors_size(),
                             resp.ok() && bad == 0 ? "ok" : absl::StrCat(bad, " mismatched"));
    if (resp.ok() && bad == 0) return 0;
    s.err << absl::StrFormat(
        "refitctl: verify: DATA_LOSS: version %u: %d of %d tensors differ from the publisher's "
        "digests\n",
        resp.version(), bad, resp.tensors_size());
    return 1;
  };
  return p;
}

absl::StatusOr<Parsed> ParseResync(ArgCursor& args) {
  Parsed p;
  v1::ResyncRequest req;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl resync", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    ASSIGN_OR_RETURN(bool tensor, args.Value("--tensor", &v));
    if (tensor) {
      req.add_tensors(v);
      return true;
    }
    ASSIGN_OR_RETURN(bool sub, args.Value("--subscriber", &v));
    if (sub) req.set_subscriber(v);
    return sub;
  }));
  if (p.help) return p;
  p.run = [req](Session& s) -> absl::StatusOr<int> {
    v1::ResyncResponse resp;
    RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Resync, req, &resp));
    s.out << absl::StrFormat("resync: %u session(s) will receive keyframes for %s\n",
                             resp.sessions(),
                             req.tensors_size() == 0
                                 ? std::string("every tensor")
                                 : absl::StrCat(req.tensors_size(), " tensor(s)"));
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseMetrics(ArgCursor& args) {
  Parsed p;
  std::string address;
  RETURN_IF_ERROR(ParseOptions(args, "refitctl metrics", &p, [&]() -> absl::StatusOr<bool> {
    return args.Value("--address", &address);
  }));
  if (p.help) return p;
  p.run = [address](Session& s) -> absl::StatusOr<int> {
    std::string endpoint = address;
    if (endpoint.empty()) {
      v1::StatusResponse status;
      RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Status, v1::StatusRequest(), &status));
      endpoint = status.metrics_address();
      if (endpoint.empty()) {
        return absl::FailedPreconditionError(
            "the daemon serves no metrics (its config's metrics.listen is empty)");
      }
    }
    ASSIGN_OR_RETURN(const metrics::HttpResponse r,
                     metrics::HttpGet(endpoint, "/metrics", s.timeout));
    if (r.status != 200) {
      return absl::UnavailableError(absl::StrCat("GET http://", endpoint, "/metrics: HTTP ",
                                                 r.status));
    }
    s.out << r.body;
    return 0;
  };
  return p;
}

struct Verb {
  const char* name;
  const char* usage;
  absl::StatusOr<Parsed> (*parse)(ArgCursor&);
};

constexpr Verb kVerbs[] = {
    {"status", kStatusUsage, ParseStatus},   {"publish", kPublishUsage, ParsePublish},
    {"export", kExportUsage, ParseExport},   {"wait", kWaitUsage, ParseWait},
    {"verify", kVerifyUsage, ParseVerify},   {"resync", kResyncUsage, ParseResync},
    {"metrics", kMetricsUsage, ParseMetrics},
};

int UsageError(std::ostream& err, const absl::Status& status) {
  err << "refitctl: error: " << status.message() << "\n";
  return 2;
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1000) return absl::StrCat(bytes, " B");
  const char* units[] = {"kB", "MB", "GB", "TB", "PB"};
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  return absl::StrFormat("%.2f %s", v, units[u]);
}

std::string FormatDigest(uint64_t digest) { return absl::StrFormat("0x%016x", digest); }

std::string FormatMicros(uint64_t micros) {
  if (micros < 1000) return absl::StrCat(micros, " us");
  if (micros < 1000000) return absl::StrFormat("%.1f ms", micros / 1e3);
  return absl::StrFormat("%.2f s", micros / 1e6);
}

// "persisted (version 7) at /var/lib/refitd/baseline.safetensors", with the errors in full.
std::string FormatBaseline(const v1::BaselineStatus& b) {
  std::string state;
  switch (b.state()) {
    case v1::BASELINE_STATE_DISABLED: return "not persisted (no persist_dir)";
    case v1::BASELINE_STATE_EMPTY: state = "none persisted yet"; break;
    case v1::BASELINE_STATE_LOADED: state = "reloaded at start"; break;
    case v1::BASELINE_STATE_PERSISTED: state = "persisted"; break;
    case v1::BASELINE_STATE_PERSIST_FAILED: state = "PERSIST FAILED"; break;
    case v1::BASELINE_STATE_MOVED_ASIDE: state = "REFUSED AT START, moved aside"; break;
    default: state = "unknown"; break;
  }
  std::string out = state;
  if (b.persisted_version() != 0) {
    absl::StrAppend(&out, " (files hold version ", b.persisted_version(), ": baseline version ",
                    b.baseline_version(), " + ", b.log_versions(), " in the patch log, ",
                    FormatBytes(b.log_bytes()), ")");
  }
  absl::StrAppend(&out, " at ", b.path());
  if (!b.moved_to().empty()) {
    absl::StrAppend(&out, "\n            refused file now at ", b.moved_to(), ": ", b.load_error());
  } else if (!b.load_error().empty()) {
    absl::StrAppend(&out, "\n            patch log refused at start: ", b.load_error());
  }
  if (!b.last_persist_error().empty()) {
    absl::StrAppend(&out, "\n            last persist error (", FormatUnixNanos(b.last_persist_error_unix_nanos()),
                    "): ", b.last_persist_error());
  }
  return out;
}

// Status.tls: one line per TLS block, plus its refused reload if any.
std::string FormatTls(const v1::StatusResponse& st) {
  if (st.tls_size() == 0) return "";
  std::string out = "\ntls:\n";
  for (const v1::TlsMaterialStatus& t : st.tls()) {
    absl::StrAppend(&out, "  ", t.field(), ": ", t.subject(), ", not after ",
                    absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                                     absl::FromUnixSeconds(t.not_after_unix_seconds()),
                                     absl::UTCTimeZone()),
                    ", sha256 ", t.sha256_fingerprint(), ", reloads ", t.reloads(), "\n");
    if (!t.last_reload_error().empty()) {
      absl::StrAppend(&out, "    last reload refused (old material kept): ", t.last_reload_error(),
                      "\n");
    }
  }
  return out;
}


// A relay (serve_peers): how its upstream's transfers reach its peers.
std::string FormatRelay(const v1::RelayStatus& r) {
  std::string out = absl::StrCat(
      r.cut_through() ? "cut-through" : "encodes every version again", ": ", r.streamed(),
      " of ", r.transfers(), " transfers streamed to peers while arriving (",
      r.peer_streamed_transfers(), " taken), ", FormatBytes(r.object_bytes()), "; installed ",
      r.adopted_versions(), " from the patches received, ", r.reencoded_versions(),
      " by encoding");
  if (r.failed() > 0 || r.not_relayable() > 0) {
    absl::StrAppend(&out, "; ", r.failed(), " failed, ", r.not_relayable(), " not relayable");
  }
  if (!r.last_error().empty()) absl::StrAppend(&out, " (last: ", r.last_error(), ")");
  return out;
}

// Sharded versions: a publisher's shard identity, or a subscriber's join of its shards.
std::string FormatShardsLine(const v1::StatusResponse& st) {
  const v1::ShardsStatus& s = st.shards();
  if (st.role() == v1::ROLE_PUBLISHER) {
    return absl::StrCat("shard ", s.index(), " of ", s.count(), " of set ", s.set());
  }
  std::string out = absl::StrCat("set ", s.set(), ", ", s.count(), " shards: ", s.joined_versions(),
                                 " versions joined, ", s.failed_transfers(), " failed, ",
                                 s.superseded(), " superseded");
  if (s.waiting_version() != 0) {
    absl::StrAppend(&out, "; version ", s.waiting_version(), " waits for shard",
                    s.waiting_for_size() == 1 ? " " : "s ", absl::StrJoin(s.waiting_for(), ", "));
  }
  return out;
}

// A subscriber's shards, one row each.
std::string FormatShardsTable(const v1::ShardsStatus& s) {
  std::vector<std::vector<std::string>> rows = {
      {"shard", "state", "offered", "tensors", "bytes", "received", "address"}};
  std::string errors;
  for (const v1::ShardStatus& p : s.shards()) {
    rows.push_back({absl::StrCat(p.index()), StateName(p.session().state()),
                    p.offered_version() == 0
                        ? std::string("-")
                        : absl::StrCat(p.offered_version(), p.joined() ? " (joined)" : " (waiting)"),
                    absl::StrCat(p.tensors()), FormatBytes(p.bytes()), FormatBytes(p.wire_bytes()),
                    p.session().address().empty() ? "-" : p.session().address()});
    const std::string& e = p.last_error().empty() ? p.session().last_error() : p.last_error();
    if (!e.empty()) absl::StrAppend(&errors, "  shard ", p.index(), ": last error: ", e, "\n");
  }
  return RenderTable(rows) + errors;
}

// Status.patch_format: "v2" or "v1 (auto: trial, v1 480 ms over 2, v2 1150 ms over 1; next v2)".
std::string FormatPatchFormat(const v1::PatchFormatStatus& p) {
  std::string out = absl::StrCat("v", p.last());
  if (!p.auto_choice()) return out;
  const auto median = [](uint64_t us, uint32_t n) {
    return n == 0 ? std::string("none") : absl::StrCat(us / 1000, " ms over ", n);
  };
  absl::StrAppend(&out, " (auto: ", p.chosen() == 0 ? std::string("trial")
                                                     : absl::StrCat("chose v", p.chosen()),
                  ", v1 ", median(p.median_refit_micros_v1(), p.samples_v1()), ", v2 ",
                  median(p.median_refit_micros_v2(), p.samples_v2()), "; next v", p.next(), ")");
  return out;
}

// The status table's first part: one "key: value" line each.
static std::string FormatStatusLines(const v1::StatusResponse& st) {
  std::string out;
  auto line = [&out](const std::string& key, const std::string& value) {
    absl::StrAppend(&out, absl::StrFormat("%-12s%s\n", key + ":", value));
  };
  line("role", RoleName(st.role()));
  line("name", st.name().empty() ? "-" : st.name());
  line("build", st.build_version().empty() ? "-" : st.build_version());
  line("uptime", FormatUptime(st.uptime_ms()));
  line("version", st.version() == 0
                      ? std::string("none")
                      : absl::StrCat(st.version(), " (digest ", FormatDigest(st.version_digest()),
                                     ")"));
  line("model", absl::StrCat(st.tensors(), " tensors, ", FormatBytes(st.model_bytes())));
  line("traffic", absl::StrCat("sent ", FormatBytes(st.bytes_sent()), ", received ",
                               FormatBytes(st.bytes_received())));
  line("metrics", st.metrics_address().empty()
                      ? std::string("off (config metrics.listen is empty)")
                      : absl::StrCat("http://", st.metrics_address(), "/metrics"));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_history()) {
    const v1::HistoryStatus& h = st.history();
    line("history", h.versions() == 0
                        ? absl::StrCat("empty, budget ", FormatBytes(h.budget_bytes()))
                        : absl::StrCat("versions ", h.oldest_version(), "..", h.newest_version(),
                                       " (", h.versions(), " held), ", FormatBytes(h.bytes()),
                                       " of ", FormatBytes(h.budget_bytes()), " budget"));
  }
  line("last refit", FormatRefit(st.last_refit()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_patch_format()) {
    line("patch fmt", FormatPatchFormat(st.patch_format()));
  }
  if (st.lineage() != 0) line("lineage", absl::StrFormat("%016x", st.lineage()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_baseline()) line("baseline", FormatBaseline(st.baseline()));
  if (st.role() == v1::ROLE_PUBLISHER && st.has_publish_queue()) {
    const v1::PublishQueueStatus& q = st.publish_queue();
    line("publish q", absl::StrCat(q.pending(), " pending of at most ", q.max_pending(), ", ",
                                   q.refused_full(), " refused (full), ", q.dropped_expired(),
                                   " dropped (caller gone)"));
  }

  if (st.role() == v1::ROLE_SUBSCRIBER && st.has_relay()) line("relay", FormatRelay(st.relay()));
  if (st.has_shards()) line("shards", FormatShardsLine(st));
  return out;
}

// The status table's session sections: the upstream (subscribers, relays) and the sessions.
static std::string FormatSessionSections(const v1::StatusResponse& st) {
  std::string out;
  if (st.role() == v1::ROLE_SUBSCRIBER || st.has_upstream()) {
    out += "\nupstream:\n";
    if (st.has_upstream()) {
      out += RenderTable({SessionHeader(), SessionRow(st.upstream())});
      out += SessionErrors({&st.upstream()});
    } else {
      out += "  none\n";
    }
  }

  absl::StrAppend(&out, "\n",
                  st.role() == v1::ROLE_SUBSCRIBER ? "peer sessions" : "subscriber sessions", " (",
                  st.sessions_size(), "):\n");
  if (st.sessions_size() > 0) {
    std::vector<std::vector<std::string>> rows = {SessionHeader()};
    std::vector<const v1::SessionStatus*> all;
    for (const v1::SessionStatus& s : st.sessions()) {
      rows.push_back(SessionRow(s));
      all.push_back(&s);
    }
    out += RenderTable(rows);
    out += SessionErrors(all);
  }
  return out;
}

// The status table's leases section (subscribers, or wherever there are leases).
static std::string FormatLeases(const v1::StatusResponse& st) {
  std::string out;
  if (st.role() == v1::ROLE_SUBSCRIBER || st.leases_size() > 0) {
    absl::StrAppend(&out, "\nleases (", st.leases_size(), "):\n");
    if (st.leases_size() > 0) {
      std::vector<std::vector<std::string>> rows = {{"ID", "CONSUMER", "VERSION", "REMAINING"}};
      for (const v1::LeaseStatus& l : st.leases()) {
        rows.push_back({absl::StrFormat("%016x", l.lease_id()),
                        l.consumer().empty() ? "-" : l.consumer(), absl::StrCat(l.version()),
                        absl::StrFormat("%.1f s", l.remaining_ms() / 1000.0)});
      }
      out += RenderTable(rows);
    }
  }
  return out;
}

// The BLOCKED ON LEASES section, when a version waits for a free slot.
static std::string FormatLeaseBlock(const v1::StatusResponse& st) {
  if (!st.has_blocked_on_leases()) return "";
  std::string out;
  const v1::LeaseBlockStatus& b = st.blocked_on_leases();
  const absl::Duration waited = absl::Now() - absl::FromUnixNanos(
                                                  static_cast<int64_t>(b.since_unix_nanos()));
  absl::StrAppend(&out, "\nBLOCKED ON LEASES: version ", b.version(),
                  " waits for a free slot (versions waiting for ",
                  absl::StrFormat("%.1f s", absl::ToDoubleSeconds(waited)), "); held by:\n");
  for (const std::string& h : b.holders()) absl::StrAppend(&out, "  ", h, "\n");
  return out;
}

std::string FormatStatusTable(const v1::StatusResponse& st) {
  std::string out = FormatStatusLines(st);
  if (st.role() == v1::ROLE_SUBSCRIBER && st.shards().shards_size() > 0) {
    out += "\nshards:\n" + FormatShardsTable(st.shards());
  }
  out += FormatSessionSections(st);
  out += FormatLeases(st);
  out += FormatTls(st);
  out += FormatLeaseBlock(st);
  return out;
}

absl::StatusOr<std::string> FormatStatusJson(const v1::StatusResponse& status) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.add_whitespace = true;
  std::string json;
  auto s = google::protobuf::util::MessageToJsonString(status, &json, options);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("cannot render StatusResponse as JSON: ", s.ToString()));
  }
  if (json.empty() || json.back() != '\n') json += "\n";
  return json;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeControlChannel(const ControlTarget& target,
                                                                  const std::string& flag) {
  absl::StatusOr<config::Address> addr =
      config::ParseAddress(target.address, config::AddressUse::kConnect);
  if (!addr.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " \"", target.address, "\": ", addr.status().message()));
  }
  const v1::ClientTls& tls = target.tls;
  const bool any_file = !tls.cert().empty() || !tls.key().empty() || !tls.ca().empty();
  if (tls.insecure() && (any_file || !tls.server_name().empty())) {
    return absl::InvalidArgumentError(
        "--insecure cannot be combined with --tls-cert, --tls-key, --tls-ca or --tls-server-name");
  }
  if (any_file && !config::UsesTls(tls)) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-ca go together (mTLS): give all three");
  }
  if (!tls.server_name().empty() && !config::UsesTls(tls)) {
    return absl::InvalidArgumentError(
        "--tls-server-name needs --tls-cert, --tls-key and --tls-ca");
  }
  if (!addr->loopback && !config::UsesTls(tls) && !tls.insecure()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " \"", target.address,
        "\" is not a loopback address: give --tls-cert, --tls-key and --tls-ca (mTLS), or "
        "--insecure to connect in plaintext"));
  }
  if (config::UsesTls(tls)) {
    // Read and checked here too so that errors name the flags.
    ASSIGN_OR_RETURN(const std::string cert, config::ReadSmallFile(tls.cert(), "--tls-cert"));
    ASSIGN_OR_RETURN(const std::string key, config::ReadSmallFile(tls.key(), "--tls-key"));
    ASSIGN_OR_RETURN(const std::string ca, config::ReadSmallFile(tls.ca(), "--tls-ca"));
    auto named = [](const char* flag, const std::string& path) {
      return absl::StrCat(flag, " \"", path, "\"");
    };
    RETURN_IF_ERROR(config::CheckTlsMaterialNamed(cert, key, ca, named("--tls-cert", tls.cert()),
                                                  named("--tls-key", tls.key()),
                                                  named("--tls-ca", tls.ca()))
                        .status());
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                   config::MakeChannelCredentials(tls, "tls"));
  grpc::ChannelArguments args;
  config::ApplyClientTlsArgs(tls, &args);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(addr->grpc_target, creds, args);
}

// The options before the verb.
struct GlobalOptions {
  ControlTarget target;
  std::optional<absl::Duration> timeout;
  bool have_target = false;
  bool help = false;     // --help: print the usage, nothing else
  bool version = false;  // --version
};

// One option before the verb at args.Cur() into `g`; InvalidArgument for an unknown one or a
// missing or bad value.
static absl::Status ParseGlobalOption(ArgCursor& args, GlobalOptions& g) {
  if (args.Switch("--help") || args.Switch("-h")) {
    g.help = true;
    return absl::OkStatus();
  }
  if (args.Switch("--version")) {
    g.version = true;
    return absl::OkStatus();
  }
  if (args.Switch("--insecure")) {
    g.target.tls.set_insecure(true);
    return absl::OkStatus();
  }
  struct StringFlag {
    const char* name;
    std::function<void(const std::string&)> set;
  };
  const StringFlag flags[] = {
      {"--target", [&](const std::string& s) { g.target.address = s; g.have_target = true; }},
      {"--tls-cert", [&](const std::string& s) { g.target.tls.set_cert(s); }},
      {"--tls-key", [&](const std::string& s) { g.target.tls.set_key(s); }},
      {"--tls-ca", [&](const std::string& s) { g.target.tls.set_ca(s); }},
      {"--tls-server-name", [&](const std::string& s) { g.target.tls.set_server_name(s); }},
  };
  std::string v;
  for (const StringFlag& f : flags) {
    ASSIGN_OR_RETURN(const bool matched, args.Value(f.name, &v));
    if (matched) {
      f.set(v);
      return absl::OkStatus();
    }
  }
  ASSIGN_OR_RETURN(const bool matched, args.Value("--timeout", &v));
  if (!matched) return UnknownOption(args.Cur(), "refitctl");
  ASSIGN_OR_RETURN(g.timeout, ParseSeconds("--timeout", v));
  return absl::OkStatus();
}

// The verb at args.Cur() (consumed); InvalidArgument naming the verbs when it is missing or
// unknown.
static absl::StatusOr<const Verb*> TakeVerb(ArgCursor& args, std::string* name) {
  if (args.Done()) {
    return absl::InvalidArgumentError(
        "missing verb: status, publish, export, wait, verify, resync or metrics "
        "(see refitctl --help)");
  }
  *name = args.Cur();
  args.Next();
  for (const Verb& v : kVerbs) {
    if (*name == v.name) return &v;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown verb \"", *name,
      "\": expected status, publish, export, wait, verify, resync or metrics"));
}

int RunRefitctl(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  ArgCursor args(argc, argv);
  GlobalOptions g;
  while (!args.Done() && absl::StartsWith(args.Cur(), "-")) {
    const absl::Status st = ParseGlobalOption(args, g);
    if (!st.ok()) return UsageError(err, st);
    if (g.help) {
      out << kMainUsage;
      return 0;
    }
    if (g.version) {
      out << "refitctl " << kBuildVersion << "\n";
      return 0;
    }
  }
  std::string verb_name;
  absl::StatusOr<const Verb*> verb = TakeVerb(args, &verb_name);
  if (!verb.ok()) return UsageError(err, verb.status());
  absl::StatusOr<Parsed> parsed = (*verb)->parse(args);
  if (!parsed.ok()) return UsageError(err, parsed.status());
  if (parsed->help) {
    out << (*verb)->usage;
    return 0;
  }
  if (!g.have_target) {
    return UsageError(err, absl::InvalidArgumentError(absl::StrCat(
                               "refitctl ", verb_name,
                               " needs --target ADDR before the verb (the daemon's Control "
                               "address, e.g. 127.0.0.1:7400 or unix:/run/refitd/control.sock)")));
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeControlChannel(g.target);
  if (!channel.ok()) return UsageError(err, channel.status());
  std::unique_ptr<v1::Control::Stub> stub = v1::Control::NewStub(*channel);
  Session session{stub.get(), g.timeout.value_or(parsed->default_timeout) + parsed->extra_deadline,
                  out, err};
  absl::StatusOr<int> rc = parsed->run(session);
  if (!rc.ok()) {
    err << "refitctl: " << verb_name << ": " << absl::StatusCodeToString(rc.status().code())
        << ": " << rc.status().message() << "\n";
    return 1;
  }
  return *rc;
}

}  // namespace refit::client
