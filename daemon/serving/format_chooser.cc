#include "daemon/serving/format_chooser.h"

#include <algorithm>
#include <vector>

namespace refit::publisher {
namespace {

// Decisions kept while their refit may still be measured.
constexpr uint64_t kDecisionWindow = 1024;

int Other(int format) { return format == 1 ? 2 : 1; }

}  // namespace

FormatChooser::FormatChooser(FormatChooserOptions options)
    : options_{std::max<uint32_t>(1, options.trial_samples), options.revisit_every} {}

int FormatChooser::NextFormatLocked() const {
  if (chosen_ == 0) return last_format_ == 1 ? 2 : 1;  // trial: alternate, 1 first
  const bool revisit = options_.revisit_every > 0 && since_choice_ >= options_.revisit_every;
  return revisit ? Other(chosen_) : chosen_;
}

int FormatChooser::FormatFor(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version == last_version_ && last_format_ != 0) return last_format_;
  const int f = NextFormatLocked();
  if (chosen_ != 0) {
    since_choice_ = f == chosen_ ? since_choice_ + 1 : 0;  // a revisit restarts the count
  }
  decided_[version] = f;
  while (!decided_.empty() && decided_.begin()->first + kDecisionWindow < version) {
    decided_.erase(decided_.begin());
  }
  last_version_ = version;
  last_format_ = f;
  return f;
}

void FormatChooser::Observe(uint64_t version, uint64_t micros) {
  absl::MutexLock lock(&mu_);
  auto it = decided_.find(version);
  if (it == decided_.end()) return;
  const int f = it->second;
  decided_.erase(it);
  std::deque<uint64_t>& s = samples_[f - 1];
  s.push_back(micros);
  while (s.size() > options_.trial_samples) s.pop_front();
  const bool trial_done = samples_[0].size() >= options_.trial_samples &&
                          samples_[1].size() >= options_.trial_samples;
  if ((chosen_ == 0 && trial_done) || (chosen_ != 0 && f != chosen_)) ChooseLocked();
}

uint64_t FormatChooser::MedianLocked(int format) const {
  std::vector<uint64_t> v(samples_[format - 1].begin(), samples_[format - 1].end());
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

void FormatChooser::ChooseLocked() {
  const uint64_t m1 = MedianLocked(1), m2 = MedianLocked(2);
  chosen_ = m2 != 0 && (m1 == 0 || m2 < m1) ? 2 : 1;
  since_choice_ = 0;
  ++choices_;
}

FormatChooser::State FormatChooser::state() const {
  absl::MutexLock lock(&mu_);
  State st;
  st.chosen = chosen_;
  st.next = NextFormatLocked();
  for (int f = 1; f <= 2; ++f) {
    st.samples[f - 1] = static_cast<uint32_t>(samples_[f - 1].size());
    st.median_micros[f - 1] = MedianLocked(f);
  }
  st.choices = choices_;
  return st;
}

}  // namespace refit::publisher
