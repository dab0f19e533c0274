// gRPC credentials from a config's TLS blocks (config.proto ServerTls / ClientTls), and the
// identity of a TLS peer.
//
// Listeners with TLS are always mTLS: the client must present a certificate that chains to
// `ca`, else the handshake fails. With `allowed_identities`, a call from a peer whose certificate
// names none of them (subject CN or a subject alternative name) fails with PERMISSION_DENIED
// before any handler runs, on every service of that listener (health included).
// A TLS block without files (loopback, or insecure: true) gives plaintext credentials; the config
// validator has already enforced when that is allowed.
#ifndef REFIT_DAEMON_CONFIG_CREDENTIALS_H_
#define REFIT_DAEMON_CONFIG_CREDENTIALS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "refit/v1/config.pb.h"

namespace refit::config {

// Reads the PEM files (errors name `field_path`.cert etc. and the file path).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const v1::ServerTls& tls, const std::string& field_path);

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const v1::ClientTls& tls, const std::string& field_path);

// Sets the TLS target name override when tls.server_name is set (for connecting by IP to a
// server whose certificate carries a DNS name).
void ApplyClientTlsArgs(const v1::ClientTls& tls, grpc::ChannelArguments* args);

// True when the block configures TLS (cert, key and ca set), false for plaintext.
bool UsesTls(const v1::ServerTls& tls);
bool UsesTls(const v1::ClientTls& tls);

// Names a TLS peer's certificate carries: subject alternative names then the common name.
// Empty for a plaintext peer.
std::vector<std::string> PeerIdentities(const grpc::AuthContext& context);
// The peer's identity for logs and status (first SAN, else CN); "" for a plaintext peer.
std::string PeerIdentity(const grpc::AuthContext& context);

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_CREDENTIALS_H_
