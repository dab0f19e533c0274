#include "client/control_channel.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"
#include "daemon/config/config.h"
#include "daemon/config/credentials.h"
#include "daemon/config/tls_material.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace refit::client {

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeControlChannel(const ControlTarget& target,
                                                                  const std::string& flag) {
  absl::StatusOr<config::Address> addr =
      config::ParseAddress(target.address, config::AddressUse::kConnect);
  if (!addr.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, addr.status(), flag, " ",
                      Quoted(target.address));
  }
  const v1::ClientTls& tls = target.tls;
  const bool any_file = !tls.cert().empty() || !tls.key().empty() || !tls.ca().empty();
  if (tls.insecure() && (any_file || !tls.server_name().empty())) {
    return absl::InvalidArgumentError(
        "--insecure cannot be combined with --tls-cert, --tls-key, --tls-ca or --tls-server-name");
  }
  if (any_file && !config::UsesTls(tls)) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-ca go together (mTLS): give all three");
  }
  if (!tls.server_name().empty() && !config::UsesTls(tls)) {
    return absl::InvalidArgumentError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca");
  }
  if (!addr->loopback && !config::UsesTls(tls) && !tls.insecure()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " \"", target.address,
        "\" is not a loopback address: give --tls-cert, --tls-key and --tls-ca (mTLS), or "
        "--insecure to connect in plaintext"));
  }
  if (config::UsesTls(tls)) {
    // Read and checked here too so that errors name the flags.
    REFIT_ASSIGN_OR_RETURN(const std::string cert, config::ReadSmallFile(tls.cert(), "--tls-cert"));
    REFIT_ASSIGN_OR_RETURN(const std::string key, config::ReadSmallFile(tls.key(), "--tls-key"));
    REFIT_ASSIGN_OR_RETURN(const std::string ca, config::ReadSmallFile(tls.ca(), "--tls-ca"));
    auto named = [](const char* flag, const std::string& path) {
      return absl::StrCat(flag, " ", Quoted(path));
    };
    REFIT_RETURN_IF_ERROR(
        config::CheckTlsMaterialNamed(cert, key, ca, named("--tls-cert", tls.cert()),
                                      named("--tls-key", tls.key()), named("--tls-ca", tls.ca()))
            .status());
  }
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                         config::MakeChannelCredentials(tls, "tls"));
  grpc::ChannelArguments args;
  config::ApplyClientTlsArgs(tls, &args);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(addr->grpc_target, creds, args);
}

}  // namespace refit::client
