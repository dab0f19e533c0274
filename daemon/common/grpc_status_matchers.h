// The status matchers (status_matchers.h: IsOk, StatusIs) for grpc::Status too, so that a test of
// a gRPC call prints the call's code and message when it fails:
//   EXPECT_THAT(stub->Status(&ctx, request, &response), IsOk());
//   EXPECT_THAT(call->Finish(), StatusIs(absl::StatusCode::kPermissionDenied));
// The gRPC status is compared as FromGrpcStatus gives it (codes map one to one).
#ifndef REFIT_DAEMON_COMMON_GRPC_STATUS_MATCHERS_H_
#define REFIT_DAEMON_COMMON_GRPC_STATUS_MATCHERS_H_

#include "daemon/common/grpc_status.h"
#include "daemon/common/status_matchers.h"
#include "grpcpp/support/status.h"

namespace refit::testing::internal {

template <>
struct StatusOf<grpc::Status> {
  static absl::Status Get(const grpc::Status& s) { return FromGrpcStatus(s); }
};

}  // namespace refit::testing::internal

#endif  // REFIT_DAEMON_COMMON_GRPC_STATUS_MATCHERS_H_
