#include "client/refitctl_verbs.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/refitctl_format.h"
#include "client/refitctl_usage.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/metrics/http_get.h"

namespace refit::client {
namespace {

absl::StatusOr<uint64_t> ParseVersionFlag(const std::string& flag, const std::string& text) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", Quoted(text), " is not a version number (an integer >= 1)"));
  }
  return v;
}

std::string AbsolutePath(const std::string& path) {
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec) return path;
  return abs.lexically_normal().string();
}

// Reads a verb's options to the end of the command line. --help/-h sets p->help and stops;
// `option` takes the option at the cursor (true) or does not know it (false: an error naming
// `verb`, e.g. "refitctl publish").
absl::Status ParseOptions(ArgCursor& args, const std::string& verb, Parsed* p,
                          const std::function<absl::StatusOr<bool>()>& option) {
  while (!args.Done()) {
    if (args.Help()) {
      p->help = true;
      return absl::OkStatus();
    }
    REFIT_ASSIGN_OR_RETURN(bool taken, option());
    if (!taken) return UnknownArgument(args.Cur(), verb);
  }
  return absl::OkStatus();
}

// Matches "--version N" (N >= 1) at the cursor into the request's version.
template <typename Request>
absl::StatusOr<bool> VersionOption(ArgCursor& args, Request* req) {
  std::string v;
  REFIT_ASSIGN_OR_RETURN(bool found, args.Value("--version", &v));
  if (!found) return false;
  REFIT_ASSIGN_OR_RETURN(uint64_t version, ParseVersionFlag("--version", v));
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
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl status", &p, [&]() -> absl::StatusOr<bool> {
    if (args.Switch("--json")) {
      json = true;
      return true;
    }
    if (args.Switch("--watch")) {
      watch = true;
      return true;
    }
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool found, args.Value("--interval", &v));
    if (found) {
      REFIT_ASSIGN_OR_RETURN(interval, ParseSeconds("--interval", v, /*allow_zero=*/true));
      return true;
    }
    REFIT_ASSIGN_OR_RETURN(found, args.Value("--count", &v));
    if (found && !absl::SimpleAtoi(v, &count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--count ", Quoted(v), " is not a number of views"));
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
    REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Status, v1::StatusRequest(), &resp));
    if (json) {
      REFIT_ASSIGN_OR_RETURN(std::string text, FormatStatusJson(resp));
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
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl publish", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool files, args.Value("--safetensors", &v));
    if (files) {
      req.add_safetensors(AbsolutePath(v));
      for (const std::string& more : args.TakeOperands()) req.add_safetensors(AbsolutePath(more));
      return true;
    }
    REFIT_ASSIGN_OR_RETURN(bool id, args.Value("--request-id", &v));
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
    REFIT_RETURN_IF_ERROR(CallWithRetries(s, &v1::Control::Stub::Publish, req, &resp, "publish"));
    s.out << absl::StrFormat(
        "published version %u digest %s: %u tensors, %s, change rate %s, publish time %s\n",
        resp.version(), FormatDigest(resp.version_digest()), resp.tensors(),
        FormatBytes(resp.bytes()), FormatPercent(resp.change_rate()),
        FormatMicros(resp.publish_micros()));
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseExport(ArgCursor& args) {
  Parsed p;
  p.default_timeout = absl::Seconds(600);
  v1::ExportRequest req;
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl export", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool file, args.Value("--safetensors", &v));
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
    REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Export, req, &resp));
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
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl wait", &p, [&]() -> absl::StatusOr<bool> {
    if (args.Switch("--all-subscribers")) {
      req.set_all_subscribers(true);
      return true;
    }
    REFIT_ASSIGN_OR_RETURN(bool version, VersionOption(args, &req));
    if (version) return true;
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool timeout, args.Value("--timeout", &v));
    if (timeout) {
      REFIT_ASSIGN_OR_RETURN(absl::Duration d,
                             ParseSeconds("wait --timeout", v, /*allow_zero=*/true));
      // 0: until the RPC deadline (the connection --timeout).
      req.set_timeout_ms(
          d == absl::ZeroDuration() ? 0 : std::max<uint64_t>(1, absl::ToInt64Milliseconds(d)));
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
    REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::WaitVersion, req, &resp));
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
  REFIT_RETURN_IF_ERROR(
      ParseOptions(args, "refitctl verify", &p, []() -> absl::StatusOr<bool> { return false; }));
  if (p.help) return p;
  p.run = [](Session& s) -> absl::StatusOr<int> {
    v1::VerifyResponse resp;
    REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Verify, v1::VerifyRequest(), &resp));
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
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl resync", &p, [&]() -> absl::StatusOr<bool> {
    std::string v;
    REFIT_ASSIGN_OR_RETURN(bool tensor, args.Value("--tensor", &v));
    if (tensor) {
      req.add_tensors(v);
      return true;
    }
    REFIT_ASSIGN_OR_RETURN(bool sub, args.Value("--subscriber", &v));
    if (sub) req.set_subscriber(v);
    return sub;
  }));
  if (p.help) return p;
  p.run = [req](Session& s) -> absl::StatusOr<int> {
    v1::ResyncResponse resp;
    REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Resync, req, &resp));
    s.out << absl::StrFormat(
        "resync: %u session(s) will receive keyframes for %s\n", resp.sessions(),
        req.tensors_size() == 0 ? std::string("every tensor")
                                : absl::StrCat(req.tensors_size(), " tensor(s)"));
    return 0;
  };
  return p;
}

