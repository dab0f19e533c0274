#include "daemon/publisher/trainer_api.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/parallel.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {
namespace {

// Client-supplied text (names, paths) escaped for logs and messages (logging.h Printable).
std::string Quoted(const std::string& s) { return absl::StrCat("\"", Printable(s), "\""); }

absl::Status Prefixed(const std::string& what, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

absl::StatusCode OpenErrorCode(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::StatusCode::kResourceExhausted;
    default:
      return absl::StatusCode::kInvalidArgument;
  }
}

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

// ---- OpenedIpc, CudaRegionOpener ----------------------------------------------------------------

OpenedIpc::~OpenedIpc() {
  if (base_ == nullptr) return;
  absl::Status st = device_->CloseIpc(base_);
  if (!st.ok()) {
    Logger("trainer-api")->warn("closing a CUDA IPC mapping on {}: {}", device_->Describe(),
                                st.ToString());
  }
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> OpenedIpc::Open(cuda::Device* device,
                                                                 const cuda::IpcHandle& handle) {
  ASSIGN_OR_RETURN(void* base, device->OpenIpc(handle));
  std::shared_ptr<OpenedIpc> opened(new OpenedIpc());
  opened->device_ = device;
  opened->base_ = static_cast<uint8_t*>(base);  // closed by the destructor from here on
  absl::StatusOr<std::pair<void*, size_t>> range = device->AddressRange(base);
  if (!range.ok()) {
    return absl::Status(range.status().code(),
                        absl::StrCat("the size of the opened allocation is unknown: ",
                                     range.status().message()));
  }
  // The handle names an allocation (cudaMalloc) from its base: the mapping starts there.
  if (range->first != base) {
    return absl::InvalidArgumentError(
        "the opened handle does not map to the start of an allocation");
  }
  opened->size_ = range->second;
  return std::shared_ptr<const OpenedIpc>(std::move(opened));
}

absl::StatusOr<std::shared_ptr<const OpenedIpc>> CudaRegionOpener::Open(
    const v1::CudaIpcRegion& region, const std::string& what) {
  if (region.ipc_handle().size() != cuda::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cuda_ipc.ipc_handle has ", region.ipc_handle().size(), " bytes; a CUDA IPC "
        "handle (cudaIpcMemHandle_t) has ", cuda::kIpcHandleBytes));
  }
  if (region.device_uuid().size() != cuda::kUuidBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cuda_ipc.device_uuid has ", region.device_uuid().size(),
        " bytes; a GPU UUID (cudaDeviceProp.uuid) has ", cuda::kUuidBytes));
  }
  ASSIGN_OR_RETURN(const cuda::Uuid uuid, cuda::UuidFromBytes(region.device_uuid()));
  cuda::IpcHandle handle;
  std::memcpy(handle.data(), region.ipc_handle().data(), handle.size());
  const std::string gpu = cuda::FormatUuid(uuid);
  auto key = std::make_pair(uuid, handle);
  if (auto it = opened_.find(key); it != opened_.end()) return it->second;
  if (devices_ == nullptr || !*devices_) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": CUDA IPC region on ", gpu, ", but this publisher has no GPU support "
        "(register the tensor in shared memory instead)"));
  }
  absl::StatusOr<cuda::Device*> device = (*devices_)(uuid);
  if (!device.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": CUDA IPC region on ", gpu, ", which this publisher cannot use: ",
        device.status().message()));
  }
  absl::StatusOr<std::shared_ptr<const OpenedIpc>> opened = OpenedIpc::Open(*device, handle);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat(what, ": cannot open the CUDA IPC handle on ", gpu, " (",
                                     (*device)->Describe(), "): ", opened.status().message()));
  }
  opened_.emplace(key, *opened);
  return *opened;
}

// ---- MappedTensor -------------------------------------------------------------------------------

MappedTensor::~MappedTensor() {
  if (map_ != nullptr) munmap(map_, map_len_);
}

