// The daemons' Control, TrainerApi and ConsumerApi services behind their authorization: each
// wrapper checks the caller (control_auth.h) and forwards to the real service, so no service
// implementation carries authorization code and none can forget it. A denial is logged (logger
// "auth") and answered PERMISSION_DENIED before the real handler runs.
//
//   AuthorizedControl control(&publisher_control, ControlAuthorizer(cfg.control_access(),
//                                                                   "publisher.control_access"));
//   spec.services = {&control};   // register the wrapper, not the service
#ifndef REFIT_DAEMON_AUTH_AUTHORIZED_SERVICES_H_
#define REFIT_DAEMON_AUTH_AUTHORIZED_SERVICES_H_

#include <memory>

#include "daemon/auth/control_auth.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace refit::auth {

class AuthorizedControl final : public v1::Control::Service {
 public:
  // `inner` must outlive the wrapper.
  AuthorizedControl(v1::Control::Service* inner, ControlAuthorizer authorizer);

  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest* request,
                      v1::StatusResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::PublishRequest* request,
                       v1::PublishResponse* response) override;
  grpc::Status Export(grpc::ServerContext* context, const v1::ExportRequest* request,
                      v1::ExportResponse* response) override;
  grpc::Status WaitVersion(grpc::ServerContext* context, const v1::WaitVersionRequest* request,
                           v1::WaitVersionResponse* response) override;
  grpc::Status Verify(grpc::ServerContext* context, const v1::VerifyRequest* request,
                      v1::VerifyResponse* response) override;
  grpc::Status Resync(grpc::ServerContext* context, const v1::ResyncRequest* request,
                      v1::ResyncResponse* response) override;

 private:
  // OK, or the denial (logged) as a gRPC status.
  grpc::Status Check(grpc::ServerContext* context, absl::string_view method) const;

  v1::Control::Service* const inner_;
  const ControlAuthorizer authorizer_;
  std::shared_ptr<spdlog::logger> log_;
};

class AuthorizedTrainerApi final : public v1::TrainerApi::Service {
 public:
  AuthorizedTrainerApi(v1::TrainerApi::Service* inner, LocalAuthorizer authorizer);

  grpc::Status RegisterTensors(grpc::ServerContext* context,
                               const v1::RegisterTensorsRequest* request,
                               v1::RegisterTensorsResponse* response) override;
  grpc::Status Unregister(grpc::ServerContext* context, const v1::UnregisterRequest* request,
                          v1::UnregisterResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::LocalPublishRequest* request,
                       v1::LocalPublishResponse* response) override;

 private:
  grpc::Status Check(grpc::ServerContext* context, absl::string_view method) const;

  v1::TrainerApi::Service* const inner_;
  const LocalAuthorizer authorizer_;
  std::shared_ptr<spdlog::logger> log_;
};

class AuthorizedConsumerApi final : public v1::ConsumerApi::Service {
 public:
  AuthorizedConsumerApi(v1::ConsumerApi::Service* inner, LocalAuthorizer authorizer);

  grpc::Status GetLayout(grpc::ServerContext* context, const v1::GetLayoutRequest* request,
                         v1::Layout* response) override;
  grpc::Status WatchVersions(grpc::ServerContext* context, const v1::WatchVersionsRequest* request,
                             grpc::ServerWriter<v1::VersionEvent>* writer) override;
  grpc::Status AcquireLease(grpc::ServerContext* context, const v1::AcquireLeaseRequest* request,
                            v1::Lease* response) override;
  grpc::Status RenewLease(grpc::ServerContext* context, const v1::RenewLeaseRequest* request,
                          v1::Lease* response) override;
  grpc::Status ReleaseLease(grpc::ServerContext* context, const v1::ReleaseLeaseRequest* request,
                            v1::ReleaseLeaseResponse* response) override;
  grpc::Status GetChanges(grpc::ServerContext* context, const v1::GetChangesRequest* request,
                          v1::ChangeSet* response) override;

 private:
  grpc::Status Check(grpc::ServerContext* context, absl::string_view method) const;

  v1::ConsumerApi::Service* const inner_;
  const LocalAuthorizer authorizer_;
  std::shared_ptr<spdlog::logger> log_;
};

}  // namespace refit::auth

#endif  // REFIT_DAEMON_AUTH_AUTHORIZED_SERVICES_H_
