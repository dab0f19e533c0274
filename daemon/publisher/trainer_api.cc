// TrainerApiService: the trainers' registrations, the rounds of a version (every client's
// share, lent or copied), the CUDA snapshots, and the gRPC handlers.
#include "daemon/publisher/trainer_api.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/durations.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/logging.h"
#include "daemon/common/parallel.h"
#include "daemon/common/printable.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/units.h"
#include "daemon/publisher/shm_object.h"
#include "daemon/publisher/tensor_slice.h"
#include "daemon/sync/version_digest.h"

namespace refit::publisher {

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

absl::StatusOr<std::vector<std::shared_ptr<const MappedTensor>>> TrainerApiService::MapTensors(
    const v1::RegisterTensorsRequest& request, const std::string& who,
    const std::optional<PeerCred>& peer) const {
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
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": duplicate name (also tensor ", it->second, ")",
          location.has_slice() ? "; each client registers at most one block of a tensor" : ""));
    }
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<MappedTensor> t,
                           MappedTensor::Map(location, what, &cuda, peer));
    mapped.push_back(std::move(t));
  }

  if (options_.cuda_snapshot != CudaSnapshot::kHost) {
    for (const auto& t : mapped) {
      if (t->block().has_value() && t->gpu() != nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            who, ": tensor ", Quoted(t->spec().name()),
            " is a block in CUDA memory; blocks are joined "
            "on the host, and this publisher snapshots CUDA tensors on the GPU for GPU encoding "
            "(register whole CUDA tensors, or use codec.device cpu)"));
      }
    }
  }
  return mapped;
}

absl::StatusOr<v1::RegisterTensorsResponse> TrainerApiService::DoRegister(
    const v1::RegisterTensorsRequest& request, const std::optional<PeerCred>& peer) {
  const std::string& name = request.client();
  if (name.empty()) {
    return absl::InvalidArgumentError(
        "RegisterTensors: client is empty (name the process, e.g. "
        "\"rank0\")");
  }
  const std::string who = absl::StrCat("client ", Quoted(name));
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": no tensors to register"));
  }
  // Validate and map outside the lock (opening objects may be slow).
  REFIT_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<const MappedTensor>> mapped,
                         MapTensors(request, who, peer));

  absl::MutexLock lock(&mu_);
  AwaitNotPublishingLocked(name);
  for (const auto& t : mapped) REFIT_RETURN_IF_ERROR(CheckAgainstOthersLocked(name, *t));
  auto existing = clients_.find(name);
  const bool replaced = existing != clients_.end();
  if (replaced) {
    for (const auto& t : existing->second.tensors) ForgetLocked(name, *t);
  }
  Client& client = clients_[name];
  client.generation = next_generation_++;
  client.tensors = std::move(mapped);
  for (const auto& t : client.tensors) {
    if (!t->block().has_value()) {
      owners_[t->spec().name()] = name;
      continue;
    }
    SlicedTensor& sliced = sliced_[t->spec().name()];
    sliced.dtype = t->dtype();
    sliced.blocks[name] = *t->block();
  }
  SizeJoinPoolLocked();
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
  AwaitNotPublishingLocked(name);
  auto it = clients_.find(name);
  if (it == clients_.end()) {
    return absl::NotFoundError(absl::StrCat("Unregister: client ", Quoted(name),
                                            " is not registered"));
  }
  for (const auto& t : it->second.tensors) ForgetLocked(name, *t);
  clients_.erase(it);
  SizeJoinPoolLocked();
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

