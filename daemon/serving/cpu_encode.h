// Encoding a version on the CPU codec (PublisherCore "CPU one pass", and the copying path kept
// for benchmarks): the encode itself, the baseline buffers brought forward at the commit, and
// the v1 digests a streamed pass leaves to after its End.
#ifndef REFIT_DAEMON_SERVING_CPU_ENCODE_H_
#define REFIT_DAEMON_SERVING_CPU_ENCODE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/serving/encoded_version.h"
#include "daemon/serving/patch_log.h"
#include "daemon/serving/publisher_core.h"

namespace refit::publisher {

// The CPU codec's copying path (options.cpu_one_pass false, for benchmarks): memcmp, snapshot
// copy, digest of the copy, encode (four reads). Host bytes of every input (no DeviceBytes).
absl::Status EncodeOnCpuCopying(const PublisherOptions& options,
                                std::span<const TensorInput> inputs,
                                const std::vector<size_t>& order,
                                const std::vector<v1::TensorSpec>& specs,
                                const std::vector<BaselineTensor>& prev, const std::string& where,
                                Encoded* out, PublishSummary* sum);
// The copying path: each tensor's v2 digest, the previous one where the buffer is the
// previous version's, else TensorDigestV2 of the host bytes (a full read of changed tensors).
void FillDigestsV2(const PublisherOptions& options, const std::vector<BaselineTensor>& prev,
                   Encoded* enc, PublishSummary* sum);

// CPU one pass (PublisherCore's class comment): every tensor with a base compared, encoded and
// digested by EncodePatchesWithDigests over (baseline, caller's bytes); no snapshot copy. When
// streamed, in batches, each tensor's object handed to the live version as its batch completes
// (keyframes and byte-less unchanged tensors before the pass).
absl::Status EncodeOnCpuOnePass(const PublisherOptions& options,
                                std::span<const TensorInput> inputs,
                                const std::vector<size_t>& order,
                                const std::vector<v1::TensorSpec>& specs,
                                const std::vector<BaselineTensor>& prev, const std::string& where,
                                const StreamPass& stream, Encoded* out, PublishSummary* sum);
// CPU one pass, before the commit (outside the core's lock): changed tensors whose baseline
// buffer something else already references get a new buffer now (copy-on-write).
void CopySharedPending(Encoded* enc, PublishSummary* sum);
// CPU one pass, at the commit, with the core's mu_ held exclusively: the changed tensors'
// baseline buffers patched in place from the pass's change log, or copied (see the .cc).
void UpdateBaselineBytes(Encoded* enc, int threads, PublishSummary* sum);
// After the v2 End is out: every v1 digest the version still lacks (changed tensors the pass
// deferred, and those carried over pending from the base) into enc->next. Returns every
// tensor's v1 digest in manifest order.
std::vector<uint64_t> FillDeferredV1(Encoded* enc, int threads, PublishSummary* sum);

}  // namespace refit::publisher

#endif  // REFIT_DAEMON_SERVING_CPU_ENCODE_H_
