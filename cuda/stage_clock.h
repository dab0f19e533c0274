// Stage timings: device events around each stage of a call, summed by stage name into the
// caller's DeviceTimings.
#ifndef REFIT_CUDA_STAGE_CLOCK_H_
#define REFIT_CUDA_STAGE_CLOCK_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cuda/codec_cuda.h"
#include "cuda/runtime.h"
#include "daemon/common/status_macros.h"

namespace refit::cuda::internal {

// Records device stage times when asked to.
class StageClock {
 public:
  StageClock(DeviceTimings* out, void* stream) : out_(out), stream_(stream) {
    if (out_ != nullptr) out_->stages.clear();
  }
  absl::Status Begin(const char* name) {
    if (out_ == nullptr) return absl::OkStatus();
    timers_.emplace_back(name, std::make_unique<rt::Timer>());
    return timers_.back().second->Start(stream_);
  }
  absl::Status End() {
    if (out_ == nullptr) return absl::OkStatus();
    return timers_.back().second->Stop(stream_);
  }
  // After the stream is synchronised: collects the times.
  absl::Status Finish() {
    if (out_ == nullptr) return absl::OkStatus();
    for (auto& [name, timer] : timers_) {
      REFIT_ASSIGN_OR_RETURN(double ms, timer->ElapsedMs());
      bool merged = false;
      for (auto& s : out_->stages) {
        if (s.name == name) {
          s.ms += ms;
          merged = true;
        }
      }
      if (!merged) out_->stages.push_back({name, ms});
    }
    return absl::OkStatus();
  }

 private:
  DeviceTimings* out_;
  void* stream_;
  std::vector<std::pair<std::string, std::unique_ptr<rt::Timer>>> timers_;
};

}  // namespace refit::cuda::internal

#endif  // REFIT_CUDA_STAGE_CLOCK_H_
