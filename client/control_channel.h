// The connection refitctl makes to a daemon's Control service: the target address and its TLS
// (mTLS files, or plaintext where the security rule allows it), checked before any connection.
#ifndef REFIT_CLIENT_CONTROL_CHANNEL_H_
#define REFIT_CLIENT_CONTROL_CHANNEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "refit/v1/config.pb.h"

namespace refit::client {

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
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeControlChannel(
    const ControlTarget& target, const std::string& flag = "--target");

}  // namespace refit::client

#endif  // REFIT_CLIENT_CONTROL_CHANNEL_H_