absl::StatusOr<std::unique_ptr<MappedTensor>> MappedTensor::Map(
    const v1::TensorLocation& location, const std::string& what, CudaRegionOpener* cuda) {
  const v1::TensorSpec& spec = location.spec();
  absl::Status valid = sync::ValidateTensorSpec(spec);
  if (!valid.ok()) return Prefixed(what, valid);
  absl::StatusOr<DType> dtype = sync::FromProtoDType(spec.dtype());
  if (!dtype.ok()) return Prefixed(what, dtype.status());
  absl::StatusOr<uint64_t> elements = sync::ElementCount(spec);
  if (!elements.ok()) return Prefixed(what, elements.status());
  absl::StatusOr<uint64_t> size = sync::TensorByteSize(spec);
  if (!size.ok()) return Prefixed(what, size.status());

  switch (location.region_case()) {
    case v1::TensorLocation::kCudaIpc: {
      const v1::CudaIpcRegion& region = location.cuda_ipc();
      if (region.size_bytes() != *size) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": cuda_ipc.size_bytes is ", region.size_bytes(), " but the tensor needs ",
            *size, " bytes (", DTypeName(*dtype), ", ", *elements, " elements)"));
      }
      const uint64_t offset = region.offset();
      if (region.allocation_bytes() != 0 &&
          (offset > region.allocation_bytes() || *size > region.allocation_bytes() - offset)) {
        return absl::OutOfRangeError(absl::StrCat(
            what, ": CUDA region [", offset, ", ", offset, " + ", *size,
            ") is outside its allocation of ", region.allocation_bytes(),
            " bytes (cuda_ipc.allocation_bytes)"));
      }
      CudaRegionOpener none(nullptr);
      ASSIGN_OR_RETURN(std::shared_ptr<const OpenedIpc> ipc,
                       (cuda != nullptr ? cuda : &none)->Open(region, what));
      if (offset > ipc->size() || *size > ipc->size() - offset) {
        return absl::OutOfRangeError(absl::StrCat(
            what, ": CUDA region [", offset, ", ", offset, " + ", *size,
            ") is outside the allocation of ", ipc->size(), " bytes its handle opens on ",
            ipc->device()->Describe()));
      }
      if (region.allocation_bytes() != 0 && region.allocation_bytes() > ipc->size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": cuda_ipc.allocation_bytes is ", region.allocation_bytes(),
            " but the allocation its handle opens has ", ipc->size(), " bytes"));
      }
      std::unique_ptr<MappedTensor> t(new MappedTensor());
      t->spec_ = spec;
      t->dtype_ = *dtype;
      t->size_ = static_cast<size_t>(*size);
      t->data_ = ipc->base() + offset;
      t->ipc_ = std::move(ipc);
      return t;
    }
    case v1::TensorLocation::REGION_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no region: set shm (shm_name or path, offset, size_bytes)"));
    case v1::TensorLocation::kShm:
      break;
  }
  const v1::ShmRegion& region = location.shm();

  int fd = -1;
  std::string object;
  switch (region.object_case()) {
    case v1::ShmRegion::kShmName:
      object = absl::StrCat("shm object ", Quoted(region.shm_name()));
      if (region.shm_name().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": shm.shm_name is empty"));
      }
      fd = shm_open(region.shm_name().c_str(), O_RDONLY | O_CLOEXEC, 0);
      break;
    case v1::ShmRegion::kPath:
      object = absl::StrCat("file ", Quoted(region.path()));
      if (region.path().empty() || region.path()[0] != '/') {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": shm.path ", Quoted(region.path()), " is not absolute"));
      }
      fd = open(region.path().c_str(), O_RDONLY | O_CLOEXEC);
      break;
    case v1::ShmRegion::OBJECT_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shm region names no object: set shm_name or path"));
  }
  if (fd < 0) {
    const int err = errno;
    return absl::Status(OpenErrorCode(err),
                        absl::StrCat(what, ": cannot open ", object, ": ",
                                     err == ENOENT ? "it does not exist" : std::strerror(err)));
  }
  FdCloser closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat(what, ": cannot stat ", object, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", object, " is not a regular file or shared memory object"));
  }
  if (region.size_bytes() != *size) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shm.size_bytes is ", region.size_bytes(), " but the tensor needs ", *size,
        " bytes (", DTypeName(*dtype), ", ", *elements, " elements)"));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (region.offset() > object_size || *size > object_size - region.offset()) {
    return absl::OutOfRangeError(absl::StrCat(
        what, ": region [", region.offset(), ", ", region.offset(), " + ", *size,
        ") is outside ", object, " of ", object_size, " bytes"));
  }

  std::unique_ptr<MappedTensor> t(new MappedTensor());
  t->spec_ = spec;
  t->dtype_ = *dtype;
  t->size_ = static_cast<size_t>(*size);
  if (*size == 0) return t;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = region.offset() / page * page;
  const uint64_t delta = region.offset() - aligned;
  const size_t len = static_cast<size_t>(delta + *size);
  void* map = mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(aligned));
  if (map == MAP_FAILED) {
    const int err = errno;
    return absl::Status(err == ENOMEM ? absl::StatusCode::kResourceExhausted
                                      : absl::StatusCode::kInvalidArgument,
                        absl::StrCat(what, ": cannot map ", len, " bytes of ", object,
                                     " at offset ", aligned, ": ", std::strerror(err)));
  }
  t->map_ = map;
  t->map_len_ = len;
  t->data_ = static_cast<const uint8_t*>(map) + delta;
  return t;
}

