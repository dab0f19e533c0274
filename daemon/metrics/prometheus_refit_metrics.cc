#include "daemon/metrics/prometheus_refit_metrics.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace refit::metrics {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Histogram;
using prometheus::Registry;

// Refits take milliseconds (a small delta on a fast link) to minutes (a keyframe of a large
// model over a WAN).
const Histogram::BucketBoundaries& SecondsBuckets() {
  static const Histogram::BucketBoundaries* const b = new Histogram::BucketBoundaries{
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
  return *b;
}

Family<Counter>& CounterFamily(Registry& r, const std::string& name, const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}

Counter& OneCounter(Registry& r, const std::string& name, const std::string& help) {
  return CounterFamily(r, name, help).Add({});
}

Family<Histogram>& HistogramFamily(Registry& r, const std::string& name,
                                   const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }
double MicrosToSeconds(uint64_t us) { return static_cast<double>(us) / 1e6; }

}  // namespace

std::string ReasonLabel(v1::TransferReason reason) {
  std::string name = v1::TransferReason_Name(reason);
  constexpr absl::string_view kPrefix = "TRANSFER_REASON_";
  if (name.empty()) return "unknown";  // a value this build does not know
  if (absl::StartsWith(name, kPrefix)) name.erase(0, kPrefix.size());
  return absl::AsciiStrToLower(name);
}

PrometheusRefitMetrics::PrometheusRefitMetrics(v1::Role role) : registry_(std::make_shared<Registry>()) {
  if (role == v1::ROLE_PUBLISHER) RegisterPublisher();
  RegisterTransfers(role);
  if (role == v1::ROLE_SUBSCRIBER) RegisterSubscriber();
}

void PrometheusRefitMetrics::RegisterPublisher() {
  Registry& r = *registry_;
  published_ = &OneCounter(r, "refitd_publisher_versions_published_total",
                           "Versions the publisher committed and serves.");
  publish_failures_ = &OneCounter(r, "refitd_publisher_publish_failures_total",
                                  "Publishes that failed (bad input, publish guard, I/O).");
  published_wire_bytes_ = &OneCounter(
      r, "refitd_publisher_published_wire_bytes_total",
      "Bytes a subscriber at the previous version receives per published version (patches and "
      "keyframe tensors, before LZ4), summed.");
  published_dense_bytes_ = &OneCounter(r, "refitd_publisher_published_dense_bytes_total",
                                       "Dense size of each published version, summed.");
  published_changed_elements_ = &OneCounter(
      r, "refitd_publisher_published_changed_elements_total",
      "Elements changed per published version (keyframe tensors count fully), summed; over "
      "refitd_publisher_published_elements_total it is the change rate.");
  published_elements_ = &OneCounter(r, "refitd_publisher_published_elements_total",
                                    "Elements of each published version, summed.");
  published_keyframe_tensors_ =
      &OneCounter(r, "refitd_publisher_published_keyframe_tensors_total",
                  "Tensors published as keyframes (new, or dtype/shape changed), summed.");
  Family<Histogram>& stages = HistogramFamily(
      r, "refitd_publisher_publish_stage_duration_seconds",
      "Stages of a publish: encode, digest, persist (hand-over to the persister), total.");
  const char* const names[] = {"encode", "digest", "persist", "total"};
  for (size_t i = 0; i < publish_stages_.size(); ++i) {
    publish_stages_[i] = &stages.Add({{"stage", names[i]}}, SecondsBuckets());
  }
  Family<Counter>& cpu = CounterFamily(
      r, "refitd_publisher_publish_cpu_seconds_total",
      "CPU time of the publisher process (user + system, every thread) spent publishing, by "
      "stage: pass (scan, encode, v2 digests), digest (digests outside the pass), "
      "baseline_update, total (the whole publish with its input read).");
  const char* const cpu_names[] = {"pass", "digest", "baseline_update", "total"};
  for (size_t i = 0; i < publish_cpu_.size(); ++i) {
    publish_cpu_[i] = &cpu.Add({{"stage", cpu_names[i]}});
  }
  fully_acked_ = &HistogramFamily(r, "refitd_publisher_refit_duration_seconds",
                                  "Publish -> applied everywhere: version snapshot taken -> the "
                                  "last connected subscriber acked it.")
                      .Add({}, SecondsBuckets());
}

void PrometheusRefitMetrics::RegisterTransfers(v1::Role role) {
  Registry& r = *registry_;
  const bool pub = role == v1::ROLE_PUBLISHER;
  applied_ = &CounterFamily(r, "refitd_transfers_applied_total",
                            pub ? "Transfers subscribers acked as applied, by transfer reason."
                                : "Versions applied from the upstream, by transfer reason.");
  keyframe_tensors_ = &CounterFamily(
      r, "refitd_transfer_keyframe_tensors_total",
      "Tensors that went as keyframes in applied transfers, by transfer reason.");
  // Every series exists from the start (a rate over a series that appears late misses its first
  // increment).
  for (int v = v1::TransferReason_MIN; v <= v1::TransferReason_MAX; ++v) {
    if (!v1::TransferReason_IsValid(v) || v == v1::TRANSFER_REASON_UNSPECIFIED) continue;
    const std::string label = ReasonLabel(static_cast<v1::TransferReason>(v));
    applied_->Add({{"reason", label}});
    keyframe_tensors_->Add({{"reason", label}});
  }
  wire_bytes_ = &OneCounter(r, "refitd_transfer_wire_bytes_total",
                            "Payload bytes on the wire of applied transfers.");
  dense_bytes_ = &OneCounter(r, "refitd_transfer_dense_bytes_total",
                             "Dense size of the versions of applied transfers.");
  changed_elements_ = &OneCounter(r, "refitd_transfer_changed_elements_total",
                                  "Elements changed by applied transfers.");
  elements_ = &OneCounter(r, "refitd_transfer_elements_total",
                          "Elements of the versions of applied transfers.");
  refit_ = &HistogramFamily(r, "refitd_transfer_duration_seconds",
                            pub ? "Applied transfers: transfer start -> the subscriber's Ack."
                                : "Applied transfers: VersionHeader received -> version "
                                  "announced to consumers.")
                .Add({}, SecondsBuckets());
  rejected_ = &OneCounter(r, "refitd_transfers_rejected_total",
                          "Transfers the subscriber rejected (digest check or apply failed).");
  mismatched_tensors_ = &OneCounter(r, "refitd_digest_mismatched_tensors_total",
                                    "Tensors whose digest did not match, in rejected transfers.");
}

