// local_api_probe: one call on a daemon's local API socket, for tests that run it as another user
// (setpriv) to check who the daemon lets in.
//
//   local_api_probe trainer unix:/path.sock    TrainerApi Publish (client "probe")
//   local_api_probe consumer unix:/path.sock   ConsumerApi GetLayout
//
// Prints "OK" or "<CODE>: <message>" on stdout; exits 0 when the call succeeded, 1 otherwise,
// 2 for bad arguments.
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "daemon/common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "refit/v1/local.grpc.pb.h"

namespace {

absl::Status Call(const std::string& api, const std::string& target) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (api == "trainer") {
    auto stub = refit::v1::TrainerApi::NewStub(channel);
    refit::v1::LocalPublishRequest req;
    req.set_client("probe");
    refit::v1::LocalPublishResponse resp;
    return refit::FromGrpcStatus(stub->Publish(&ctx, req, &resp));
  }
  auto stub = refit::v1::ConsumerApi::NewStub(channel);
  refit::v1::Layout layout;
  return refit::FromGrpcStatus(stub->GetLayout(&ctx, refit::v1::GetLayoutRequest(), &layout));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "trainer" && std::string(argv[1]) != "consumer")) {
    std::fprintf(stderr, "usage: local_api_probe trainer|consumer unix:/path.sock\n");
    return 2;
  }
  const absl::Status s = Call(argv[1], argv[2]);
  if (s.ok()) {
    std::printf("OK\n");
    return 0;
  }
  std::printf("%s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
              std::string(s.message()).c_str());
  return 1;
}