// ---- TrainerApiService --------------------------------------------------------------------------

TrainerApiService::TrainerApiService(PublishQueue* queue, int copy_threads)
    : TrainerApiService(queue, [copy_threads] {
        TrainerApiOptions o;
        o.copy_threads = copy_threads;
        return o;
      }()) {}

TrainerApiService::TrainerApiService(PublishQueue* queue, TrainerApiOptions options)
    : queue_(queue), options_(std::move(options)), log_(Logger("trainer-api")) {}

TrainerApiService::~TrainerApiService() = default;

v1::RegisterTensorsResponse TrainerApiService::CountsLocked() const {
  v1::RegisterTensorsResponse r;
  r.set_clients(static_cast<uint32_t>(clients_.size()));
  uint32_t tensors = 0;
  uint64_t bytes = 0;
  for (const auto& [name, client] : clients_) {
    tensors += static_cast<uint32_t>(client.tensors.size());
    for (const auto& t : client.tensors) bytes += t->size();
  }
  r.set_tensors(tensors);
  r.set_bytes(bytes);
  return r;
}

absl::StatusOr<v1::RegisterTensorsResponse> TrainerApiService::DoRegister(
    const v1::RegisterTensorsRequest& request) {
  const std::string& name = request.client();
  if (name.empty()) {
    return absl::InvalidArgumentError("RegisterTensors: client is empty (name the process, e.g. "
                                      "\"rank0\")");
  }
  const std::string who = absl::StrCat("client ", Quoted(name));
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": no tensors to register"));
  }
  // Validate and map outside the lock (opening objects may be slow).
  std::vector<std::shared_ptr<const MappedTensor>> mapped;
  mapped.reserve(request.tensors().size());
  std::map<std::string, int> seen;
  CudaRegionOpener cuda(&options_.devices);
  for (int i = 0; i < request.tensors().size(); ++i) {
    const v1::TensorLocation& location = request.tensors(i);
    const std::string what =
        absl::StrCat(who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i),
                                                     location.spec().name()));
    auto [it, inserted] = seen.emplace(location.spec().name(), i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": duplicate name (also tensor ",
                                                     it->second, ")"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<MappedTensor> t, MappedTensor::Map(location, what, &cuda));
    mapped.push_back(std::move(t));
  }

  absl::MutexLock lock(&mu_);
  for (const auto& t : mapped) {
    auto owner = owners_.find(t->spec().name());
    if (owner != owners_.end() && owner->second != name) {
      return absl::AlreadyExistsError(absl::StrCat(who, ": tensor '", t->spec().name(),
                                                   "' is already registered by client ",
                                                   Quoted(owner->second)));
    }
  }
  auto existing = clients_.find(name);
  const bool replaced = existing != clients_.end();
  if (replaced) {
    for (const auto& t : existing->second.tensors) owners_.erase(t->spec().name());
  }
  Client& client = clients_[name];
  client.generation = next_generation_++;
  client.tensors = std::move(mapped);
  for (const auto& t : client.tensors) owners_[t->spec().name()] = name;
  // A snapshot of the replaced tensors no longer counts: the client publishes again.
  if (round_.has_value() && round_->snapshots.erase(name) > 0) {
    log_->warn("{} re-registered while version {} was being assembled: its snapshot is dropped, "
               "it must publish again",
               who, round_->version);
  }
  v1::RegisterTensorsResponse counts = CountsLocked();
  uint64_t bytes = 0;
  size_t on_gpu = 0;
  for (const auto& t : client.tensors) {
    bytes += t->size();
    if (t->gpu() != nullptr) ++on_gpu;
  }
  log_->info("{} {} {} tensors ({}, {} in CUDA memory); now {} clients, {} tensors", who,
             replaced ? "re-registered" : "registered", client.tensors.size(), FormatBytes(bytes),
             on_gpu, counts.clients(), counts.tensors());
  return counts;
}

