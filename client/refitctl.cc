#include "client/refitctl.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/control_call.h"
#include "client/refitctl_usage.h"
#include "client/refitctl_verbs.h"
#include "daemon/common/arg_cursor.h"
#include "daemon/common/status_macros.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/version.h"

namespace refit::client {
namespace {

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
absl::Status ParseGlobalOption(ArgCursor& args, GlobalOptions& g) {
  if (args.Help()) {
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
    REFIT_ASSIGN_OR_RETURN(const bool matched, args.Value(f.name, &v));
    if (matched) {
      f.set(v);
      return absl::OkStatus();
    }
  }
  REFIT_ASSIGN_OR_RETURN(const bool matched, args.Value("--timeout", &v));
  if (!matched) return UnknownArgument(args.Cur(), "refitctl");
  REFIT_ASSIGN_OR_RETURN(g.timeout, ParseSeconds("--timeout", v));
  return absl::OkStatus();
}

// The verb at args.Cur() (consumed); InvalidArgument naming the verbs when it is missing or
// unknown.
absl::StatusOr<const Verb*> TakeVerb(ArgCursor& args, std::string* name) {
  if (args.Done()) {
    return absl::InvalidArgumentError(
        "missing verb: status, publish, export, wait, verify, resync or metrics "
        "(see refitctl --help)");
  }
  *name = args.Cur();
  args.Next();
  for (const Verb& v : Verbs()) {
    if (*name == v.name) return &v;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown verb \"", *name,
      "\": expected status, publish, export, wait, verify, resync or metrics"));
}

int UsageError(std::ostream& err, const absl::Status& status) {
  err << "refitctl: error: " << status.message() << "\n";
  return 2;
}

}  // namespace

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
      out << "refitctl " << kRefitVersion << "\n";
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
