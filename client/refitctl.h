// refitctl: the command-line client of both daemons (proto/refit/v1/control.proto).
//
//   refitctl --target ADDR [--tls-cert F --tls-key F --tls-ca F [--tls-server-name N] |
//            --insecure] [--timeout S] VERB [verb flags]
//
// Verbs: status [--json | --watch [--interval S] [--count N]], publish --safetensors PATH...
// [--version N], export --safetensors PATH [--version N], wait --version N [--timeout S]
// [--all-subscribers], verify, resync [--tensor NAME]... [--subscriber NAME]. `--help` on refitctl
// and on every verb. Exit codes: 0 ok; 1 the RPC failed, verify found mismatches, or wait timed out
// (one line "refitctl: <verb>: <CODE>: <message>" on stderr); 2 usage errors ("refitctl: error:
// ...").
//
// The logic lives in the library refit_client so that tests run it in process; refitctl_main.cc
// only calls RunRefitctl. Its parts, one concept a file: refitctl.cc (the options before the
// verb, the run), refitctl_verbs.{h,cc} (each verb's options and RPC), refitctl_usage.{h,cc}
// (the --help texts), refitctl_format.{h,cc} (the status table and units), control_call.{h,cc}
// (calls under a deadline, the publish retry), control_channel.{h,cc} (target and TLS checks,
// the channel); the argument parser is daemon/common/arg_cursor.h, shared with refitd.
#ifndef REFIT_CLIENT_REFITCTL_H_
#define REFIT_CLIENT_REFITCTL_H_

#include <ostream>

#include "client/control_channel.h"  // ControlTarget, MakeControlChannel
#include "client/refitctl_format.h"  // FormatStatusTable, FormatStatusJson, FormatBytes, ...

namespace refit::client {

// Runs refitctl with its command line (argv[0] is the program name); writes results to `out`,
// errors to `err`; returns the exit code (0, 1 or 2).
int RunRefitctl(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFITCTL_H_
