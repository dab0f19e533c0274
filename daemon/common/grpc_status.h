// The one place where grpc::Status and absl::Status convert into each other.
//
// refitd code returns absl::Status everywhere; RPC handlers convert at the gRPC boundary
// (`return ToGrpcStatus(status);`) and clients convert what a call returns
// (`REFIT_RETURN_IF_ERROR(FromGrpcStatus(stub->Status(&ctx, req, &resp)));`).
//
// Codes map one to one (gRPC and absl share the canonical code space). Messages are preserved,
// except that ToGrpcStatus shortens a message whose gRPC wire form (the percent-encoded
// grpc-message trailer) would exceed kMaxGrpcMessageWireBytes: an oversized trailer would make the
// peer fail the call with an unrelated error and lose the message entirely. gRPC's binary
// error_details travel as the absl payload kGrpcErrorDetailsTypeUrl; other absl payloads are not
// carried over gRPC.
#ifndef REFIT_DAEMON_COMMON_GRPC_STATUS_H_
#define REFIT_DAEMON_COMMON_GRPC_STATUS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace refit {

// Largest percent-encoded message ToGrpcStatus emits (gRPC's default limit for all metadata of
// a response is 8 KiB).
inline constexpr size_t kMaxGrpcMessageWireBytes = 4096;

// Type URL of the absl::Status payload holding grpc::Status::error_details() (a serialized
// google.rpc.Status).
inline constexpr char kGrpcErrorDetailsTypeUrl[] = "type.googleapis.com/google.rpc.Status";

grpc::StatusCode ToGrpcCode(absl::StatusCode code);
absl::StatusCode FromGrpcCode(grpc::StatusCode code);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// Shortens `message` so that its percent-encoded form fits in `max_wire_bytes`, cutting at a
// UTF-8 character boundary and appending " [... N bytes truncated]"; returns it unchanged when it
// fits. Exposed for tests.
std::string TruncateForGrpc(const std::string& message,
                            size_t max_wire_bytes = kMaxGrpcMessageWireBytes);

}  // namespace refit

#endif  // REFIT_DAEMON_COMMON_GRPC_STATUS_H_