absl::Status TrainerApiService::CheckAgainstOthersLocked(const std::string& client,
                                                         const MappedTensor& t) const {
  const std::string& tensor = t.spec().name();
  const std::string who = absl::StrCat("client ", Quoted(client), ": tensor ", Quoted(tensor));
  auto owner = owners_.find(tensor);
  if (owner != owners_.end() && owner->second != client) {
    return absl::AlreadyExistsError(
        absl::StrCat(who, " is already registered by client ", Quoted(owner->second)));
  }
  auto sliced = sliced_.find(tensor);
  if (sliced == sliced_.end()) return absl::OkStatus();
  for (const auto& [other, block] : sliced->second.blocks) {
    if (other == client) continue;  // replaced by this registration
    if (!t.block().has_value()) {
      return absl::AlreadyExistsError(absl::StrCat(
          who, " is registered whole, but client ", Quoted(other), " registered block ",
          block.Describe(), " of it (a tensor is either whole or sliced)"));
    }
    const TensorBlock& mine = *t.block();
    if (t.dtype() != sliced->second.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": block ", mine.Describe(), " is ", DTypeName(t.dtype()), " but client ",
          Quoted(other), "'s block ", block.Describe(), " is ", DTypeName(sliced->second.dtype)));
    }
    if (mine.global_shape != block.global_shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": block ", mine.Describe(), " is of a tensor of shape ",
                       DescribeShape(mine.global_shape), " but client ", Quoted(other), "'s block ",
                       block.Describe(), " is of shape ", DescribeShape(block.global_shape)));
    }
    if (mine.Overlaps(block)) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": block ", mine.Describe(),
                                                     " overlaps client ", Quoted(other),
                                                     "'s block ", block.Describe()));
    }
  }
  return absl::OkStatus();
}

void TrainerApiService::ForgetLocked(const std::string& client, const MappedTensor& t) {
  const std::string& tensor = t.spec().name();
  if (!t.block().has_value()) {
    owners_.erase(tensor);
    return;
  }
  auto sliced = sliced_.find(tensor);
  if (sliced == sliced_.end()) return;
  sliced->second.blocks.erase(client);
  if (sliced->second.blocks.empty()) sliced_.erase(sliced);
}

v1::TrainerApiStatus TrainerApiService::TrainerStatus() const {
  v1::TrainerApiStatus st;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, client] : clients_) {
    v1::TrainerApiStatus::Client* c = st.add_clients();
    c->set_name(name);
    for (const auto& t : client.tensors) {
      if (t->block().has_value()) {
        c->set_blocks(c->blocks() + 1);
      } else {
        c->set_tensors(c->tensors() + 1);
      }
      c->set_bytes(c->bytes() + t->size());
    }
  }
  st.set_sliced_tensors(static_cast<uint32_t>(sliced_.size()));
  for (const auto& [name, sliced] : sliced_) {
    v1::TrainerApiStatus::Sliced* t = st.add_sliced();
    t->set_name(name);
    const TensorBlock& any = sliced.blocks.begin()->second;  // never empty: see ForgetLocked
    for (uint64_t d : any.global_shape) t->add_whole_shape(d);
    t->set_blocks(static_cast<uint32_t>(sliced.blocks.size()));
    if (options_.parts) {
      const RowRange rows = JoinRowsLocked(name);
      t->set_shard_part(true);
      t->set_first_row(rows.first);
      t->set_rows(rows.rows());
    }
  }
  if (round_.has_value()) {
    st.set_round_version(round_->version);
    for (const auto& [name, client] : clients_) {
      if (round_->snapshots.contains(name)) {
        st.add_published(name);
      } else {
        st.add_waiting_for(name);
      }
    }
  }
  return st;
}

void TrainerApiService::AwaitNotPublishingLocked(const std::string& client) {
  auto idle = [this, &client]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = publishing_.find(client);
    return it == publishing_.end() || it->second == 0;
  };
  mu_.Await(absl::Condition(&idle));
}

void TrainerApiService::EndPublishingLocked(const std::string& client) {
  auto it = publishing_.find(client);
  if (it != publishing_.end() && --it->second == 0) publishing_.erase(it);
}