absl::Status TrainerApiService::DoUnregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(name);
  if (it == clients_.end()) {
    return absl::NotFoundError(absl::StrCat("Unregister: client ", Quoted(name),
                                            " is not registered"));
  }
  for (const auto& t : it->second.tensors) owners_.erase(t->spec().name());
  clients_.erase(it);
  log_->info("client {} unregistered; now {} clients", Quoted(name), clients_.size());
  if (round_.has_value()) {
    round_->snapshots.erase(name);
    if (round_->snapshots.empty()) {
      round_.reset();
    } else {
      // The remaining clients may all have published already.
      absl::StatusOr<bool> committed = MaybeCommitLocked();
      if (!committed.ok()) {
        log_->error("version could not be queued after client {} unregistered: {}", Quoted(name),
                    committed.status().ToString());
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> TrainerApiService::MaybeCommitLocked() {
  if (!round_.has_value()) return false;
  for (const auto& [name, client] : clients_) {
    if (!round_->snapshots.contains(name)) return false;
  }
  Round round = std::move(*round_);
  round_.reset();
  std::vector<OwnedTensor> tensors;
  std::vector<std::string> names;
  for (auto& [name, snapshot] : round.snapshots) {
    names.push_back(name);
    for (OwnedTensor& t : snapshot) tensors.push_back(std::move(t));
  }
  const std::string source = absl::StrCat("trainer-api clients ", absl::StrJoin(names, ", "));
  absl::Status queued = queue_->EnqueueTensors(round.version, std::move(tensors), source);
  if (!queued.ok()) {
    return absl::Status(queued.code(), absl::StrCat("version ", round.version, " from ", source,
                                                    " was not queued: ", queued.message()));
  }
  log_->info("version {} committed by {} (queued for encoding)", round.version, source);
  return true;
}

absl::StatusOr<v1::LocalPublishResponse> TrainerApiService::DoPublish(
    const v1::LocalPublishRequest& request) {
  const std::string& name = request.client();
  const std::string who = absl::StrCat("client ", Quoted(name));
  std::vector<std::shared_ptr<const MappedTensor>> tensors;
  uint64_t generation = 0;
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(name);
    if (it == clients_.end()) {
      return absl::NotFoundError(absl::StrCat("Publish: ", who,
                                              " is not registered (call RegisterTensors first)"));
    }
    tensors = it->second.tensors;
    generation = it->second.generation;
    if (round_.has_value()) {
      if (request.has_version() && request.version() != round_->version) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Publish: ", who, " publishes version ", request.version(), " but client ",
            Quoted(round_->first_client), " published version ", round_->version,
            "; every client must publish the same version"));
      }
      version = round_->version;
    } else {
      std::optional<uint64_t> requested;
      if (request.has_version()) requested = request.version();
      absl::StatusOr<uint64_t> chosen = queue_->ChooseVersion(requested);
      if (!chosen.ok()) return Prefixed(absl::StrCat("Publish: ", who), chosen.status());
      version = *chosen;
    }
  }

  // The snapshot, outside the lock: other clients copy theirs at the same time. Large models
  // are copied in chunks over the copy threads.
  const absl::Time start = absl::Now();
  std::vector<OwnedTensor> snapshot;
  snapshot.reserve(tensors.size());
  struct Chunk {
    size_t tensor;
    size_t offset;
    size_t bytes;
  };
  constexpr size_t kChunkBytes = 8u << 20;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const MappedTensor& t = *tensors[i];
    OwnedTensor o;
    o.name = t.spec().name();
    o.dtype = t.dtype();
    o.shape.assign(t.spec().shape().begin(), t.spec().shape().end());
    if (t.gpu() != nullptr) {
      // CUDA tensors: one copy each on the tensor's device.
      const std::string what = absl::StrCat(
          "Publish: ", who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), o.name));
      RETURN_IF_ERROR(SnapshotCuda(t, what, &o));
      snapshot.push_back(std::move(o));
      continue;
    }
    o.bytes.resize(t.bytes().size());
    for (size_t off = 0; off < o.bytes.size(); off += kChunkBytes) {
      chunks.push_back({i, off, std::min(kChunkBytes, o.bytes.size() - off)});
    }
    snapshot.push_back(std::move(o));
  }
  ParallelFor(chunks.size(), options_.copy_threads, 1, [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      std::memcpy(snapshot[chunk.tensor].bytes.data() + chunk.offset,
                  tensors[chunk.tensor]->bytes().data() + chunk.offset, chunk.bytes);
    }
  });
  const int64_t micros = absl::ToInt64Microseconds(absl::Now() - start);

  absl::MutexLock lock(&mu_);
  auto it = clients_.find(name);
  if (it == clients_.end() || it->second.generation != generation) {
    return absl::AbortedError(absl::StrCat("Publish: ", who,
                                           " re-registered or unregistered during the snapshot; "
                                           "publish again"));
  }
  if (!round_.has_value()) {
    round_.emplace();
    round_->version = version;
    round_->first_client = name;
  } else if (round_->version != version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Publish: ", who, " publishes version ", version, " but client ",
        Quoted(round_->first_client), " published version ", round_->version,
        " at the same time; every client must publish the same version"));
  }
  round_->snapshots[name] = std::move(snapshot);
  v1::LocalPublishResponse response;
  response.set_version(version);
  response.set_snapshot_micros(micros < 0 ? 0 : static_cast<uint64_t>(micros));
  ASSIGN_OR_RETURN(const bool committed, MaybeCommitLocked());
  response.set_committed(committed);
  if (!committed) {
    log_->debug("{} published its share of version {} ({}/{} clients)", who, version,
                round_->snapshots.size(), clients_.size());
  }
  return response;
}

