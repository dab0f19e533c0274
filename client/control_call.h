// How refitctl calls the daemon's Control RPCs: one call under the command's deadline (Call), or
// an idempotent call (Publish, with its request id) retried while the daemon is unreachable
// (CallWithRetries), and the random request id that makes the retry safe.
#ifndef REFIT_CLIENT_CONTROL_CALL_H_
#define REFIT_CLIENT_CONTROL_CALL_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/grpc_status.h"
#include "grpcpp/client_context.h"
#include "refit/v1/control.grpc.pb.h"

namespace refit::client {

// What a verb runs with: the Control stub, the RPC deadline (from now), where to print.
struct Session {
  v1::Control::Stub* stub;
  absl::Duration timeout;
  std::ostream& out;
  std::ostream& err;
};

// A Control RPC as a member of the stub.
template <typename Req, typename Resp>
using ControlRpc = grpc::Status (v1::Control::Stub::*)(grpc::ClientContext*, const Req&, Resp*);

// Calls one Control RPC under the session's deadline.
template <typename Req, typename Resp>
absl::Status Call(const Session& s, ControlRpc<Req, Resp> rpc, const Req& req, Resp* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + s.timeout));
  return FromGrpcStatus((s.stub->*rpc)(&ctx, req, resp));
}

// Calls an idempotent RPC (a request with a request_id: Publish), retrying UNAVAILABLE (daemon
// not reachable, connection reset) with the same request, up to 3 attempts with a doubling
// backoff from 200 ms, all under the session's one deadline. A retried failure says how many
// attempts were made with which `verb` request id.
template <typename Req, typename Resp>
absl::Status CallWithRetries(const Session& s, ControlRpc<Req, Resp> rpc, const Req& req,
                             Resp* resp, const std::string& verb) {
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

// 32 hex digits from the OS's random source (a publish's default request id).
std::string RandomRequestId();

}  // namespace refit::client

#endif  // REFIT_CLIENT_CONTROL_CALL_H_
