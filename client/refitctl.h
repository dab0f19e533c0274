// refitctl: the command-line client of both daemons (proto/refit/v1/control.proto).
//
//   refitctl --target ADDR [--tls-cert F --tls-key F --tls-ca F [--tls-server-name N] |
//            --insecure] [--timeout S] VERB [verb flags]
//
// Verbs: status [--json | --watch [--interval S] [--count N]], publish --safetensors PATH... [--version N],
// export --safetensors PATH [--version N], wait --version N [--timeout S] [--all-subscribers],
// verify, resync [--tensor NAME]... [--subscriber NAME]. `--help` on refitctl and on every verb.
// Exit codes: 0 ok; 1 the RPC failed, verify found mismatches, or wait timed out (one line
// "refitctl: <verb>: <CODE>: <message>" on stderr); 2 usage errors ("refitctl: error: ...").
//
// The logic lives in this library so that tests run it in process; refitctl_main.cc only calls
// RunRefitctl.
#ifndef REFIT_CLIENT_REFITCTL_H_
#define REFIT_CLIENT_REFITCTL_H_

#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "refit/v1/config.pb.h"
#include "refit/v1/control.pb.h"

namespace refit::client {

// Runs refitctl with its command line (argv[0] is the program name); writes results to `out`,
// errors to `err`; returns the exit code (0, 1 or 2).
int RunRefitctl(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

// Where and how to connect to a daemon's Control service.
struct ControlTarget {
  // Address as config::ParseAddress(kConnect) accepts: "127.0.0.1:7400", "unix:/run/x.sock", ...
  std::string address;
  // TLS of the connection (cert/key/ca/server_name, or insecure). A non-loopback address needs
  // cert, key and ca, or insecure: true.
  v1::ClientTls tls;
};

// Parses and checks the target (InvalidArgument naming the address, or the rule that a
// non-loopback target needs TLS or --insecure), reads the TLS files, and creates a channel (no
// connection attempt yet). `flag` names the option in messages ("--target").
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeControlChannel(const ControlTarget& target,
                                                                  const std::string& flag =
                                                                      "--target");

// Renders a StatusResponse as refitctl status prints it: a human table, or JSON (the message
// with proto field names, every field printed).
std::string FormatStatusTable(const v1::StatusResponse& status);
absl::StatusOr<std::string> FormatStatusJson(const v1::StatusResponse& status);

// Small formatting helpers (exposed for tests and the demo): "1.23 GB", "0x0123456789abcdef",
// "12.3 ms".
std::string FormatBytes(uint64_t bytes);
std::string FormatDigest(uint64_t digest);
std::string FormatMicros(uint64_t micros);

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_H_