absl::StatusOr<Parsed> ParseMetrics(ArgCursor& args) {
  Parsed p;
  std::string address;
  REFIT_RETURN_IF_ERROR(ParseOptions(args, "refitctl metrics", &p, [&]() -> absl::StatusOr<bool> {
    return args.Value("--address", &address);
  }));
  if (p.help) return p;
  p.run = [address](Session& s) -> absl::StatusOr<int> {
    std::string endpoint = address;
    if (endpoint.empty()) {
      v1::StatusResponse status;
      REFIT_RETURN_IF_ERROR(Call(s, &v1::Control::Stub::Status, v1::StatusRequest(), &status));
      endpoint = status.metrics_address();
      if (endpoint.empty()) {
        return absl::FailedPreconditionError(
            "the daemon serves no metrics (its config's metrics.listen is empty)");
      }
    }
    REFIT_ASSIGN_OR_RETURN(const metrics::HttpResponse r,
                           metrics::HttpGet(endpoint, "/metrics", s.timeout));
    if (r.status != 200) {
      return absl::UnavailableError(
          absl::StrCat("GET http://", endpoint, "/metrics: HTTP ", r.status));
    }
    s.out << r.body;
    return 0;
  };
  return p;
}

}  // namespace

std::span<const Verb> Verbs() {
  static constexpr Verb kVerbs[] = {
      {"status", kStatusUsage, ParseStatus},    {"publish", kPublishUsage, ParsePublish},
      {"export", kExportUsage, ParseExport},    {"wait", kWaitUsage, ParseWait},
      {"verify", kVerifyUsage, ParseVerify},    {"resync", kResyncUsage, ParseResync},
      {"metrics", kMetricsUsage, ParseMetrics},
  };
  return kVerbs;
}

absl::StatusOr<absl::Duration> ParseSeconds(const std::string& flag, const std::string& text,
                                            bool allow_zero) {
  double s = 0;
  if (!absl::SimpleAtod(text, &s) || !(allow_zero ? s >= 0 : s > 0) || s > 1e7) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", Quoted(text),
                                                   " is not a number of seconds (",
                                                   allow_zero ? ">= 0" : "> 0", ")"));
  }
  return absl::Seconds(s);
}

}  // namespace refit::client