absl::StatusOr<bool> TrainerApiService::MaybeCommitLocked(
    std::shared_ptr<InputsRelease> release) {
  if (!round_.has_value()) return false;
  for (const auto& [name, client] : clients_) {
    if (!round_->snapshots.contains(name)) return false;
  }
  Round round = std::move(*round_);
  round_.reset();
  std::vector<std::string> names;
  for (const auto& [name, share] : round.snapshots) names.push_back(name);
  const std::string source = absl::StrCat("trainer-api clients ", absl::StrJoin(names, ", "));
  absl::StatusOr<std::vector<OwnedTensor>> joined = JoinRound(round);
  if (join_.has_value() && join_->version == round.version) join_.reset();  // done either way
  if (!joined.ok()) {
    return Annotate(joined.status(), "version ", round.version, " from ", source,
                    " was not published");
  }
  std::vector<OwnedTensor> tensors = *std::move(joined);
  // Refused now, so the completing client hears it (the core checks again when publishing).
  std::vector<GuardTensor> guard;
  guard.reserve(tensors.size());
  for (const OwnedTensor& t : tensors) {
    guard.push_back({t.name, t.size()});
  }
  REFIT_RETURN_IF_ERROR(queue_->CheckPublishGuard(
      guard, round.allow_degenerate, absl::StrCat("version ", round.version, " from ", source)));
  absl::Status queued =
      queue_->EnqueueTensors(round.version, std::move(tensors), source, round.allow_degenerate,
                             std::move(release));
  if (!queued.ok()) {
    return Annotate(queued, "version ", round.version, " from ", source, " was not queued");
  }
  log_->info("version {} committed by {} (queued for encoding)", round.version, source);
  return true;
}

absl::StatusOr<uint64_t> TrainerApiService::ChooseRoundVersion(
    const v1::LocalPublishRequest& request, const std::string& who, bool* completes) {
  // This client completes the round when every other registered client is in it already.
  size_t others_in = 0;
  if (round_.has_value()) {
    for (const auto& [name, snapshot] : round_->snapshots) {
      if (name != request.client() && clients_.contains(name)) ++others_in;
    }
  }
  *completes = others_in + 1 == clients_.size();
  if (round_.has_value()) {
    if (request.has_version() && request.version() != round_->version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Publish: ", who, " publishes version ", request.version(), " but client ",
          Quoted(round_->first_client), " published version ", round_->version,
          "; every client must publish the same version"));
    }
    return round_->version;
  }
  std::optional<uint64_t> requested;
  if (request.has_version()) requested = request.version();
  absl::StatusOr<uint64_t> chosen = queue_->ChooseVersion(requested);
  if (!chosen.ok()) return Annotate(chosen.status(), "Publish: ", who);
  return *chosen;
}

namespace {

// A lent tensor becomes a copy (its round did not complete in the lender's call).
void CopyLent(std::vector<OwnedTensor>& tensors) {
  for (OwnedTensor& t : tensors) {
    if (t.keep == nullptr) continue;
    t.bytes.assign(t.borrowed.begin(), t.borrowed.end());
    t.borrowed = {};
    t.keep.reset();
  }
}

}  // namespace

