#include "daemon/publisher/publisher_daemon.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cuda/device.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/config/config.h"
#include "daemon/model/safetensors.h"
#include "daemon/sync/digest_format.h"
#include "daemon/sync/version_digest.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/control.grpc.pb.h"
#include "refit/v1/local.grpc.pb.h"
#include "refit/version.h"

namespace refit::publisher {
namespace {

using refit::testing::Deadline;
using ::refit::testing::IsOk;
using refit::testing::Location;
using refit::testing::Memfd;
using refit::testing::ReadFile;
using ::refit::testing::StatusIs;
using refit::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// The value of "key" in the flat JSON object of the ready file.
std::string JsonField(const std::string& json, const std::string& key) {
  const std::string k = absl::StrCat("\"", key, "\": \"");
  const size_t at = json.find(k);
  if (at == std::string::npos) return "<missing>";
  const size_t begin = at + k.size();
  return json.substr(begin, json.find('"', begin) - begin);
}

struct TestTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

TestTensor MakeTensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                      uint8_t seed) {
  TestTensor t{name, dtype, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t.bytes.resize(static_cast<size_t>(n) * DTypeSize(dtype));
  for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<uint8_t>(i * 31 + seed);
  return t;
}

void WriteTensors(const std::string& path, const std::vector<TestTensor>& tensors) {
  std::vector<model::SafetensorsTensorRef> refs;
  refs.reserve(tensors.size());
  for (const TestTensor& t : tensors) {
    refs.push_back({t.name, t.dtype, t.shape, std::span<const uint8_t>(t.bytes)});
  }
  ASSERT_THAT(model::WriteSafetensors(path, refs), IsOk());
}

class PublisherDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string yaml = absl::StrCat(
        "publisher:\n"
        "  name: test-publisher\n"
        "  listen: \"127.0.0.1:0\"\n"
        "  control_access: {unauthenticated_tcp_role: write}\n"  // Control over loopback TCP
        "  local_socket: ", dir_.path(), "/trainer.sock\n"
        "  ready_file: ", dir_.path(), "/ready.json\n"
        "  history:\n"
        "    memory_budget_bytes: 1000000\n"
        "  codec:\n"
        "    threads: 1\n"
        "  files:\n"
        "    publish_dirs: [\"", dir_.path(), "\"]\n"
        "    export_dir: \"", dir_.path(), "\"\n");
    REFIT_ASSERT_OK_AND_ASSIGN(auto config,
                               config::LoadPublisherConfigFromString(yaml, "test.yaml"));
    config_ = config;
    REFIT_ASSERT_OK_AND_ASSIGN(auto daemon, PublisherDaemon::Start(config_));
    daemon_ = std::move(daemon);
    control_ = v1::Control::NewStub(
        grpc::CreateChannel(daemon_->listen_address(), grpc::InsecureChannelCredentials()));
    trainer_ = v1::TrainerApi::NewStub(
        grpc::CreateChannel(daemon_->local_address(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (daemon_) daemon_->Shutdown();
  }

  absl::StatusOr<v1::PublishResponse> Publish(const std::vector<std::string>& files,
                                              std::optional<uint64_t> version = {}) {
    v1::PublishRequest request;
    for (auto& f : files) request.add_safetensors(f);
    if (version) request.set_version(*version);
    v1::PublishResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    absl::Status s = FromGrpcStatus(control_->Publish(&ctx, request, &response));
    if (!s.ok()) return s;
    return response;
  }
  v1::StatusResponse Status() {
    v1::StatusResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    EXPECT_THAT(control_->Status(&ctx, v1::StatusRequest(), &response), IsOk());
    return response;
  }
  absl::StatusOr<v1::ExportResponse> Export(const std::string& path,
                                            std::optional<uint64_t> version = {}) {
    v1::ExportRequest request;
    request.set_safetensors(path);
    if (version) request.set_version(*version);
    v1::ExportResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    absl::Status s = FromGrpcStatus(control_->Export(&ctx, request, &response));
    if (!s.ok()) return s;
    return response;
  }
  absl::StatusOr<v1::WaitVersionResponse> WaitVersion(uint64_t version, uint64_t timeout_ms) {
    v1::WaitVersionRequest request;
    request.set_version(version);
    request.set_timeout_ms(timeout_ms);
    v1::WaitVersionResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    absl::Status s = FromGrpcStatus(control_->WaitVersion(&ctx, request, &response));
    if (!s.ok()) return s;
    return response;
  }
  // Every tensor of an exported file, by name.
  std::map<std::string, std::vector<uint8_t>> ReadExport(const std::string& path) {
    std::map<std::string, std::vector<uint8_t>> out;
    auto file = model::SafetensorsFile::Open(path);
    EXPECT_THAT(file, IsOk());
    if (!file.ok()) return out;
    std::string previous;
    for (size_t i = 0; i < file->tensors().size(); ++i) {
      const auto& e = file->tensors()[i];
      EXPECT_LT(previous, e.name);  // name order
      previous = e.name;
      auto data = file->data(i);
      out[e.name] = std::vector<uint8_t>(data.begin(), data.end());
    }
    return out;
  }

  TempDir dir_{"refit-pubd"};
  v1::PublisherConfig config_;
  std::unique_ptr<PublisherDaemon> daemon_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::TrainerApi::Stub> trainer_;
};

TEST_F(PublisherDaemonTest, ReadyFileAndHealth) {
  const std::string ready = ReadFile(dir_.path() + "/ready.json");
  EXPECT_EQ(JsonField(ready, "listen"), daemon_->listen_address());
  EXPECT_TRUE(absl::StartsWith(daemon_->listen_address(), "127.0.0.1:"));
  EXPECT_NE(daemon_->listen_address(), "127.0.0.1:0");
  EXPECT_EQ(JsonField(ready, "control_listen"), "");
  EXPECT_EQ(JsonField(ready, "local_socket"), absl::StrCat("unix:", dir_.path(), "/trainer.sock"));
  EXPECT_EQ(JsonField(ready, "pid"), absl::StrCat(getpid()));

  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(daemon_->listen_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_THAT(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response), IsOk());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  v1::StatusResponse status = Status();
  EXPECT_EQ(status.role(), v1::ROLE_PUBLISHER);
  EXPECT_EQ(status.name(), "test-publisher");
  EXPECT_EQ(status.build_version(), kRefitVersion);
  EXPECT_EQ(status.version(), 0u);
  EXPECT_EQ(status.history().budget_bytes(), 1000000u);
}

TEST_F(PublisherDaemonTest, ControlPublishStatusExportVerify) {
  const std::vector<TestTensor> shard0 = {MakeTensor("layer.0.w", DType::kBF16, {64, 32}, 1),
                                          MakeTensor("layer.0.b", DType::kF32, {32}, 2)};
  const std::vector<TestTensor> shard1 = {MakeTensor("embed", DType::kBF16, {128, 16}, 3),
                                          MakeTensor("step", DType::kI64, {}, 4)};
  const std::string f0 = dir_.path() + "/shard0.safetensors";
  const std::string f1 = dir_.path() + "/shard1.safetensors";
  WriteTensors(f0, shard0);
  WriteTensors(f1, shard1);

  REFIT_ASSERT_OK_AND_ASSIGN(auto v1r, Publish({f0, f1}));
  EXPECT_EQ(v1r.version(), 1u);
  EXPECT_EQ(v1r.tensors(), 4u);
  EXPECT_EQ(v1r.change_rate(), 0.0);
  EXPECT_NE(v1r.version_digest(), 0u);

  // Version 2: one tensor changes a few elements.
  std::vector<TestTensor> shard0b = shard0;
  shard0b[0].bytes[10] ^= 1;
  shard0b[0].bytes[100] ^= 1;
  WriteTensors(f0, shard0b);
  REFIT_ASSERT_OK_AND_ASSIGN(auto v2r, Publish({f0, f1}));
  EXPECT_EQ(v2r.version(), 2u);
  EXPECT_GT(v2r.change_rate(), 0.0);
  EXPECT_LT(v2r.change_rate(), 0.01);

  v1::StatusResponse status = Status();
  EXPECT_EQ(status.version(), 2u);
  EXPECT_EQ(status.version_digest(), v2r.version_digest());
  // The version's identity is its v2 digest (digest_format 2), recomputed here from the inputs;
  // the v1 digest, for subscribers that ask for v1, is left pending until one is admitted
  // (version 2's changed tensor was not hashed in v1): reported as 0.
  {
    std::vector<TestTensor> all = shard0b;
    all.insert(all.end(), shard1.begin(), shard1.end());
    std::vector<v1::TensorSpec> specs;
    std::vector<uint64_t> d2;
    std::sort(all.begin(), all.end(),
              [](const TestTensor& a, const TestTensor& b) { return a.name < b.name; });
    for (const TestTensor& t : all) {
      v1::TensorSpec spec;
      spec.set_name(t.name);
      spec.set_dtype(sync::ToProtoDType(t.dtype));
      for (int64_t d : t.shape) spec.add_shape(static_cast<uint64_t>(d));
      specs.push_back(spec);
      d2.push_back(sync::TensorDigestOf(sync::DigestFormat::kV2, t.bytes));
    }
    EXPECT_EQ(status.digest_format(), 2u);
    EXPECT_EQ(status.version_digest(), *sync::VersionDigest(specs, d2));
    EXPECT_EQ(status.version_digest_v1(), 0u);
  }
  EXPECT_EQ(status.tensors(), 4u);
  uint64_t model_bytes = 0;
  for (const auto& t : shard0b) model_bytes += t.bytes.size();
  for (const auto& t : shard1) model_bytes += t.bytes.size();
  EXPECT_EQ(status.model_bytes(), model_bytes);
  EXPECT_EQ(status.last_refit().version(), 2u);
  EXPECT_EQ(status.last_refit().base_version(), 1u);
  EXPECT_EQ(status.last_refit().changed_elements(), 2u);
  EXPECT_GT(status.last_refit().total_elements(), 0u);
  EXPECT_EQ(status.last_refit().dense_bytes(), model_bytes);
  EXPECT_EQ(status.last_refit().keyframe_tensors(), 0u);
  EXPECT_GT(status.last_refit().wire_bytes(), 0u);
  EXPECT_NE(status.last_refit().finished_unix_nanos(), 0u);
  EXPECT_EQ(status.history().newest_version(), 2u);
  EXPECT_EQ(status.sessions_size(), 0);

  // Export: byte-equal to the inputs, in name order.
  const std::string out = dir_.path() + "/export.safetensors";
  REFIT_ASSERT_OK_AND_ASSIGN(auto exported, Export(out));
  EXPECT_EQ(exported.version(), 2u);
  EXPECT_EQ(exported.version_digest(), v2r.version_digest());
  EXPECT_EQ(exported.tensors(), 4u);
  EXPECT_EQ(exported.bytes(), model_bytes);
  auto tensors = ReadExport(out);
  ASSERT_EQ(tensors.size(), 4u);
  for (const auto& t : shard0b) EXPECT_EQ(tensors[t.name], t.bytes) << t.name;
  for (const auto& t : shard1) EXPECT_EQ(tensors[t.name], t.bytes) << t.name;
  auto old = Export(out, 1);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition) << old.status();
  EXPECT_THAT(Export(out, 2), IsOk());
  EXPECT_EQ(Export("../relative.safetensors").status().code(),
            absl::StatusCode::kInvalidArgument);

  // Verify.
  v1::VerifyResponse verify;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    ASSERT_THAT(control_->Verify(&ctx, v1::VerifyRequest(), &verify), IsOk());
  }
  EXPECT_TRUE(verify.ok());
  EXPECT_EQ(verify.version(), 2u);
  EXPECT_EQ(verify.version_digest(), v2r.version_digest());
  ASSERT_EQ(verify.tensors_size(), 4);
  EXPECT_EQ(verify.tensors(0).name(), "embed");
  for (const auto& t : verify.tensors()) EXPECT_EQ(t.expected(), t.actual()) << t.name();

  // WaitVersion: reached, and timed out with the documented message.
  REFIT_ASSERT_OK_AND_ASSIGN(auto reached, WaitVersion(2, 1000));
  EXPECT_EQ(reached.version(), 2u);
  auto timeout = WaitVersion(7, 200);
  ASSERT_EQ(timeout.status().code(), absl::StatusCode::kDeadlineExceeded) << timeout.status();
  EXPECT_EQ(timeout.status().message(), "version 7 not reached after 200 ms, at version 2");

  // Without an RPC deadline the request's timeout alone bounds the wait.
  {
    v1::WaitVersionRequest request;
    request.set_version(9);
    request.set_timeout_ms(100);
    v1::WaitVersionResponse response;
    grpc::ClientContext ctx;  // no deadline
    grpc::Status s = control_->WaitVersion(&ctx, request, &response);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded));
    EXPECT_EQ(s.error_message(), "version 9 not reached after 100 ms, at version 2");
  }

  // A huge timeout saturates (no timeout) instead of wrapping into the past.
  {
    v1::WaitVersionRequest request;
    request.set_version(9);
    request.set_timeout_ms(~uint64_t{0});
    v1::WaitVersionResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    const absl::Time start = absl::Now();
    grpc::Status s = control_->WaitVersion(&ctx, request, &response);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  }

  // Resync of an unknown subscriber.
  v1::ResyncRequest resync;
  resync.set_subscriber("nobody");
  v1::ResyncResponse resync_response;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    EXPECT_EQ(control_->Resync(&ctx, resync, &resync_response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(PublisherDaemonTest, PublishErrors) {
  const std::string f0 = dir_.path() + "/a.safetensors";
  WriteTensors(f0, {MakeTensor("w", DType::kBF16, {16}, 1)});
  auto rel = Publish({"a.safetensors"});
  EXPECT_EQ(rel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(rel.status().message(), "a.safetensors")) << rel.status();
  EXPECT_EQ(Publish({}).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string missing = dir_.path() + "/missing.safetensors";
  auto gone = Publish({missing});
  ASSERT_THAT(gone, Not(IsOk()));
  EXPECT_TRUE(absl::StrContains(gone.status().message(), missing)) << gone.status();

  REFIT_ASSERT_OK_AND_ASSIGN(auto v5, Publish({f0}, 5));
  EXPECT_EQ(v5.version(), 5u);
  auto again = Publish({f0}, 5);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(again.status().message(), "version 5 must exceed 5"))
      << again.status();
  REFIT_ASSERT_OK_AND_ASSIGN(auto next, Publish({f0}));
  EXPECT_EQ(next.version(), 6u);
}

TEST_F(PublisherDaemonTest, TrainerApiTwoClients) {
  Memfd rank0(8192), rank1(8192);
  for (int i = 0; i < 8192; ++i) {
    rank0.data()[i] = static_cast<uint8_t>(i);
    rank1.data()[i] = static_cast<uint8_t>(255 - i);
  }
  auto register_client = [&](const std::string& client,
                             std::vector<v1::TensorLocation> tensors) -> absl::Status {
    v1::RegisterTensorsRequest request;
    request.set_client(client);
    for (auto& t : tensors) *request.add_tensors() = std::move(t);
    v1::RegisterTensorsResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return FromGrpcStatus(trainer_->RegisterTensors(&ctx, request, &response));
  };
  auto publish = [&](const std::string& client,
                     std::optional<uint64_t> version) -> absl::StatusOr<v1::LocalPublishResponse> {
    v1::LocalPublishRequest request;
    request.set_client(client);
    if (version) request.set_version(*version);
    v1::LocalPublishResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    absl::Status s = FromGrpcStatus(trainer_->Publish(&ctx, request, &response));
    if (!s.ok()) return s;
    return response;
  };

  ASSERT_THAT(
      register_client("rank0", {Location("a.w", v1::DTYPE_BF16, {32, 32}, rank0.path(), 0, 2048),
                                Location("a.b", v1::DTYPE_F32, {16}, rank0.path(), 4096, 64)}),
      IsOk());
  ASSERT_THAT(
      register_client("rank1", {Location("b.w", v1::DTYPE_BF16, {1024}, rank1.path(), 10, 2048)}),
      IsOk());

  // Bad regions over the socket: codes and messages.
  absl::Status range =
      register_client("rank2", {Location("c", v1::DTYPE_BF16, {1024}, rank1.path(), 8000, 2048)});
  EXPECT_EQ(range.code(), absl::StatusCode::kOutOfRange) << range;
  EXPECT_TRUE(absl::StrContains(range.message(), "rank2")) << range;
  EXPECT_TRUE(absl::StrContains(range.message(), "\"c\"")) << range;
  absl::Status size =
      register_client("rank2", {Location("c", v1::DTYPE_BF16, {1024}, rank1.path(), 0, 1000)});
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument) << size;
  v1::TensorLocation missing = Location("c", v1::DTYPE_U8, {4}, "", 0, 4);
  missing.mutable_shm()->set_shm_name("/refit-pubd-test-missing");
  absl::Status gone = register_client("rank2", {missing});
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_TRUE(absl::StrContains(gone.message(), "/refit-pubd-test-missing")) << gone;
  absl::Status dup =
      register_client("rank2", {Location("a.w", v1::DTYPE_U8, {4}, rank1.path(), 0, 4)});
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists) << dup;

  REFIT_ASSERT_OK_AND_ASSIGN(auto first, publish("rank0", 3));
  EXPECT_FALSE(first.committed());
  EXPECT_EQ(first.version(), 3u);
  const std::vector<uint8_t> snap_aw(rank0.data(), rank0.data() + 2048);
  const std::vector<uint8_t> snap_ab(rank0.data() + 4096, rank0.data() + 4096 + 64);
  std::memset(rank0.data(), 0x55, 8192);  // the trainer moves on right after Publish
  EXPECT_EQ(Status().version(), 0u);
  EXPECT_EQ(WaitVersion(3, 50).status().code(), absl::StatusCode::kDeadlineExceeded);

  auto wrong = publish("rank1", 4);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  REFIT_ASSERT_OK_AND_ASSIGN(auto second, publish("rank1", std::nullopt));
  EXPECT_TRUE(second.committed());
  EXPECT_EQ(second.version(), 3u);
  const std::vector<uint8_t> snap_bw(rank1.data() + 10, rank1.data() + 10 + 2048);
  std::memset(rank1.data(), 0x66, 8192);

  REFIT_ASSERT_OK_AND_ASSIGN(auto reached, WaitVersion(3, 30000));
  EXPECT_EQ(reached.version(), 3u);
  const std::string out = dir_.path() + "/trainer-export.safetensors";
  ASSERT_THAT(Export(out), IsOk());
  auto tensors = ReadExport(out);
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors["a.w"], snap_aw);
  EXPECT_EQ(tensors["a.b"], snap_ab);
  EXPECT_EQ(tensors["b.w"], snap_bw);
  EXPECT_EQ(Status().tensors(), 3u);
}

