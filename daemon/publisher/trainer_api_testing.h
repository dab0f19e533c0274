// Test fixtures of the TrainerApi (trainer_api_test.cc, trainer_api_slices_test.cc,
// trainer_api_parts_test.cc): a memfd holding a pattern, a client's block of a 2-d tensor, and a
// TrainerApiService over a real PublisherCore and PublishQueue.
#ifndef REFIT_DAEMON_PUBLISHER_TRAINER_API_TESTING_H_
#define REFIT_DAEMON_PUBLISHER_TRAINER_API_TESTING_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/publisher/publish_queue.h"
#include "daemon/publisher/trainer_api.h"
#include "daemon/serving/publisher_core.h"
#include "gtest/gtest.h"

namespace refit::publisher {

// A memfd of `bytes` holding a pattern, addressed as /proc/self/fd/N.
class Memfd : public refit::testing::Memfd {
 public:
  explicit Memfd(size_t bytes, uint8_t seed = 1, bool allow_sealing = true)
      : refit::testing::Memfd(bytes, allow_sealing) {
    for (size_t i = 0; i < bytes; ++i) data()[i] = static_cast<uint8_t>(i * 7 + seed);
  }
};

// A 2-d BF16 tensor's elements, each its own row-major index plus `step` (distinct values).
inline std::vector<uint16_t> Whole(uint64_t rows, uint64_t cols, uint16_t step = 0) {
  std::vector<uint16_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(i * 3 + step);
  return w;
}

inline std::vector<uint8_t> Bytes(const std::vector<uint16_t>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// One client's block [r0, r0 + rows) x [c0, c0 + cols) of a [R, C] tensor, in a memfd of its
// own holding the block row-major (`sealable` false: the publisher reads it with pread).
struct Block {
  Block(const std::vector<uint16_t>& whole, uint64_t R, uint64_t C, uint64_t r0, uint64_t c0,
        uint64_t rows, uint64_t cols, const std::string& name = "w", bool sealable = true)
      : memfd(std::max<size_t>(rows * cols * 2, 1), 1, sealable),
        r0(r0),
        c0(c0),
        rows(rows),
        cols(cols) {
    location = refit::testing::Location(name, v1::DTYPE_BF16, {rows, cols}, memfd.path(), 0,
                                        rows * cols * 2);
    location.mutable_slice()->add_global_shape(R);
    location.mutable_slice()->add_global_shape(C);
    location.mutable_slice()->add_offsets(r0);
    location.mutable_slice()->add_offsets(c0);
    Write(whole, C);
  }
  // The block's part of `whole` (a [R, C] tensor) into the memfd: the trainer's step.
  void Write(const std::vector<uint16_t>& whole, uint64_t C) {
    auto* out = reinterpret_cast<uint16_t*>(memfd.data());
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint64_t c = 0; c < cols; ++c) out[r * cols + c] = whole[(r0 + r) * C + c0 + c];
    }
  }
  Memfd memfd;
  uint64_t r0, c0, rows, cols;
  v1::TensorLocation location;
};

class TrainerApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PublisherOptions options;
    options.encode_threads = 1;
    options.digest_threads = 1;
    REFIT_ASSERT_OK_AND_ASSIGN(auto core, PublisherCore::Open(options));
    core_ = std::move(core);
    queue_ = std::make_unique<PublishQueue>(core_.get(), nullptr);
    api_ = std::make_unique<TrainerApiService>(queue_.get());
  }
  void TearDown() override {
    api_.reset();
    queue_.reset();
  }

  absl::Status Register(const std::string& client, std::vector<v1::TensorLocation> tensors) {
    v1::RegisterTensorsRequest r;
    r.set_client(client);
    for (auto& t : tensors) *r.add_tensors() = std::move(t);
    return api_->DoRegister(r).status();
  }
  absl::StatusOr<v1::LocalPublishResponse> Publish(const std::string& client,
                                                   std::optional<uint64_t> version = {}) {
    v1::LocalPublishRequest r;
    r.set_client(client);
    if (version) r.set_version(*version);
    return api_->DoPublish(r);
  }
  // Every client publishes `version` in turn (the last one completes the round), then waits
  // until the version is published.
  void PublishAll(const std::vector<std::string>& clients, uint64_t version) {
    for (size_t i = 0; i < clients.size(); ++i) {
      absl::StatusOr<v1::LocalPublishResponse> r = Publish(clients[i], version);
      ASSERT_THAT(r, ::refit::testing::IsOk()) << clients[i];
      EXPECT_EQ(r->committed(), i + 1 == clients.size()) << clients[i];
    }
    ASSERT_THAT(queue_->WaitPublished(version, absl::Now() + absl::Seconds(30), nullptr),
                ::refit::testing::IsOk());
  }
  std::vector<uint8_t> PublishedBytes(const std::string& name) {
    for (const BaselineTensor& t : core_->Baseline()) {
      if (t.spec.name() == name) return *t.bytes;
    }
    return {};
  }

  std::unique_ptr<PublisherCore> core_;
  std::unique_ptr<PublishQueue> queue_;
  std::unique_ptr<TrainerApiService> api_;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_PUBLISHER_TRAINER_API_TESTING_H_