absl::StatusOr<std::vector<OwnedTensor>> TrainerApiService::TakeTensors(
    const std::vector<std::shared_ptr<const MappedTensor>>& tensors,
    const std::vector<JoinTarget>& joins, const std::string& who, uint64_t version,
    bool lend) const {
  std::vector<OwnedTensor> snapshot;
  snapshot.reserve(tensors.size());
  struct Chunk {
    size_t tensor;
    size_t offset;
    size_t bytes;
  };
  constexpr size_t kChunkBytes = 8u << 20;
  std::vector<Chunk> chunks;
  std::vector<size_t> blocks;  // indices of the blocks, copied into their join buffers
  for (size_t i = 0; i < tensors.size(); ++i) {
    const MappedTensor& t = *tensors[i];
    OwnedTensor o;
    o.name = t.spec().name();
    o.dtype = t.dtype();
    o.shape.assign(t.spec().shape().begin(), t.spec().shape().end());
    if (t.block().has_value()) {
      blocks.push_back(i);
    } else if (t.gpu() != nullptr) {
      // CUDA tensors: one copy each on the tensor's device.
      const std::string what = absl::StrCat(
          "Publish: ", who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), o.name));
      REFIT_RETURN_IF_ERROR(SnapshotCuda(t, what, &o));
    } else if (lend && t.mapped()) {
      // Sealed against shrinking and mapped: read in place by the publish.
      o.borrowed = t.bytes();
      o.keep = tensors[i];
    } else {
      o.bytes.resize(t.size());
      for (size_t off = 0; off < o.bytes.size(); off += kChunkBytes) {
        chunks.push_back({i, off, std::min(kChunkBytes, o.bytes.size() - off)});
      }
    }
    snapshot.push_back(std::move(o));
  }
  // Mapped regions are memcpy'd, the others pread (a shrunk object is an error, not SIGBUS).
  // Large models are copied in chunks over the copy threads.
  std::vector<absl::Status> copied(chunks.size());
  ParallelFor(chunks.size(), options_.copy_threads, 1, [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      copied[c] = tensors[chunk.tensor]->CopyTo(snapshot[chunk.tensor].bytes.data() + chunk.offset,
                                                chunk.offset, chunk.bytes);
    }
  });
  for (const absl::Status& st : copied) {
    if (!st.ok()) return Annotate(st, "Publish of version ", version);
  }
  std::vector<absl::Status> placed(blocks.size());
  ParallelFor(blocks.size(), options_.copy_threads, 1, [&](size_t begin, size_t end) {
    for (size_t b = begin; b < end; ++b) {
      const size_t i = blocks[b];
      const std::string what = absl::StrCat(
          "Publish: ", who, ": ", sync::DescribeTensor(static_cast<uint32_t>(i), snapshot[i].name));
      placed[b] = CopyBlock(*tensors[i], what, joins[i]);
    }
  });
  for (const absl::Status& st : placed) {
    if (!st.ok()) return Annotate(st, "Publish of version ", version);
  }
  return snapshot;
}

absl::StatusOr<v1::LocalPublishResponse> TrainerApiService::DoPublish(
    const v1::LocalPublishRequest& request, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  const std::string& name = request.client();
  const std::string who = absl::StrCat("client ", Quoted(name));
  std::vector<std::shared_ptr<const MappedTensor>> tensors;
  std::vector<JoinTarget> joins;
  uint64_t generation = 0;
  uint64_t version = 0;
  bool completes = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(name);
    if (it == clients_.end()) {
      return absl::NotFoundError(absl::StrCat("Publish: ", who,
                                              " is not registered (call RegisterTensors first)"));
    }
    tensors = it->second.tensors;
    generation = it->second.generation;
    REFIT_ASSIGN_OR_RETURN(version, ChooseRoundVersion(request, who, &completes));
    joins = JoinBuffersLocked(version, tensors);
    ++publishing_[name];
  }
  // Until this client's share is in the round (or the call failed): its registration waits.
  struct Publishing {
    TrainerApiService* service;
    const std::string& client;
    bool ended = false;
    void End() {
      if (ended) return;
      ended = true;
      absl::MutexLock lock(&service->mu_);
      service->EndPublishingLocked(client);
    }
    ~Publishing() { End(); }
  } publishing{this, name};

  // The snapshot (or the loan), outside the lock: other clients take theirs at the same time.
  const absl::Time start = absl::Now();
  // Lent only to a call without a deadline: a client whose deadline expires returns while the
  // pass may still read (gRPC ends the call on the client's side, whatever the server does),
  // and its trainer would then write under the pass. A call with a deadline gets a copy.
  const bool lend = completes && deadline == absl::InfiniteFuture();
  REFIT_ASSIGN_OR_RETURN(std::vector<OwnedTensor> snapshot,
                         TakeTensors(tensors, joins, who, version, lend));
  const bool lent = std::any_of(snapshot.begin(), snapshot.end(),
                                [](const OwnedTensor& t) { return t.keep != nullptr; });
  std::shared_ptr<InputsRelease> release =
      lent ? std::make_shared<InputsRelease>() : nullptr;

  v1::LocalPublishResponse response;
  response.set_version(version);
  {
    absl::MutexLock lock(&mu_);
    publishing.ended = true;
    EndPublishingLocked(name);
    REFIT_ASSIGN_OR_RETURN(
        const bool committed,
        AddShareLocked(name, who, generation, version,
                       Share{std::move(snapshot), std::move(tensors), std::move(joins)},
                       request.allow_degenerate(), release));
    response.set_committed(committed);
  }
  if (release != nullptr) {
    absl::Status read = release->Wait(deadline, cancelled);
    if (!read.ok()) {
      return Annotate(read, "Publish of version ", version, " by ", who);
    }
  }
  response.set_snapshot_micros(WholeMicros(absl::Now() - start));
  return response;
}