TEST(PublisherDaemonStartTest, HistoryMaxVersionsFromConfig) {
  TempDir dir("refit-pubd");
  auto config = config::LoadPublisherConfigFromString(
      absl::StrCat("publisher:\n  listen: \"127.0.0.1:0\"\n  control_access: {unauthenticated_tcp_role: write}\n"
                   "  history:\n    max_versions: 2\n"
                   "  codec:\n    threads: 1\n    block_log2: 10\n"
                   "  files: {publish_dirs: [\"", dir.path(), "\"]}\n"),
      "history.yaml");
  ASSERT_THAT(config, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto daemon, PublisherDaemon::Start(*config));
  auto control = v1::Control::NewStub(
      grpc::CreateChannel(daemon->listen_address(), grpc::InsecureChannelCredentials()));
  const std::string file = dir.path() + "/m.safetensors";
  TestTensor t = MakeTensor("w", DType::kBF16, {4096}, 1);
  for (int v = 1; v <= 4; ++v) {
    t.bytes[static_cast<size_t>(v) * 2] ^= 1;
    WriteTensors(file, {t});
    v1::PublishRequest request;
    request.add_safetensors(file);
    v1::PublishResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    ASSERT_THAT(control->Publish(&ctx, request, &response), IsOk());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::StatusResponse status;
  ASSERT_THAT(control->Status(&ctx, v1::StatusRequest(), &status), IsOk());
  EXPECT_EQ(status.version(), 4u);
  EXPECT_EQ(status.history().newest_version(), 4u);
  EXPECT_LE(status.history().versions(), 2u) << status.history().ShortDebugString();
  daemon->Shutdown();
}

TEST(PublisherDaemonStartTest, CutConfigPublishesPartsAndExportsTheWholeTensors) {
  TempDir dir("refit-pubd");
  auto config = config::LoadPublisherConfigFromString(
      absl::StrCat("publisher:\n  listen: \"127.0.0.1:0\"\n"
                   "  control_access: {unauthenticated_tcp_role: write}\n"
                   "  codec:\n    threads: 1\n"
                   "  cut: {parts: 2, rows: [\"w*\"], columns: [o]}\n"
                   "  files: {publish_dirs: [\"",
                   dir.path(), "\"], export_dir: \"", dir.path(), "\"}\n"),
      "cut.yaml");
  ASSERT_THAT(config, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto daemon, PublisherDaemon::Start(*config));
  auto control = v1::Control::NewStub(
      grpc::CreateChannel(daemon->listen_address(), grpc::InsecureChannelCredentials()));
  const std::string file = dir.path() + "/m.safetensors";
  std::vector<TestTensor> model = {MakeTensor("b", DType::kBF16, {3}, 1),
                                   MakeTensor("o", DType::kF32, {4, 5}, 2),
                                   MakeTensor("w", DType::kBF16, {7, 4}, 3)};
  auto publish = [&]() -> v1::PublishResponse {
    WriteTensors(file, model);
    v1::PublishRequest request;
    request.add_safetensors(file);
    v1::PublishResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    EXPECT_THAT(control->Publish(&ctx, request, &response), IsOk());
    return response;
  };
  auto status = [&]() {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::StatusResponse r;
    EXPECT_THAT(control->Status(&ctx, v1::StatusRequest(), &r), IsOk());
    return r;
  };
  publish();
  EXPECT_EQ(status().tensors(), 5u);  // b, o's two column parts, w's two row parts
  model[2].bytes[1] ^= 1;             // w's first part
  publish();
  const v1::StatusResponse s2 = status();
  EXPECT_EQ(s2.version(), 2u);
  EXPECT_EQ(s2.last_refit().keyframe_tensors(), 0u);
  EXPECT_EQ(s2.last_refit().changed_elements(), 1u);
  // Export writes the whole tensors, bit-equal to the published file's.
  const std::string exported = dir.path() + "/export.safetensors";
  v1::ExportRequest request;
  request.set_safetensors(exported);
  v1::ExportResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  ASSERT_THAT(control->Export(&ctx, request, &response), IsOk());
  EXPECT_EQ(response.tensors(), 3u);
  auto read = model::SafetensorsFile::Open(exported);
  ASSERT_THAT(read, IsOk());
  ASSERT_EQ(read->tensors().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(read->tensors()[i].name, model[i].name);
    EXPECT_EQ(read->tensors()[i].shape, model[i].shape);
    const std::span<const uint8_t> data = read->data(i);
    EXPECT_EQ(std::vector<uint8_t>(data.begin(), data.end()), model[i].bytes) << model[i].name;
  }
  daemon->Shutdown();
}

TEST(PublisherDaemonStartTest, RefusesCudaAndServesControlSeparately) {
  TempDir dir("refit-pubd");
  auto cuda = config::LoadPublisherConfigFromString(
      "publisher:\n  listen: \"127.0.0.1:0\"\n  codec:\n    device: cuda\n", "cuda.yaml");
  ASSERT_THAT(cuda, IsOk());
  auto listed = cuda::ListDevices();
  if (listed.ok() && !listed->empty()) {
    // A GPU: device cuda starts (publisher_gpu_test covers encoding on it).
    auto started = PublisherDaemon::Start(*cuda, &cuda::OpenDevice);
    EXPECT_THAT(started, IsOk());
  } else {
    // No GPU (or built without CUDA): refused, naming the field and the cause.
    auto refused = PublisherDaemon::Start(*cuda, &cuda::OpenDevice);
    ASSERT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  AllOf(HasSubstr("publisher.codec.device: cuda"),
                                        HasSubstr("cannot use the GPU"))));
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "no CUDA device") ||
                absl::StrContains(refused.status().message(), "no usable CUDA device"))
        << refused.status();
    // Naming the GPU by UUID: the message names that field too.
    auto by_uuid = config::LoadPublisherConfigFromString(
        "publisher:\n  listen: \"127.0.0.1:0\"\n  codec:\n    device: cuda\n"
        "    cuda_device_uuid: GPU-8b1f0011-2233-4455-6677-8899aabbccdd\n",
        "uuid.yaml");
    ASSERT_THAT(by_uuid, IsOk());
    auto refused_uuid = PublisherDaemon::Start(*by_uuid, &cuda::OpenDevice);
    ASSERT_THAT(
        refused_uuid,
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 HasSubstr("codec.cuda_device_uuid GPU-8b1f0011-2233-4455-6677-8899aabbccdd")));
  }
  // A process without GPU support (no opener) refuses codec.device cuda whatever the machine.
  auto unsupported = PublisherDaemon::Start(*cuda);
  ASSERT_THAT(unsupported, Not(IsOk()));
  EXPECT_TRUE(absl::StrContains(unsupported.status().message(), "this process has no GPU support"))
      << unsupported.status();

  auto split = config::LoadPublisherConfigFromString(
      absl::StrCat("publisher:\n  listen: \"127.0.0.1:0\"\n  control_listen: \"unix:", dir.path(),
                   "/control.sock\"\n  codec:\n    device: auto\n    threads: 1\n"),
      "split.yaml");
  ASSERT_THAT(split, IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto daemon, PublisherDaemon::Start(*split));
  EXPECT_EQ(daemon->control_address(), absl::StrCat("unix:", dir.path(), "/control.sock"));
  EXPECT_EQ(daemon->local_address(), "");
  {
    auto control = v1::Control::NewStub(
        grpc::CreateChannel(daemon->control_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::StatusResponse status;
    EXPECT_THAT(control->Status(&ctx, v1::StatusRequest(), &status), IsOk());
    EXPECT_FALSE(status.name().empty());  // the host name
  }
  {
    // Control is not on the data-plane address then.
    auto control = v1::Control::NewStub(
        grpc::CreateChannel(daemon->listen_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::StatusResponse status;
    EXPECT_EQ(control->Status(&ctx, v1::StatusRequest(), &status).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  daemon->Shutdown();
  daemon->Shutdown();  // idempotent
}

}  // namespace
}  // namespace refit::publisher