void PrometheusRefitMetrics::RegisterSubscriber() {
  Family<Histogram>& stages =
      HistogramFamily(*registry_, "refitd_subscriber_apply_stage_duration_seconds",
                      "Stages of an applied transfer: receive, stage, verify, apply.");
  const char* const names[] = {"receive", "stage", "verify", "apply"};
  for (size_t i = 0; i < apply_stages_.size(); ++i) {
    apply_stages_[i] = &stages.Add({{"stage", names[i]}}, SecondsBuckets());
  }
  Family<Counter>& cpu = CounterFamily(
      *registry_, "refitd_subscriber_apply_cpu_seconds_total",
      "CPU time of the subscriber process (user + system, every thread) over the stages of "
      "applied transfers: receive, stage, verify, apply.");
  for (size_t i = 0; i < apply_cpu_.size(); ++i) apply_cpu_[i] = &cpu.Add({{"stage", names[i]}});
  pause_wait_ = &HistogramFamily(*registry_, "refitd_subscriber_pause_wait_seconds",
                                 "Single-copy store: from a version verified to the last consumer "
                                 "lease on the held version released.")
                     .Add({}, SecondsBuckets());
  pause_ = &HistogramFamily(*registry_, "refitd_subscriber_pause_seconds",
                            "Single-copy store: the pause, from the last consumer lease released "
                            "to the version written in place and committed.")
                .Add({}, SecondsBuckets());
}

void PrometheusRefitMetrics::InPlaceUpdate(absl::Duration wait, absl::Duration pause) {
  if (pause_ == nullptr) return;
  pause_wait_->Observe(Seconds(wait));
  pause_->Observe(Seconds(pause));
}

void PrometheusRefitMetrics::Published(const PublishFigures& f) {
  if (published_ == nullptr) return;
  published_->Increment();
  published_wire_bytes_->Increment(static_cast<double>(f.wire_bytes));
  published_dense_bytes_->Increment(static_cast<double>(f.dense_bytes));
  published_changed_elements_->Increment(static_cast<double>(f.changed_elements));
  published_elements_->Increment(static_cast<double>(f.total_elements));
  published_keyframe_tensors_->Increment(static_cast<double>(f.keyframe_tensors));
  const absl::Duration stages[] = {f.encode, f.digest, f.persist, f.total};
  for (size_t i = 0; i < publish_stages_.size(); ++i) {
    publish_stages_[i]->Observe(Seconds(stages[i]));
  }
  const absl::Duration cpu[] = {f.pass_cpu, f.digest_cpu, f.baseline_update_cpu, f.cpu};
  for (size_t i = 0; i < publish_cpu_.size(); ++i) publish_cpu_[i]->Increment(Seconds(cpu[i]));
}

void PrometheusRefitMetrics::PublishFailed() {
  if (publish_failures_ != nullptr) publish_failures_->Increment();
}

void PrometheusRefitMetrics::FullyAcked(absl::Duration latency) {
  if (fully_acked_ != nullptr) fully_acked_->Observe(Seconds(latency));
}

void PrometheusRefitMetrics::TransferApplied(v1::TransferReason reason, const v1::RefitStats& stats,
                                   const ApplyStages* stages) {
  const std::string label = ReasonLabel(reason);
  applied_->Add({{"reason", label}}).Increment();
  keyframe_tensors_->Add({{"reason", label}}).Increment(stats.keyframe_tensors());
  wire_bytes_->Increment(static_cast<double>(stats.wire_bytes()));
  dense_bytes_->Increment(static_cast<double>(stats.dense_bytes()));
  changed_elements_->Increment(static_cast<double>(stats.changed_elements()));
  elements_->Increment(static_cast<double>(stats.total_elements()));
  refit_->Observe(MicrosToSeconds(stats.latency_micros()));
  if (stages == nullptr || apply_stages_[0] == nullptr) return;
  const absl::Duration split[] = {stages->receive, stages->stage, stages->verify, stages->apply};
  for (size_t i = 0; i < apply_stages_.size(); ++i) apply_stages_[i]->Observe(Seconds(split[i]));
  const absl::Duration cpu[] = {stages->receive_cpu, stages->stage_cpu, stages->verify_cpu,
                                stages->apply_cpu};
  for (size_t i = 0; i < apply_cpu_.size(); ++i) apply_cpu_[i]->Increment(Seconds(cpu[i]));
}

void PrometheusRefitMetrics::TransferRejected(uint64_t mismatched_tensors) {
  rejected_->Increment();
  mismatched_tensors_->Increment(static_cast<double>(mismatched_tensors));
}

}  // namespace refit::metrics
