#include "daemon/serving/format_chooser.h"

#include <vector>

#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

// Runs versions first..last through `c`, each measured at `micros(format)` (0: not measured);
// returns the formats chosen.
template <typename F>
std::vector<int> RunVersions(FormatChooser& c, uint64_t first, uint64_t last, F micros) {
  std::vector<int> out;
  for (uint64_t v = first; v <= last; ++v) {
    const int f = c.FormatFor(v);
    out.push_back(f);
    if (const uint64_t us = micros(f); us != 0) c.Observe(v, us);
  }
  return out;
}

TEST(FormatChooser, TrialAlternatesThenTheFasterFormatIsUsed) {
  FormatChooser c({.trial_samples = 3, .revisit_every = 0});
  // Format 2 is faster here (a slow link): 600 ms against 900 ms.
  const auto formats = RunVersions(c, 2, 12, [](int f) { return f == 2 ? 600000u : 900000u; });
  EXPECT_EQ(formats, (std::vector<int>{1, 2, 1, 2, 1, 2, 2, 2, 2, 2, 2}));
  const FormatChooser::State st = c.state();
  EXPECT_EQ(st.chosen, 2);
  EXPECT_EQ(st.next, 2);
  EXPECT_EQ(st.samples[0], 3u);
  EXPECT_EQ(st.median_micros[0], 900000u);
  EXPECT_EQ(st.median_micros[1], 600000u);
  EXPECT_EQ(st.choices, 1u);
}

TEST(FormatChooser, SlowerFormatTwoLosesAndTiesGoToOne) {
  FormatChooser slow({.trial_samples = 2, .revisit_every = 0});
  EXPECT_EQ(RunVersions(slow, 1, 8, [](int f) { return f == 2 ? 1200000u : 500000u; }),
            (std::vector<int>{1, 2, 1, 2, 1, 1, 1, 1}));
  FormatChooser tie({.trial_samples = 2, .revisit_every = 0});
  RunVersions(tie, 1, 4, [](int) { return 700000u; });
  EXPECT_EQ(tie.state().chosen, 1);
}

TEST(FormatChooser, TheMedianIgnoresOneOutlier) {
  FormatChooser c({.trial_samples = 3, .revisit_every = 0});
  // Format 2's second trial refit is slow once (a late joiner's keyframe in the same version).
  const std::vector<uint64_t> v1 = {800, 810, 790}, v2 = {600, 5000, 620};
  size_t i1 = 0, i2 = 0;
  RunVersions(c, 1, 6, [&](int f) { return f == 1 ? v1[i1++] : v2[i2++]; });
  EXPECT_EQ(c.state().chosen, 2);
}

TEST(FormatChooser, UnmeasuredVersionsOnlyDelayTheChoice) {
  FormatChooser c({.trial_samples = 2, .revisit_every = 0});
  // No session acks versions 1-4 (nobody connected): the trial goes on.
  RunVersions(c, 1, 4, [](int) { return 0u; });
  EXPECT_EQ(c.state().chosen, 0);
  // An observation for a version never decided, or decided twice, is ignored.
  c.Observe(99, 1);
  const auto formats = RunVersions(c, 5, 10, [](int f) { return f == 2 ? 100u : 200u; });
  EXPECT_EQ(formats, (std::vector<int>{1, 2, 1, 2, 2, 2}));
  c.Observe(5, 1);  // already observed: no effect
  EXPECT_EQ(c.state().median_micros[0], 200u);
}

TEST(FormatChooser, ARetriedVersionKeepsItsFormat) {
  FormatChooser c;
  EXPECT_EQ(c.FormatFor(7), 1);
  EXPECT_EQ(c.FormatFor(7), 1);  // the publish failed and is retried
  EXPECT_EQ(c.FormatFor(8), 2);
}

TEST(FormatChooser, RevisitsTheOtherFormatAndSwitchesWhenTheLinkChanges) {
  FormatChooser c({.trial_samples = 1, .revisit_every = 4});
  bool slow_link = false;
  auto micros = [&](int f) -> uint64_t {
    if (f == 1) return slow_link ? 2000 : 500;
    return 1000;  // format 2: CPU-bound, the same on both links
  };
  // Trial 1, 2; format 1 chosen; 4 versions of it, then one of format 2 (the revisit).
  EXPECT_EQ(RunVersions(c, 1, 7, micros), (std::vector<int>{1, 2, 1, 1, 1, 1, 2}));
  EXPECT_EQ(c.state().chosen, 1);
  EXPECT_EQ(c.state().choices, 2u);
  // The link slows down: format 1's refits now take 2000; the next revisit finds format 2
  // faster and switches.
  slow_link = true;
  EXPECT_EQ(RunVersions(c, 8, 13, micros), (std::vector<int>{1, 1, 1, 1, 2, 2}));
  EXPECT_EQ(c.state().chosen, 2);
  EXPECT_EQ(c.state().choices, 3u);
}

}  // namespace
}  // namespace refit::publisher
