// A ConsumerApi client for the end-to-end tests: read leases, and the bytes of a leased layout's
// tensors read through fresh read-only mappings of their shared-memory regions.
#ifndef REFIT_TESTS_HARNESS_CONSUMER_H_
#define REFIT_TESTS_HARNESS_CONSUMER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "refit/v1/local.grpc.pb.h"

namespace refit::e2e {

// AcquireLease as `consumer` on `version` (nullopt: the current one), 10 s deadline.
absl::StatusOr<v1::Lease> AcquireLease(v1::ConsumerApi::Stub& stub, const std::string& consumer,
                                       std::optional<uint64_t> version = std::nullopt,
                                       uint64_t ttl_ms = 60000);
absl::Status ReleaseLease(v1::ConsumerApi::Stub& stub, uint64_t lease_id);

// The bytes of `tensor` of `layout` (its ShmRegion), through a fresh read-only mapping.
absl::StatusOr<std::vector<uint8_t>> ReadTensor(const v1::Layout& layout,
                                                const std::string& tensor);

}  // namespace refit::e2e

#endif  // REFIT_TESTS_HARNESS_CONSUMER_H_
