#include "daemon/auth/authorized_services.h"

#include <utility>

#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"

namespace refit::auth {
namespace {

// OK, or the denial: logged once (warn) and converted. `Authorizer`: ControlAuthorizer or
// LocalAuthorizer.
template <typename Authorizer>
grpc::Status CheckCall(const Authorizer& authorizer, spdlog::logger& log,
                       const grpc::ServerContext& context, absl::string_view method) {
  const absl::Status s = authorizer.Authorize(context, method);
  if (s.ok()) return grpc::Status::OK;
  log.warn("denied: {}", std::string(s.message()));
  return ToGrpcStatus(s);
}

}  // namespace

// The forwarding bodies: check, then call the same method of the real service.
#define REFIT_GUARDED(method, ...)                                      \
  if (grpc::Status denied = Check(context, #method); !denied.ok()) {    \
    return denied;                                                      \
  }                                                                     \
  return inner_->method(context, __VA_ARGS__)

// ---- Control ----------------------------------------------------------------------------------

AuthorizedControl::AuthorizedControl(v1::Control::Service* inner, ControlAuthorizer authorizer)
    : inner_(inner), authorizer_(std::move(authorizer)), log_(Logger("auth")) {}

grpc::Status AuthorizedControl::Check(grpc::ServerContext* context,
                                      absl::string_view method) const {
  return CheckCall(authorizer_, *log_, *context, method);
}

grpc::Status AuthorizedControl::Status(grpc::ServerContext* context,
                                       const v1::StatusRequest* request,
                                       v1::StatusResponse* response) {
  REFIT_GUARDED(Status, request, response);
}
grpc::Status AuthorizedControl::Publish(grpc::ServerContext* context,
                                        const v1::PublishRequest* request,
                                        v1::PublishResponse* response) {
  REFIT_GUARDED(Publish, request, response);
}
grpc::Status AuthorizedControl::Export(grpc::ServerContext* context,
                                       const v1::ExportRequest* request,
                                       v1::ExportResponse* response) {
  REFIT_GUARDED(Export, request, response);
}
grpc::Status AuthorizedControl::WaitVersion(grpc::ServerContext* context,
                                            const v1::WaitVersionRequest* request,
                                            v1::WaitVersionResponse* response) {
  REFIT_GUARDED(WaitVersion, request, response);
}
grpc::Status AuthorizedControl::Verify(grpc::ServerContext* context,
                                       const v1::VerifyRequest* request,
                                       v1::VerifyResponse* response) {
  REFIT_GUARDED(Verify, request, response);
}
grpc::Status AuthorizedControl::Resync(grpc::ServerContext* context,
                                       const v1::ResyncRequest* request,
                                       v1::ResyncResponse* response) {
  REFIT_GUARDED(Resync, request, response);
}

// ---- TrainerApi -------------------------------------------------------------------------------

AuthorizedTrainerApi::AuthorizedTrainerApi(v1::TrainerApi::Service* inner,
                                           LocalAuthorizer authorizer)
    : inner_(inner), authorizer_(std::move(authorizer)), log_(Logger("auth")) {}

grpc::Status AuthorizedTrainerApi::Check(grpc::ServerContext* context,
                                         absl::string_view method) const {
  return CheckCall(authorizer_, *log_, *context, method);
}

grpc::Status AuthorizedTrainerApi::RegisterTensors(grpc::ServerContext* context,
                                                   const v1::RegisterTensorsRequest* request,
                                                   v1::RegisterTensorsResponse* response) {
  REFIT_GUARDED(RegisterTensors, request, response);
}
grpc::Status AuthorizedTrainerApi::Unregister(grpc::ServerContext* context,
                                              const v1::UnregisterRequest* request,
                                              v1::UnregisterResponse* response) {
  REFIT_GUARDED(Unregister, request, response);
}
grpc::Status AuthorizedTrainerApi::Publish(grpc::ServerContext* context,
                                           const v1::LocalPublishRequest* request,
                                           v1::LocalPublishResponse* response) {
  REFIT_GUARDED(Publish, request, response);
}

// ---- ConsumerApi ------------------------------------------------------------------------------

AuthorizedConsumerApi::AuthorizedConsumerApi(v1::ConsumerApi::Service* inner,
                                             LocalAuthorizer authorizer)
    : inner_(inner), authorizer_(std::move(authorizer)), log_(Logger("auth")) {}

grpc::Status AuthorizedConsumerApi::Check(grpc::ServerContext* context,
                                          absl::string_view method) const {
  return CheckCall(authorizer_, *log_, *context, method);
}

grpc::Status AuthorizedConsumerApi::GetLayout(grpc::ServerContext* context,
                                              const v1::GetLayoutRequest* request,
                                              v1::Layout* response) {
  REFIT_GUARDED(GetLayout, request, response);
}
grpc::Status AuthorizedConsumerApi::WatchVersions(grpc::ServerContext* context,
                                                  const v1::WatchVersionsRequest* request,
                                                  grpc::ServerWriter<v1::VersionEvent>* writer) {
  REFIT_GUARDED(WatchVersions, request, writer);
}
grpc::Status AuthorizedConsumerApi::AcquireLease(grpc::ServerContext* context,
                                                 const v1::AcquireLeaseRequest* request,
                                                 v1::Lease* response) {
  REFIT_GUARDED(AcquireLease, request, response);
}
grpc::Status AuthorizedConsumerApi::RenewLease(grpc::ServerContext* context,
                                               const v1::RenewLeaseRequest* request,
                                               v1::Lease* response) {
  REFIT_GUARDED(RenewLease, request, response);
}
grpc::Status AuthorizedConsumerApi::ReleaseLease(grpc::ServerContext* context,
                                                 const v1::ReleaseLeaseRequest* request,
                                                 v1::ReleaseLeaseResponse* response) {
  REFIT_GUARDED(ReleaseLease, request, response);
}
grpc::Status AuthorizedConsumerApi::GetChanges(grpc::ServerContext* context,
                                               const v1::GetChangesRequest* request,
                                               v1::ChangeSet* response) {
  REFIT_GUARDED(GetChanges, request, response);
}

#undef REFIT_GUARDED

}  // namespace refit::auth
