// codec.patch_format auto: which patch format (1 or 2) the publisher encodes each version with,
// chosen by what is faster end to end on this deployment, measured. Format 2 sends fewer bytes
// (about 0.7x on a real trajectory) and costs more CPU on both sides; which refit is faster
// depends on the link, the CPUs and the change rate, so the chooser measures the refit latency
// the publisher already tracks (snapshot taken -> every session acked the version) for both:
//   1. Trial: the delta versions alternate 1, 2, 1, 2, ... until each format has `trial_samples`
//      measured refits.
//   2. Choice: the format with the lower median of its last `trial_samples` refits (ties: 1) is
//      used for every version.
//   3. Revisit: after `revisit_every` chosen versions, one version of the other format is
//      measured again (the link or the load may have changed), and the choice is made again over
//      the latest samples.
// Versions without a measurement (no session acked them all, or the history dropped them) only
// delay the choice. Thread-safe; a leaf lock (callers may hold their own).
#ifndef REFIT_DAEMON_SERVING_FORMAT_CHOOSER_H_
#define REFIT_DAEMON_SERVING_FORMAT_CHOOSER_H_

#include <cstdint>
#include <deque>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace refit::publisher {

struct FormatChooserOptions {
  uint32_t trial_samples = 3;   // measured refits per format before a choice (>= 1)
  uint32_t revisit_every = 64;  // chosen versions between revisits (0 = never revisit)
};

class FormatChooser {
 public:
  explicit FormatChooser(FormatChooserOptions options = {});

  // The format to encode delta version `version` with (versions ascending; a version asked
  // twice, e.g. a publish that failed and is retried, gets the same answer).
  int FormatFor(uint64_t version);
  // Version `version` was acked by every session `micros` after its snapshot. Ignored unless
  // FormatFor chose its format.
  void Observe(uint64_t version, uint64_t micros);

  struct State {
    int chosen = 0;            // 0 while in the first trial
    int next = 1;              // the format of the next version
    uint32_t samples[2] = {};  // measured refits kept per format (index format - 1)
    uint64_t median_micros[2] = {};  // their medians (0 = none)
    uint64_t choices = 0;      // choices made (the first and every revisit)
  };
  State state() const;

 private:
  int NextFormatLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ChooseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MedianLocked(int format) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const FormatChooserOptions options_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, int> decided_ ABSL_GUARDED_BY(mu_);  // version -> format, awaiting a sample
  std::deque<uint64_t> samples_[2] ABSL_GUARDED_BY(mu_);  // latest micros per format
  int chosen_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t since_choice_ ABSL_GUARDED_BY(mu_) = 0;  // versions encoded with chosen_ since the choice
  uint64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;
  int last_format_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t choices_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_FORMAT_CHOOSER_H_
