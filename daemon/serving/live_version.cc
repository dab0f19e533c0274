#include "daemon/serving/live_version.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/sync/frames.h"

namespace refit::publisher {

LiveVersion::LiveVersion(v1::VersionHeader header, uint64_t expected_object_bytes,
                         std::function<void()> on_change)
    : header_([&] {
        header.set_streamed(true);
        return std::move(header);
      }()),
      expected_object_bytes_(expected_object_bytes),
      on_change_(std::move(on_change)) {
  objects_.reserve(tensor_count());
}

void LiveVersion::Ready(uint32_t tensor_index, std::shared_ptr<const std::vector<uint8_t>> bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (objects_.size() >= tensor_count()) return;  // each tensor once
    Object o;
    o.tensor_index = tensor_index;
    o.keyframe =
        header_.tensors(static_cast<int>(tensor_index)).delivery() == v1::DELIVERY_KEYFRAME;
    if (bytes != nullptr) {
      o.bytes = *bytes;
      keep_.push_back(std::move(bytes));
    }
    objects_.push_back(o);
    ready_.store(objects_.size(), std::memory_order_release);
  }
  if (on_change_) on_change_();
}

void LiveVersion::Commit(v1::VersionEnd end, std::optional<v1::VersionEnd> end_v2) {
  {
    absl::MutexLock lock(&mu_);
    if (state() != State::kEncoding) return;
    end_ = std::move(end);
    end_v2_ = std::move(end_v2);
    v1_.store(kV1Ready, std::memory_order_release);
    state_.store(static_cast<int>(State::kCommitted), std::memory_order_release);
  }
  if (on_change_) on_change_();
}

void LiveVersion::CommitV2First(v1::VersionEnd end_v2) {
  {
    absl::MutexLock lock(&mu_);
    if (state() != State::kEncoding) return;
    end_v2_ = std::move(end_v2);
    state_.store(static_cast<int>(State::kCommitted), std::memory_order_release);
  }
  if (on_change_) on_change_();
}

void LiveVersion::CompleteV1(absl::StatusOr<v1::VersionEnd> end) {
  {
    absl::MutexLock lock(&mu_);
    if (state() != State::kCommitted || v1_.load(std::memory_order_relaxed) != kV1Pending) return;
    if (end.ok()) {
      end_ = *std::move(end);
      v1_.store(kV1Ready, std::memory_order_release);
    } else {
      v1_failure_ = end.status();
      v1_.store(kV1Failed, std::memory_order_release);
    }
  }
  if (on_change_) on_change_();
}

void LiveVersion::Fail(absl::Status why) {
  if (state() == State::kCommitted) {
    CompleteV1(std::move(why));  // a v2-first commit whose v1 End will not come
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if (state() != State::kEncoding) return;
    failure_ = std::move(why);
    state_.store(static_cast<int>(State::kFailed), std::memory_order_release);
  }
  if (on_change_) on_change_();
}

bool LiveVersion::settled(sync::DigestFormat format) const {
  switch (state()) {
    case State::kEncoding: return false;
    case State::kFailed: return true;
    case State::kCommitted: break;
  }
  return format == sync::DigestFormat::kV2 || v1_.load(std::memory_order_acquire) != kV1Pending;
}

LiveVersion::Object LiveVersion::object(size_t j) const { return objects_[j]; }

absl::Status LiveVersion::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

absl::StatusOr<v1::VersionEnd> LiveVersion::end(sync::DigestFormat format) const {
  absl::MutexLock lock(&mu_);
  if (format != sync::DigestFormat::kV2) {
    switch (v1_.load(std::memory_order_relaxed)) {
      case kV1Ready: return end_;
      case kV1Failed: return v1_failure_;
      default:
        return absl::UnavailableError(
            absl::StrCat("streamed version ", version(), ": its v1 End is not made yet"));
    }
  }
  if (!end_v2_.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("streamed version ", version(), " has no tensor digests v2"));
  }
  return *end_v2_;
}

StreamedTransfer::StreamedTransfer(std::shared_ptr<const LiveVersion> live, uint32_t frame_bytes,
                                   bool lz4)
    : live_(std::move(live)), frame_bytes_(frame_bytes), lz4_(lz4) {
  cuts_.reserve(live_->tensor_count());
}

absl::Status StreamedTransfer::Extend() {
  const size_t ready = live_->ready_objects();
  size_t have = cut_count_.load(std::memory_order_relaxed);
  uint64_t frames = frames_.load(std::memory_order_relaxed);
  for (; have < ready; ++have) {
    Cut c;
    c.object = live_->object(have);
    c.lz4 = c.object.keyframe && lz4_ && sync::Lz4Pays(c.object.bytes);
    c.first_frame = frames;
    REFIT_ASSIGN_OR_RETURN(const uint32_t chunks,
                           sync::ChunkCount(c.object.bytes.size(), frame_bytes_));
    frames += chunks;
    object_bytes_.fetch_add(c.object.bytes.size(), std::memory_order_relaxed);
    cuts_.push_back(c);
    cut_count_.store(cuts_.size(), std::memory_order_release);
    frames_.store(frames, std::memory_order_release);
  }
  if (have == live_->tensor_count()) all_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<v1::DataFrame> StreamedTransfer::Frame(uint64_t i) const {
  // frames_ before cut_count_: Extend stores them the other way round, so every frame below
  // `frames` lies in a cut below `n`.
  const uint64_t frames = frames_.load(std::memory_order_acquire);
  const size_t n = cut_count_.load(std::memory_order_acquire);
  if (i >= frames || n == 0) {
    return absl::OutOfRangeError(
        absl::StrCat("frame ", i, " of streamed version ", version(), " does not exist yet"));
  }
  auto it = std::upper_bound(cuts_.begin(), cuts_.begin() + static_cast<ptrdiff_t>(n), i,
                             [](uint64_t f, const Cut& c) { return f < c.first_frame; });
  const Cut& c = *(it - 1);
  sync::FrameTarget target;
  target.version = version();
  target.tensor_index = c.object.tensor_index;
  target.part = 0;
  sync::SplitOptions split;
  split.frame_bytes = frame_bytes_;
  split.lz4 = c.lz4;
  return sync::MakeFrame(c.object.bytes, target, split, static_cast<uint32_t>(i - c.first_frame));
}

}  // namespace refit::publisher
