// gRPC credentials from a config's TLS blocks (config.proto ServerTls / ClientTls), and the
// identity of a TLS peer.
//
// Listeners with TLS are always mTLS: the client must present a certificate that chains to
// `ca`, else the handshake fails. With `allowed_identities`, a call from a peer whose certificate
// names none of them (subject CN or a subject alternative name) fails with PERMISSION_DENIED
// before any handler runs, on every service of that listener (health included).
// A TLS block without files (loopback, or insecure: true) gives plaintext credentials; the config
// validator has already enforced when that is allowed.
//
// Certificate rotation (TlsReloader): the daemons' credentials come from a certificate provider
// that serves material refitd has checked itself (tls_material.h). The files are read again
// every reload_interval_ms and on Reload() (SIGHUP); new valid material is used by new
// handshakes (gRPC picks it up within a second), live connections keep theirs, and a bad file
// (unparsable, key not matching the certificate, CA not parseable) keeps the old material, says
// so in the "tls" log and in Status (TlsMaterialStatus). gRPC's FileWatcherCertificateProvider
// reads only checked copies, held in memory files (memfd) behind /proc/self/fd paths, so it
// never sees a bad or half-replaced file.
#ifndef REFIT_DAEMON_CONFIG_CREDENTIALS_H_
#define REFIT_DAEMON_CONFIG_CREDENTIALS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/config/tls_material.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "refit/v1/config.pb.h"
#include "refit/v1/control.pb.h"

namespace refit::config {

// Reads and checks the PEM files (errors name `field_path`.cert etc. and the file path); the
// material is fixed (refitctl, tests). Daemons use TlsReloader.
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

// One TLS block's material, checked by refitd and served to gRPC (see the top of this file).
class ReloadableTls;

// The TLS blocks of one daemon, reloaded together: every block's reload_interval_ms by a
// thread, and all at once on Reload().
class TlsReloader {
 public:
  TlsReloader();
  ~TlsReloader();  // stops the thread
  TlsReloader(const TlsReloader&) = delete;
  TlsReloader& operator=(const TlsReloader&) = delete;

  // Credentials whose material follows the files (plaintext ones when the block has no TLS, as
  // MakeServerCredentials). Errors as LoadTlsMaterial, naming `field_path`.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
      const v1::ServerTls& tls, const std::string& field_path);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
      const v1::ClientTls& tls, const std::string& field_path);

  // Checks every block's files now (SIGHUP). OK when all hold the loaded or newly loaded
  // material; else the first refusal (the old material stays).
  absl::Status Reload();

  // One entry per TLS block, in the order they were added.
  std::vector<v1::TlsMaterialStatus> Status() const;

 private:
  absl::StatusOr<ReloadableTls*> Add(const TlsFiles& files, uint32_t interval_ms);
  void Run();

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<ReloadableTls>> blocks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_CREDENTIALS_H_
