#include "client/trainer_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/config/address.h"
#include "daemon/sync/version_digest.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace refit::client {
namespace {

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE: return absl::ResourceExhaustedError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case EINVAL: return absl::InvalidArgumentError(msg);
    default: return absl::InternalError(msg);
  }
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

absl::StatusOr<std::unique_ptr<TrainerClient>> TrainerClient::Create(
    const std::string& local_socket, const std::string& client_name,
    const std::vector<v1::TensorSpec>& tensors, const TrainerClientOptions& options) {
  if (client_name.empty()) {
    return absl::InvalidArgumentError("trainer client name is empty (e.g. \"rank0\")");
  }
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer client ", Quoted(client_name), ": no tensors to register"));
  }
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer client alignment ", options.alignment, " is not a power of two"));
  }
  std::string target = local_socket;
  if (absl::StartsWith(target, "/")) target = absl::StrCat("unix:", target);
  absl::StatusOr<config::Address> addr =
      config::ParseAddress(target, config::AddressUse::kConnect);
  if (!addr.ok()) {
    return AnnotateAs(absl::StatusCode::kInvalidArgument, addr.status(), "publisher local socket ",
                      Quoted(local_socket));
  }
  if (addr->kind == config::AddressKind::kTcp) {
    return absl::InvalidArgumentError(absl::StrCat("publisher local socket \"", local_socket,
                                                   "\" is not a unix socket address"));
  }

  std::unique_ptr<TrainerClient> c(new TrainerClient());
  c->name_ = client_name;
  c->options_ = options;
  absl::flat_hash_set<std::string> names;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const v1::TensorSpec& spec = tensors[i];
    REFIT_RETURN_IF_ERROR(sync::ValidateTensorSpec(spec));
    if (!names.insert(spec.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("trainer client ", Quoted(client_name),
                                                     ": tensor ", Quoted(spec.name()),
                                                     " appears twice (tensor ", i, ")"));
    }
    REFIT_ASSIGN_OR_RETURN(uint64_t bytes, sync::TensorByteSize(spec));
    offset = AlignUp(offset, options.alignment);
    c->specs_.push_back(spec);
    c->offsets_.push_back(offset);
    c->sizes_.push_back(bytes);
    c->slices_.emplace_back();  // whole until SetSlice
    offset += bytes;
  }
  c->total_bytes_ = offset;
  c->map_bytes_ = std::max<uint64_t>(AlignUp(offset, options.alignment), options.alignment);

  // Not CLOEXEC-critical (the publisher opens it via /proc), but keep it out of exec'd children.
  // Sealable, sized once and sealed against resizing: the publisher maps it (zero copy at
  // registration) knowing it can never shrink under its mapping.
  c->fd_ = memfd_create(absl::StrCat("refit-trainer-", client_name).c_str(),
                        MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (c->fd_ < 0) return ErrnoStatus(errno, "memfd_create for the trainer's tensors");
  if (ftruncate(c->fd_, static_cast<off_t>(c->map_bytes_)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("ftruncate of the trainer memfd to ", c->map_bytes_,
                                           " bytes"));
  }
  if (fcntl(c->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus(errno, "sealing the trainer memfd against resizing");
  }
  void* map = mmap(nullptr, c->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, c->fd_, 0);
  if (map == MAP_FAILED) {
    return ErrnoStatus(errno, absl::StrCat("mmap of the trainer memfd (", c->map_bytes_,
                                           " bytes)"));
  }
  c->base_ = static_cast<uint8_t*>(map);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  c->stub_ = v1::TrainerApi::NewStub(
      grpc::CreateCustomChannel(addr->grpc_target, grpc::InsecureChannelCredentials(), args));
  return c;
}

TrainerClient::~TrainerClient() {
  if (base_ != nullptr) munmap(base_, map_bytes_);
  if (fd_ >= 0) close(fd_);
}

std::string TrainerClient::ProcPath() const {
  return absl::StrCat("/proc/", getpid(), "/fd/", fd_);
}

absl::StatusOr<size_t> TrainerClient::Find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].name() == name) return i;
  }
  return absl::NotFoundError(
      absl::StrCat("trainer client ", Quoted(name_), " has no tensor ", Quoted(name)));
}

v1::RegisterTensorsRequest TrainerClient::RegisterRequest() const {
  v1::RegisterTensorsRequest req;
  req.set_client(name_);
  const std::string path = ProcPath();
  for (size_t i = 0; i < specs_.size(); ++i) {
    v1::TensorLocation* loc = req.add_tensors();
    *loc->mutable_spec() = specs_[i];
    v1::ShmRegion* shm = loc->mutable_shm();
    shm->set_path(path);
    shm->set_offset(offsets_[i]);
    shm->set_size_bytes(sizes_[i]);
    if (slices_[i].has_value()) *loc->mutable_slice() = *slices_[i];
  }
  return req;
}

void TrainerClient::SetSlice(size_t i, const std::vector<uint64_t>& global_shape,
                             const std::vector<uint64_t>& offsets) {
  v1::TensorSlice slice;
  for (uint64_t d : global_shape) slice.add_global_shape(d);
  for (uint64_t d : offsets) slice.add_offsets(d);
  slices_[i] = std::move(slice);
}

absl::StatusOr<v1::RegisterTensorsResponse> TrainerClient::Register() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  v1::RegisterTensorsResponse resp;
  absl::Status s = FromGrpcStatus(stub_->RegisterTensors(&ctx, RegisterRequest(), &resp));
  if (!s.ok()) {
    return Annotate(s, "RegisterTensors of trainer client ", Quoted(name_));
  }
  return resp;
}

absl::StatusOr<v1::LocalPublishResponse> TrainerClient::Publish(std::optional<uint64_t> version,
                                                                bool allow_degenerate) {
  grpc::ClientContext ctx;
  // Without a deadline the publisher may lend our memory to its pass (the call then returns
  // only after the pass has read it): see TrainerClientOptions::publish_timeout.
  if (options_.publish_timeout != absl::InfiniteDuration()) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.publish_timeout));
  }
  v1::LocalPublishRequest req;
  req.set_client(name_);
  if (version.has_value()) req.set_version(*version);
  req.set_allow_degenerate(allow_degenerate);
  v1::LocalPublishResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Publish(&ctx, req, &resp));
  if (!s.ok()) {
    return Annotate(s, "Publish of trainer client ", Quoted(name_),
                    version ? absl::StrCat(" (version ", *version, ")") : std::string());
  }
  return resp;
}

absl::Status TrainerClient::Unregister() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  v1::UnregisterRequest req;
  req.set_client(name_);
  v1::UnregisterResponse resp;
  absl::Status s = FromGrpcStatus(stub_->Unregister(&ctx, req, &resp));
  if (!s.ok()) {
    return Annotate(s, "Unregister of trainer client ", Quoted(name_));
  }
  return absl::OkStatus();
}

}  // namespace refit::client
