// Test fixtures of the TrainerApi (trainer_api_test.cc, trainer_api_slices_test.cc): a memfd
// holding a pattern, and a TrainerApiService over a real PublisherCore and PublishQueue.
#ifndef REFIT_DAEMON_PUBLISHER_TRAINER_API_TESTING_H_
#define REFIT_DAEMON_PUBLISHER_TRAINER_API_TESTING_H_

#include <cstdint>
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