absl::Status TrainerApiService::SnapshotCuda(const MappedTensor& t, const std::string& what,
                                             OwnedTensor* out) const {
  cuda::Device* const device = t.gpu()->device();
  const size_t bytes = t.size();
  auto failed = [&](const char* step, const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat(what, ": ", step, " on ", device->Describe(), ": ",
                                                st.message()));
  };
  if (options_.cuda_snapshot == CudaSnapshot::kHost) {
    out->bytes.resize(bytes);
    if (bytes == 0) return absl::OkStatus();
    absl::Status st = device->CopyToHost(out->bytes.data(), t.device_data(), bytes);
    if (!st.ok()) return failed("copying the tensor to the host", st);
    return absl::OkStatus();
  }
  const bool pinned = options_.cuda_snapshot == CudaSnapshot::kPinned;
  auto snapshot = std::make_shared<DeviceBytes>();
  snapshot->device = device;
  absl::StatusOr<cuda::Allocation> memory = device->Allocate(
      bytes, pinned ? cuda::Allocation::Kind::kPinnedHost : cuda::Allocation::Kind::kDevice);
  if (!memory.ok()) return failed("allocating the snapshot", memory.status());
  snapshot->memory = std::move(*memory);
  if (bytes != 0) {
    absl::Status st = pinned ? device->CopyToHost(snapshot->memory.data(), t.device_data(), bytes)
                             : device->CopyOnDevice(snapshot->memory.data(), t.device_data(),
                                                    bytes);
    if (!st.ok()) return failed("copying the tensor", st);
  }
  out->device_bytes = std::move(snapshot);
  return absl::OkStatus();
}

grpc::Status TrainerApiService::RegisterTensors(grpc::ServerContext*,
                                                const v1::RegisterTensorsRequest* request,
                                                v1::RegisterTensorsResponse* response) {
  absl::StatusOr<v1::RegisterTensorsResponse> r = DoRegister(*request);
  if (!r.ok()) {
    log_->warn("RegisterTensors: {}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status TrainerApiService::Unregister(grpc::ServerContext*,
                                           const v1::UnregisterRequest* request,
                                           v1::UnregisterResponse*) {
  return ToGrpcStatus(DoUnregister(request->client()));
}

grpc::Status TrainerApiService::Publish(grpc::ServerContext*,
                                        const v1::LocalPublishRequest* request,
                                        v1::LocalPublishResponse* response) {
  absl::StatusOr<v1::LocalPublishResponse> r = DoPublish(*request);
  if (!r.ok()) {
    log_->warn("{}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

}  // namespace refit::publisher