absl::StatusOr<bool> TrainerApiService::AddShareLocked(const std::string& name,
                                                       const std::string& who, uint64_t generation,
                                                       uint64_t version, Share share,
                                                       bool allow_degenerate,
                                                       std::shared_ptr<InputsRelease>& release) {
  auto it = clients_.find(name);
  if (it == clients_.end() || it->second.generation != generation) {
    return absl::AbortedError(absl::StrCat("Publish: ", who,
                                           " re-registered or unregistered during the snapshot; "
                                           "publish again"));
  }
  if (!round_.has_value()) {
    round_.emplace(Round{});  // Round{}: clang cannot default-construct it in emplace() here
    round_->version = version;
    round_->first_client = name;
  } else if (round_->version != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("Publish: ", who, " publishes version ", version, " but client ",
                     Quoted(round_->first_client), " published version ", round_->version,
                     " at the same time; every client must publish the same version"));
  }
  round_->snapshots[name] = std::move(share);
  round_->allow_degenerate = round_->allow_degenerate || allow_degenerate;
  REFIT_ASSIGN_OR_RETURN(const bool committed, MaybeCommitLocked(release));
  if (!committed) {
    // A round holds lent memory only inside the call that commits it (`release` is set exactly
    // when this share lent its tensors).
    if (release != nullptr) CopyLent(round_->snapshots[name].tensors);
    release.reset();
    log_->debug("{} published its share of version {} ({}/{} clients)", who, version,
                round_->snapshots.size(), clients_.size());
  }
  return committed;
}

absl::Status TrainerApiService::SnapshotCuda(const MappedTensor& t, const std::string& what,
                                             OwnedTensor* out) const {
  cuda::Device* const device = t.gpu()->device();
  const size_t bytes = t.size();
  auto failed = [&](const char* step, const absl::Status& st) {
    return Annotate(st, what, ": ", step, " on ", device->Describe());
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

grpc::Status TrainerApiService::RegisterTensors(grpc::ServerContext* context,
                                                const v1::RegisterTensorsRequest* request,
                                                v1::RegisterTensorsResponse* response) {
  absl::StatusOr<v1::RegisterTensorsResponse> r = DoRegister(*request, PeerCredOf(*context));
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

grpc::Status TrainerApiService::Publish(grpc::ServerContext* context,
                                        const v1::LocalPublishRequest* request,
                                        v1::LocalPublishResponse* response) {
  // No deadline set by the client: time_point::max (gpr_inf_future).
  const absl::Time deadline = context->deadline() == std::chrono::system_clock::time_point::max()
                                  ? absl::InfiniteFuture()
                                  : absl::FromChrono(context->deadline());
  absl::StatusOr<v1::LocalPublishResponse> r =
      DoPublish(*request, deadline, [context] { return context->IsCancelled(); });
  if (!r.ok()) {
    log_->warn("{}", r.status().ToString());
    return ToGrpcStatus(r.status());
  }
  *response = std::move(*r);
  return grpc::Status::OK;
}

}  // namespace refit::publisher
