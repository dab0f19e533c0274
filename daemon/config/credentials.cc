#include "daemon/config/credentials.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/config.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace refit::config {
namespace {

// Rejects calls from peers whose certificate names no allowed identity.
class IdentityAuthorizer final : public grpc::AuthMetadataProcessor {
 public:
  IdentityAuthorizer(absl::flat_hash_set<std::string> allowed, std::string field_path)
      : allowed_(std::move(allowed)), field_path_(std::move(field_path)) {}

  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& /*auth_metadata*/, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    const std::vector<std::string> ids = PeerIdentities(*context);
    for (const std::string& id : ids) {
      if (allowed_.contains(id)) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("client certificate identity [", absl::StrJoin(ids, ", "),
                                     "] is not in ", field_path_, ".allowed_identities"));
  }

 private:
  const absl::flat_hash_set<std::string> allowed_;
  const std::string field_path_;
};

}  // namespace

bool UsesTls(const v1::ServerTls& tls) {
  return !tls.insecure() && !tls.cert().empty() && !tls.key().empty() && !tls.ca().empty();
}

bool UsesTls(const v1::ClientTls& tls) {
  return !tls.insecure() && !tls.cert().empty() && !tls.key().empty() && !tls.ca().empty();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const v1::ServerTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureServerCredentials();
  ASSIGN_OR_RETURN(std::string cert, ReadSmallFile(tls.cert(), absl::StrCat(field_path, ".cert")));
  ASSIGN_OR_RETURN(std::string key, ReadSmallFile(tls.key(), absl::StrCat(field_path, ".key")));
  ASSIGN_OR_RETURN(std::string ca, ReadSmallFile(tls.ca(), absl::StrCat(field_path, ".ca")));
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = std::move(ca);
  options.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  if (tls.allowed_identities_size() > 0) {
    absl::flat_hash_set<std::string> allowed(tls.allowed_identities().begin(),
                                             tls.allowed_identities().end());
    creds->SetAuthMetadataProcessor(
        std::make_shared<IdentityAuthorizer>(std::move(allowed), field_path));
  }
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const v1::ClientTls& tls, const std::string& field_path) {
  if (!UsesTls(tls)) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  ASSIGN_OR_RETURN(options.pem_cert_chain,
                   ReadSmallFile(tls.cert(), absl::StrCat(field_path, ".cert")));
  ASSIGN_OR_RETURN(options.pem_private_key,
                   ReadSmallFile(tls.key(), absl::StrCat(field_path, ".key")));
  ASSIGN_OR_RETURN(options.pem_root_certs,
                   ReadSmallFile(tls.ca(), absl::StrCat(field_path, ".ca")));
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(options);
  if (creds == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_path, ": gRPC rejected the TLS configuration"));
  }
  return creds;
}

void ApplyClientTlsArgs(const v1::ClientTls& tls, grpc::ChannelArguments* args) {
  if (UsesTls(tls) && !tls.server_name().empty()) {
    args->SetSslTargetNameOverride(tls.server_name());
  }
}

std::vector<std::string> PeerIdentities(const grpc::AuthContext& context) {
  std::vector<std::string> ids;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : context.FindPropertyValues(property)) {
      std::string id(value.data(), value.size());
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(std::move(id));
    }
  }
  return ids;
}

std::string PeerIdentity(const grpc::AuthContext& context) {
  std::vector<std::string> ids = PeerIdentities(context);
  return ids.empty() ? std::string() : std::move(ids.front());
}

}  // namespace refit::config
